#!/usr/bin/env python3
"""Reads scripts/bench.sh's results.jsonl and prints the ratio table, the
peak throughput of one run, or the latency-vs-throughput plot.

  bench_report.py peak RESULTS LABEL SCENARIO
  bench_report.py summary RESULTS CLK_TCK
  bench_report.py list_scale RESULTS   (the ListUncertain-at-scale block alone)
  bench_report.py plot RESULTS OUT.png
  bench_report.py wakeups SECONDS   (how late this machine wakes a sleeping
                                     thread, idle: the floor under any tail)
  bench_report.py first_touch         (what the first touch of new memory costs:
                                     a 4 KiB page, and a transparent huge page)
"""
import json
import math
import sys


def load(path):
    runs, metrics = [], {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "metric" in row:
                metrics[row["metric"]] = row["value"]
            else:
                runs.append(row)
    return runs, metrics


def find(runs, label, scenario, mode="closed"):
    for r in runs:
        if r["label"] == label and r.get("scenario") == scenario and r.get("mode") == mode:
            return r
    return None


def peak(path, label, scenario):
    runs, _ = load(path)
    print(int(find(runs, label, scenario)["throughput_rps"]))


def wakeups(seconds):
    """Sleeps 0.5 ms over and over and prints how late each wake-up came, as
    two metric lines for results.jsonl."""
    import time
    late = []
    end = time.perf_counter() + float(seconds)
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.0005)
        late.append(time.perf_counter() - t - 0.0005)
    late.sort()
    for name, value in (("p999", late[int(len(late) * 0.999)]), ("max", late[-1])):
        print(json.dumps({"metric": f"idle_wakeup_late_{name}_us", "value": round(value * 1e6)}))


