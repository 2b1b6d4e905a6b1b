"""``fingerprint(value)``: the request fingerprint every atmost client makes.

SHA-256 of the RFC 8785 (JSON Canonicalization Scheme) form of a JSON value,
in UTF-8: 32 bytes. The same request gives the same fingerprint in every
client (Rust, Python, TypeScript), so a key retried from another process
or language is recognised as the same request. clients/testdata holds the
vectors each client reproduces.
"""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 canonical JSON of ``value`` (None, bool, int, float, str,
    list/tuple, dict with str keys), UTF-8. Anything else, an integer past
    2^53-1 in magnitude, NaN or an infinity raises ValueError
    (``rfc8785.CanonicalizationError``)."""
    return rfc8785.dumps(value)


def fingerprint(value: Any) -> bytes:
    """SHA-256 of :func:`canonical_json` of ``value``: 32 bytes."""
    return hashlib.sha256(canonical_json(value)).digest()
