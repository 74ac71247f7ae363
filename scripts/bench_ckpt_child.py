#!/usr/bin/env python3
"""The process scripts/bench_ckpt.py checkpoints: GIB GiB of pseudo-random data on the GPU (CuPy,
1 GiB allocations filled by a splitmix64 kernel, no managed memory), then it waits.

stdout: "ready {json}" with the data's checksum; then on each stdin line "check" it prints
"check {json}" with the checksum computed again (unchanged after a checkpoint and restore, or
the benchmark fails); "exit" or end of input ends it.
"""

import argparse
import json
import os
import sys

import cupy as cp

FILL = cp.ElementwiseKernel(
    "uint64 seed", "uint32 x",
    """
    unsigned long long z = (unsigned long long)i + seed + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    x = (unsigned int)(z ^ (z >> 31));
    """,
    "gpuos_bench_fill",
)


def checksum(chunks: list) -> int:
    return sum(int(c.sum(dtype=cp.uint64)) for c in chunks) % (1 << 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, required=True)
    args = ap.parse_args()
    per_chunk = (1 << 30) // 4
    chunks = []
    for k in range(args.gib):
        chunk = cp.empty(per_chunk, dtype=cp.uint32)
        FILL(cp.uint64(k * per_chunk), chunk)
        chunks.append(chunk)
    cp.cuda.Device().synchronize()
    print("ready " + json.dumps({"pid": os.getpid(), "checksum": checksum(chunks)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print("check " + json.dumps({"checksum": checksum(chunks)}), flush=True)
        elif line.strip() == "exit":
            break


if __name__ == "__main__":
    main()
