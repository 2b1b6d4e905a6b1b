#!/usr/bin/env bash
# The TypeScript client's tests, on a fresh machine, from anywhere (e.g. the
# repo root: clients/node/test.sh). Needs Node.js 20+, npm, openssl and
# redis-server (the stalled-store tests run atmost on a Redis of their own).
#   1. npm ci (skipped when node_modules was installed from this very
#      package-lock.json), then npm run build;
#   2. the atmost binary: $ATMOST_BIN if set, else
#      `cargo build --quiet --locked -p atmost --bin atmost` and
#      ${CARGO_TARGET_DIR:-target}/debug/atmost of the repo;
#   3. every test (node --test): they start their own atmost processes on
#      free loopback ports and kill them when done, even on failure.
# The last line is `node client: N passed, M failed`; the exit status is
# non-zero on any failure.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$here"

for tool in node npm openssl redis-server; do
  command -v "$tool" >/dev/null 2>&1 || { echo "clients/node/test.sh: $tool is not installed" >&2; exit 1; }
done
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 20 ]; then
  echo "clients/node/test.sh: Node.js 20 or later is needed, this is $(node --version)" >&2
  exit 1
fi

# node_modules is reused only when the stamp npm ci left says it came from
# this lockfile; anything else (none, stale, hand-installed) is replaced.
stamp=node_modules/.atmost-package-lock.sha256
want=$(node -e 'const c=require("node:crypto"),f=require("node:fs");process.stdout.write(c.createHash("sha256").update(f.readFileSync("package-lock.json")).digest("hex"))')
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  npm ci --no-audit --no-fund
  printf '%s\n' "$want" > "$stamp"
fi
npm run --silent build

if [ -z "${ATMOST_BIN:-}" ]; then
  (cd "$root" && cargo build --quiet --locked -p atmost --bin atmost)
  target="${CARGO_TARGET_DIR:-target}"
  case "$target" in /*) ;; *) target="$root/$target" ;; esac
  export ATMOST_BIN="$target/debug/atmost"
fi

tap=$(mktemp)
trap 'rm -f "$tap"' EXIT
status=0
node --test \
  --test-reporter=spec --test-reporter-destination=stdout \
  --test-reporter=tap --test-reporter-destination="$tap" \
  dist/test/*.test.js || status=$?

count() { sed -n "s/^# $1 \([0-9][0-9]*\)\$/\1/p" "$tap" | tail -n 1; }
passed=$(count pass)
passed=${passed:-0}
failed=0
# A cancelled test failed; a skipped or todo one did not pass either (the
# suite has none, so one appearing is a defect to see, not a green).
for kind in fail cancelled skipped todo; do
  n=$(count "$kind")
  failed=$((failed + ${n:-0}))
done
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1 # the runner failed outside any test (a file that did not load)
fi
echo "node client: ${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
