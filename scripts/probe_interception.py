#!/usr/bin/env python3
"""Driver-API interception without CUPTI against the native CUPTI tracer, on the GPU: the
evidence for choosing how the agent's native core sees each driver call (docs/interception.md).

One run, side by side (every program is a fresh process; its output goes to --logs):

1. cost of a wrapped call on this host's CPU: tests/intercept_prog.c against the stand-in driver
   (tests/fake_libcuda_entry.c), with and without the interposer, per route (direct, dlsym,
   cuGetProcAddress): the floor of what interception adds to a driver call.
2. checkpoints: a PyTorch job (256 MiB on the GPU, an int64 recurrence checked against NumPy at
   the end, a cuBLAS GEMM each step) under the interposer, then `gpu-ckpt --pid P` (lock +
   checkpoint) / `gpu-restore --pid P` (restore + unlock); the same job under `gpu-trace run`
   (CUPTI), where the driver is expected to refuse; under the interposer again, `gpu-ckpt --pid P
   --image DIR` (driver + CRIU dump) / `gpu-restore --image DIR` (CRIU restore + driver). Each
   time: did every step work, did the job stop while checkpointed, did it run on and end with
   the right numbers, did the interposer go on counting after the restore. When the first case
   fails, the job is tried once more without any tool as a control.
3. workloads (--workloads; WORKLOADS below), each run in four modes:
     untraced    the program alone
     intercept   LD_PRELOAD=libgpuos_intercept (counts by route and per kernel)
     cupti       `gpu-trace run --backend native` (the native CUPTI tracer, records every call)
     both        both at once: the same launches seen by both, compared per CUfunction handle
   Per run: the median step (synchronised after each step, after warm-up steps), and the calls
   the interposer counted inside the timed window. Per workload: overhead of each tool on the
   median step, per launch ((traced - untraced) / launches per step), and completeness: launches
   CUPTI recorded that the interposer did not see (by handle), per driver API.
   Passes: both/untraced/intercept of every workload first, then cupti of every workload, then
   (time left) a second untraced/intercept pair of the cheap workloads.

Everything is bounded: --budget seconds in all (a run that would not fit is skipped and says
so), each run by its workload's timeout (its whole process group is killed past it), each
checkpoint step by a timeout. The JSON (--json) is rewritten after every run, so a cut-off run
keeps what it measured. A table for people goes to stderr at the end.

Needs on the device: torch, timm, cupy, triton (the workloads), cupti-python (gpu-trace's native
path), a C compiler, root and `criu` on PATH for the CRIU case (CRIU_BUNDLE_NO_PLUGINS=1 is set
for it: the driver does the GPU part, not CRIU's CUDA plugin).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MODES = ("untraced", "intercept", "cupti", "both")
LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel")
#: trace records that come from one driver call each, with its API name
TRACED_TYPES = ("launch", "memcpy", "memset", "alloc", "free", "graph_launch", "graph", "library")
FLOOR_CALLS = 2000  # launches in one step of the floor workloads


@dataclass(frozen=True)
class Workload:
    what: str
    steps: int
    warmup: int
    timeout: float
    launches_per_step: int | None = None  # known by construction (the floors)
    cheap: bool = False  # repeated when time is left


WORKLOADS: dict[str, Workload] = {
    "floor_cupy": Workload(f"CuPy: one tiny elementwise kernel per call, {FLOOR_CALLS} calls a step", 10, 2, 60,
                           FLOOR_CALLS, cheap=True),
    "floor_torch": Workload(f"PyTorch: x.add_(1) on one element, {FLOOR_CALLS} calls a step", 10, 2, 60,
                            FLOOR_CALLS, cheap=True),
    "mlp_adam": Workload("PyTorch MLP 512-512-512-10, batch 128, cross-entropy, Adam(foreach=True)", 200, 20, 90,
                         cheap=True),
    "resnet50": Workload("timm ResNet-50 (random weights) training, bf16 autocast, batch 64, SGD momentum",
                         30, 8, 150),
    "blas_cudnn": Workload("cuBLAS GEMMs (bf16 4096^2, fp32 2048^2, fp16 batched 32x256^2) + cuDNN conv2d fwd/bwd",
                           30, 5, 90),
    "cupy_libs": Workload("CuPy elementwise + cuFFT fft2 (1024^2 c64) + cuSOLVER cholesky/solve/qr (512^2 f64)",
                          30, 3, 90),
    "torch_compile": Workload("torch.compile (Triton) of a pointwise+reduction function and of an MLP fwd/bwd",
                              50, 3, 240),
}


# ---------------------------------------------------------------- workloads (in the worker)

def _torch_versions(torch: Any) -> dict[str, Any]:
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "gpu": torch.cuda.get_device_name()}


def setup_floor_cupy() -> tuple[Callable[[], None], Callable[[], None], dict[str, Any]]:
    import cupy as cp

    x = cp.zeros(1, dtype=cp.float32)
    inc = cp.ElementwiseKernel("float32 a", "float32 b", "b = a + 1", "gpuos_probe_floor_inc")

    def step() -> None:
        for _ in range(FLOOR_CALLS):
            inc(x, x)

    return step, cp.cuda.runtime.deviceSynchronize, {"cupy": cp.__version__}


def setup_floor_torch():
    import torch

    x = torch.zeros(1, device="cuda")

    def step() -> None:
        for _ in range(FLOOR_CALLS):
            x.add_(1)

    return step, torch.cuda.synchronize, _torch_versions(torch)


def setup_mlp_adam():
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(128, 512, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step, torch.cuda.synchronize, _torch_versions(torch)


def setup_resnet50():
    import timm
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    model = timm.create_model("resnet50", pretrained=False).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (64,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step, torch.cuda.synchronize, {**_torch_versions(torch), "timm": timm.__version__}


def setup_blas_cudnn():
    import torch

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(2048, 2048, device="cuda")
    bm = torch.randn(32, 256, 256, device="cuda", dtype=torch.float16)
    conv = torch.nn.Conv2d(64, 128, 3, padding=1).cuda().half()
    inp = torch.randn(32, 64, 56, 56, device="cuda", dtype=torch.float16, requires_grad=True)

    def step() -> None:
        a @ b
        c @ c
        torch.bmm(bm, bm)
        conv(inp).float().sum().backward()  # cuDNN forward, backward data and backward filter

    return step, torch.cuda.synchronize, _torch_versions(torch)


def setup_cupy_libs():
    import cupy as cp

    rng = cp.random.default_rng(0)
    fma = cp.ElementwiseKernel("float32 x, float32 y", "float32 z", "z = x * y + 1.0f", "gpuos_probe_fma")
    x = rng.random(1 << 22, dtype=cp.float32)
    y = rng.random(1 << 22, dtype=cp.float32)
    sig = (rng.random((1024, 1024)) + 1j * rng.random((1024, 1024))).astype(cp.complex64)
    m = rng.random((512, 512))
    spd = m @ m.T + 512 * cp.eye(512)
    rhs = rng.random((512, 8))

    def step() -> None:
        fma(x, y)
        cp.fft.fft2(sig)
        cp.linalg.cholesky(spd)
        cp.linalg.solve(spd, rhs)
        cp.linalg.qr(m)

    return step, cp.cuda.runtime.deviceSynchronize, {"cupy": cp.__version__}


def setup_torch_compile():
    import torch
    import triton

    torch.manual_seed(0)

    def f(x: Any, y: Any) -> Any:
        return (torch.sin(x) * torch.cos(y) + x * y).sum(dim=-1) + torch.tanh(x).mean()

    cf = torch.compile(f)  # default mode: Triton kernels, no CUDA graphs
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()
    cm = torch.compile(mlp)
    opt = torch.optim.SGD(mlp.parameters(), lr=1e-3)
    x = torch.randn(4096, 1024, device="cuda")
    y = torch.randn(4096, 1024, device="cuda")
    inp = torch.randn(256, 1024, device="cuda")

    def step() -> None:
        cf(x, y)
        cm(inp).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, torch.cuda.synchronize, {**_torch_versions(torch), "triton": triton.__version__}


SETUPS: dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None], dict[str, Any]]]] = {
    "floor_cupy": setup_floor_cupy, "floor_torch": setup_floor_torch, "mlp_adam": setup_mlp_adam,
    "resnet50": setup_resnet50, "blas_cudnn": setup_blas_cudnn, "cupy_libs": setup_cupy_libs,
    "torch_compile": setup_torch_compile,
}


def write_json(path: Path | str, data: Any) -> None:
    from gpuos_tools.stream import atomic

    atomic.replace(str(path), (json.dumps(data, indent=1, default=str) + "\n").encode())


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def worker_main(name: str, steps: int, warmup: int, result: Path) -> None:
    """One workload in this process: warm up, time `steps` steps, write the result file."""
    from gpuos_tools.injection.intercept import InProcess, delta

    started = time.monotonic()
    step, sync, versions = SETUPS[name]()
    view = InProcess.attach()
    for _ in range(warmup):
        step()
    sync()
    ready = time.monotonic()
    before = view.totals() if view else None
    times = []
    t0 = time.monotonic_ns()
    for _ in range(steps):
        a = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - a)
    t1 = time.monotonic_ns()
    write_json(result, {
        "workload": name, "pid": os.getpid(), "steps": steps, "warmup": warmup, "times_s": times,
        "t0_ns": t0, "t1_ns": t1, "setup_s": round(ready - started, 3),
        "window": delta(before, view.totals()) if view else None, "versions": versions,
    })


# the checkpoint job (in its own process)
LCG_A, LCG_C, LCG_MASK = 1103515245, 12345, (1 << 31) - 1


def ckpt_job_main(state: Path, max_s: float) -> None:
    """Run until state/stop appears: an int64 recurrence and a GEMM per step; then check the
    recurrence against NumPy and a 256 MiB constant buffer, and write state/result.json."""
    import numpy as np
    import torch

    from gpuos_tools.injection.intercept import InProcess, delta

    x = torch.arange(1 << 16, dtype=torch.int64, device="cuda")
    big = torch.full((64 << 20,), 7.0, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    view = InProcess.attach()
    start = view.totals() if view else None
    write_json(state / "ready.json", {"pid": os.getpid(), "t": time.time()})
    it = 0
    deadline = time.monotonic() + max_s
    while not (state / "stop").exists() and time.monotonic() < deadline:
        x = (x * LCG_A + LCG_C) & LCG_MASK
        w @ w
        it += 1
        if it % 10 == 0:
            torch.cuda.synchronize()
            launched = sum(view.totals()[n] for n in LAUNCHES) if view else None
            write_json(state / "progress.json", {"it": it, "t": time.time(), "launches": launched})
        time.sleep(0.005)
    torch.cuda.synchronize()
    ref = np.arange(1 << 16, dtype=np.int64)
    for _ in range(it):
        ref = (ref * LCG_A + LCG_C) & LCG_MASK
    write_json(state / "result.json", {
        "pid": os.getpid(), "iterations": it, "stopped": (state / "stop").exists(),
        "recurrence_ok": bool((x.cpu().numpy() == ref).all()), "buffer_ok": bool((big == 7.0).all().item()),
        "intercept_calls": delta(start, view.totals()) if view else None,
    })


# ---------------------------------------------------------------- running things, bounded

def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End the process group that `proc` leads (started in a session of its own, not yet reaped):
    SIGTERM, then SIGKILL to whatever of the group is left once the leader has exited or `grace`
    has passed. The leader is reaped only after that, so the group's id cannot have been reused."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
        except ChildProcessError:  # reaped already: its group id may name someone else's by now
            return
        time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_bounded(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> dict[str, Any]:
    """Run cmd in a session of its own, output to `log`; past `timeout` its group is ended."""
    t = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)
        try:
            rc = proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc)
            rc = proc.returncode
    return {"rc": rc, "timed_out": timed_out, "wall_s": round(time.monotonic() - t, 2)}


def tail(path: Path, n: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode(errors="replace")


def wait_for(check: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() >= end:
            return value
        time.sleep(poll)


@dataclass
class Context:
    """Where things go and how much time is left."""

    work: Path
    logs: Path
    library: Path
    deadline: float
    call_names: list[str]
    keep_traces: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_cmd: Callable[[str, Workload, Path], list[str]] | None = None
    job_cmd: Callable[[Path, float], list[str]] | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        env.pop("GPUOS_INTERCEPT_OUT", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compile in-process: no worker pool to start
        env.update(self.extra_env)
        return env

    def time_for(self, wanted: float, least: float = 15.0) -> float | None:
        left = self.deadline - time.monotonic() - 5.0
        return min(wanted, left) if left >= least else None

    def command(self, name: str, spec: Workload, result: Path) -> list[str]:
        if self.worker_cmd is not None:
            return self.worker_cmd(name, spec, result)
        return [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--steps", str(spec.steps),
                "--warmup", str(spec.warmup), "--result", str(result)]


def traced(cmd: list[str], trace: Path) -> list[str]:
    return [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--backend", "native", "--no-images",
            "-o", str(trace), "--", *cmd]


# ---------------------------------------------------------------- reading what came out

def base_api(api: str) -> str:
    for suffix in ("_ptsz", "_ptds"):
        if api.endswith(suffix):
            return api[: -len(suffix)]
    return api


def trace_summary(path: Path, window: tuple[int, int] | None = None) -> dict[str, Any]:
    """What the CUPTI tracer recorded: records by type, calls by API (per-thread-stream variants
    folded in), launches per CUfunction with its name, and calls inside `window` (ns)."""
    from gpuos_tools.stream import open_input
    from gpuos_tools.stream.framing import StreamError

    types: Counter[str] = Counter()
    apis: Counter[str] = Counter()
    in_window: Counter[str] = Counter()
    funcs: Counter[int] = Counter()
    names: dict[int, str] = {}
    header: dict[str, Any] | None = None
    ended: dict[str, Any] | None = None
    problem = None
    reader = open_input(str(path), on_error="emit")
    try:
        for rec in reader:
            kind = rec.get("type")
            types[kind] += 1
            if kind == "header":
                header = rec
            elif kind == "exit":
                ended = rec
            if kind in TRACED_TYPES and isinstance(rec.get("api"), str):
                api = base_api(rec["api"])
                apis[api] += 1
                if window and window[0] <= rec.get("ts", -1) <= window[1]:
                    in_window[api] += 1
            if kind == "launch":
                funcs[int(rec["func"])] += 1
                names.setdefault(int(rec["func"]), rec.get("kernel") or rec.get("name") or "")
    except StreamError as e:
        problem = str(e)
    finally:
        reader.close()
    return {"types": dict(types), "apis": dict(apis), "window": dict(in_window), "funcs": funcs, "names": names,
            "backend": header.get("backend") if header else None,
            "complete": ended.get("complete") if ended else None, "problem": problem}


def completeness(counts: Any, trace: dict[str, Any], wrapped: Iterable[str]) -> dict[str, Any]:
    """The interposer's counts (intercept.Counts) against the CUPTI trace of the same process:
    launches by CUfunction handle, and every driver API the tracer records."""
    wrapped = set(wrapped)
    funcs: Counter[int] = trace["funcs"]
    cupti = sum(funcs.values())
    seen = 0
    missing = []
    for f, n in funcs.items():
        got = counts.kernels.get(f, (0, None))[0]
        seen += min(n, got)
        if got < n:
            missing.append((n - got, trace["names"].get(f) or f"0x{f:x}"))
    missing.sort(reverse=True)
    apis: dict[str, dict[str, Any]] = {}
    for api, n in sorted(trace["apis"].items()):
        if api in wrapped:
            got = counts.total(api)
            apis[api] = {"cupti": n, "intercept": got, "missing": max(0, n - got)}
        else:
            apis[api] = {"cupti": n, "intercept": None}  # the prototype does not wrap this API
    return {
        "cupti_launches": cupti, "intercept_launches": counts.launches(), "seen_launches": seen,
        "seen_fraction": round(seen / cupti, 6) if cupti else None, "missing_launches": cupti - seen,
        "missing_kernels": [{"launches": n, "name": name} for n, name in missing[:15]],
        "distinct_kernels": {"cupti": len(funcs), "intercept": len(counts.kernels)},
        "apis": apis, "missing_calls": sum(v.get("missing", 0) for v in apis.values()),
        "not_wrapped": sorted(a for a, v in apis.items() if v["intercept"] is None),
    }


def pick_counts(work: Path, tag: str, pid: int | None) -> Any:
    """The count file of the worker process (others come from gpu-trace or helper processes)."""
    from gpuos_tools.injection import intercept

    found = []
    for p in sorted(work.glob(f"{tag}.counts-*.json")):
        try:
            found.append(intercept.read_counts(p))
        except (OSError, ValueError, KeyError):
            continue
    for c in found:
        if pid is not None and c.pid == pid:
            return c
    return max(found, key=lambda c: c.launches(), default=None)


def counts_summary(c: Any) -> dict[str, Any]:
    return {"pid": c.pid, "libcuda": c.libcuda, "launches": c.launches(), "kernels": len(c.kernels),
            "launch_routes": c.by_route(LAUNCHES), "all_routes": c.by_route(tuple(c.calls)),
            "calls": c.calls, "getproc": c.getproc, "slots_full": c.raw.get("slots_full"),
            "kernels_dropped": c.raw.get("kernels_dropped")}


def run_mode(ctx: Context, name: str, spec: Workload, mode: str, rep: int = 1) -> dict[str, Any]:
    tag = f"{name}-{mode}" + (f"-{rep}" if rep > 1 else "")
    result_path = ctx.work / f"{tag}.result.json"
    trace = ctx.work / f"{tag}.trace.ndjson"
    for stale in [result_path, trace, *ctx.work.glob(f"{tag}.counts-*.json")]:
        stale.unlink(missing_ok=True)
    timeout = ctx.time_for(spec.timeout)
    if timeout is None:
        return {"mode": mode, "skipped": "out of time"}
    cmd = ctx.command(name, spec, result_path)
    env = ctx.env()
    if mode in ("intercept", "both"):
        from gpuos_tools.injection import intercept

        env = intercept.environment(ctx.library, str(ctx.work / f"{tag}.counts-%p.json"), env)
    if mode in ("cupti", "both"):
        cmd = traced(cmd, trace)
    log = ctx.logs / f"{tag}.log"
    rec: dict[str, Any] = {"mode": mode, **run_bounded(cmd, env, timeout, log)}
    result = read_json(result_path)
    if result:
        times = result["times_s"]
        rec.update(steps=len(times), median_s=statistics.median(times), min_s=min(times), max_s=max(times),
                   times_ms=[round(t * 1e3, 4) for t in times],
                   setup_s=result.get("setup_s"), window=result.get("window"), pid=result.get("pid"),
                   versions=result.get("versions"), t0_ns=result["t0_ns"], t1_ns=result["t1_ns"])
    counts = None
    if mode in ("intercept", "both"):
        counts = pick_counts(ctx.work, tag, rec.get("pid"))
        rec["counts"] = counts_summary(counts) if counts else None
    summary = None
    if mode in ("cupti", "both") and trace.exists():
        window = (result["t0_ns"], result["t1_ns"]) if result else None
        summary = trace_summary(trace, window)
        rec["trace"] = {k: summary[k] for k in ("types", "apis", "window", "backend", "complete", "problem")}
        rec["trace"]["kernels"] = len(summary["funcs"])
        if not ctx.keep_traces:
            trace.unlink(missing_ok=True)
    if mode == "both" and counts is not None and summary is not None:
        rec["completeness"] = completeness(counts, summary, ctx.call_names)
        if rec.get("window") is not None:
            rec["completeness"]["window_launches"] = {
                "cupti": sum(summary["window"].get(n, 0) for n in LAUNCHES),
                "intercept": sum(rec["window"].get(n, 0) for n in LAUNCHES)}
    rec["ok"] = rec["rc"] == 0 and result is not None
    if not rec["ok"]:
        rec["log_tail"] = tail(log)
    return rec


def summarize(spec: Workload, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Overheads and completeness of one workload from its runs (mode -> run; reps as mode.N)."""
    def medians(mode: str) -> list[float]:
        return [r["median_s"] for m, r in runs.items() if m.split(".")[0] == mode and r.get("median_s")]

    med = {m: statistics.median(v) for m in MODES if (v := medians(m))}
    out: dict[str, Any] = {"median_ms": {m: round(v * 1e3, 4) for m, v in med.items()}}
    window = next((r["window"] for m in ("intercept", "both") for k, r in runs.items()
                   if k.split(".")[0] == m and r.get("window") is not None), None)
    steps = next((r["steps"] for r in runs.values() if r.get("steps")), None)
    launches = spec.launches_per_step
    if launches is None and window is not None and steps:
        launches = sum(window.get(n, 0) for n in LAUNCHES) / steps
    out["launches_per_step"] = launches
    if window is not None and steps:
        out["calls_per_step"] = round(sum(window.values()) / steps, 2)
        out["window_calls_per_step"] = {k: round(v / steps, 2) for k, v in sorted(window.items())}
    base = med.get("untraced")
    if base and launches:
        out["untraced_us_per_launch"] = round(base / launches * 1e6, 3)
    for mode in ("intercept", "cupti"):
        if base and mode in med:
            out[f"{mode}_overhead_pct"] = round((med[mode] / base - 1) * 100, 2)
            if launches:
                out[f"{mode}_us_per_launch"] = round((med[mode] - base) / launches * 1e6, 3)
    both = runs.get("both", {}).get("completeness")
    if both:
        out["seen_fraction"] = both["seen_fraction"]
        out["missing_launches"] = both["missing_launches"]
        out["missing_calls"] = both["missing_calls"]
    cupti_run = runs.get("cupti", {})
    if cupti_run.get("trace") and steps:
        out["cupti_launches_per_step"] = sum(cupti_run["trace"]["window"].get(n, 0) for n in LAUNCHES) / steps
    return out


