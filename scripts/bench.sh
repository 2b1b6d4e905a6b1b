#!/usr/bin/env bash
# The benchmark: in one run on one machine, the two ceilings and atmost side
# by side, each atmost figure printed as a ratio to its ceiling.
#
#   (a) Redis's ceiling: atmost's authorize script, each call built by the
#       Redis store's own code and each reply read by it (every one must be
#       a fresh DISPATCH), through one multiplexed connection (as the store
#       sends), one connection per caller (as redis-benchmark would) and
#       deadpool pools; Redis's own time per script from INFO commandstats
#       (tools/bench redis_ceiling);
#   (b) the gRPC ceiling: grpc.health.v1 Check against atmost (no store);
#   (c) authorize, cycle, replay and contended on the memory store and on
#       the Redis store; server CPU per Authorize (with the audit trail
#       written, to /dev/null, and off) and peak RSS (from /proc);
#       Redis memory per finished attempt; a latency-vs-throughput sweep,
#       and the health check's latency at the same rates beside it;
#   ListUncertain with 1k, 100k and 1M open attempts in one permit, on
#       both stores, and Redis's SLOWLOG meanwhile (tools/bench list_scale);
#   reconciling across permits: the whole cross-permit ListUncertain walk
#       and the census with 100k live permits, 100 uncertain attempts and
#       1000 in flight, on both stores (tools/bench cross_scale);
#   (d) Redis Cluster (3 primaries, 3 replicas) beside one standalone Redis:
#       authorize through atmost with --durability none and replica, and
#       Redis's own CPU per authorize script from INFO commandstats.
#
# Every section fails the run when its calls did not take the path it
# claims (a ceiling call that did not DISPATCH, a scenario's call refused;
# the overload sweep may shed): a wrong path is not a figure.
#
# Usage: scripts/bench.sh            (DURATION=10s CONCURRENCY=64 by default)
#        LIST_SIZES=1000,100000 scripts/bench.sh   (ListUncertain without 1M)
#        SWEEP_ONLY=1 scripts/bench.sh   (the Redis store's peak and the
#            overload sweep alone, about 2 minutes: docs/performance.md,
#            "Overload")
#        CLUSTER_ONLY=1 scripts/bench.sh   (Redis Cluster beside
#            standalone alone, about 2 minutes: docs/performance.md,
#            "Redis Cluster")
#        SMOKE=1 scripts/bench.sh   (every section, tiny durations and
#            sizes, on the debug build scripts/test.sh made: that it runs
#            to the end, no figure is meaningful; scripts/test.sh runs it)
# Results: target/bench/<time>/results.jsonl and summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${SMOKE:-}" ]; then
  # Every section, as small as it goes; each still checks its path.
  : "${DURATION:=1s}" "${WARMUP:=0s}" "${CONCURRENCY:=8}" "${LIST_SIZES:=30}"
  : "${LIST_ARGS:=--pages 5,10 --calls 10}"
  : "${CEILING_REQUESTS:=2000}" "${CPU_REQUESTS:=2000}" "${MEMORY_REQUESTS:=2000}"
  : "${ROUNDS:=1}" "${OUT:=target/bench-smoke/$(date -u +%Y%m%dT%H%M%SZ)}"
  : "${CROSS_ARGS:=--permits 300 --uncertain 20 --reserved 20 --page 10 --calls 2}"
