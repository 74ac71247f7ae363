"""What several GPU test files share (imported as ``gpu_jobs``: pytest puts tests/gpu on sys.path):
ending a job however a test left it, CRIU's presence and the guards' log for the full-process
image tests, and the small PyTorch training program that checks a run under the toolkit ends
bit-identical to a plain one."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from gpuos_tools import procs
from gpuos_tools.ckpt import criu
from gpuos_tools.ckpt.driver import Checkpointer, CkptError

FIGURES = os.environ.get("GPUOS_TEST_FIGURES")  # a JSON-lines file the device run brings back


def kill_group(proc: subprocess.Popen, wait: float | None = 60) -> None:
    """SIGKILL ``proc``'s process group (a job started with ``start_new_session``), gone or not;
    then reap it within ``wait`` seconds (None: do not wait)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if wait is not None:
        proc.wait(timeout=wait)


def end_process(pid: int, child: subprocess.Popen | None = None) -> None:
    """End process ``pid`` however a test left it: a process the driver holds checkpointed or
    locked is brought back first (a SIGKILL would not free its GPU state otherwise), then killed;
    ``child`` (its launcher, or itself while it is this test's child) is reaped."""
    if procs.exists(pid):
        try:
            if Checkpointer().state(pid) in ("checkpointed", "locked"):
                Checkpointer().resume(pid)
        except CkptError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if child is not None:
        child.wait(timeout=60)


def skip_without_criu() -> None:
    try:
        criu.find_criu()
    except Exception as e:  # noqa: BLE001 -- whatever stops it, the test cannot run here
        pytest.skip(f"no usable CRIU: {e}")


def keep_guard_log(state_dir: Path, test: str) -> None:
    """Append what the guards of ``test``'s dumps and restores did (STATE_DIR/guard.log) beside
    the figures, which the device run brings back, pass or fail."""
    log = state_dir / "guard.log"
    if FIGURES and log.exists():
        with open(FIGURES + ".guard.log", "a", encoding="utf-8") as f:
            f.write(f"== {test}\n" + log.read_text(errors="replace"))


#: A deterministic PyTorch training loop (an MLP, Adam with foreach kernels) of argv[1] steps;
#: prints one JSON line: the sha256 of its final weights and whether libcupti was loaded.
TORCH_MLP = """
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
