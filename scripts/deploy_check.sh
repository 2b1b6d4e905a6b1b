#!/usr/bin/env bash
# The deployment files, read by the tools that will read them (run by
# scripts/test.sh, which installs promtool and kubectl when missing):
#
# - deploy/prometheus/alerts.yaml loaded by Prometheus's promtool
#   (`promtool check rules`), and its unit tests,
#   deploy/prometheus/alerts_test.yaml, run by promtool's rule engine
#   (`promtool test rules`), after checking that they make every alert
#   fire once and stay silent once;
# - deploy/kubernetes rendered by `kubectl kustomize`, and every object it
#   renders validated strictly against the Kubernetes schemas of every
#   version kubernetes-validate bundles (a virtualenv in target/, pinned
#   by scripts/deploy_check-requirements.txt).
#
# Needs promtool (Debian's prometheus), kubectl with kustomize (Debian's
# kubernetes-client, or any kubectl since 1.14) and python3. Runs every
# check, prints each failure's output, and closes with
# `deploy checks: N passed, M failed`; any failure exits non-zero.
# Usage: scripts/deploy_check.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

for tool in promtool kubectl python3; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "deploy check: $tool is not installed (scripts/test.sh installs it)" >&2
    echo "deploy checks: 0 passed, 1 failed"
    exit 1
  }
done

venv="$root/target/deploy-venv"
pins="$root/scripts/deploy_check-requirements.txt"
# Reused while made from the same pins by the same interpreter.
want="$(python3 -c 'import sys; print(sys.version)') $(sha256sum "$pins" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.atmost-pins" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" \
    && "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$pins" \
    && echo "$want" >"$venv/.atmost-pins" \
    || { echo "deploy check: could not make $venv"; echo "deploy checks: 0 passed, 1 failed"; exit 1; }
fi
py="$venv/bin/python"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0
# check NAME COMMAND...: one check; its output is shown when it fails.
check() {
  local name=$1
  shift
  if "$@" >"$work/out" 2>&1; then
    passed=$((passed + 1))
    echo "deploy check: ok: $name" >&2
    grep -v '^ *$' "$work/out" | sed 's/^ */  /' >&2
  else
    failed=$((failed + 1))
    echo "deploy check: FAILED: $name" >&2
    sed 's/^/  /' "$work/out" >&2
  fi
}

check "promtool check rules deploy/prometheus/alerts.yaml" \
  promtool check rules deploy/prometheus/alerts.yaml
check "every alert fires in a test and stays silent in another" \
  "$py" scripts/deploy_check.py alert-tests deploy/prometheus/alerts.yaml deploy/prometheus/alerts_test.yaml
check "promtool test rules deploy/prometheus/alerts_test.yaml" \
  promtool test rules deploy/prometheus/alerts_test.yaml
kubectl=$(kubectl version --client -o json 2>/dev/null \
  | python3 -c 'import json, sys; v = json.load(sys.stdin); k = v.get("kustomizeVersion"); print(v["clientVersion"]["gitVersion"] + (", kustomize " + k if k else ""))' 2>/dev/null)
render() { kubectl kustomize deploy/kubernetes >"$work/rendered.yaml"; }
check "kubectl kustomize deploy/kubernetes (kubectl ${kubectl:-of unknown version})" render
if [ -s "$work/rendered.yaml" ]; then
  check "kubernetes-validate --strict, the rendered objects" \
    "$py" scripts/deploy_check.py manifests "$work/rendered.yaml"
else
  failed=$((failed + 1))
  echo "deploy check: FAILED: kubernetes-validate: nothing rendered to validate" >&2
fi

echo "deploy checks: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