# ---------------------------------------------------------------- the CPU cost of a wrapped call

def cpu_call_cost(ctx: Context, calls: int = 2_000_000, reps: int = 3) -> dict[str, Any]:
    """ns per cuLaunchKernel through each route on the stand-in driver, plain and interposed."""
    from gpuos_tools import cbuild

    cache = ctx.work / "cache"
    fake = cbuild.build_library(cache, source=ROOT / "tests" / "fake_libcuda_entry.c", stem="libfake-entry",
                                flags=("-O2", "-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1"), libs=("-lpthread",))
    drv = ctx.work / "fake-driver"
    drv.mkdir(exist_ok=True)
    shutil.copy(fake, drv / "libcuda.so.1")
    prog = ctx.work / "intercept_prog"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    done = subprocess.run([cc, "-O2", "-o", str(prog), str(ROOT / "tests" / "intercept_prog.c"),
                           str(drv / "libcuda.so.1"), "-ldl", "-lpthread"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"cannot build intercept_prog: {done.stderr.strip()[-500:]}")
    base = dict(os.environ, LD_LIBRARY_PATH=str(drv))
    base.pop("LD_PRELOAD", None)
    base.pop("GPUOS_INTERCEPT_OUT", None)
    from gpuos_tools.injection import intercept

    out: dict[str, Any] = {"calls": calls, "reps": reps}
    for route in ("direct", "dlsym", "getproc"):
        row = {}
        for label, env in (("plain_ns", base), ("intercept_ns", intercept.environment(ctx.library, None, base))):
            values = []
            for _ in range(reps):
                p = subprocess.run([str(prog), "bench", str(calls), route], env=env, capture_output=True, text=True,
                                   timeout=60)
                if p.returncode:
                    raise RuntimeError(f"intercept_prog bench {route}: {p.stderr.strip()[-300:]}")
                values.append(json.loads(p.stdout)["ns_per_call"])
            row[label] = round(statistics.median(values), 2)
        row["added_ns"] = round(row["intercept_ns"] - row["plain_ns"], 2)
        out[route] = row
    return out


# ---------------------------------------------------------------- checkpoints

def cli(tool: str, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """gpu-ckpt / gpu-restore with records on stdout: exit status, steps, the final result.
    Past `timeout` its whole group (criu included) is ended."""
    t = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", f"gpuos_tools.commands.{tool}", *args], env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        stdout, stderr = proc.communicate()
        out = summarize_ckpt_records(args, proc.returncode, stdout, stderr, time.monotonic() - t)
        return {**out, "rc": None, "timed_out": True}
    return summarize_ckpt_records(args, proc.returncode, stdout, stderr, time.monotonic() - t)


def summarize_ckpt_records(args: list[str], rc: int, stdout: str, stderr: str, wall: float) -> dict[str, Any]:
    records = []
    for line in stdout.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    steps = [{k: r.get(k) for k in ("step", "ok", "state_before", "state_after", "duration_s", "error")}
             for r in records if r.get("type") == "ckpt_step"]
    result = next((r for r in reversed(records) if r.get("type") == "ckpt_result"), None)
    out: dict[str, Any] = {"command": args, "rc": rc, "wall_s": round(wall, 2), "steps": steps}
    if result:
        out["result"] = {k: result.get(k) for k in ("action", "ok", "state", "error", "message", "bytes", "lock_s",
                                                    "checkpoint_s", "restore_s", "unlock_s", "duration_s", "pid")}
    if rc:
        out["stderr"] = stderr.strip()[-1500:]
    return out


def _progress(state: Path, key: str = "it") -> int:
    p = read_json(state / "progress.json")
    return int(p.get(key) or 0) if p else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Job:
    """The checkpoint job under `mode` (intercept | cupti | plain), its state files in `state`."""

    def __init__(self, ctx: Context, mode: str, state: Path, max_s: float = 150.0):
        self.ctx, self.mode, self.state = ctx, mode, state
        if state.exists():
            shutil.rmtree(state)
        state.mkdir(parents=True)
        cmd = (ctx.job_cmd(state, max_s) if ctx.job_cmd else
               [sys.executable, str(Path(__file__).resolve()), "--ckpt-job", str(state), "--max-s", str(max_s)])
        env = ctx.env()
        if mode == "intercept":
            from gpuos_tools.injection import intercept

            env = intercept.environment(ctx.library, str(state / "counts-%p.json"), env)
        if mode == "cupti":
            cmd = traced(cmd, state / "trace.ndjson")
        self.log = open(ctx.logs / f"ckpt-{state.name}.log", "wb")  # noqa: SIM115 (closed in stop)
        # files, not pipes, for its output: CRIU restores regular files, not our end of a pipe
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        self.pid: int | None = None

    def ready(self, timeout: float) -> bool:
        got = wait_for(lambda: read_json(self.state / "ready.json") or self.proc.poll() is not None, timeout)
        if isinstance(got, dict):
            self.pid = int(got["pid"])
            return bool(wait_for(lambda: _progress(self.state) >= 20 or self.proc.poll() is not None, 60)) \
                and _progress(self.state) >= 20
        return False

    def runs(self, seconds: float = 1.0) -> bool:
        before = _progress(self.state)
        time.sleep(seconds)
        return _progress(self.state) > before

    def finish(self, timeout: float = 60.0) -> dict[str, Any] | None:
        (self.state / "stop").touch()
        return wait_for(lambda: read_json(self.state / "result.json"), timeout)

    def stop(self) -> None:
        """End whatever is left of it: its group, and a process CRIU restored outside it."""
        if self.proc.poll() is None:
            stop_group(self.proc)
        if self.pid and _alive(self.pid):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


def ckpt_env(ctx: Context) -> dict[str, str]:
    env = ctx.env()
    env["GPUOS_CKPT_STATE_DIR"] = str(ctx.work / "ckpt-registry")
    env.setdefault("CRIU_BUNDLE_NO_PLUGINS", "1")
    return env


def probe_driver_path(ctx: Context, mode: str, out: dict[str, Any] | None = None,
                      save: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """gpu-ckpt --pid / gpu-restore --pid on the job under `mode`; `out` filled step by step
    (save() after each), so that a run cut off keeps what was seen."""
    out = {} if out is None else out
    out["mode"] = mode
    if ctx.time_for(90, least=60) is None:
        out["skipped"] = "out of time"
        return out
    job = Job(ctx, mode, ctx.work / f"driver-{mode}")
    env = ckpt_env(ctx)
    try:
        if not job.ready(120):
            out.update(error="the job did not start", log_tail=tail(ctx.logs / f"ckpt-driver-{mode}.log"))
            return out
        out["pid"] = job.pid
        out["checkpoint"] = cli("ckpt", ["--pid", str(job.pid), "--timeout", "10000"], env, 120)
        checkpointed = out["checkpoint"]["rc"] == 0
        out["refused"] = not checkpointed
        save()
        if checkpointed:
            out["stopped_while_checkpointed"] = not job.runs(1.0)
            out["restore"] = cli("restore", ["--pid", str(job.pid)], env, 120)
            save()
        launched = _progress(job.state, "launches")
        out["runs_after"] = job.runs(1.5)
        if mode == "intercept":
            out["counting_after"] = _progress(job.state, "launches") > launched
        result = job.finish()
        out["job"] = result
        out["ok"] = bool(checkpointed and out["restore"]["rc"] == 0 and out["runs_after"] and result
                         and result["recurrence_ok"] and result["buffer_ok"])
    finally:
        if job.pid and _alive(job.pid) and job.proc.poll() is None:
            # left locked or checkpointed by a failure above: bring it back before ending it
            # (gpu-restore refuses a running process and does nothing)
            out["cleanup"] = cli("restore", ["--pid", str(job.pid)], env, 60).get("rc")
        job.stop()
    return out


def probe_criu(ctx: Context, out: dict[str, Any] | None = None,
               save: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """gpu-ckpt --pid P --image DIR, then gpu-restore --image DIR, on the job under the interposer."""
    out = {} if out is None else out
    out.update(mode="intercept", criu=shutil.which("criu"))
    if out["criu"] is None:
        out["skipped"] = "no criu on PATH"
        return out
    if ctx.time_for(150, least=90) is None:
        out["skipped"] = "out of time"
        return out
    job = Job(ctx, "intercept", ctx.work / "criu-intercept")
    env = ckpt_env(ctx)
    image = job.state / "image"
    try:
        if not job.ready(120):
            out.update(error="the job did not start", log_tail=tail(ctx.logs / "ckpt-criu-intercept.log"))
            return out
        out["pid"] = job.pid
        out["dump"] = cli("ckpt", ["--pid", str(job.pid), "--image", str(image), "--timeout", "10000"], env, 150)
        dumped = out["dump"]["rc"] == 0
        # reaped here, so that its PID is free for CRIU to restore it under
        out["ended_by_criu"] = bool(wait_for(lambda: job.proc.poll() is not None, 10)) if dumped else False
        save()
        if dumped:
            out["restore"] = cli("restore", ["--image", str(image)], env, 150)
            save()
            if out["restore"]["rc"] == 0:
                launched = _progress(job.state, "launches")
                out["runs_after"] = job.runs(2.0)
                out["counting_after"] = _progress(job.state, "launches") > launched
                result = job.finish()
                out["job"] = result
                counts_file = wait_for(lambda: next(iter(job.state.glob(f"counts-{job.pid}.json")), None), 10)
                if counts_file:
                    from gpuos_tools.injection import intercept

                    out["counts_after_restore"] = intercept.read_counts(counts_file).launches()
                out["ok"] = bool(out["runs_after"] and result and result["recurrence_ok"] and result["buffer_ok"])
    finally:
        for name in ("dump.log", "restore.log"):
            if (image / name).exists():
                out[name.replace(".", "_") + "_tail"] = tail(image / name, 1500)
        if job.pid and _alive(job.pid):
            out["cleanup"] = cli("restore", ["--pid", str(job.pid)], env, 60).get("rc")
        job.stop()
        if image.exists():
            shutil.rmtree(image, ignore_errors=True)  # GPU memory and all: do not keep it
    return out


# ---------------------------------------------------------------- the whole probe

def gpu_info() -> dict[str, Any]:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,uuid",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return {"nvidia_smi": p.stdout.strip() or p.stderr.strip()}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"nvidia_smi": f"unavailable: {e}"}


def table(results: dict[str, Any]) -> str:
    """The figures for people: per workload, then the checkpoint cases."""
    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    rows = [("workload", "untraced ms", "icpt ms", "cupti ms", "launches", "icpt us/l", "cupti us/l", "seen",
             "missing calls")]
    for name, w in results["workloads"].items():
        s = w.get("summary", {})
        m = s.get("median_ms", {})
        rows.append((name, f(m.get("untraced")), f(m.get("intercept")), f(m.get("cupti")),
                     f(s.get("launches_per_step"), "{:.1f}"), f(s.get("intercept_us_per_launch")),
                     f(s.get("cupti_us_per_launch")), f(s.get("seen_fraction"), "{:.4f}"),
                     f(s.get("missing_calls"), "{:d}")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    keys = ("ok", "refused", "stopped_while_checkpointed", "runs_after", "counting_after", "skipped", "error")
    for case, v in results.get("checkpoint", {}).items():
        lines.append(f"checkpoint {case}: " + ", ".join(f"{k}={v[k]}" for k in keys if k in v))
    if results.get("criu"):
        lines.append("criu: " + ", ".join(f"{k}={results['criu'][k]}" for k in (*keys, "ended_by_criu")
                                          if k in results["criu"]))
    if results.get("cpu_call_cost"):
        c = results["cpu_call_cost"]
        lines.append("ns added per call on this CPU: " + ", ".join(
            f"{r} {c[r]['added_ns']}" for r in ("direct", "dlsym", "getproc") if r in c))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="results (rewritten after every run)")
    ap.add_argument("--logs", type=Path, help="each program's output (default: in --work)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for everything (default 420)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    ap.add_argument("--skip-ckpt", action="store_true", help="no driver checkpoint cases")
    ap.add_argument("--skip-criu", action="store_true", help="no CRIU case")
    ap.add_argument("--skip-cpu-cost", action="store_true", help="no CPU cost of a wrapped call")
    ap.add_argument("--keep-traces", action="store_true", help="keep the CUPTI traces in --work")
    # internal: one program of the probe
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-job", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--max-s", type=float, default=150.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.steps, args.warmup, args.result)
        return 0
    if args.ckpt_job:
        ckpt_job_main(args.ckpt_job, args.max_s)
        return 0
    if args.json is None:
        ap.error("--json PATH is required")
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads: {', '.join(unknown)}")
    return probe(args, names)


def probe(args: argparse.Namespace, names: list[str], ctx: Context | None = None) -> int:
    from gpuos_tools import cbuild
    from gpuos_tools.injection import intercept, tracelib

    started = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="probe-interception-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = args.logs or work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "tool": "probe_interception", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "python": platform.python_version(), **gpu_info(),
        "budget_s": args.budget, "errors": [], "workloads": {},
    }

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - started, 1)
        write_json(args.json, results)

    try:
        library = intercept.build(work / "cache")
        results["library"] = str(library)
        results["tracer_library"] = str(tracelib.tracer_library())
    except (cbuild.BuildError, OSError) as e:
        results["errors"].append(f"build: {e}")
        save()
        return 1
    if ctx is None:
        ctx = Context(work=work, logs=logs, library=library, deadline=started + args.budget,
                      call_names=intercept.call_names(library), keep_traces=args.keep_traces)
    save()

    if not args.skip_cpu_cost:
        try:
            results["cpu_call_cost"] = cpu_call_cost(ctx)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired, cbuild.BuildError) as e:
            results["errors"].append(f"cpu_call_cost: {e}")
        save()

    if not args.skip_ckpt:
        cases = results["checkpoint"] = {}
        for mode in ("intercept", "cupti", "plain"):
            if mode == "plain" and cases["intercept"].get("ok"):
                continue  # the control is needed only when the interposer case failed
            out = cases[mode] = {}
            guarded(out, f"checkpoint {mode}", lambda m=mode, o=out: probe_driver_path(ctx, m, o, save), results)
            save()
    if not args.skip_criu:
        out = results["criu"] = {}
        guarded(out, "criu", lambda: probe_criu(ctx, out, save), results)
        save()

    def one(name: str, mode: str, key: str, rep: int = 1) -> None:
        spec = WORKLOADS[name]
        entry = results["workloads"].setdefault(name, {"what": spec.what, "runs": {}})
        out = entry["runs"][key] = {}
        plain = entry["runs"].get("untraced", {})
        if key != "untraced" and plain and not plain.get("ok") and not plain.get("timed_out") \
                and not plain.get("skipped"):
            out.update(mode=mode, skipped="the program fails on its own (see runs.untraced)")
            return
        guarded(out, f"{name} {key}", lambda: out.update(run_mode(ctx, name, spec, mode, rep)), results)
        entry["summary"] = summarize(spec, entry["runs"])
        save()

    for name in names:
        for mode in ("both", "untraced", "intercept"):
            one(name, mode, mode)
    for name in names:
        one(name, "cupti", "cupti")
    for name in names:
        if WORKLOADS[name].cheap:
            for mode in ("untraced", "intercept"):
                one(name, mode, f"{mode}.2", rep=2)
    save()
    print(table(results), file=sys.stderr)
    return 0


def guarded(out: dict[str, Any], what: str, fn: Callable[[], Any], results: dict[str, Any]) -> None:
    """fn(), which fills `out`; what went wrong in it goes into `out` and the probe's errors:
    one failing case must not lose the others."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded, and the probe goes on
        out["error"] = f"{type(e).__name__}: {e}"
        results["errors"].append(f"{what}: {out['error']}")


if __name__ == "__main__":
    sys.exit(main())
