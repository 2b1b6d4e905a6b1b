#!/usr/bin/env bash
# The Python receipt-verification example (examples/python/verify_receipt.py)
# against a live atmost: a signing key made with `cryptography`, a receipt
# issued over gRPC (scripts/grpcurl.py, grpcio), verified as a tool provider
# would; a changed result must be FORGED, an unknown key UNKNOWN_KEY.
# Run by scripts/test.sh after the README check (whose virtualenv it uses).
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "receipt example: FAILED: $*" >&2; exit 1; }
trap 'echo "receipt example: FAILED at line $LINENO" >&2' ERR
# No atmost settings from the environment: this server is the example's.
while read -r name; do unset "$name"; done < <(compgen -e | grep '^ATMOST_' || true)

venv=target/readme-venv
if ! "$venv/bin/python" -c 'import cryptography, grpc, grpc_reflection, grpc_status' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'cryptography>=41' \
    'grpcio>=1.60' 'grpcio-reflection>=1.60' 'grpcio-status>=1.60' 'protobuf>=4.25'
fi
py="$PWD/$venv/bin/python"
grpcurl() { "$py" "$PWD/scripts/grpcurl.py" "$@"; }

work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$py" - "$work/key.pem" <<'PY'
import sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
pem = Ed25519PrivateKey.generate().private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
open(sys.argv[1], "wb").write(pem)
PY

cargo build --quiet --locked -p atmost --bin atmost
"${CARGO_TARGET_DIR:-target}/debug/atmost" serve --listen 127.0.0.1:0 --receipt-signing-key "$work/key.pem" \
  >"$work/stdout" 2>"$work/stderr" &
pid=$!
for _ in $(seq 100); do grep -q '^atmost listening on' "$work/stdout" 2>/dev/null && break; sleep 0.1; done
addr=$(sed -n 's/^atmost listening on //p' "$work/stdout")
[ -n "$addr" ] || fail "atmost did not start: $(cat "$work/stderr")"

# An hour from now: a permit may live 30 days at most (--max-permit-lifetime).
expires=$(date -u -d '+1 hour' +%Y-%m-%dT%H:%M:%SZ)
permit=$(grpcurl -plaintext -d "{\"permit\": {\"tools\": [\"payments.charge\"], \"expires_at\": \"$expires\"}}" \
  "$addr" atmost.v1.Permits/CreatePermit | jq -r .permitId)
fp=$(printf 'the canonical request' | base64)
attempt=$(grpcurl -plaintext -d "{\"permit_id\": \"$permit\", \"tool\": \"payments.charge\", \"idempotency_key\": \"order-42\", \"request_fingerprint\": \"$fp\", \"cost\": 250}" \
  "$addr" atmost.v1.Gate/Authorize | jq -r .attempt.attemptId)
result=$(printf 'wallet tx 981' | base64)
grpcurl -plaintext -d "{\"permit_id\": \"$permit\", \"idempotency_key\": \"order-42\", \"attempt_id\": \"$attempt\", \"succeeded\": {\"result\": \"$result\"}}" \
  "$addr" atmost.v1.Gate/Commit >"$work/commit.json"
grpcurl -plaintext "$addr" atmost.v1.Receipts/GetSigningKeys >"$work/keys.json"

verdict() {
  local out code=0
  out=$("$py" examples/python/verify_receipt.py "$work/keys.json" "$1") || code=$?
  echo "$out $code"
}
[ "$(verdict "$work/commit.json")" = "VERIFIED 0" ] || fail "the receipt did not verify: $(verdict "$work/commit.json")"
jq '.attempt.receipt.result = "'"$(printf 'wallet tx 982' | base64)"'"' "$work/commit.json" >"$work/forged.json"
[ "$(verdict "$work/forged.json")" = "FORGED 1" ] || fail "a changed result was not FORGED: $(verdict "$work/forged.json")"
jq '.attempt.receipt.keyId = "0000000000000000"' "$work/commit.json" >"$work/unknown.json"
[ "$(verdict "$work/unknown.json")" = "UNKNOWN_KEY 3" ] || fail "an unknown key was not UNKNOWN_KEY"
jq '.attempt.receipt.cost = 2.5' "$work/commit.json" >"$work/bad.json"
[ "$(verdict "$work/bad.json" 2>/dev/null)" = " 2" ] || fail "unusable input did not exit 2: $(verdict "$work/bad.json")"
echo "receipt example: examples/python/verify_receipt.py verified a live receipt, caught a forged result and an unknown key, refused a bad cost" >&2
