#!/usr/bin/env bash
# The HTTP/JSON edge's tests (tests/http): a Python HTTP client (httpx)
# against live atmost servers, on the memory store and on a Redis of their
# own, runnable from anywhere on a fresh machine with python3 and
# redis-server and, unless ATMOST_BIN names an atmost binary, a Rust
# toolchain:
#
#   tests/http/test.sh [PYTEST ARGS...]
#
# Makes (or reuses) a virtualenv in target/http-tests-venv with the pinned
# requirements.txt. The last line is `http checks: N passed, M failed`; any
# failure exits non-zero.
set -euo pipefail
command -v redis-server >/dev/null 2>&1 || { echo "tests/http/test.sh: redis-server is not installed" >&2; exit 1; }
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/tests/http"
cd "$root"

venv="$root/target/http-tests-venv"
python=${PYTHON:-python3}
want="$("$python" -c 'import sys; print(sys.version)') $(sha256sum "$here/requirements.txt" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.atmost-pins" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
  echo "$want" >"$venv/.atmost-pins"
fi
if [ -z "${ATMOST_BIN:-}" ]; then
  cargo build --locked -p atmost --bin atmost
  target=${CARGO_TARGET_DIR:-target}
  case $target in /*) ;; *) target="$root/$target" ;; esac
  export ATMOST_BIN="$target/debug/atmost"
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
"$venv/bin/python" -m pytest -p no:cacheprovider -q "$here" "$@" 2>&1 | tee "$log" || status=$?
passed=$(grep -Eo '[0-9]+ passed' "$log" | tail -1 | cut -d' ' -f1 || true)
failed=$( (grep -Eo '[0-9]+ (failed|errors?)' "$log" || true) | tail -2 | awk '{ n += $1 } END { print n + 0 }')
echo "http checks: ${passed:-0} passed, ${failed:-0} failed"
if [ "$status" -eq 0 ] && [ "${passed:-0}" -eq 0 ]; then
  echo "tests/http/test.sh: no test ran" >&2
  exit 1
fi
exit "$status"
