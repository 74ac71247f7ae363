"""A scientific loop for `gpu-prefetch-sched run`: --arrays float32 arrays of --mib MiB each;
step s reads arrays s, s+1, s+2 (mod n) and writes array s+3 with a 3-point stencil whose
per-element work is --work fused multiply-adds (the arithmetic intensity of the job). Every
--arrays steps the same launches repeat on the same memory, as an iterative solver's do.

Each array is allocated and filled by a kernel before the next one is allocated, so a memory
manager acting at launches sees the memory grow one array at a time. No temporaries inside
the loop (every kernel writes a preallocated array), so the arrays are the job's memory.

Writes one JSON line to --out (stdout without it): the loop's wall time (synchronised before and after),
steps, bytes, and per array the sha256 of its final contents, which a run under any memory
manager must reproduce bit for bit.
"""

import argparse
import hashlib
import json
import time

import cupy as cp

FILL = cp.ElementwiseKernel(
    "uint64 seed", "float32 x",
    """
    unsigned long long z = (unsigned long long)i + seed + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    x = (float)((z ^ (z >> 31)) & 0xffffff) * (1.0f / 16777216.0f);
    """,
    "gpuos_stencil_fill",
)

STEP = cp.ElementwiseKernel(
    "raw float32 a, raw float32 b, raw float32 c, int64 n, int32 work", "float32 out",
    """
    long long l = i > 0 ? i - 1 : n - 1, r = i + 1 < n ? i + 1 : 0;
    float x = 0.25f * a[l] + 0.5f * b[i] + 0.25f * c[r];
    float y = x;
    for (int k = 0; k < work; ++k) y = fmaf(y, 0.999f, 0.001f * x);
    out = y;
    """,
    "gpuos_stencil_step",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=12)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--periods", type=int, default=10)
    ap.add_argument("--work", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    n = args.mib * (1 << 20) // 4
    arrays = []
    for k in range(args.arrays):
        a = cp.empty(n, dtype=cp.float32)
        FILL(cp.uint64(k * n), a)
        arrays.append(a)
    dev = cp.cuda.Device()
    dev.synchronize()
    m = args.arrays
    steps = args.periods * m
    t0 = time.perf_counter()
    for s in range(steps):
        STEP(arrays[s % m], arrays[(s + 1) % m], arrays[(s + 2) % m], n, args.work, arrays[(s + 3) % m])
    dev.synchronize()
    loop_s = time.perf_counter() - t0
    digests = [hashlib.sha256(cp.asnumpy(a).tobytes()).hexdigest() for a in arrays]
    out = {"loop_s": loop_s, "steps": steps, "arrays": m, "array_bytes": n * 4, "total_bytes": m * n * 4,
           "work": args.work, "digests": digests}
    line = json.dumps(out)
    if args.out:  # not stdout: under gpu-prefetch-sched run, stdout carries its summary
        with open(args.out, "w") as f:
            f.write(line + "\n")
    else:
        print(line, flush=True)


if __name__ == "__main__":
    main()
