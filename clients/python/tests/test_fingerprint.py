"""fingerprint(): every vector of clients/testdata/fingerprint_vectors.json,
whose inputs are parsed with Python's own json module first."""

import json
import math
import pathlib

import pytest

from atmost_client import canonical_json, fingerprint

VECTORS = json.loads(
    (pathlib.Path(__file__).resolve().parents[2] / "testdata" / "fingerprint_vectors.json").read_text("utf-8")
)["vectors"]


def test_the_vectors_are_there():
    assert len(VECTORS) >= 14


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector(vector):
    value = json.loads(vector["json"])
    assert canonical_json(value) == vector["canonical"].encode("utf-8")
    digest = fingerprint(value)
    assert len(digest) == 32
    assert digest.hex() == vector["sha256"]


@pytest.mark.parametrize("value", [math.nan, math.inf, 2**53, {1: "not a string key"}, {"a": object()}])
def test_what_json_cannot_say_is_refused(value):
    with pytest.raises(ValueError):
        fingerprint(value)
