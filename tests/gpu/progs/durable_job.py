"""A CuPy job for the "no snapshot lost" GPU tests, run under the agent: --gib GiB in 256 MiB arrays
of deterministic integers, then idle until told to end.

    durable_job.py --dir DIR [--gib N]

Writes DIR/ready.json ({pid, arrays: [[device pointer, bytes, sha256], ...]}) once its data is
final, then waits for a line on stdin and returns from main: the program ends while the agent
may still be writing an image of it.
"""

import argparse
import hashlib
import json
import os
import sys

import cupy as cp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    per = 256 << 20
    arrays = []
    for i in range(max(1, int(args.gib * (1 << 30)) // per)):
        a = cp.arange(per // 4, dtype=cp.uint32)
        a *= cp.uint32(2654435761 + 2 * i)
        a ^= cp.uint32(i * 0x9E3779B9 & 0xFFFFFFFF)
        arrays.append(a)
    cp.cuda.Device().synchronize()
    listed = [[int(a.data.ptr), int(a.nbytes), hashlib.sha256(cp.asnumpy(a).tobytes()).hexdigest()] for a in arrays]
    temp = os.path.join(args.dir, ".ready.json")
    with open(temp, "w") as f:
        json.dump({"pid": os.getpid(), "arrays": listed}, f)
    os.replace(temp, os.path.join(args.dir, "ready.json"))
    sys.stdin.readline()


if __name__ == "__main__":
    main()