fi
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
CONCURRENCY=${CONCURRENCY:-64}
LIST_SIZES=${LIST_SIZES:-1000,100000,1000000}
OUT=${OUT:-target/bench/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"

command -v redis-server >/dev/null && command -v redis-cli >/dev/null || {
  echo "bench.sh: needs redis-server and redis-cli (apt-get install redis-server)" >&2
  exit 1
}
if [ -n "${SMOKE:-}" ]; then
  # The debug build of the test run (BENCH_BIN: its directory), or one
  # made now.
  if [ -z "${BENCH_BIN:-}" ]; then
    cargo build --locked --workspace --bins >&2
    BENCH_BIN=${CARGO_TARGET_DIR:-target}/debug
  fi
  BIN=$BENCH_BIN
else
  # The server as it ships (`-p atmost`, as the Dockerfile and `cargo run`
  # build it): built with --workspace, Cargo would unify its dependencies'
  # features with the tools' and measure a different binary (500 KB larger).
  cargo build --release --locked -p atmost --bin atmost >&2
  cargo build --release --locked -p atmost-bench --bins >&2
  BIN=${CARGO_TARGET_DIR:-target}/release
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --daemonize no --loglevel warning --dir "$OUT" >/dev/null &
PIDS+=($!)
REDIS_PID=$!
until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do sleep 0.05; done
rcli() { redis-cli -p "$REDIS_PORT" "$@"; }

# Starts atmost with the given flags; sets ATMOST_PID and ATMOST_URL.
start_atmost() {
  local fifo="$OUT/atmost.$$.$RANDOM"
  mkfifo "$fifo"
  # The scenarios put up to millions of keys on 16 permits and leave
  # Authorize's attempts open: the quotas would refuse them (they measure
  # the store, not the quotas).
  # The audit trail is written (it is on by default), to /dev/null: a
  # run writes gigabytes of it. The logs are only start-up and shutdown.
  # AUDIT_LOG=off: without it.
  "$BIN/atmost" serve --listen 127.0.0.1:0 --max-open-attempts 0 --max-attempts-per-permit 0 \
    --memory-max-bytes 0 --audit-log "${AUDIT_LOG:-/dev/null}" "$@" >"$fifo" 2>>"$OUT/atmost.log" &
  ATMOST_PID=$!
  PIDS+=("$ATMOST_PID")
  local line="" started=""
  # The listening line is the last at start-up ("atmost metrics on ADDR"
  # comes first with --metrics-listen).
  while read -r line; do
    case $line in "atmost listening on "*) started=1; break ;; esac
  done <"$fifo"
  rm -f "$fifo"
  if [ -z "$started" ]; then
    echo "bench.sh: atmost $* did not start:" >&2
    tail -n 20 "$OUT/atmost.log" >&2
    exit 1
  fi
  ATMOST_URL="http://${line#atmost listening on }"
}
stop_atmost() { kill "$ATMOST_PID" 2>/dev/null || true; wait "$ATMOST_PID" 2>/dev/null || true; }

bench() { # label scenario [extra args]; IN_FLIGHT overrides the concurrency
  local label=$1 scenario=$2; shift 2
  "$BIN/atmost-bench" --target "$ATMOST_URL" --scenario "$scenario" --label "$label" \
    --concurrency "${IN_FLIGHT:-$CONCURRENCY}" --duration "$DURATION" --warmup "$WARMUP" \
    --json "$RESULTS" "$@"
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
peak_rss_kib() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }
record() { # name value
  printf '{"metric":"%s","value":%s}\n' "$1" "$2" >>"$RESULTS"
}

# CPU time the hypervisor gave to others (steal) over the whole run: a
# figure to read the others by on a shared virtual machine.
cpu_totals() { awk '/^cpu / {t = 0; for (i = 2; i <= NF; i++) t += $i; print t, $9}' /proc/stat; }
read -r CPU_TOTAL0 CPU_STEAL0 < <(cpu_totals)

echo "== machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r)"
# How late the idle machine wakes a sleeping thread: no request's tail can
# beat it, and every request waits for several wake-ups. And what the first
# touch of new memory costs: a transparent huge page is zeroed whole on it.
python3 scripts/bench_report.py wakeups 5 >>"$RESULTS"
python3 scripts/bench_report.py first_touch >>"$RESULTS"
full() { [ -z "${SWEEP_ONLY:-}${CLUSTER_ONLY:-}" ]; }
sweep() { [ -z "${CLUSTER_ONLY:-}" ]; }
if full; then
echo "== (a) Redis ceiling: authorize.lua as the Redis store sends it, c=$CONCURRENCY"
STRATEGIES="multiplexed,connections-$CONCURRENCY,pool-8"
[ "$CONCURRENCY" = 8 ] || STRATEGIES="$STRATEGIES,pool-$CONCURRENCY"
"$BIN/redis_ceiling" --redis-url "redis://127.0.0.1:$REDIS_PORT" --concurrency "$CONCURRENCY" \
  --requests "${CEILING_REQUESTS:-200000}" --strategies "$STRATEGIES" --json "$RESULTS"
rcli FLUSHALL >/dev/null

# The server's CPU over exactly n calls of scenario $2, labelled $1.
cpu_per_call() {
  local label=$1 scenario=$2 start end n=${CPU_REQUESTS:-200000}
  start=$(cpu_ticks "$ATMOST_PID")
  "$BIN/atmost-bench" --target "$ATMOST_URL" --scenario "$scenario" --requests "$n" \
    --concurrency "$CONCURRENCY" --label "$label-cpu" >/dev/null
  end=$(cpu_ticks "$ATMOST_PID")
  record "${label}_${scenario}_cpu_ticks" $((end - start))
  record "${label}_${scenario}_cpu_requests" "$n"
}

