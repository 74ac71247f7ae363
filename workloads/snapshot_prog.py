"""Random GPU work on several streams while snapshots are taken, for the agent's trials.

GPUOS_TRIAL_SEED picks the work; GPUOS_TRIAL_OPS how many operations; GPUOS_TRIAL_SNAPSHOTS how
many snapshots a thread of this program requests from its own agent (over $GPUOS_AGENT_SOCKET)
at random moments while the work runs (0 in the twin run that takes the references). The work
is deterministic: each stream owns its buffers, and work that crosses streams waits for an
event first, so the state after N operations is the same in every run. Writes the snapshots'
answers to $GPUOS_TEST_REPORT.
"""

import json
import os
import random
import threading
import time

import cupy as cp

from gpuos_tools.agent.control import request

seed = int(os.environ.get("GPUOS_TRIAL_SEED", "1"))
ops = int(os.environ.get("GPUOS_TRIAL_OPS", "600"))
wanted = int(os.environ.get("GPUOS_TRIAL_SNAPSHOTS", "0"))
rng = random.Random(seed)

kernels = cp.RawModule(code=r"""
extern "C" __global__ void axpy(const float* x, float* y, float a, long long n, int rounds) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = y[i];
    for (int r = 0; r < rounds; r++) v = a * x[i] + v * 0.5f;
    y[i] = v;
}
extern "C" __global__ void scale(float* y, float a, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] * a + 1.0f;
}
""")
axpy, scale = kernels.get_function("axpy"), kernels.get_function("scale")

streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
sizes = [1 << 12, 1 << 16, 1 << 18, 1 << 20]  # floats
if os.environ.get("GPUOS_TRIAL_BIG") == "1":  # odd sizes up to 80 MB: buffers straddle the 64 MiB staging pieces
    sizes = [1 << 12, 3_000_017, 9_000_011, 21_000_007]
owned = []  # per stream: its buffers
for k, s in enumerate(streams):
    with s:
        owned.append([cp.arange(rng.choice(sizes), dtype=cp.float32) * (k + 1) for _ in range(4)])
cp.cuda.Device().synchronize()

answers = []
done = threading.Event()


def snapshotter():
    sock = os.environ["GPUOS_AGENT_SOCKET"]
    r = random.Random(seed * 7919)
    for _ in range(wanted):
        time.sleep(r.uniform(0.0, 0.004))
        if done.is_set():
            break
        answers.append(request(sock, "snapshot", digest=True, cow_budget=r.choice([0, 1 << 20, 64 << 20])))


t = threading.Thread(target=snapshotter) if wanted else None
if t:
    t.start()
for i in range(ops):
    k = rng.randrange(3)
    s = streams[k]
    bufs = owned[k]
    op = rng.random()
    y = rng.choice(bufs)
    with s:
        if op < 0.5:
            x = rng.choice(bufs)
            n = min(x.size, y.size)
            axpy(((n + 255) // 256,), (256,), (x, y, cp.float32(rng.uniform(-1, 1)), cp.int64(n), cp.int32(rng.choice([1, 50, 400]))))
        elif op < 0.7:
            scale(((y.size + 255) // 256,), (256,), (y, cp.float32(rng.uniform(0.5, 1.5)), cp.int64(y.size)))
        elif op < 0.8:
            n = rng.randrange(1, y.nbytes)
            cp.cuda.runtime.memsetAsync(y.data.ptr, rng.randrange(256), n, s.ptr)
        elif op < 0.9:
            # from another stream's buffer, after that stream's work so far
            j = (k + 1) % 3
            ev = streams[j].record()
            s.wait_event(ev)
            x = rng.choice(owned[j])
            n = min(x.nbytes, y.nbytes)
            cp.cuda.runtime.memcpyAsync(y.data.ptr, x.data.ptr, n, cp.cuda.runtime.memcpyDeviceToDevice, s.ptr)
            # and stream j's later writes to x wait for this read: without it, which of the two
            # ran first decided y's contents, and a run and its twin could differ (seeds 213, 614)
            streams[j].wait_event(s.record())
        else:
            y += 1  # a CuPy elementwise kernel on this stream
    if wanted and i % 5 == 0:
        time.sleep(0.001)  # let snapshots land at different points, with work in flight
done.set()
if t:
    t.join()
cp.cuda.Device().synchronize()
report = os.environ.get("GPUOS_TEST_REPORT")
if report:
    with open(report, "w") as f:
        json.dump({"answers": answers}, f)