def first_touch():
    """Times the first write to fresh anonymous pages: 4 KiB ones, and 2 MiB
    ones asked for as transparent huge pages (what mimalloc asks for unless
    built with no_thp); prints the medians as metric lines."""
    import ctypes
    import mmap
    import time

    def touch(count, step, huge):
        m = mmap.mmap(-1, (count + 1) * step, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            m.madvise(mmap.MADV_HUGEPAGE)
        base = (-ctypes.addressof(ctypes.c_char.from_buffer(m))) % step
        took = []
        for i in range(count):
            t = time.perf_counter_ns()
            m[base + i * step] = 1
            took.append(time.perf_counter_ns() - t)
        took.sort()
        return took[count // 2] / 1e3

    print(json.dumps({"metric": "first_touch_4k_p50_us", "value": round(touch(20000, 4096, False), 1)}))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        print(json.dumps({"metric": "first_touch_thp_p50_us", "value": round(touch(50, 2 << 20, True))}))


def mark(ok):
    return "ok " if ok else "MISS"


def ceiling_rows(runs):
    """The Redis ceiling's strategies, by name (tools/bench redis_ceiling)."""
    return {r["strategy"]: r for r in runs if r["label"] == "redis-ceiling"}


def ceilings(runs, m, clk_tck):
    """The ceilings, the scenarios and their targets (a full run only)."""
    strategies = ceiling_rows(runs)
    # (a): the most Redis did with the script, however it was driven.
    best = max(strategies.values(), key=lambda r: r["rps"])
    redis_ceiling = best["rps"]
    multiplexed = strategies.get("multiplexed")
    health = find(runs, "memory", "health")
    grpc_ceiling = health["throughput_rps"]
    steal = m.get("cpu_steal_percent")
    if steal is not None:
        print(f"CPU stolen by the hypervisor during the run: {steal}%")
    if "idle_wakeup_late_p999_us" in m:
        print(f"a sleeping thread woke late, idle machine: p99.9 {m['idle_wakeup_late_p999_us']}us, "
              f"max {m['idle_wakeup_late_max_us']}us")
    if "first_touch_thp_p50_us" in m:
        print(f"first touch of new memory: a 4 KiB page {m['first_touch_4k_p50_us']}us, "
              f"a transparent huge page {m['first_touch_thp_p50_us']}us (p50)")
    print(f"(a) Redis ceiling, authorize.lua as the store sends it ({best['strategy']}): "
          f"{redis_ceiling:10.0f}/s")
    print(f"(b) gRPC ceiling, health Check:           {grpc_ceiling:10.0f}/s   "
          f"p50 {health['p50_us']}us p99 {health['p99_us']}us")
    print()
    print("(cycle: one Authorize + one Commit; RPC/s counts both, latency is per pair)")
    print(f"{'store':<7}{'scenario':<11}{'RPC/s':>10}{'p50':>8}{'p99':>8}{'p99.9':>8}{'errors':>8}"
          f"{'/(a)':>8}{'/(b)':>8}")
    for store in ("memory", "redis"):
        for scenario in ("authorize", "cycle", "replay", "contended"):
            r = find(runs, store, scenario)
            if not r:
                continue
            rps = r["throughput_rps"] * r["rpcs_per_request"]
            to_a = f"{rps / redis_ceiling:7.0%}" if store == "redis" else "      -"
            print(f"{store:<7}{scenario:<11}{rps:10.0f}{r['p50_us']:>6}us{r['p99_us']:>6}us"
                  f"{r['p999_us']:>6}us{r['errors']:>8} {to_a}{rps / grpc_ceiling:8.0%}")
    print()
    red = find(runs, "redis", "authorize")
    print(f"  (Redis authorize: {red['throughput_rps'] / redis_ceiling:.0%} of (a)"
          + (f", {red['throughput_rps'] / multiplexed['rps']:.0%} of the multiplexed connection"
             if multiplexed else "") + ")")
    rounds = sorted({r["label"] for r in runs if r["label"].startswith("memory-round-")})
    ratios = [find(runs, label, "authorize")["throughput_rps"] / find(runs, label, "health")["throughput_rps"]
              for label in rounds]
    if ratios:
        median = sorted(ratios)[len(ratios) // 2]
        print(f"  {mark(median >= 0.9)} memory authorize >= 90% of (b), {len(ratios)} interleaved rounds: "
              + " ".join(f"{x:.0%}" for x in ratios) + f" (median {median:.0%})")

    def cpu_us(store, scenario):
        ticks = m.get(f"{store}_{scenario}_cpu_ticks")
        total = m.get(f"{store}_{scenario}_cpu_requests")
        return None if ticks is None or not total else ticks / float(clk_tck) / total * 1e6

    floor = cpu_us("memory", "health")
    for store, extra in (("memory", 2.0), ("redis", 9.0)):
        micros = cpu_us(store, "authorize")
        if micros is None or floor is None:
            continue
        print(f"  {mark(micros <= floor + extra)} server CPU per Authorize ({store}): {micros:.1f} us "
              f"(target <= a health check's {floor:.1f} + {extra:.0f})")
        rss = m.get(f"{store}_peak_rss_kib")
        if rss is not None:
            note = " (holds every attempt of the run in process memory, by design)" if store == "memory" else ""
            print(f"       peak RSS ({store}): {rss / 1024:.1f} MiB{note}")
    http_ratios = [find(runs, label, "httpauthorize")["throughput_rps"] / find(runs, label, "authorize")["throughput_rps"]
                   for label in rounds if find(runs, label, "httpauthorize")]
    if http_ratios:
        median = sorted(http_ratios)[len(http_ratios) // 2]
        print(f"  HTTP/JSON Authorize (h2c, the same connections) / gRPC Authorize, memory store, "
              f"{len(http_ratios)} interleaved rounds: " + " ".join(f"{x:.0%}" for x in http_ratios)
              + f" (median {median:.0%})")
        red_http = find(runs, "redis", "httpauthorize")
        if red_http and red:
            print(f"       Redis store: {red_http['throughput_rps']:.0f}/s over HTTP/JSON, "
                  f"{red_http['throughput_rps'] / red['throughput_rps']:.0%} of gRPC's {red['throughput_rps']:.0f}/s; "
                  f"p50 {red_http['p50_us']}us p99 {red_http['p99_us']}us (gRPC {red['p50_us']}us, {red['p99_us']}us)")
        http_cpu = cpu_us("memory-edge-http", "http-authorize")
        grpc_cpu = cpu_us("memory-edge-grpc", "authorize")
        if http_cpu is not None and grpc_cpu is not None:
            print(f"       server CPU per Authorize, memory store, each on a fresh server: {http_cpu:.1f} us "
                  f"over HTTP/JSON, {grpc_cpu:.1f} us over gRPC ({http_cpu / grpc_cpu:.2f}x, "
                  f"+{http_cpu - grpc_cpu:.1f} us)")
    with_audit, without = cpu_us("memory-audit-on", "authorize"), cpu_us("memory-audit-off", "authorize")
    if with_audit is not None and without is not None:
        print(f"       the audit trail's cost (memory store, two fresh servers): {with_audit - without:.1f} us "
              f"per Authorize ({with_audit:.1f} written to /dev/null, {without:.1f} off)")
    if multiplexed:
        usec = multiplexed["script_usec_per_call"]
        print(f"  {mark(usec <= 14)} authorize.lua's Redis time per call under (a): {usec:.2f} us (target <= 14); "
              f"the multiplexed client's own CPU {multiplexed['client_cpu_us_per_call']:.1f} us per call")
    per_attempt = m.get("redis_bytes_per_finished_attempt")
    if per_attempt is not None:
        beyond = per_attempt - 16
        print(f"  {mark(beyond <= 250)} Redis memory per finished attempt: {per_attempt} B, "
              f"{beyond} B beyond its 16-byte result (target <= 250)")


def summary(path, clk_tck):
    runs, m = load(path)
    print()
    if ceiling_rows(runs) and find(runs, "memory", "health") and find(runs, "redis", "authorize"):
        ceilings(runs, m, clk_tck)
    conns = ceiling_rows(runs).values()
    if conns:
        print()
        print("Redis connection strategy (authorize script as the store sends it, same concurrency):")
        for r in conns:
            print(f"  {r['strategy']:<16} {r['rps']:>8.0f}/s  p50 {r['p50_us']:>6}us p99 {r['p99_us']:>6}us  "
                  f"client CPU {r['client_cpu_us_per_call']:.1f} us/call  "
                  f"Redis {r['script_usec_per_call']:.2f} us/script")
    sweep = sorted(
        (r for r in runs if r["label"].startswith("redis-sweep-")),
        key=lambda r: int(r["label"].rsplit("-", 1)[1]),
    )
    ceiling = {r["label"].rsplit("-", 1)[1]: r for r in runs if r["label"].startswith("health-sweep-")}
    if sweep:
        print()
        print("latency vs load (open loop, Redis store, authorize; [the gRPC ceiling, health, at the same rate]):")
        for r in sweep:
            pct = r["label"].rsplit("-", 1)[1]
            h = ceiling.get(pct)
            print(f"  {pct:>4}% of peak: {r['target_rate']:>6}/s offered {r.get('ok_rps', 0):>7.0f}/s ok  p50 {r['p50_us']:>6}us "
                  f"p99 {r['p99_us']:>7}us p99.9 {r['p999_us']:>7}us  (service p99 "
                  f"{r.get('service_p99_us', '?')}us)  errors {r['errors']} {r['error_kinds'] or ''}"
                  + (f"  [health p50 {h['p50_us']}us p99 {h['p99_us']}us, service p99 {h['service_p99_us']}us]" if h else ""))
        by_pct = {r["label"].rsplit("-", 1)[1]: r for r in sweep}
        top = find(runs, "redis", "authorize")
        if top and all(p in by_pct for p in ("50", "80", "150")):
            at150, at50, at80 = by_pct["150"], by_pct["50"], by_pct["80"]
            good = at150.get("ok_rps", 0) / top["throughput_rps"]
            tail = at150["p99_us"] / max(at50["p99_us"], 1)
            shed80 = at80.get("error_kinds", {}).get("OVERLOADED", 0) if isinstance(at80.get("error_kinds"), dict) else at80["errors"]
            print(f"overload targets: at 150% {good:.2f} of peak ok (target >= 0.90, {mark(good >= 0.9)}); "
                  f"p99 at 150% / p99 at 50% = {tail:.1f} (target <= 4, {mark(tail <= 4)}); "
                  f"shed at 80%: {shed80} (target 0, {mark(shed80 == 0)})")
            h50 = ceiling.get("50")
            if h50:
                print(f"p99 at 50% of peak: Redis store {at50['p99_us']}us, the transport (health) "
                      f"{h50['p99_us']}us: {at50['p99_us'] / max(h50['p99_us'], 1):.1f}x")
    list_scale(runs)
    cross_scale(runs)
    cluster(runs, m)


def cross_scale(runs):
    """Reconciling across permits: the whole cross-permit ListUncertain walk
    and the census with many live permits and few uncertain attempts
    (tools/bench cross_scale)."""
    rows = [r for r in runs if r.get("scenario") == "cross_permit_reconcile"]
    if not rows:
        return
    print()
    print("Reconciling across permits (many live permits, few uncertain; medians of the calls):")
    for r in rows:
        pages_ok = r["walk_pages"] <= -(-r["uncertain"] // r["page"]) + 1
        print(f"  {mark(pages_ok and r['walk_ms'] < 50)} {r['store']:<7}{r['permits']:>8} permits, "
              f"{r['uncertain']} uncertain, {r['reserved']} reserved: the whole walk {r['walk_pages']} "
              f"pages of {r['page']} in {r['walk_ms']:.1f} ms (target: 2 pages, < 50 ms); "
              f"the census {r['census_ms']:.2f} ms")


def cluster(runs, m):
    """Redis Cluster beside one standalone Redis: authorize through atmost,
    and Redis's own CPU per authorize script (INFO commandstats)."""
    rows = [(label, find(runs, label, "authorize")) for label in ("standalone", "cluster-none", "cluster-replica")]
    rows = [(label, r) for label, r in rows if r]
    if not rows:
        return
    base = rows[0][1]["throughput_rps"] if rows[0][0] == "standalone" else None
    print()
    print("Redis Cluster (3 primaries, 3 replicas) beside one standalone Redis, authorize, closed loop:")
    for label, r in rows:
        usec = m.get(f"{label}_script_usec_per_call")
        ratio = f" ({r['throughput_rps'] / base:.2f} of standalone)" if base else ""
        print(f"  {label:<16} {r['throughput_rps']:>8.0f}/s{ratio}  p50 {r['p50_us']:>6}us p99 {r['p99_us']:>6}us  "
              f"Redis CPU per authorize script {usec} us")


def list_scale(runs):
    """The ListUncertain-at-scale block: per page, listing and scope, the
    time per page at each number of open attempts, and the SLOWLOG."""
    rows = [r for r in runs if r.get("scenario") == "list_uncertain"]
    fills = [r for r in runs if r.get("scenario") == "list_uncertain_fill"]
    if not rows:
        return
    sizes = sorted({r["open"] for r in rows})
    print()
    print("ListUncertain at scale (one permit with N open attempts; time per page, one call at a time,")
    print("p50/p99; [in Redis: list_uncertain.lua's own time per script run, at most 200 attempts each]):")
    print(f"  {'store':<7}{'page':>5} {'listing':<8}{'scope':<7}" + "".join(f"{n:>24}" for n in sizes))
    groups = {}
    for r in rows:
        groups.setdefault((r["store"], r["page"], r["listing"], r["scope"]), {})[r["open"]] = r
    for (store, page, listing, scope), by_size in sorted(groups.items()):
        cells = []
        for n in sizes:
            r = by_size.get(n)
            if not r:
                cells.append(f"{'-':>24}")
                continue
            cell = f"{r['p50_us']:.0f}/{r['p99_us']:.0f}us"
            if r.get("redis_script_us") is not None:
                cell += f" [{r['redis_script_us']:.0f}]"
            cells.append(f"{cell:>24}")
        print(f"  {store:<7}{page:>5} {listing:<8}{scope:<7}" + "".join(cells))
    for store in sorted({r["store"] for r in rows}):
        for page in sorted({r["page"] for r in rows if r["store"] == store}):
            # Flat: the largest size's figure against the smallest's, on the
            # steadiest reading (Redis's own time where there is one).
            def reading(n):
                picked = [r for r in rows if r["store"] == store and r["page"] == page and r["open"] == n]
                return sum(r["redis_script_us"] if r.get("redis_script_us") is not None else r["p50_us"]
                           for r in picked) / max(len(picked), 1)
            if len(sizes) > 1:
                # O(log n + page) at most doubles from 1k to 1M (log2); O(n)
                # would grow as n does.
                bound = max(2.0, math.log2(sizes[-1]) / math.log2(max(sizes[0], 2)))
                ratio = reading(sizes[-1]) / reading(sizes[0])
                print(f"  {mark(ratio <= bound)} {store}, page {page}: {sizes[-1]} open attempts cost "
                      f"{ratio:.2f}x what {sizes[0]} do ({sizes[-1] / sizes[0]:.0f}x as many; "
                      f"flat: <= {bound:.1f}x)")
    for f in sorted(fills, key=lambda f: (f["store"], f["open"])):
        line = f"  {f['store']:<7}{f['open']:>9} open: filled at {f['fill_rps']:.0f}/s"
        if "redis_bytes_per_open_attempt" in f:
            line += f", {f['redis_bytes_per_open_attempt']:.0f} B of Redis memory per open attempt"
        if "slowlog_list_entries" in f:
            by_page = {}
            for e in f.get("slowlog_list", []):
                by_page.setdefault(e.get("page"), []).append(e["us"])
            detail = ", ".join(f"page {p}: {len(us)} (max {max(us) / 1000:.1f} ms)" for p, us in sorted(
                by_page.items(), key=lambda kv: kv[0] or 0)) or "none"
            line += (f"; SLOWLOG > {f['slowlog_threshold_us'] / 1000:.0f} ms: fill {f['slowlog_fill_entries']}, "
                     f"listing {f['slowlog_list_entries']} ({detail})")
        print(line)


def plot(path, out):
    try:
        import matplotlib
    except ImportError:
        import subprocess
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "matplotlib"])
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, _ = load(path)
    sweep = sorted(
        (r for r in runs if r["label"].startswith("redis-sweep-")),
        key=lambda r: r["target_rate"],
    )
    x = [r["target_rate"] for r in sweep]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for q, name in (("p50_us", "p50"), ("p99_us", "p99"), ("p999_us", "p99.9"),
                    ("service_p99_us", "p99 from send")):
        if all(q in r for r in sweep):
            ax.plot(x, [r[q] / 1000 for r in sweep], marker="o", label=name)
    health = sorted(
        (r for r in runs if r["label"].startswith("health-sweep-")),
        key=lambda r: r["target_rate"],
    )
    if health:
        ax.plot([r["target_rate"] for r in health], [r["p99_us"] / 1000 for r in health],
                marker="x", linestyle="--", color="grey", label="p99 of the gRPC ceiling (health)")
    ax.set_xlabel("offered load, Authorize/s (open loop)")
    ax.set_ylabel("latency, ms (from scheduled start)")
    ax.set_yscale("log")
    ax.set_title("atmost Authorize on the Redis store: latency vs load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "peak":
        peak(*sys.argv[2:5])
    elif cmd == "summary":
        summary(sys.argv[2], sys.argv[3])
    elif cmd == "wakeups":
        wakeups(sys.argv[2])
    elif cmd == "first_touch":
        first_touch()
    elif cmd == "list_scale":
        list_scale(load(sys.argv[2])[0])
    elif cmd == "plot":
        plot(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
