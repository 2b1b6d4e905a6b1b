#!/usr/bin/env bash
# The Python client's tests (clients/python), runnable from anywhere on a
# fresh machine with python3 (3.9+), redis-server (the stalled-store tests
# run atmost on a Redis of their own) and, unless ATMOST_BIN names an
# atmost binary, a Rust toolchain:
#
#   clients/python/test.sh [PYTEST ARGS...]
#
# Makes (or reuses) a virtualenv in target/clients-python-venv with the
# pinned requirements-test.txt, installs the package into it, builds atmost
# unless ATMOST_BIN is set, and runs pytest: the fixtures start their own
# atmost servers on free loopback ports. The last line is
# `python client: N passed, M failed`; any failure exits non-zero.
# PYTHON picks the interpreter that makes the virtualenv (python3).
set -euo pipefail
command -v redis-server >/dev/null 2>&1 || { echo "clients/python/test.sh: redis-server is not installed" >&2; exit 1; }
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/clients/python"
cd "$root"

venv="$root/target/clients-python-venv"
python=${PYTHON:-python3}
# The virtualenv is reused while it was made from the same pins by the same
# interpreter; anything else makes it anew.
want="$("$python" -c 'import sys; print(sys.version)') $(sha256sum "$here/requirements-test.txt" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.atmost-pins" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements-test.txt"
  echo "$want" >"$venv/.atmost-pins"
fi
# The package as a user gets it (not editable), so a file left out of it
# fails here. --no-build-isolation: the pinned setuptools is in the venv.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp -r "$here/pyproject.toml" "$here/README.md" "$here/src" "$build/"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --force-reinstall "$build"

if [ -z "${ATMOST_BIN:-}" ]; then
  cargo build --quiet --locked -p atmost --bin atmost
  target=${CARGO_TARGET_DIR:-target}
  case $target in /*) ;; *) target="$root/$target" ;; esac
  export ATMOST_BIN="$target/debug/atmost"
fi

status=0
(cd "$here" && "$venv/bin/python" -m pytest -p no:cacheprovider --junitxml="$build/junit.xml" "$@") || status=$?
read -r passed failed < <("$venv/bin/python" - "$build/junit.xml" <<'PY'
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
echo "python client: $passed passed, $failed failed"
if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$passed" -eq 0 ]; then
  exit 1
fi
