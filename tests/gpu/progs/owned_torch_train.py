"""Deterministic PyTorch training for the owned-allocation tests (tests/gpu/test_owned_torch_gpu.py).

A small CNN with a wide MLP head (cuDNN convolutions, cuBLAS matmuls) trained for STEPS steps
with SGD + momentum on batches that a second stream generates ahead (the main stream waits for
it, and it waits for the main stream before reusing memory, as a program that frees across
streams must without record_stream). Deterministic settings, so that two runs give the same
bits whatever allocator is in place.

GPUOS_SUSPEND_DIR=D: half way, it writes its pid to D/pid and launches a small kernel every
millisecond until D/go exists (a suspend and resume happen meanwhile). GPUOS_TORCH_PROBES=1:
after the digest, what torch says under the allocator in place (memory_stats, a CUDA graph
capture), for the report. Writes a JSON report to GPUOS_TORCH_OUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

STEPS = 40
BATCH = 128


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.f1 = nn.Linear(64 * 8 * 8, 2048)
        self.f2 = nn.Linear(2048, 2048)
        self.f3 = nn.Linear(2048, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = F.relu(self.f1(x.flatten(1)))
        x = F.relu(self.f2(x))
        return self.f3(x)


def batch(k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(1000 + k)
    x = torch.randn(BATCH, 3, 32, 32, device=dev, generator=g)
    y = torch.randint(0, 10, (BATCH,), device=dev, generator=g)
    return x, y


def wait_for_go(d: str, report: dict) -> None:
    scratch = torch.zeros(1 << 16, device="cuda")
    with open(os.path.join(d, "pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, "pid.tmp"), os.path.join(d, "pid"))
    spins = 0
    while not os.path.exists(os.path.join(d, "go")):
        scratch += 1.0
        torch.cuda.synchronize()
        spins += 1
        time.sleep(0.001)
    report["spins"] = spins
    report["scratch_ok"] = float(scratch[0]) == float(spins)


def probes(report: dict) -> None:
    """What torch's allocator-facing APIs do under the allocator in place."""
    out = {}
    try:
        s = torch.cuda.memory_stats()
        out["memory_stats"] = {"ok": True, "keys": len(s), "allocated_bytes": s.get("allocated_bytes.all.current")}
    except Exception as e:  # noqa: BLE001
        out["memory_stats"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        out["memory_allocated"] = {"ok": True, "value": torch.cuda.memory_allocated()}
    except Exception as e:  # noqa: BLE001
        out["memory_allocated"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    try:  # what training loops log: a peak over a step, after a reset
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        peak = torch.cuda.max_memory_allocated()
        del big
        out["peak"] = {"ok": True, "before": before, "peak": peak, "after": torch.cuda.memory_allocated(),
                       "reserved": torch.cuda.memory_reserved(), "max_reserved": torch.cuda.max_memory_reserved()}
    except Exception as e:  # noqa: BLE001
        out["peak"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        a = torch.ones(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = a * 2  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            b = a * 2 + 1
        g.replay()
        torch.cuda.synchronize()
        out["cuda_graph"] = {"ok": True, "result_ok": bool((b == 3).all().item())}
    except Exception as e:  # noqa: BLE001
        out["cuda_graph"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    torch.cuda.synchronize()
    out["cross_stream"] = cross_stream()
    report["probes"] = out


def cross_stream() -> dict:
    """A block freed on the main stream while a kernel there still runs is not handed to another
    stream; once the main stream is done, it is (the owned cache; torch's own never crosses)."""
    n = 48 << 20
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    pa = a.data_ptr()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU time on the main stream, then a writes a
    a.fill_(7)
    del a  # back to the cache, freed on the main stream with that work still queued
    with torch.cuda.stream(side):
        b = torch.empty(n, dtype=torch.uint8, device="cuda")
    busy = torch.cuda.current_stream().query() is False
    pb = b.data_ptr()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        c = torch.empty(n, dtype=torch.uint8, device="cuda")
    pc = c.data_ptr()
    del b, c
    torch.cuda.synchronize()
    return {"main_was_busy": busy, "other_while_busy": pb != pa, "reused_after": pc == pa}


def main() -> None:
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    report: dict = {}
    dev = torch.device("cuda")
    model = Net().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    main_s, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        nxt = batch(0, dev)
    losses = []
    for step in range(STEPS):
        if step == STEPS // 2 and os.environ.get("GPUOS_SUSPEND_DIR"):
            wait_for_go(os.environ["GPUOS_SUSPEND_DIR"], report)
        main_s.wait_stream(side)
        x, y = nxt
        with torch.cuda.stream(side):  # the next batch, on the side stream, after this step's inputs
            side.wait_stream(main_s)
            nxt = batch(step + 1, dev)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        del x, y
    torch.cuda.synchronize()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    for buf in opt.state.values():
        h.update(buf["momentum_buffer"].cpu().numpy().tobytes())
    report["digest"] = h.hexdigest()
    report["losses"] = [float(v) for v in torch.stack(losses).cpu()]

    from gpuos_tools.memory import owned

    report["owned"] = owned.torch_allocator() is not None
    lib = owned.loaded()
    if report["owned"] and lib is not None:
        tensors = [p for p in model.parameters()] + [b["momentum_buffer"] for b in opt.state.values()]
        report["tensors_owned"] = all(lib.lookup(t.data_ptr()) is not None for t in tensors)
        table = lib.table()
        report["records"] = len(table)
        report["record_bytes"] = sum(r.size for r in table)
        report["stats"] = lib.stats()
        report["torch_stats"] = lib.torch_stats()
    if os.environ.get("GPUOS_TORCH_PROBES") == "1":
        probes(report)
        if lib is not None and report["owned"]:
            before = lib.torch_stats()["cached_bytes"]
            torch.cuda.empty_cache()
            report["empty_cache"] = {"cached_before": before, "cached_after": lib.torch_stats()["cached_bytes"]}
    with open(os.environ["GPUOS_TORCH_OUT"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
