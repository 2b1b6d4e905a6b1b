#!/usr/bin/env bash
# The whole test suite, on a fresh machine. Installs what it needs when it is
# missing (redis-server, jq, openssl, libfaketime, promtool (prometheus) and
# kubectl (kubernetes-client) from the system packages; grpcio
# and cryptography for the README check and the receipt example, in a
# virtualenv under target/; each client's own packages, by its
# clients/*/test.sh), then runs every test
# of the workspace (tests start their own redis-server on free loopback
# ports, or use REDIS_URL) and the protocol's model check (tools/model,
# with the number of states it explored), then the README's commands as written
# (scripts/readme.sh), the three clients through the same situations
# against one atmost (scripts/cross_client.sh), then the deployment files
# through promtool, kustomize and the Kubernetes schemas
# (scripts/deploy_check.sh), then the benchmark's smoke run (SMOKE=1
# scripts/bench.sh).
# Usage: scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
# Even with REDIS_URL set, the tests that kill Redis start their own.
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v jq >/dev/null 2>&1 || missing+=(jq)
# The clients' TLS tests make throwaway certificates with it.
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
# The clock-skew test runs replicas under libfaketime (LD_PRELOAD).
compgen -G '/usr/lib/*/faketime/libfaketime.so.1' >/dev/null \
  || compgen -G '/usr/lib/faketime/libfaketime.so.1' >/dev/null \
  || compgen -G '/usr/local/lib/faketime/libfaketime.so.1' >/dev/null \
  || missing+=(libfaketime)
# scripts/deploy_check.sh: promtool loads and unit-tests the alert rules,
# kubectl kustomize renders deploy/kubernetes. Any kubectl since 1.14 has
# kustomize; Debian's is kubernetes-client.
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
kubectl kustomize --help >/dev/null 2>&1 || missing+=(kubernetes-client)
if [ ${#missing[@]} -gt 0 ]; then
  echo "test.sh: installing ${missing[*]} from the system packages" >&2
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: no apt-get here: install ${missing[*]} yourself" >&2
    exit 1
  fi
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  # The prometheus package starts its daemon on install unless
  # policy-rc.d denies it (invoke-rc.d and, under systemd,
  # deb-systemd-invoke ask it). Only promtool is wanted: where no
  # policy-rc.d decides already (containers usually have one), one denies
  # every start for this install. Under systemd the unit is still enabled
  # for the next boot (`systemctl disable prometheus`).
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod 755 "$policy"
  fi
  status=0
  $sudo apt-get update -qq || status=$?
  # No recommends: prometheus's is prometheus-node-exporter, another daemon.
  [ "$status" -ne 0 ] || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null || status=$?
  if [ -n "$policy" ]; then $sudo rm -f "$policy"; fi
  [ "$status" -eq 0 ] || exit "$status"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# (The protocol's model check prints the states each search explored:
# "atmost-model: ...".)
cargo test --locked --workspace --all-targets "$@" 2>&1 | tee "$log"
# The README's commands as written. Its `cargo run` builds the server with
# the root package's features alone (the workspace's add the model
# checker's and the tests'), into target/debug/atmost: before the build
# below, which puts the workspace's back there without compiling again.
scripts/readme.sh
# The suites below run the binaries built with the test run's features
# (this build only adds the ones no Rust test runs, atmost-mcp's): each
# suite's own `cargo build -p ...` would build them again with -p's
# features, a minute or two each. With extra cargo arguments (another
# profile or target) the suites build their own.
if [ $# -eq 0 ]; then
  cargo build --locked --workspace --all-targets
  target=${CARGO_TARGET_DIR:-target}
  case $target in /*) ;; *) target="$PWD/$target" ;; esac
  export ATMOST_BIN="${ATMOST_BIN:-$target/debug/atmost}"
  export ATMOST_MCP_BIN="${ATMOST_MCP_BIN:-$target/debug/atmost-mcp}"
fi
# The examples in the docs (the client's), compiled and run.
cargo test --locked --workspace --doc 2>&1 | tee -a "$log"
# The Python example that verifies a live receipt with `cryptography`.
scripts/receipt_example.sh
# The clients in other languages, the MCP proxy with the official Python
# MCP SDK, and the HTTP/JSON edge through httpx, each against live atmost
# servers of its own (each script installs what it needs: pip packages,
# npm packages). In two lanes side by side, one per core: each suite waits
# mostly on its servers and its installs. Each lane's output is printed
# whole as the lane ends (a lane's suites stop at the first that fails);
# on an early exit (Ctrl-C, a CI timeout) the lanes are stopped and what
# they printed so far is shown.
lanes=("mcp/test.sh" "$(echo clients/*/test.sh) tests/http/test.sh")
declare -A out_of=()
lanes_done() {
  local pid
  for pid in "${!out_of[@]}"; do
    kill -- -"$pid" 2>/dev/null || true
    echo "test.sh: a lane stopped early; its output so far:" >&2
    cat "${out_of[$pid]}" >&2
    rm -f "${out_of[$pid]}"
  done
  rm -f "$log"
}
trap lanes_done EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for lane in "${lanes[@]}"; do
  out=$(mktemp)
  # Its own process group (setsid), so that it can be stopped whole.
  # shellcheck disable=SC2086 # a lane is a list of scripts
  setsid -w bash -c 'set -e; for suite in $0; do "$suite"; done' "$lane" >"$out" 2>&1 &
  out_of[$!]=$out
done
failed_lanes=0
while [ ${#out_of[@]} -gt 0 ]; do
  status=0
  wait -n -p ended "${!out_of[@]}" || status=$?
  [ "$status" -eq 0 ] || failed_lanes=$((failed_lanes + 1))
  tee -a "$log" <"${out_of[$ended]}"
  rm -f "${out_of[$ended]}"
  unset "out_of[$ended]"
done
if [ "$failed_lanes" -gt 0 ]; then
  echo "test.sh: a suite of the clients, the MCP proxy or the HTTP/JSON edge failed (above)" >&2
  exit 1
fi
# The same scripted situations through the three clients against one
# atmost per store, compared with the contract and with each other (on the
# virtualenv and the build the clients' suites just made).
scripts/cross_client.sh 2>&1 | tee -a "$log"
# The alert rules through promtool, the manifests through kustomize and
# the Kubernetes schemas.
scripts/deploy_check.sh 2>&1 | tee -a "$log"
# The benchmark, every section at its smallest, on this build's binaries:
# that each runs to the end and took the path it claims. No figure is
# asserted (scripts/bench.sh measures; docs/performance.md reports).
if [ $# -eq 0 ]; then
  smoke=$(mktemp -d)
  SMOKE=1 BENCH_BIN="$target/debug" OUT="$smoke" scripts/bench.sh
  rm -rf "$smoke"
  echo "bench smoke: 1 passed, 0 failed" | tee -a "$log"
fi

# One closing line for the whole run: every cargo test binary, plus the
# README check and the receipt example, plus each client's closing line
# ("<language> client: N passed, M failed", "mcp proxy: N passed, M failed"),
# plus the cross-client test's ("cross client: N passed, M failed"),
# plus the deployment checks' ("deploy checks: N passed, M failed"),
# plus the benchmark's smoke run ("bench smoke: 1 passed, 0 failed").
read -r passed failed < <(awk '
  /^test result:/ { p += $4; f += $6 }
  /^[a-z]+ (client|proxy|checks|smoke): [0-9]+ passed, [0-9]+ failed$/ { p += $3; f += $5 }
  END { print p + 2, f }' "$log")
echo "test.sh: ${passed} passed, ${failed} failed"
