#!/usr/bin/env bash
# atmost-mcp's end-to-end tests (mcp/tests), runnable from anywhere on a
# fresh machine with python3 (3.10+, which the MCP SDK needs), redis-server
# (the tests run atmost on each store) and, unless ATMOST_BIN and
# ATMOST_MCP_BIN name the binaries, a Rust toolchain:
#
#   mcp/test.sh [PYTEST ARGS...]
#
# Makes (or reuses) a virtualenv in target/mcp-venv with the pinned
# requirements-test.txt (the official MCP Python SDK, pytest, trustme),
# builds atmost and atmost-mcp unless told where they are, and runs
# pytest: the fixtures start atmost, the SDK's MCPServer as the upstream
# and the proxy, each on free loopback ports, and the SDK's Client as the
# agent. The last line is `mcp proxy: N passed, M failed`; any failure
# exits non-zero. PYTHON picks the interpreter that makes the virtualenv
# (python3).
set -euo pipefail
command -v redis-server >/dev/null 2>&1 || { echo "mcp/test.sh: redis-server is not installed" >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
here="$root/mcp"
cd "$root"

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "mcp/test.sh: $("$python" --version 2>&1) is too old: the MCP Python SDK 2.x needs 3.10+ (set PYTHON)" >&2
  echo "mcp proxy: 0 passed, 1 failed"
  exit 1
fi
venv="$root/target/mcp-venv"
# The virtualenv is reused while it was made from the same pins by the same
# interpreter; anything else makes it anew.
want="$("$python" -c 'import sys; print(sys.version)') $(sha256sum "$here/requirements-test.txt" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.atmost-pins" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements-test.txt"
  echo "$want" >"$venv/.atmost-pins"
fi

target=${CARGO_TARGET_DIR:-target}
case $target in /*) ;; *) target="$root/$target" ;; esac
if [ -z "${ATMOST_BIN:-}" ]; then
  cargo build --quiet --locked -p atmost --bin atmost
  export ATMOST_BIN="$target/debug/atmost"
fi
if [ -z "${ATMOST_MCP_BIN:-}" ]; then
  cargo build --quiet --locked -p atmost-mcp
  export ATMOST_MCP_BIN="$target/debug/atmost-mcp"
fi

report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
status=0
(cd "$here/tests" && "$venv/bin/python" -m pytest -p no:cacheprovider --junitxml="$report/junit.xml" "$@") || status=$?
read -r passed failed < <("$venv/bin/python" - "$report/junit.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(0, 1)  # pytest wrote no report: it could not run
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
total = sum(int(s.get("tests", 0)) for s in suites)
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
# A skipped test counts as failed: none of these tests may pass by not running.
print(total - bad - skipped, bad + skipped)
PY
)
echo "mcp proxy: $passed passed, $failed failed"
if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$passed" -eq 0 ]; then
  exit 1
fi