# Runs the store scenarios against the running atmost, labelled $1.
store_scenarios() {
  local label=$1
  bench "$label" authorize
  cpu_per_call "$label" authorize
  bench "$label" cycle
  bench "$label" replay
  bench "$label" contended
  record "${label}_peak_rss_kib" "$(peak_rss_kib "$ATMOST_PID")"
}

echo "== (b) gRPC ceiling and (c) the memory store"
start_atmost --store memory
bench memory health
# The transport's own CPU per call, the floor under CPU per Authorize.
cpu_per_call memory health
store_scenarios memory
# This machine's speed drifts between minutes: the memory store's ratio to
# (b) again, as health and Authorize runs side by side, ROUNDS times.
# The same Authorize over the HTTP/JSON edge too (h2c, as many
# connections), in turns: odd rounds gRPC first, even rounds HTTP first.
for round in $(seq "${ROUNDS:-3}"); do
  bench "memory-round-$round" health
  if [ $((round % 2)) = 1 ]; then
    bench "memory-round-$round" authorize
    bench "memory-round-$round" http-authorize
  else
    bench "memory-round-$round" http-authorize
    bench "memory-round-$round" authorize
  fi
done
stop_atmost
# What the audit trail costs: CPU per Authorize on two fresh servers, one
# writing it (to /dev/null) and one without it.
start_atmost --store memory
cpu_per_call memory-audit-on authorize
stop_atmost
AUDIT_LOG=off start_atmost --store memory
cpu_per_call memory-audit-off authorize
stop_atmost
# CPU per Authorize over each edge, each on a fresh server (the memory
# store holds every attempt of a run).
start_atmost --store memory
cpu_per_call memory-edge-grpc authorize
stop_atmost
start_atmost --store memory
cpu_per_call memory-edge-http http-authorize
stop_atmost

fi

if sweep; then
echo "== (c) the Redis store"
start_atmost --store redis --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-prefix bench
if full; then
store_scenarios redis
bench redis http-authorize

echo "== Redis memory per finished attempt (100 000 Authorize + Commit Succeeded, 16-byte results)"
rcli FLUSHALL >/dev/null
BEFORE=$(rcli INFO memory | awk -F: '/^used_memory:/ {print $2+0}')
MEMORY_REQUESTS=${MEMORY_REQUESTS:-100000}
"$BIN/atmost-bench" --target "$ATMOST_URL" --scenario cycle --permits 16 --requests "$MEMORY_REQUESTS" \
  --concurrency "$CONCURRENCY" --label redis-memory >/dev/null
AFTER=$(rcli INFO memory | awk -F: '/^used_memory:/ {print $2+0}')
record redis_bytes_per_finished_attempt $(((AFTER - BEFORE) / MEMORY_REQUESTS))
else
  bench redis authorize
fi

echo "== latency vs throughput: open loop, Redis store"
PEAK=$(python3 scripts/bench_report.py peak "$RESULTS" redis authorize)
# Past the peak atmost sheds (OVERLOADED) and the generator runs out of
# slots: the summary reports them against the targets.
SHED=OVERLOADED,CLIENT_IN_FLIGHT_LIMIT
for pct in 25 50 80 100 120 150; do
  IN_FLIGHT=4096 bench "redis-sweep-$pct" authorize --rate $((PEAK * pct / 100)) --allow-errors "$SHED"
done
stop_atmost
if full; then
start_atmost --store redis --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-prefix bench
echo "== the gRPC ceiling's latency at the same rates (health, same server)"
for pct in 25 50 80 100; do
  IN_FLIGHT=4096 bench "health-sweep-$pct" health --rate $((PEAK * pct / 100)) --allow-errors "$SHED"
done
stop_atmost

echo "== ListUncertain at scale: one permit with $LIST_SIZES open attempts"
# In process through the store trait (list_scale), on this run's Redis,
# emptied first; it sets the SLOWLOG threshold to 10 ms around the fill and
# the listing, and puts it back.
rcli FLUSHALL >/dev/null
# shellcheck disable=SC2086 # LIST_ARGS: more flags, word-split on purpose
"$BIN/list_scale" --redis-url "redis://127.0.0.1:$REDIS_PORT" --sizes "$LIST_SIZES" \
  ${LIST_ARGS:-} --json "$RESULTS" | tee "$OUT/list-scale.txt"
rcli FLUSHALL >/dev/null

echo "== Reconciling across permits: many live permits, few uncertain"
# shellcheck disable=SC2086 # CROSS_ARGS: more flags, word-split on purpose
"$BIN/cross_scale" --redis-url "redis://127.0.0.1:$REDIS_PORT" ${CROSS_ARGS:-} \
  --json "$RESULTS" | tee "$OUT/cross-scale.txt"
