#!/usr/bin/env bash
# The cross-client test: the guarded call's scripted situations
# (clients/testdata/guarded_situations.json) through the Rust, Python and
# Node clients against one live atmost per store (memory, then Redis), each
# runner's answers and what atmost recorded compared with the file's
# expectations and across the three (examples/cross_client.rs, the harness;
# the runners client/examples/situations.rs,
# clients/python/tests/situations_runner.py, clients/node/test/situations-runner.ts).
#
#   scripts/cross_client.sh [--store memory|redis|both]
#
# Runs after clients/python/test.sh and clients/node/test.sh (scripts/test.sh
# does): it uses the virtualenv the first makes (target/clients-python-venv,
# the package installed as a user gets it) and the build the second makes
# (clients/node/dist). Either missing, or node, fails the run: nothing is
# skipped. Needs redis-server (or REDIS_URL). ATMOST_BIN names the server
# to test; without it, the workspace's debug build. The last line is
# `cross client: N passed, M failed`; any failure exits non-zero.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
fail() { echo "scripts/cross_client.sh: $*" >&2; exit 1; }

python="$root/target/clients-python-venv/bin/python"
runner_py="$root/clients/python/tests/situations_runner.py"
runner_js="$root/clients/node/dist/test/situations-runner.js"
[ -x "$python" ] || fail "no $python: run clients/python/test.sh first (it makes the virtualenv)"
"$python" -c 'import atmost_client' || fail "the virtualenv has no atmost_client: run clients/python/test.sh first"
command -v node >/dev/null 2>&1 || fail "node is not installed"
[ -f "$runner_js" ] || fail "no $runner_js: run clients/node/test.sh first (it builds the package)"

# The harness and the Rust runner are examples: scripts/test.sh's workspace
# build made them (this is then only a check), with the same features.
bins=()
[ -n "${ATMOST_BIN:-}" ] || bins=(--bins)
cargo build --quiet --locked --workspace --examples "${bins[@]}"
target=${CARGO_TARGET_DIR:-target}
case $target in /*) ;; *) target="$root/$target" ;; esac
atmost=${ATMOST_BIN:-$target/debug/atmost}

exec "$target/debug/examples/cross_client" \
  --situations "$root/clients/testdata/guarded_situations.json" \
  --atmost "$atmost" \
  --rust "$target/debug/examples/situations" \
  --python "$python" "$runner_py" \
  --node node "$runner_js" \
  "$@"
