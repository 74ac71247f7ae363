#!/usr/bin/env python3
"""Allocation cost with owned allocations (gpuos_tools/agent/owned.py) against CuPy's default.

Three measurements, each for CuPy's default (cudaMalloc; MemoryPool over it) and the owned
library (VMM; MemoryPool over it), in this process, untraced:

- raw: the base allocator alone, batches of 64 allocations of mixed sizes (512 B to 64 MiB,
  log-uniform, fixed seed) then their frees: cudaMalloc/cudaFree against gpuos_alloc_malloc/free
  (through ctypes, about CuPy's own call overhead). µs per allocation+free.
- pool: the same sizes through a MemoryPool, all held at once then freed: first from an empty
  pool (every request a miss: what a program pays while its pool warms up), then again (hits).
  µs per allocation+free.
- ops: a loop of CuPy elementwise and reduction ops on 4K- and 1M-element arrays that create
  temporaries, timed with the device synchronised. µs per iteration.

Usage: scripts/bench_alloc.py [--json FILE] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sizes(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(512), math.log(64 << 20)))) for _ in range(n)]


def raw(kind: str, sz: list[int], repeat: int) -> float:
    import cupy as cp

    from gpuos_tools.agent import owned

    if kind == "default":
        alloc, free = cp.cuda.runtime.malloc, cp.cuda.runtime.free
    else:
        lib = owned.OwnedLibrary.load()
        dev = cp.cuda.Device().id

        def alloc(n: int) -> int:
            return lib.malloc(n, dev)

        free = lib.free
    times = []
    for _ in range(repeat):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for i in range(0, len(sz), 64):
            ptrs = [alloc(n) for n in sz[i : i + 64]]
            for p in ptrs:
                free(p)
        times.append((time.perf_counter() - t) / len(sz) * 1e6)
        if kind != "default":
            lib.trim()
    return statistics.median(times)


def make_pool(kind: str):
    import cupy as cp

    from gpuos_tools.agent import owned

    if kind == "default":
        pool = cp.cuda.MemoryPool()
        cp.cuda.set_allocator(pool.malloc)
        return pool
    return owned.install_cupy()


def pooled(kind: str, sz: list[int], repeat: int) -> tuple[float, float]:
    import cupy as cp

    cold, warm = [], []
    for _ in range(repeat):
        pool = make_pool(kind)
        for bucket in (cold, warm):  # all held at once: the first pass misses every time
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            arrays = [cp.empty(n, dtype=cp.uint8) for n in sz]
            del arrays
            bucket.append((time.perf_counter() - t) / len(sz) * 1e6)
        pool.free_all_blocks()
    return statistics.median(cold), statistics.median(warm)


def ops(kind: str, iters: int, repeat: int) -> float:
    import cupy as cp

    pool = make_pool(kind)
    small = cp.arange(4096, dtype=cp.float32)
    big = cp.arange(1 << 20, dtype=cp.float32)
    times = []
    for r in range(repeat + 1):  # the first round warms the pool and the kernel cache
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            a = cp.sin(small) * 2 + small
            b = (cp.exp(big * 1e-6) - big).sum()
            c = cp.sqrt(cp.abs(a - b)) + small[::-1]
            small = (c * 0.5).astype(cp.float32)
        cp.cuda.Device().synchronize()
        if r:
            times.append((time.perf_counter() - t) / iters * 1e6)
    pool.free_all_blocks()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n", type=int, default=512, help="allocations per round")
    ap.add_argument("--iters", type=int, default=2000, help="iterations of the ops loop")
    args = ap.parse_args()
    import cupy as cp

    sz = sizes(args.n)
    result = {"gpu": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
              "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "n": args.n, "iters": args.iters,
              "repeat": args.repeat, "size_range": [512, 64 << 20]}
    runs: dict[str, dict[str, float]] = {"default": {}, "owned": {}}
    for kind in ("default", "owned"):
        r = runs[kind]
        r["raw_us"] = raw(kind, sz, args.repeat)
        r["pool_cold_us"], r["pool_warm_us"] = pooled(kind, sz, args.repeat)
    # the ops loop in A B A B order, the better of each kind's two: the first loop of a process
    # also pays for the GPU's clocks ramping up
    for kind in ("default", "owned", "default", "owned"):
        t = ops(kind, args.iters, args.repeat)
        runs[kind]["ops_us_per_iter"] = min(t, runs[kind].get("ops_us_per_iter", t))
    for kind, r in runs.items():
        result[kind] = {k: round(v, 3) for k, v in r.items()}
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    print(f"{'':10} {'raw µs':>10} {'pool cold':>10} {'pool warm':>10} {'ops µs/it':>10}")
    for kind in ("default", "owned"):
        r = result[kind]
        print(f"{kind:10} {r['raw_us']:10.2f} {r['pool_cold_us']:10.2f} {r['pool_warm_us']:10.2f} "
              f"{r['ops_us_per_iter']:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
