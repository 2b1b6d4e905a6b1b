#!/usr/bin/env python3
"""Shares of a server profile by layer (docs/performance.md, "Where the
time goes").

    perf record -F 1999 --call-graph dwarf,32768 -p <atmost pid> -o atm.perf -- sleep 5
    perf script -i atm.perf -F ip,sym,dso | python3 scripts/perf_layers.py

Each sample goes to the innermost frame on its stack that names a layer;
a sample in the kernel goes to the code that made the system call (its
kernel share is printed beside it).
"""
import collections
import re
import sys

LAYERS = [
    ("the store: memory", r"MemoryStore|domain::ledger"),
    ("the store: the redis client", r"RedisStore|store::redis|redis::|combine::|deadpool"),
    ("the audit line", r"atmost::api::audit|atmost::audit"),
    ("the handler: convert, validate, answer", r"atmost::api::gate|atmost::api::convert|atmost::domain|atmost::api::Ctx"),
    ("protobuf and the gRPC codec", r"prost::|tonic::codec"),
    ("atmost's layers: transport limits, auth, admission, metrics",
     r"atmost::transport|atmost::auth|atmost::admission|atmost::telemetry|opentelemetry"),
    ("tonic: routing, the unary service", r"tonic::|tower::|axum::"),
    ("HTTP/2 (h2, hyper)", r"h2::|hyper"),
    ("tokio: I/O and scheduling", r"tokio::"),
]
LAYERS = [(name, re.compile(rx)) for name, rx in LAYERS]


def main():
    shares, kernel, total = collections.Counter(), collections.Counter(), 0
    for sample in sys.stdin.read().split("\n\n"):
        lines = [line.strip() for line in sample.strip().split("\n") if line.strip()]
        if not lines:
            continue
        total += 1
        in_kernel = "kernel.kallsyms" in lines[0]
        layer = "other (allocator, libc, threads)"
        for frame in lines:
            hit = next((name for name, rx in LAYERS if rx.search(frame)), None)
            if hit:
                layer = hit
                break
        shares[layer] += 1
        kernel[layer] += in_kernel
    for layer, n in shares.most_common():
        print(f"{100 * n / total:5.1f}%  (in the kernel {100 * kernel[layer] / total:4.1f}%)  {layer}")
    print(f"{total} samples")


if __name__ == "__main__":
    main()
