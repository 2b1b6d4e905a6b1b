#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs redis-server when it is
# missing (tests start their own on free loopback ports, or use REDIS_URL),
# then runs every test. Usage: scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 && [ -z "${REDIS_URL:-}" ]; then
  echo "test.sh: redis-server not found; installing it from the system packages" >&2
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: no apt-get here: install redis-server yourself, or set REDIS_URL" >&2
    exit 1
  fi
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
fi

cargo test --locked --workspace --all-targets "$@"
