#!/usr/bin/env python3
"""The workloads scripts/bench_trace.py times, traced and untraced. Prints one JSON line.

cupy:        a loop of one small elementwise kernel per iteration (launch-bound)
cupy-floor:  the same loop with a no-op cupti-python callback on cuLaunchKernel: the cost of
             entering Python from CUPTI at all, which any tracer built on cupti-python pays
torch:       training steps of a small MLP (forward, backward, Adam), launch-bound
"""

import json
import sys
import time


def cupy_loop(iters: int, floor: bool) -> dict:
    import cupy as cp

    x = cp.zeros(1024, dtype=cp.float32)
    k = cp.ElementwiseKernel("float32 a", "float32 b", "b = a + 1", "gpuos_bench_inc")
    for _ in range(200):
        k(x, x)
    cp.cuda.runtime.deviceSynchronize()
    if floor:
        from cupti import cupti

        sub = cupti.subscribe(lambda *a: None, None)
        cupti.enable_callback(1, sub, cupti.CallbackDomain.DRIVER_API, cupti.driver_api_trace_cbid.cuLaunchKernel)
    t0 = time.monotonic_ns()
    for _ in range(iters):
        k(x, x)
    t1 = time.monotonic_ns()
    cp.cuda.runtime.deviceSynchronize()
    assert float(x[0]) == 200 + iters
    return {"t0": t0, "t1": t1, "iters": iters, "launches_per_iter": 1}


def torch_loop(iters: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device="cuda")
    target = torch.randint(0, 10, (64,), device="cuda")

    def step():
        loss = F.cross_entropy(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.monotonic_ns()
    for _ in range(iters):
        step()
    t1 = time.monotonic_ns()
    torch.cuda.synchronize()
    return {"t0": t0, "t1": t1, "iters": iters, "launches_per_iter": None}


if __name__ == "__main__":
    mode, iters = sys.argv[1], int(sys.argv[2])
    if mode == "torch":
        result = torch_loop(iters)
    else:
        result = cupy_loop(iters, floor=(mode == "cupy-floor"))
    print(json.dumps(result), flush=True)
