"""Exercises the less common driver paths gpu-trace records: cooperative launch, stream-ordered
(async) allocation, managed and pinned memory, 2-D copies, memsets, and a CUDA graph replay.
Writes what it did to $GPUOS_TEST_REPORT."""

import json
import os

import cupy as cp
import numpy as np
import torch

report = {}

# a cooperative launch (cuLaunchCooperativeKernel)
coop = cp.RawKernel(r"""
#include <cooperative_groups.h>
extern "C" __global__ void coop_sum(float* out, const float* in, int n) {
    cooperative_groups::grid_group g = cooperative_groups::this_grid();
    int i = g.thread_rank();
    if (i < n) atomicAdd(out, in[i]);
    g.sync();
}
""", "coop_sum", enable_cooperative_groups=True)
src = cp.ones(256, dtype=cp.float32)
acc = cp.zeros(1, dtype=cp.float32)
coop((2,), (128,), (acc, src, np.int32(256)))
assert float(acc[0]) == 256.0
report["coop_out"] = acc.data.ptr

# stream-ordered allocation (cuMemAllocAsync / cuMemFreeAsync)
stream = cp.cuda.Stream(non_blocking=True)
with stream:
    ptr = cp.cuda.runtime.mallocAsync(1 << 20, stream.ptr)
    cp.cuda.runtime.freeAsync(ptr, stream.ptr)
stream.synchronize()
report["async_ptr"] = ptr

# managed memory, small (cuMemAllocManaged) and pinned host memory (cuMemHostAlloc)
managed = cp.cuda.malloc_managed(1 << 20)
report["managed_ptr"] = managed.ptr
pinned = cp.cuda.alloc_pinned_memory(1 << 16)
report["pinned_ptr"] = pinned.ptr

# a 2-D copy device to host and a memset (cudaMemcpy2D, cudaMemset)
dev = cp.arange(64 * 64, dtype=cp.uint8).reshape(64, 64)
host = np.empty((16, 8), dtype=np.uint8)
cp.cuda.runtime.memcpy2D(host.ctypes.data, 8, dev.data.ptr, 64, 8, 16, cp.cuda.runtime.memcpyDeviceToHost)
assert (host == cp.asnumpy(dev[:16, :8])).all()
cp.cuda.runtime.memset(dev.data.ptr, 7, 4096)
cp.cuda.runtime.deviceSynchronize()
report["memset_dst"] = dev.data.ptr

# a captured CUDA graph, replayed twice (cuGraphLaunch)
x = torch.ones(1024, device="cuda")
y = torch.empty_like(x)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y.copy_(x * 2)  # warm-up outside capture
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y.copy_(x * 2)
g.replay()
g.replay()
torch.cuda.synchronize()
assert float(y.sum()) == 2048.0
report["graph_replays"] = 2

with open(os.environ["GPUOS_TEST_REPORT"], "w") as f:
    json.dump(report, f)
