#!/usr/bin/env python3
"""Verify an atmost receipt offline, as a tool provider would: with the
public keys atmost publishes (atmost.v1.Receipts/GetSigningKeys) and the
`cryptography` library, nothing of atmost's.

    verify_receipt.py KEYS_JSON ATTEMPT_JSON

KEYS_JSON is GetSigningKeys's answer and ATTEMPT_JSON an attempt (or an
Authorize / Commit response holding one), both as grpcurl prints them
(proto3 JSON: bytes in base64). Prints VERIFIED, FORGED or UNKNOWN_KEY and
exits 0, 1 or 3, as `atmost receipt verify` does (2 for input it cannot
read); a verified receipt's tenant is said on standard error. The signed
bytes are the receipt's canonical encoding, docs/api.md "Signed receipts":
version 2 signs the tenant of the receipt's permit; version 1 (receipts
without `signatureVersion`, signed before version 2) signs none, so it
proves nothing about whose permit the receipt came from.
"""

import base64
import datetime
import hashlib
import json
import struct
import sys

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


def strict_int(value):
    """An int64 as proto3 JSON writes it: a number or a string of digits."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"not an integer: {value!r}")
    if isinstance(value, str) and not value.lstrip("-").isdigit():
        raise ValueError(f"not an integer: {value!r}")
    return int(value)


def encoding(receipt):
    """(version, tenant) the receipt names: tenant None with version 1."""
    version = strict_int(receipt.get("signatureVersion", 0))
    tenant = receipt.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"tenant is not a string: {tenant!r}")
    if version in (0, 1):
        if tenant is not None:
            raise ValueError(f"tenant {tenant!r} is given, but a version 1 signature does not cover a tenant")
        return 1, None
    if version == 2:
        return 2, tenant or ""
    raise ValueError(f"signature version {version} is not one this verifier knows (1, 2)")


def canonical(attempt, receipt):
    """The bytes atmost signs, in the version the receipt names."""
    version, tenant = encoding(receipt)
    issued = datetime.datetime.fromisoformat(receipt["issuedAt"].replace("Z", "+00:00"))
    if issued.tzinfo is None:
        raise ValueError("issuedAt has no offset")
    issued_ms = int(issued.timestamp() * 1000 + 0.5)
    fields = [] if tenant is None else [tenant.encode()]
    fields += [
        attempt["permitId"].encode(),
        attempt["tool"].encode(),
        attempt["idempotencyKey"].encode(),
        base64.b64decode(attempt.get("requestFingerprint", "")),
        attempt["attemptId"].encode(),
        receipt["receiptId"].encode(),
        b"SUCCEEDED",
        hashlib.sha256(base64.b64decode(receipt.get("result", ""))).digest(),
        struct.pack(">q", strict_int(receipt.get("cost", 0))),
        struct.pack(">q", issued_ms),
    ]
    # The tag names the version, so the version is signed too.
    out = b"atmost.receipt.v%d\x00" % version
    for field in fields:
        out += struct.pack(">I", len(field)) + field
    return out


def main(keys_path, attempt_path):
    keys = {k["keyId"]: base64.b64decode(k["publicKey"]) for k in json.load(open(keys_path)).get("keys", [])}
    doc = json.load(open(attempt_path))
    attempt = doc.get("attempt", doc)
    receipt = attempt["receipt"]
    message = canonical(attempt, receipt)
    public = keys.get(receipt.get("keyId", ""))
    if public is None:
        print("UNKNOWN_KEY")
        return 3
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(
            base64.b64decode(receipt.get("signature", "")), message
        )
    except InvalidSignature:
        print("FORGED")
        return 1
    print("VERIFIED")
    version, tenant = encoding(receipt)
    if version == 1:
        print(
            "verify_receipt.py: signed in version 1, which signs no tenant: "
            "it proves nothing about whose permit the receipt came from",
            file=sys.stderr,
        )
    elif tenant:
        print(f"verify_receipt.py: signed in version 2, tenant {json.dumps(tenant)}", file=sys.stderr)
    else:
        print('verify_receipt.py: signed in version 2, tenant "" (dev mode, no keys)', file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    try:
        code = main(sys.argv[1], sys.argv[2])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"verify_receipt.py: unusable input: {e!r}", file=sys.stderr)
        code = 2
    sys.exit(code)
