"""fingerprint(): every vector of clients/testdata/fingerprint_vectors.json,
whose inputs are parsed with Python's own json module first; every
`refused` input and every `not_json` value (built here) refused with the
JSON Pointer of what is wrong; and the values only Python can hold."""

import collections
import decimal
import json
import math
import pathlib

import pytest

from atmost_client import FingerprintError, canonical_json, fingerprint

FILE = json.loads(
    (pathlib.Path(__file__).resolve().parents[2] / "testdata" / "fingerprint_vectors.json").read_text("utf-8")
)
VECTORS = FILE["vectors"]
REFUSED = FILE["refused"]
NOT_JSON = FILE["not_json"]

#: Each `not_json` name of the shared file, built natively, and the JSON
#: Pointer the refusal must name. A name missing here fails the test.
NATIVE = {
    "NaN": (math.nan, ""),
    "Infinity": ({"amount": math.inf}, "/amount"),
    "-Infinity": ([1, -math.inf], "/1"),
    "NaN at depth": ({"a": [{"b": math.nan}]}, "/a/0/b"),
}


def test_the_vectors_are_there():
    assert len(VECTORS) >= 14 and len(REFUSED) >= 7 and len(NOT_JSON) >= 4


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector(vector):
    value = json.loads(vector["json"])
    assert canonical_json(value) == vector["canonical"].encode("utf-8")
    digest = fingerprint(value)
    assert len(digest) == 32
    assert digest.hex() == vector["sha256"]


def refused(value, path):
    for make in (fingerprint, canonical_json):
        with pytest.raises(FingerprintError) as caught:
            make(value)
        e = caught.value
        assert isinstance(e, ValueError)
        assert e.path == path
        assert e.why and e.why in str(e)
        assert (path or "the request") in str(e)
    return e


@pytest.mark.parametrize("vector", REFUSED, ids=[v["name"] for v in REFUSED])
def test_refused(vector):
    # Parsed by Python's json: the integers stay int, 1e21 and 1E30 are float.
    refused(json.loads(vector["json"]), vector["path"])


@pytest.mark.parametrize("entry", NOT_JSON, ids=[v["name"] for v in NOT_JSON])
def test_not_json(entry):
    assert entry["name"] in NATIVE, f"no native value for the shared not_json {entry['name']!r}"
    value, path = NATIVE[entry["name"]]
    refused(value, path)


def test_the_edges_of_the_safe_range_are_taken():
    edge = 2**53 - 1
    for value in (edge, -edge, float(edge), -float(edge)):
        assert canonical_json([value]) == f"[{'-' if value < 0 else ''}{edge}]".encode()
    refused(float(2**53), "")
    refused([-(2**53)], "/0")


class Thing:
    pass


class Cents(int):
    pass


@pytest.mark.parametrize(
    "value, path",
    [
        ({"tags": {"a", "b"}}, "/tags"),  # a set
        ([frozenset()], "/0"),
        ({"blob": b"\x00raw"}, "/blob"),  # bytes: no JSON form (encode them yourself, say base64)
        ({"blob": bytearray(b"x")}, "/blob"),
        ({"a": {1: "an int key"}}, "/a"),
        ({("a", "b"): 1}, ""),
        ({None: 1}, ""),
        ({"n": decimal.Decimal("1.5")}, "/n"),
        ({"when": Thing()}, "/when"),
        ({"f": print}, "/f"),
        ({"a~b": [0, {"c/d": math.nan}]}, "/a~0b/1/c~1d"),  # RFC 6901 escapes
        ({"big": Cents(2**60)}, "/big"),
        (["\ud800"], "/0"),  # a lone surrogate is not UTF-8
        ({"\udfff": 1}, ""),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_what_only_python_can_hold_is_refused_where_it_is(value, path):
    refused(value, path)


def test_a_cycle_is_refused_not_overflowed():
    cycle: list = [1]
    cycle.append({"again": cycle})
    e = refused(cycle, "/1/again")
    assert "cycle" in e.why


def test_what_python_holds_as_json_is_taken():
    # Subclasses of the JSON types (rfc8785 takes them), tuples as arrays.
    point = collections.namedtuple("point", "x y")(1, 2)
    value = collections.OrderedDict(b=Cents(3), a=[point, (True, None)])
    assert canonical_json(value) == b'{"a":[[1,2],[true,null]],"b":3}'
    # The same object twice (not a cycle) is taken.
    shared = {"k": 1}
    assert canonical_json([shared, shared]) == b'[{"k":1},{"k":1}]'
