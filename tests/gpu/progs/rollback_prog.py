"""A deterministic CuPy job for the rollback test: phase 1, a pause (the test takes an image),
damage, a pause (the test rolls the job back to the image), phase 2; prints the digest of its
arrays at the end. With GPUOS_RB_TWIN=1 it runs phase 1 then phase 2 straight through: the
uninterrupted run the rolled-back one must equal.

Handshake files in $GPUOS_RB_DIR: it writes `ready` (its pid) and `damaged` (the digest after
the damage), and waits for `go` and `go2`. Every array is allocated up front and nothing
allocates device memory afterwards, so the allocation table stays the image's.
"""

import hashlib
import json
import os
import sys
import time

import cupy as cp

twin = os.environ.get("GPUOS_RB_TWIN") == "1"
where = os.environ.get("GPUOS_RB_DIR", "")


def wait(name: str) -> None:
    if twin:
        return
    path = os.path.join(where, name)
    deadline = time.time() + 300
    while not os.path.exists(path):
        if time.time() > deadline:
            sys.exit(f"rollback_prog: {name} never came")
        time.sleep(0.01)


def mark(name: str, text: str) -> None:
    if twin:
        return
    tmp = os.path.join(where, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(where, name))


sizes = [1 << 20, 3 << 20, 16 << 20, 123457]
arrays = [cp.arange(n, dtype=cp.float32) * (i + 1) / n for i, n in enumerate(sizes)]
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]


def run(steps: int, first: int) -> None:
    for k in range(first, first + steps):
        for i, a in enumerate(arrays):
            with streams[(i + k) % 2]:
                a *= 1.0001
                a += (k % 7) * 1e-3
        for s in streams:  # each step sees the last one's results, whichever stream ran them
            s.synchronize()


def digest() -> str:
    cp.cuda.Device().synchronize()
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.get().tobytes())  # to host memory: no device allocation
    return h.hexdigest()


run(40, 0)
mark("ready", str(os.getpid()))
wait("go")  # the test writes images of this state
if not twin:
    for a in arrays:
        a.fill(-1.0)
    run(9, 1000)
mark("damaged", digest())
wait("go2")  # the test rolls the job back to the image
run(40, 40)
print(json.dumps({"digest": digest()}), flush=True)
