"""A CuPy job holding GPU_JOB_GIB GiB in 256 MiB arrays that keeps updating them on two streams
until $GPUOS_JOB_STOP exists; writes "unix_time iters_per_s longest_gap_s" per >= 100 ms window to
$GPUOS_JOB_LOG (the gap: the longest time between two synchronisations, every 8 iterations)."""

import os
import sys
import time

import cupy as cp

gib = float(os.environ.get("GPU_JOB_GIB", "8"))
stop = os.environ["GPUOS_JOB_STOP"]
log = open(os.environ["GPUOS_JOB_LOG"], "w", buffering=1)
n = int(gib * (1 << 30) // (256 << 20))
arrays = [cp.full(64 << 20, i, dtype=cp.float32) for i in range(n)]  # 256 MiB each
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
cp.cuda.Device().synchronize()
with open(os.environ["GPUOS_JOB_READY"] + ".tmp", "w") as f:
    f.write(str(os.getpid()))  # the agent's socket is named after this process
os.rename(os.environ["GPUOS_JOB_READY"] + ".tmp", os.environ["GPUOS_JOB_READY"])
print(f"agent_job: {n} arrays of 256 MiB ready", file=sys.stderr, flush=True)
i = 0
window = last = time.perf_counter()
count = 0
gap = 0.0
while not os.path.exists(stop):
    s = streams[i % 2]
    with s:
        a = arrays[i % n]
        a *= 1.0001  # reads and writes one array (256 MiB)
    i += 1
    count += 1
    if count % 8 == 0:
        s.synchronize()
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
        if now - window >= 0.1:
            log.write(f"{time.time():.6f} {count / (now - window):.1f} {gap:.6f}\n")
            window, count, gap = now, 0, 0.0
cp.cuda.Device().synchronize()
