"""Suspend and resume through the agent on a real GPU (pytest -m gpu): owned memory is given back
to the driver while the program waits, and the program ends bit-identical to an uninterrupted
run; refusals change nothing (gpuos_tools/agent/suspend.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuos_tools.ckpt import records as _schemas  # noqa: F401 -- registers the schemas check_written uses
from gpuos_tools.stream.records import check_written

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
NOT_OWNED, WRONG_STATE = 93, 79


def env_for(own: bool, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **extra)
    for k in ("GPUOS_AGENT_OWN", "GPUOS_AGENT_MECHANISM", "GPUOS_AGENT_BACKEND", "LD_PRELOAD"):
        env.pop(k, None)
    if own:
        env["GPUOS_AGENT_OWN"] = "1"
    return env


class Job:
    """owned_prog.py under `gpu-trace run --agent [--mechanism M]`, stopped half way in its spin loop."""

    def __init__(self, tmp: Path, own: bool, mechanism: str | None = None) -> None:
        name = f"-{mechanism}" if mechanism else ""
        self.dir = tmp / f"ctl{name}"
        self.dir.mkdir()
        self.out = tmp / f"report{name}.json"
        cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent",
               *(["--mechanism", mechanism] if mechanism else []), "--no-images", "-o",
               str(tmp / f"trace{name}.ndjson.zst"), "--", sys.executable, str(PROGS / "owned_prog.py")]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env_for(own, GPUOS_OWNED_OUT=str(self.out), GPUOS_SUSPEND_DIR=str(self.dir)))
        deadline = time.monotonic() + 120
        while not (self.dir / "pid").exists():
            assert self.proc.poll() is None, self.proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the program never reached its spin loop"
            time.sleep(0.05)
        self.pid = int((self.dir / "pid").read_text())

    def cli(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{tool}", *args], cwd=ROOT,
                              env=env_for(False), capture_output=True, text=True, timeout=300)

    def ping(self) -> dict:
        from gpuos_tools.agent import control

        return control.request(str(self.pid), "ping", timeout=30)

    def finish(self) -> dict:
        (self.dir / "go").write_text("")
        _, err = self.proc.communicate(timeout=300)
        assert self.proc.returncode == 0, err[-8000:]
        return json.loads(self.out.read_text())


def gpu_memory_of(pid: int) -> int | None:
    from gpuos_tools.cuda.nvml import nvml_session

    with nvml_session() as nv:
        if nv is None:
            return None
        return sum(g["memory"] or 0 for g in nv.processes().get(pid, []))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("plain")
    out = tmp / "plain.json"
    p = subprocess.run([sys.executable, str(PROGS / "owned_prog.py")], cwd=ROOT, capture_output=True, text=True,
                       env=env_for(False, GPUOS_OWNED_OUT=str(out)), timeout=300)
    assert p.returncode == 0, p.stderr[-8000:]
    return json.loads(out.read_text())


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_suspend_frees_owned_memory_and_resume_is_bit_identical(tmp_path, plain):
    job = Job(tmp_path, own=True)
    try:
        before = gpu_memory_of(job.pid)
        refused = job.cli("ckpt", "--agent", str(job.pid), "--suspend")  # cuBLAS/cuFFT memory is not owned
        s = job.cli("ckpt", "--agent", str(job.pid), "--suspend", "--partial", "--image", str(tmp_path / "img"))
        assert s.returncode == 0, s.stderr
        rec = records(s.stdout)[-1]
        assert rec["type"] == "agent_suspend" and rec["state"] == "suspended"
        assert rec["buffers"] > 0 and rec["released_bytes"] > 0
        during = gpu_memory_of(job.pid)
        ops0 = job.ping()
        time.sleep(0.3)
        ops1 = job.ping()
        again = job.cli("ckpt", "--agent", str(job.pid), "--suspend", "--partial")
        r = job.cli("restore", "--agent", str(job.pid), "--resume")
        assert r.returncode == 0, r.stderr
        back = records(r.stdout)[-1]
        verify = job.cli("restore", "verify", str(tmp_path / "img"))
    finally:
        report = job.finish()
    print(json.dumps({"suspend": rec, "resume": back, "nvml_before": before, "nvml_during": during}))
    if rec["not_owned"]["count"]:
        assert refused.returncode == NOT_OWNED and "--partial" in refused.stderr, refused.stderr
    # the program waited: no operation while suspended, and ping answered without the lock
    assert ops0["state"] == "suspended" and ops0["ops"] == ops1["ops"]
    assert again.returncode == WRONG_STATE and "suspended" in again.stderr
    assert back["type"] == "agent_resume" and back["buffers"] == rec["buffers"] and back["bytes"] == rec["released_bytes"]
    assert check_written(rec) is None and check_written(back) is None, (rec, back)  # the agent's real answers
    # the physical memory went back to the driver (NVML charges the process that much less)
    if before is not None and during is not None:
        assert before - during >= 0.9 * rec["released_bytes"], (before, during, rec["released_bytes"])
    assert verify.returncode == 0, verify.stderr
    # ... and the program, going on after resume, ends as the uninterrupted run
    assert report["scratch_ok"] and report["digests"] == plain["digests"]


def test_suspend_of_a_program_not_owned_is_refused_and_changes_nothing(tmp_path, plain):
    job = Job(tmp_path, own=False)
    try:
        before = job.ping()
        s = job.cli("ckpt", "--agent", str(job.pid), "--suspend")
        p = job.cli("ckpt", "--agent", str(job.pid), "--suspend", "--partial")
        after = job.ping()
        resume = job.cli("restore", "--agent", str(job.pid), "--resume")
    finally:
        report = job.finish()
    assert s.returncode == NOT_OWNED and "GPUOS_AGENT_OWN=1" in s.stderr and " at 0x" in s.stderr, s.stderr
    assert p.returncode == NOT_OWNED
    assert before["state"] == after["state"] == "running" and after["ops"] > before["ops"]  # it kept running
    assert resume.returncode == WRONG_STATE and "not suspended" in resume.stderr
    assert report["digests"] == plain["digests"]


def test_resume_without_suspend_is_refused(tmp_path):
    job = Job(tmp_path, own=True)
    try:
        r = job.cli("restore", "--agent", str(job.pid), "--resume")
        state = job.ping()["state"]
    finally:
        job.finish()
    assert r.returncode == WRONG_STATE and "not suspended" in r.stderr and state == "running"


def test_lazy_resume_goes_on_at_once_and_ends_bit_identical(tmp_path, plain):
    """Suspend, then `--resume --lazy` and at once let the program run its remaining steps
    (matmul, FFT, churn: launches the engine predicts and some it cannot) while the engine is
    still loading: every operation waits on the GPU for what it touches, and the program ends
    as the uninterrupted run."""
    job = Job(tmp_path, own=True)
    try:
        s = job.cli("ckpt", "--agent", str(job.pid), "--suspend", "--partial")
        assert s.returncode == 0, s.stderr
        rec = records(s.stdout)[-1]
        # go before the resume: the program's first operations after it are its remaining steps,
        # which race the background loads
        (job.dir / "go").write_text("")
        r = job.cli("restore", "--agent", str(job.pid), "--resume", "--lazy")
        assert r.returncode == 0, r.stderr
        back = records(r.stdout)[-1]
    finally:
        report = job.finish()
    res = report.get("residency") or {}
    print(json.dumps({"suspend": rec, "resume": back, "residency": res}))
    assert back["type"] == "agent_resume" and back["lazy"] is True
    assert check_written(rec) is None and check_written(back) is None, (rec, back)
    assert back["buffers"] == rec["buffers"] and back["bytes"] == rec["released_bytes"]
    assert report["residency_settled"] and res["pending"] == {}
    lazy = res["lazy"]
    assert lazy["done"] and "error" not in lazy and lazy["records"] == rec["buffers"]
    assert lazy["demand_loads"] + lazy["background_loads"] <= rec["buffers"]
    # every record came back exactly once: on demand, in the background, or freed meanwhile
    assert res["demand_loads"] + res["background_loads"] + res["freed_while_pending"] == rec["buffers"]
    assert report["scratch_ok"] and report["digests"] == plain["digests"]


def test_lazy_resume_of_a_program_not_suspended_is_refused(tmp_path):
    job = Job(tmp_path, own=True)
    try:
        r = job.cli("restore", "--agent", str(job.pid), "--resume", "--lazy")
        ping = job.ping()
    finally:
        job.finish()
    assert r.returncode == WRONG_STATE and "not suspended" in r.stderr
    assert ping["state"] == "running" and ping["residency"]["pending"] == {}


def test_engine_evict_then_demand_loads_keep_the_program_bit_identical(tmp_path, plain):
    """Half way, the program (under the agent) evicts every owned record through the residency
    engine -- saved after its last use on the evict stream, then released -- and goes on: each
    operation loads back on the GPU what it touches before it runs (gpuos_tools/memory/engine.py)."""
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
           str(tmp_path / "trace.ndjson.zst"), "--", sys.executable, str(PROGS / "owned_prog.py")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env_for(True, GPUOS_OWNED_OUT=str(out), GPUOS_ENGINE_EVICT="1"))
    assert p.returncode == 0, p.stderr[-8000:]
    report = json.loads(out.read_text())
    ev = report["evict"]
    print(json.dumps({"evict": ev, "residency": report.get("residency")}))
    assert ev["records"] > 0 and ev["accepted"] == ev["records"] and ev["released"] == ev["records"]
    assert ev["stats"]["evictions"] == ev["records"] and "evict_errors" not in ev["stats"]
    assert report["residency"]["demand_loads"] > 0
    assert report["digests"] == plain["digests"]
