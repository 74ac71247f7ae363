"""The agent on driver-API interception on a real GPU (pytest -m gpu): `gpu-trace run --agent
--mechanism intercept` sees the same kernel launches as the agent on CUPTI callbacks (by name and
count) in a CuPy job and a PyTorch training job, both end bit-identical to untraced runs and load
no CUPTI; the agent's snapshots of a job on interception equal a stop-the-world twin's; the
driver's checkpoint (`gpu-ckpt --pid`, `gpu-restore --pid`) takes a job under the interposer agent
and the job ends bit-identical, while under the CUPTI agent it is refused and told why; and a
suspended job on interception moves to another GPU (`gpu-restore --agent PID --resume --device
1`, skipped on one GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from test_suspend_gpu import Job, plain  # noqa: F401 -- the stopped job and its untraced twin

from gpuos_tools.stream import open_input
from workloads.snapshot_trials import trials

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
NOT_CHECKPOINTABLE = 84

CUPY_PROG = """
import hashlib, json, sys
import cupy as cp
x = cp.arange(1 << 20, dtype=cp.float32) / (1 << 20)
for i in range(int(sys.argv[1])):
    x = cp.sin(x) * cp.float32(1.0001) + cp.float32(i % 7) / 100
    total = x.sum()
a = x[: 512 * 512].reshape(512, 512)
b = a @ a.T
h = hashlib.sha256(x.get().tobytes() + b.get().tobytes() + total.get().tobytes()).hexdigest()
print(json.dumps({"digest": h, "cupti": "libcupti" in open("/proc/self/maps").read()}))
"""

TORCH_PROG = """
import hashlib, json, sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
x = torch.randn(128, 256, device="cuda"); y = torch.randint(0, 10, (128,), device="cuda")
for _ in range(int(sys.argv[1])):
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().float().cpu().numpy().tobytes())
print(json.dumps({"digest": h.hexdigest(), "cupti": "libcupti" in open("/proc/self/maps").read()}))
"""


def env_for(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **extra)
    for k in ("GPUOS_AGENT_OWN", "GPUOS_AGENT_MECHANISM", "GPUOS_AGENT_BACKEND", "LD_PRELOAD"):
        if k not in extra:
            env.pop(k, None)
    return env


def records(path: Path) -> list[dict]:
    with open_input(str(path)) as r:
        return list(r)


def kernels(recs: list[dict]) -> Counter:
    return Counter(r["kernel"] for r in recs if r["type"] == "launch" and not r.get("captured"))


@pytest.mark.parametrize("module,source,steps", [("cupy", CUPY_PROG, 40), ("torch", TORCH_PROG, 30)])
def test_interception_sees_the_launches_cupti_sees_and_the_job_ends_bit_identical(tmp_path, module, source, steps):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module}")
    prog = tmp_path / "prog.py"
    prog.write_text(source)
    untraced = subprocess.run([sys.executable, str(prog), str(steps)], capture_output=True, text=True, timeout=300,
                              env=env_for())
    assert untraced.returncode == 0, untraced.stderr[-4000:]
    want = json.loads(untraced.stdout.splitlines()[-1])
    runs = {}
    for mechanism in ("cupti", "intercept"):
        trace = tmp_path / f"{mechanism}.ndjson"
        run = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--mechanism",
                              mechanism, "--no-images", "-o", str(trace), "--", sys.executable, str(prog), str(steps)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300, env=env_for())
        assert run.returncode == 0, f"{mechanism}: {run.stderr[-4000:]}"
        runs[mechanism] = (json.loads(run.stdout.splitlines()[-1]), records(trace))
    got, recs = runs["intercept"]
    assert got["digest"] == want["digest"]  # bit-identical to the untraced run
    assert runs["cupti"][0]["digest"] == want["digest"]
    # interception adds no CUPTI: the program maps it only if it loads it itself (PyTorch's profiler does)
    assert got["cupti"] == want["cupti"] and runs["cupti"][0]["cupti"] is True
    header = recs[0]
    assert header["mechanism"] == "intercept" and header["backend"] == "native-agent" and header["cupti"] is None
    assert not [r for r in recs if r["type"] == "error"], [r for r in recs if r["type"] == "error"][:5]
    mine, theirs = kernels(recs), kernels(runs["cupti"][1])
    assert sum(theirs.values()) > steps
    # every launch CUPTI recorded, by name and count (a launch CUPTI gave no name is counted in the total)
    diff = {k: (mine.get(k, 0), n) for k, n in theirs.items() if k and mine.get(k, 0) != n}
    assert not diff and sum(mine.values()) == sum(theirs.values()), (diff, sum(mine.values()), sum(theirs.values()))
    launches = [r for r in recs if r["type"] == "launch"]
    unknown = sum(1 for r in launches if r["layout"] == "none")
    assert unknown <= sum(1 for r in runs["cupti"][1] if r["type"] == "launch" and r["layout"] == "none")
    core = recs[-1]["tracer"]["core"]
    assert core["ops"] >= len(launches)


def test_agent_snapshots_on_interception_equal_the_twins(tmp_path):
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("needs cupy")
    compared, bad = trials(tmp_path, 17, snapshots=15, env_extra={"GPUOS_AGENT_MECHANISM": "intercept"})
    assert compared > 0 and not bad, bad
    assert records(tmp_path / "a17.ndjson.zst")[0]["mechanism"] == "intercept"


def test_the_driver_checkpoints_a_job_under_the_interposer_agent(tmp_path, plain):  # noqa: F811
    job = Job(tmp_path, own=False, mechanism="intercept")
    try:
        ck = job.cli("ckpt", "--pid", str(job.pid))
        rs = job.cli("restore", "--pid", str(job.pid))
    finally:
        report = job.finish()
    assert ck.returncode == 0, ck.stderr
    assert rs.returncode == 0, rs.stderr
    print(json.dumps({"checkpoint": ck.stdout[-2000:], "restore": rs.stdout[-2000:]}))
    assert report["digests"] == plain["digests"]  # ended as the untraced run, bit for bit


def test_the_driver_refuses_a_job_under_the_cupti_agent_and_says_why(tmp_path, plain):  # noqa: F811
    if importlib.util.find_spec("cupti") is None:
        pytest.skip("needs cupti-python")
    job = Job(tmp_path, own=False, mechanism="cupti")
    try:
        ck = job.cli("ckpt", "--pid", str(job.pid))
    finally:
        report = job.finish()
    assert ck.returncode == NOT_CHECKPOINTABLE and "CUPTI loaded" in ck.stderr, ck.stderr
    assert report["digests"] == plain["digests"]  # left running, untouched


def gpu_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except OSError:
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def test_a_suspended_job_on_interception_moves_to_another_gpu(tmp_path, plain):  # noqa: F811
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    job = Job(tmp_path, own=True, mechanism="intercept")
    try:
        s = job.cli("ckpt", "--agent", str(job.pid), "--suspend", "--partial")
        r = job.cli("restore", "--agent", str(job.pid), "--resume", "--device", "1") if s.returncode == 0 else None
    finally:
        report = job.finish()
    assert s.returncode == 0, s.stderr
    assert r is not None and r.returncode == 0, r.stderr if r else None
    kinds = [json.loads(line)["type"] for line in r.stdout.splitlines() if line.strip()]
    assert "agent_resume" in kinds, kinds
    assert report["scratch_ok"] and report["digests"] == plain["digests"]
