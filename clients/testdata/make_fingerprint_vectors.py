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
    ("RFC 8785 3.2.2.3 numbers", '[333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001]'),
    ("fractions", '[0.1, 0.5, 1.25, -3.75, 1e21, 1e-7, 1.2345678901234568e20, 5e-324]'),
    ("RFC 8785 3.2.2.2 strings", '"\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/"'),
    ("control characters", '"\\u0000\\u0001\\b\\t\\n\\f\\r\\u001f\\u007f"'),
    ("non-ASCII kept as UTF-8", '{"name": "Zoë", "city": "東京", "emoji": "\\ud83d\\ude00"}'),
    ("RFC 8785 3.2.3 key order by UTF-16 code units",
     '{"\\u20ac": "Euro Sign", "\\r": "Carriage Return", "\\ufb33": "Hebrew Letter Dalet With Dagesh", '
     '"1": "One", "\\ud83d\\ude00": "Emoji: Grinning Face", "\\u0080": "Control", "\\u00f6": "Latin Small Letter O With Diaeresis"}'),
    ("nested arrays keep their order", '[[3, 2, 1], {"k": [{"b": 1, "a": 2}]}]'),
]


def main() -> None:
    vectors = []
    for name, text in INPUTS:
        canonical = rfc8785.dumps(json.loads(text))
        vectors.append({
            "name": name,
            "json": text,
            "canonical": canonical.decode("utf-8"),
            "sha256": hashlib.sha256(canonical).hexdigest(),
        })
    out = pathlib.Path(__file__).with_name("fingerprint_vectors.json")
    out.write_text(json.dumps({
        "about": "SHA-256 of the RFC 8785 canonical JSON of each input; made by make_fingerprint_vectors.py with the rfc8785 package",
        "vectors": vectors,
    }, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