rcli FLUSHALL >/dev/null
fi
fi

if full || [ -n "${CLUSTER_ONLY:-}" ]; then
echo "== (d) Redis Cluster (3 primaries, 3 replicas) beside one standalone Redis"
# Redis's own CPU per script: usec_per_call of cmdstat_fcall, summed over
# the primaries' calls, after CONFIG RESETSTAT.
fcall_stats() { # ports... -> "calls usec"
  for port in "$@"; do redis-cli -p "$port" INFO commandstats; done |
    awk -F'[=,:]' '/^cmdstat_fcall:/ { c += $3; u += $5 } END { print c + 0, u + 0 }'
}
cluster_run() { # label ports-of-primaries... ; atmost already started
  local label=$1 allow=""; shift
  # --durability replica answers STORE_UNAVAILABLE where no replica
  # acknowledged in time (WAIT): counted in the summary, not a wrong path.
  case $label in *-replica) allow="--allow-errors STORE_UNAVAILABLE" ;; esac
  for port in "$@"; do redis-cli -p "$port" CONFIG RESETSTAT >/dev/null; done
  # shellcheck disable=SC2086 # $allow: two words or none
  bench "$label" authorize $allow
  read -r calls usec < <(fcall_stats "$@")
  record "${label}_script_calls" "$calls"
  record "${label}_script_usec_per_call" "$(awk -v c="$calls" -v u="$usec" 'BEGIN { printf "%.2f", (c > 0 ? u / c : 0) }')"
}
CLUSTER_PORTS=()
for _ in 1 2 3 4 5 6; do
  port=$(free_port)
  mkdir -p "$OUT/cluster-$port"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
    --loglevel warning --dir "$OUT/cluster-$port" --cluster-enabled yes \
    --cluster-port "$(free_port)" --cluster-config-file nodes.conf \
    --repl-diskless-sync-delay 0 >/dev/null &
  PIDS+=($!)
  CLUSTER_PORTS+=("$port")
done
for port in "${CLUSTER_PORTS[@]}"; do
  until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.05; done
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${CLUSTER_PORTS[@]}") \
  --cluster-replicas 1 --cluster-yes >"$OUT/cluster-create.txt"
until redis-cli -p "${CLUSTER_PORTS[0]}" --cluster check "127.0.0.1:${CLUSTER_PORTS[0]}" 2>/dev/null |
  grep -q 'All 16384 slots covered'; do sleep 0.2; done
PRIMARIES=()
for port in "${CLUSTER_PORTS[@]}"; do
  if redis-cli -p "$port" INFO replication | grep -q '^role:master'; then PRIMARIES+=("$port"); fi
done
for port in "${PRIMARIES[@]}"; do
  until [ "$(redis-cli -p "$port" INFO replication | grep -c 'state=online')" = 1 ]; do sleep 0.1; done
done
# Every node's own view: a node answers CLUSTERDOWN until it sees every
# slot served, some time after the first node does.
for port in "${CLUSTER_PORTS[@]}"; do
  until redis-cli -p "$port" CLUSTER INFO | grep -q '^cluster_state:ok'; do sleep 0.1; done
done
SEEDS=$(printf 'redis://127.0.0.1:%s,' "${CLUSTER_PORTS[@]}")
SEEDS=${SEEDS%,}
rcli FLUSHALL >/dev/null
start_atmost --store redis --redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-prefix bench
cluster_run standalone "$REDIS_PORT"
stop_atmost
for durability in none replica; do
  start_atmost --store redis --redis-mode cluster --redis-url "$SEEDS" --durability "$durability" \
    --redis-prefix "bench-$durability"
  cluster_run "cluster-$durability" "${PRIMARIES[@]}"
  stop_atmost
done
fi

read -r CPU_TOTAL1 CPU_STEAL1 < <(cpu_totals)
record cpu_steal_percent "$(awk -v t=$((CPU_TOTAL1 - CPU_TOTAL0)) -v s=$((CPU_STEAL1 - CPU_STEAL0)) \
  'BEGIN { printf "%.1f", (t > 0 ? 100 * s / t : 0) }')"

CLK_TCK=$(getconf CLK_TCK)
python3 scripts/bench_report.py summary "$RESULTS" "$CLK_TCK" | tee "$OUT/summary.txt"
if [ -z "${SMOKE:-}" ]; then
  python3 scripts/bench_report.py plot "$RESULTS" "$OUT/latency.png" || echo "(no plot: pip install matplotlib)"
fi
echo "results: $OUT"
