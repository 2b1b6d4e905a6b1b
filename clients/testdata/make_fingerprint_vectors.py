"""Writes fingerprint_vectors.json: the test vectors every atmost client's
fingerprint helper must reproduce. A fingerprint is SHA-256 over the RFC 8785
(JSON Canonicalization Scheme) form of a JSON value, in UTF-8.

Made with the `rfc8785` package from PyPI (Trail of Bits), not with any
client's own code: `python make_fingerprint_vectors.py` after
`pip install rfc8785==0.1.4`. Each vector's input is JSON text, so each
client parses it with its own ecosystem's parser first.
"""

import hashlib
import json
import pathlib

import rfc8785

INPUTS = [
    ("empty object", "{}"),
    ("empty array", "[]"),
    ("literals", '[null, true, false]'),
    ("keys sorted", '{"b": 2, "a": 1, "c": {"z": [], "y": {}}}'),
    ("whitespace dropped", '{ "amount" : 500 ,\n "currency" : "EUR" }'),
    ("a wallet charge", '{"tool": "wallet.charge", "arguments": {"amount": 500, "currency": "EUR", "to": "acct_42"}}'),
    ("integers", '[0, -0, 1, -1, 9007199254740991, -9007199254740991, 100, 1e2]'),
    # The RFC's 1E30 is among the refused below.
    ("RFC 8785 3.2.2.3 numbers", '[333333333.33333329, 4.50, 2e-3, 0.000000000000000000000000001]'),
    ("fractions", '[0.1, 0.5, 1.25, -3.75, 1e-7, 5e-324, 4503599627370495.5, -9007199254740991.0]'),
    ("RFC 8785 3.2.2.2 strings", '"\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/"'),
    ("control characters", '"\\u0000\\u0001\\b\\t\\n\\f\\r\\u001f\\u007f"'),
    ("non-ASCII kept as UTF-8", '{"name": "Zoë", "city": "東京", "emoji": "\\ud83d\\ude00"}'),
    ("RFC 8785 3.2.3 key order by UTF-16 code units",
     '{"\\u20ac": "Euro Sign", "\\r": "Carriage Return", "\\ufb33": "Hebrew Letter Dalet With Dagesh", '
     '"1": "One", "\\ud83d\\ude00": "Emoji: Grinning Face", "\\u0080": "Control", "\\u00f6": "Latin Small Letter O With Diaeresis"}'),
    ("nested arrays keep their order", '[[3, 2, 1], {"k": [{"b": 1, "a": 2}]}]'),
]


# Requests every client refuses before Authorize, with a clear error: a
# number past ±(2^53 - 1) (as an integer or a float: every double that large
# is a whole number) is where JSON numbers stop being exact. RFC 8785 prints
# numbers as doubles, so 9007199254740993 would share 9007199254740992's
# fingerprint (and a JavaScript reader cannot tell them apart at all). Send
# such a number as a string. Each input is JSON text, as above, with where
# the refused number is as a JSON Pointer (RFC 6901), which each client's
# error names.
REFUSED = [
    ("an integer past 2^53 - 1", '{"account": 9007199254740993}', "/account"),
    ("2^53 itself", '{"account": 9007199254740992}', "/account"),
    ("a negative integer past -(2^53 - 1)", '[-9007199254740992]', "/0"),
    ("a large number written as a float", '{"amount": 1e21}', "/amount"),
    ("RFC 8785 3.2.2.3's 1E30", '[1E30]', "/0"),
    ("a whole double past 2^53", '1.2345678901234568e20', ""),
    ("deep in arrays and objects", '{"a": [{"b": [1, 2, 18446744073709551615]}]}', "/a/0/b/2"),
]

# Values no JSON text can hold, which every client's own tests build in its
# own language (float('nan'), f64::NAN, NaN...) and must refuse the same way,
# wherever they are. Each client refuses more of its own (a Map, a Set, a
# function, a sparse array in TypeScript; a set or bytes in Python).
NOT_JSON = [
    ("NaN", "NaN as the whole request"),
    ("Infinity", "+Infinity in an object"),
    ("-Infinity", "-Infinity in an array"),
    ("NaN at depth", "NaN in an object in an array in an object"),
]


def within_safe_range(value) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, (int, float)):
        return abs(value) <= 2**53 - 1
    if isinstance(value, list):
        return all(within_safe_range(v) for v in value)
    return all(within_safe_range(v) for v in value.values())


def main() -> None:
    for name, text, _ in REFUSED:
        # Each is a number rfc8785 takes as a double or refuses as an int
        # (IntegerDomainError): either way, outside ±(2^53 - 1).
        assert not within_safe_range(json.loads(text)), name
    vectors = []
    for name, text in INPUTS:
        assert within_safe_range(json.loads(text)), name
        canonical = rfc8785.dumps(json.loads(text))
        vectors.append({
            "name": name,
            "json": text,
            "canonical": canonical.decode("utf-8"),
            "sha256": hashlib.sha256(canonical).hexdigest(),
        })
    out = pathlib.Path(__file__).with_name("fingerprint_vectors.json")
    out.write_text(json.dumps({
        "about": "vectors: SHA-256 of the RFC 8785 canonical JSON of each input, made by make_fingerprint_vectors.py with the rfc8785 package; refused: inputs every client refuses before Authorize (a number outside +-(2^53 - 1)), path the JSON Pointer of the number; not_json: values no JSON text holds, which each client builds in its own tests and refuses",
        "vectors": vectors,
        "refused": [{"name": name, "json": text, "path": path} for name, text, path in REFUSED],
        "not_json": [{"name": name, "what": what} for name, what in NOT_JSON],
    }, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
