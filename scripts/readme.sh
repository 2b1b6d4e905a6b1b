#!/usr/bin/env bash
# The README's commands, run as a newcomer types them. README.md marks the
# blocks it promises with `<!-- readme-check: NAME -->` on the line before
# the fence:
#   quick-start  line 1 must bring up a server that answers HTTP/JSON on
#                127.0.0.1:50051 (it is run as written, in the
#                background; on a free port if 50051 is taken, for instance
#                by line 1 run by hand); line 2 must be the test command, scripts/test.sh
#                (which runs this check, so it is not run again here);
#   curl         run as written against that server, with bash -euo
#                pipefail: every command must succeed and the Authorize must
#                answer DECISION_DISPATCH; the same again, 409
#                IDEMPOTENCY_IN_PROGRESS; with charge-2, 429
#                PERMIT_MAX_CALLS_EXCEEDED, as the README says.
#   try-it       run as written in the repository (the binary the
#                quick-start built): `atmost demo` against its own server,
#                which must exit 0 and say every step got the answer the
#                story expects.
# A README edit that breaks a command fails this check.
set -euo pipefail
cd "$(dirname "$0")/.."
# As a newcomer's shell would have it: no atmost settings in the environment.
while read -r name; do unset "$name"; done < <(compgen -e | grep '^ATMOST_' || true)

fail() {
  echo "readme: FAILED: $*" >&2
  exit 1
}

# The lines of the fenced block after the marker of $1.
block() {
  awk -v marker="<!-- readme-check: $1 -->" '
    $0 == marker { found = 1; next }
    found && /^```/ { if (inside) exit; inside = 1; next }
    inside { print }
  ' README.md
}

quick=$(block quick-start)
examples=$(block curl)
try_it=$(block try-it)
[ -n "$quick" ] || fail "README.md has no block marked readme-check: quick-start"
[ -n "$examples" ] || fail "README.md has no block marked readme-check: curl"
[ -n "$try_it" ] || fail "README.md has no block marked readme-check: try-it"
# A command, without its trailing comment.
command_of() { sed -n "$1p" <<<"$quick" | sed -e 's/[[:space:]]*#.*$//' -e 's/[[:space:]]*$//'; }
serve=$(command_of 1)
test_command=$(command_of 2)
[ "$test_command" = "scripts/test.sh" ] ||
  fail "the README's second command is '$test_command', but the test command is scripts/test.sh"
grep -qx 'scripts/test.sh' .ci/run || fail ".ci/run does not run scripts/test.sh, the README's test command"

# The README's address. A newcomer may still have the first command's
# server running there: then the same commands are checked on a free port
# (ATMOST_LISTEN, which `atmost serve` reads when --listen is not given, and
# the examples' address rewritten to it).
addr=127.0.0.1:50051
if (exec 3<>/dev/tcp/127.0.0.1/50051) 2>/dev/null; then
  addr=127.0.0.1:$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  echo "readme: 127.0.0.1:50051 is taken (by the first command's server?); checking on $addr" >&2
  export ATMOST_LISTEN=$addr
  examples=${examples//127.0.0.1:50051/$addr}
fi

work=$(mktemp -d)
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then
    kill -TERM -- "-$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

command -v curl >/dev/null 2>&1 || fail "curl is not installed (scripts/test.sh installs it)"
command -v jq >/dev/null 2>&1 || fail "jq is not installed (scripts/test.sh installs it)"

echo "readme: running '$serve' (the first run builds the binary)" >&2
setsid bash -c "$serve" >"$work/serve.log" 2>&1 &
server_pid=$!
deadline=$((SECONDS + 1800))
# The port first (cheap, while the build runs), then an RPC that
# needs no permit: the signing keys.
until (exec 3<>"/dev/tcp/${addr%:*}/${addr##*:}") 2>/dev/null &&
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$addr/v1/signingKeys")" = 200 ]; do
  kill -0 "$server_pid" 2>/dev/null || fail "'$serve' exited: $(tail -n 20 "$work/serve.log")"
  [ "$SECONDS" -lt "$deadline" ] || fail "'$serve' did not serve on $addr within 30 minutes"
  sleep 1
done
echo "readme: '$serve' answers HTTP/JSON on $addr" >&2

if ! output=$(cd "$work" && bash -euo pipefail -c "$examples" 2>&1); then
  fail "the README's curl examples failed:"$'\n'"$output"
fi
grep -q '"decision": "DECISION_DISPATCH"' <<<"$output" || fail "no DISPATCH in:"$'\n'"$output"
echo "readme: the curl examples ran as written: a permit created, DECISION_DISPATCH" >&2

# What the README says follows: the same Authorize again is
# IDEMPOTENCY_IN_PROGRESS, and with "charge-2" PERMIT_MAX_CALLS_EXCEEDED.
# The Authorize: from its curl line to the first line that does not go on.
authorize=$(awk '/^curl .*attempts:authorize/ { on = 1 } on { print } on && !/\\$/ { exit }' <<<"$examples")
[ -n "$authorize" ] || fail "no Authorize command in the README's curl block"
# Its HTTP status too (as `-w` adds it after the body, before jq).
status_of() { sed 's/^curl -sS /curl -sS -w "\\nhttp %{http_code}\\n" /; s/ | jq \.$//' <<<"$1"; }
# (Without -e: these two are meant to fail.)
again="$examples
echo '--- again'
$(status_of "$authorize")
echo '--- charge-2'
$(status_of "${authorize//charge-1/charge-2}")"
output=$(cd "$work" && bash -u -c "$again" 2>&1) || true
sed -n '/^--- again$/,/^--- charge-2$/p' <<<"$output" | grep -q 'IDEMPOTENCY_IN_PROGRESS' ||
  fail "the same Authorize again did not answer IDEMPOTENCY_IN_PROGRESS:"$'\n'"$output"
sed -n '/^--- again$/,/^--- charge-2$/p' <<<"$output" | grep -qx 'http 409' ||
  fail "the same Authorize again was not 409:"$'\n'"$output"
sed -n '/^--- charge-2$/,$p' <<<"$output" | grep -q 'PERMIT_MAX_CALLS_EXCEEDED' ||
  fail "Authorize with charge-2 did not answer PERMIT_MAX_CALLS_EXCEEDED:"$'\n'"$output"
sed -n '/^--- charge-2$/,$p' <<<"$output" | grep -qx 'http 429' ||
  fail "Authorize with charge-2 was not 429:"$'\n'"$output"
echo "readme: and as it says, the same key again is 409 IDEMPOTENCY_IN_PROGRESS, charge-2 429 PERMIT_MAX_CALLS_EXCEEDED" >&2

# The "Try it" block: the demo plays against a server of its own (the
# binary is built by now), whatever runs on 50051.
if ! output=$(bash -euo pipefail -c "$try_it" 2>&1); then
  fail "the README's try-it block failed:"$'\n'"$output"
fi
grep -q '^Every step got the answer the story expects' <<<"$output" ||
  fail "the demo did not tell every step as the story expects:"$'\n'"$output"
echo "readme: the try-it block ran as written: every step of the demo as the story expects" >&2
