#!/usr/bin/env bash
# The Python receipt-verification example (examples/python/verify_receipt.py)
# against a live atmost with two tenants: a signing key made with
# `cryptography`, a receipt issued over gRPC (scripts/grpcurl.py, grpcio) for
# each tenant, verified as a tool provider would; one passed off as the other
# tenant's, as version 1, or with a changed result must be FORGED, an unknown
# key UNKNOWN_KEY; a receipt signed in version 1 (tests/data/receipt_v1) still
# verifies, said to prove no tenant.
# Run by scripts/test.sh after the README check (whose virtualenv it uses).
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "receipt example: FAILED: $*" >&2; exit 1; }
trap 'echo "receipt example: FAILED at line $LINENO" >&2' ERR
# The binary to run, if the caller built it (scripts/test.sh does), then no
# atmost settings from the environment: this server is the example's.
bin=${ATMOST_BIN:-}
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

# Two tenants, an admin key each.
acme_key=acme-admin-0123456789abcdef
globex_key=globex-admin-0123456789abcdef
for t in acme globex; do
  key_var="${t}_key"
  printf '[[key]]\nid = "%s-admin"\nsha256 = "%s"\ntenant = "%s"\nroles = ["admin"]\n\n' \
    "$t" "$(printf '%s' "${!key_var}" | sha256sum | cut -d' ' -f1)" "$t"
done >"$work/keys.toml"

if [ -z "$bin" ]; then
  cargo build --quiet --locked -p atmost --bin atmost
  bin="${CARGO_TARGET_DIR:-target}/debug/atmost"
fi
"$bin" serve --listen 127.0.0.1:0 --receipt-signing-key "$work/key.pem" \
  --auth-keys "$work/keys.toml" >"$work/stdout" 2>"$work/stderr" &
pid=$!
for _ in $(seq 100); do grep -q '^atmost listening on' "$work/stdout" 2>/dev/null && break; sleep 0.1; done
addr=$(sed -n 's/^atmost listening on //p' "$work/stdout")
[ -n "$addr" ] || fail "atmost did not start: $(cat "$work/stderr")"

# A receipt of tenant $1 (its key $2), in $work/$1.json.
receipt() {
  local as=(-H "authorization: Bearer $2") permit attempt
  # An hour from now: a permit may live 30 days at most (--max-permit-lifetime).
  expires=$(date -u -d '+1 hour' +%Y-%m-%dT%H:%M:%SZ)
  permit=$(grpcurl -plaintext "${as[@]}" -d "{\"permit\": {\"tools\": [\"payments.charge\"], \"expires_at\": \"$expires\"}}" \
    "$addr" atmost.v1.Permits/CreatePermit | jq -r .permitId)
  fp=$(printf 'the canonical request' | base64)
  attempt=$(grpcurl -plaintext "${as[@]}" -d "{\"permit_id\": \"$permit\", \"tool\": \"payments.charge\", \"idempotency_key\": \"order-42\", \"request_fingerprint\": \"$fp\", \"cost\": 250}" \
    "$addr" atmost.v1.Gate/Authorize | jq -r .attempt.attemptId)
  result=$(printf 'wallet tx 981' | base64)
  grpcurl -plaintext "${as[@]}" -d "{\"permit_id\": \"$permit\", \"idempotency_key\": \"order-42\", \"attempt_id\": \"$attempt\", \"succeeded\": {\"result\": \"$result\"}}" \
    "$addr" atmost.v1.Gate/Commit >"$work/$1.json"
}
receipt acme "$acme_key"
receipt globex "$globex_key"
grpcurl -plaintext "$addr" atmost.v1.Receipts/GetSigningKeys >"$work/keys.json"

# "<stdout> <exit code>" of the example on keys $2 (default: the live
# server's) and attempt $1; its standard error in $work/said.
verdict() {
  local out code=0
  out=$("$py" examples/python/verify_receipt.py "${2:-$work/keys.json}" "$1" 2>"$work/said") || code=$?
  echo "$out $code"
}
for t in acme globex; do
  [ "$(verdict "$work/$t.json")" = "VERIFIED 0" ] || fail "$t's receipt did not verify: $(verdict "$work/$t.json") $(cat "$work/said")"
  [ "$(cat "$work/said")" = "verify_receipt.py: signed in version 2, tenant \"$t\"" ] \
    || fail "$t's receipt was not said to be $t's: $(cat "$work/said")"
done
jq '.attempt.receipt.tenant = "globex"' "$work/acme.json" >"$work/as-globex.json"
[ "$(verdict "$work/as-globex.json")" = "FORGED 1" ] || fail "acme's receipt passed off as globex's was not FORGED: $(verdict "$work/as-globex.json")"
jq 'del(.attempt.receipt.tenant, .attempt.receipt.signatureVersion)' "$work/acme.json" >"$work/as-v1.json"
[ "$(verdict "$work/as-v1.json")" = "FORGED 1" ] || fail "a version 2 receipt read as version 1 was not FORGED: $(verdict "$work/as-v1.json")"
jq '.attempt.receipt.result = "'"$(printf 'wallet tx 982' | base64)"'"' "$work/acme.json" >"$work/forged.json"
[ "$(verdict "$work/forged.json")" = "FORGED 1" ] || fail "a changed result was not FORGED: $(verdict "$work/forged.json")"
jq '.attempt.receipt.keyId = "0000000000000000"' "$work/acme.json" >"$work/unknown.json"
[ "$(verdict "$work/unknown.json")" = "UNKNOWN_KEY 3" ] || fail "an unknown key was not UNKNOWN_KEY"
jq '.attempt.receipt.cost = 2.5' "$work/acme.json" >"$work/bad.json"
[ "$(verdict "$work/bad.json")" = " 2" ] || fail "unusable input did not exit 2: $(verdict "$work/bad.json")"

# A receipt an atmost signed in version 1, with the keys it published.
v1=tests/data/receipt_v1
[ "$(verdict "$v1/commit.json" "$v1/keys.json")" = "VERIFIED 0" ] \
  || fail "the version 1 receipt did not verify: $(verdict "$v1/commit.json" "$v1/keys.json") $(cat "$work/said")"
grep -q 'version 1, which signs no tenant' "$work/said" || fail "the version 1 receipt was not said to prove no tenant: $(cat "$work/said")"
jq '.attempt.receipt.result = "'"$(printf 'wallet tx 982' | base64)"'"' "$v1/commit.json" >"$work/v1-forged.json"
[ "$(verdict "$work/v1-forged.json" "$v1/keys.json")" = "FORGED 1" ] || fail "a changed version 1 result was not FORGED"
jq '.attempt.receipt.tenant = "acme"' "$v1/commit.json" >"$work/v1-tenant.json"
[ "$(verdict "$work/v1-tenant.json" "$v1/keys.json")" = " 2" ] || fail "a tenant beside a version 1 signature was not refused"
grep -q 'does not cover a tenant' "$work/said" || fail "the refusal did not say why: $(cat "$work/said")"
echo "receipt example: examples/python/verify_receipt.py verified live receipts of two tenants and a version 1 receipt, caught a receipt passed off as another tenant's or as version 1, a forged result and an unknown key, refused a bad cost and an unsigned tenant" >&2
