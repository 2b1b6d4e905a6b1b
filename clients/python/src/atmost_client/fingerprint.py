"""``fingerprint(value)``: the request fingerprint every atmost client makes.

SHA-256 of the RFC 8785 (JSON Canonicalization Scheme) form of a JSON value,
in UTF-8: 32 bytes. The same request gives the same fingerprint in every
client (Rust, Python, TypeScript), so a key retried from another process
or language is recognised as the same request. clients/testdata holds the
vectors each client reproduces.

Only what every client reads the same way is taken: a number outside
±(2^53-1) (an int or a float: 2**53, 1e21), NaN, an infinity, or a value no
JSON holds, at any depth, raises :class:`FingerprintError` naming where (a
JSON Pointer) before anything is sent. Two requests that differ only past
2^53 would otherwise share a fingerprint in another language.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, List

import rfc8785

#: The largest magnitude every client reads exactly (2^53 - 1): past it, an
#: IEEE 754 double (a JavaScript number) rounds, and two requests meet.
MAX_SAFE_NUMBER = 2**53 - 1


class FingerprintError(ValueError):
    """The request cannot be fingerprinted: ``path`` is the JSON Pointer
    (RFC 6901) of the value refused (``""`` for the whole request), ``why``
    says what is wrong with it. Raised before any RPC; an error of
    ``rfc8785`` is its ``__cause__``."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"the request cannot be fingerprinted: {path or 'the request'}: {why}")
        self.path = path
        self.why = why


def _pointer(tokens: List[str]) -> str:
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


def _check_str(text: str, tokens: List[str], what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FingerprintError(_pointer(tokens), f"{what} holds a lone surrogate, not UTF-8") from e


def check_json(value: Any) -> None:
    """Raises :class:`FingerprintError` for the first thing in ``value``
    that is not a JSON value every client reads the same way; returns
    otherwise. Taken: None, bool, int and float within ±(2^53-1), str,
    list/tuple, dict with str keys (and their subclasses, as ``rfc8785``
    takes them)."""
    tokens: List[str] = []
    on_path: set = set()  # ids of the containers above: a cycle has no JSON form

    def walk(item: Any) -> None:
        if item is None or isinstance(item, bool):
            return
        if isinstance(item, int):
            if not -MAX_SAFE_NUMBER <= item <= MAX_SAFE_NUMBER:
                raise FingerprintError(_pointer(tokens), f"{item} is outside ±(2^53-1)")
            return
        if isinstance(item, float):
            if math.isnan(item) or math.isinf(item):
                raise FingerprintError(_pointer(tokens), f"{item} is not a JSON number")
            if not -MAX_SAFE_NUMBER <= item <= MAX_SAFE_NUMBER:
                raise FingerprintError(_pointer(tokens), f"{item!r} is outside ±(2^53-1)")
            return
        if isinstance(item, str):
            _check_str(item, tokens, "the string")
            return
        if isinstance(item, (list, tuple, dict)):
            if id(item) in on_path:
                raise FingerprintError(_pointer(tokens), "the value contains itself (a cycle)")
            on_path.add(id(item))
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise FingerprintError(
                            _pointer(tokens), f"a key is {type(key).__name__} {key!r}, not a string"
                        )
                    _check_str(key, tokens, f"the key {key!r}")
                    tokens.append(key)
                    walk(child)
                    tokens.pop()
            else:
                for index, child in enumerate(item):
                    tokens.append(str(index))
                    walk(child)
                    tokens.pop()
            on_path.discard(id(item))
            return
        raise FingerprintError(_pointer(tokens), f"{type(item).__name__} has no JSON form")

    try:
        walk(value)
    except RecursionError as e:
        raise FingerprintError("", f"nested too deeply (past {len(tokens)} levels)") from e


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 canonical JSON of ``value``, UTF-8. What
    :func:`check_json` refuses raises :class:`FingerprintError` (a
    ValueError) naming its JSON Pointer."""
    check_json(value)
    try:
        return rfc8785.dumps(value)
    except rfc8785.CanonicalizationError as e:  # check_json lets nothing through that rfc8785 refuses
        raise FingerprintError("", str(e)) from e
    except RecursionError as e:
        raise FingerprintError("", "nested too deeply") from e


def fingerprint(value: Any) -> bytes:
    """SHA-256 of :func:`canonical_json` of ``value``: 32 bytes."""
    return hashlib.sha256(canonical_json(value)).digest()
