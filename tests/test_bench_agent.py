"""scripts/bench_agent.py without a GPU: the job-log arithmetic, the summaries, and the driver path's
timing around a real Checkpointer whose driver API is stubbed (a state machine that sleeps), on a
real process that maps a file named libcuda.so.1. The figures themselves come from the GPU run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import REPO, child_env, fake_cuda_process

from gpuos_tools.ckpt import driver as ckpt_driver
from gpuos_tools.ckpt import registry

spec = importlib.util.spec_from_file_location("bench_agent", REPO / "scripts" / "bench_agent.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_help_runs_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_agent.py"), "--help"],
                          capture_output=True, text=True, timeout=60, check=False, env=child_env())
    assert done.returncode == 0, done.stderr
    assert "--job" in done.stdout and "--no-driver" in done.stdout


def test_log_arithmetic(tmp_path: Path) -> None:
    log = tmp_path / "log"
    # 100 iters/s in 0.1 s windows, one 2 s window (a stall) at 10.0-12.0, then 100 again; a partial last line
    lines = [f"{9.0 + 0.1 * k:.6f} 100.0\n" for k in range(11)] + ["12.000000 5.0\n", "12.100000 100.0\n",
                                                                     "12.2000"]
    log.write_text("".join(lines))
    rates = bench.read_rates(log)
    assert len(rates) == 13
    wins = bench.windows(rates)
    assert wins[0] == (9.0, pytest.approx(9.1), 100.0)
    assert bench.median_rate(wins, 9.0, 10.0) == 100.0
    d = bench.over(wins, [(10.5, 11.5)])
    assert d["windows"] == 1 and d["iters_per_s"] == 5.0 and d["longest_window_s"] == 2.0
    d = bench.over(wins, [(9.95, 10.5)])  # half of the last 0.1 s window, a quarter of the stall window
    assert d["windows"] == 2 and d["span_s"] == 0.55
    assert d["iters_per_s"] == pytest.approx((100 * 0.05 + 5 * 0.5) / 0.55, abs=0.1)
    d = bench.over(wins, [(9.0, 9.15), (9.25, 9.3)])  # two intervals
    assert d["iters_per_s"] == 100.0 and d["span_s"] == 0.2
    assert bench.over(wins, [(20, 21)]) is None
    assert bench.loss(100.0, 75.0) == 0.25 and bench.loss(None, 1.0) is None


def test_longest_iteration_from_the_log_gap_column(tmp_path: Path) -> None:
    log = tmp_path / "log"
    # iterations of 10 ms, one window holding a 4.7 s iteration (the job stopped), old 2-field lines read too
    log.write_text("9.000000 100.0\n9.100000 100.0 0.010000\n13.800000 0.4 4.700000\n13.900000 100.0 0.012000\n"
                   "14.000000 100.0\n")
    rows = bench.read_log(log)
    assert rows[0][2] is None and rows[2] == (13.8, 0.4, 4.7)
    assert bench.read_rates(log)[2] == (13.8, 0.4)
    assert bench.longest_gap(rows, [(10.0, 11.0)]) == 4.7  # inside the long window
    assert bench.longest_gap(rows, [(13.85, 13.86)]) == 0.012
    assert bench.longest_gap(rows, [(9.0, 9.05)]) == 0.01
    assert bench.longest_gap(rows, [(13.95, 13.99)]) is None  # that window logged no gap
    assert bench.longest_gap(rows, [(20, 21)]) is None


def answer(start: float, wall: float, seconds: float, stall: float) -> dict:
    return {"ok": True, "bytes": 8 << 30, "seconds": seconds, "gbps": round((8 << 30) / seconds / 1e9, 3),
            "stall_s": stall, "cow": 1, "wall_start": start, "wall_end": start + wall, "wall_s": wall}


def test_summaries_put_the_first_snapshot_apart() -> None:
    answers = [answer(10.0, 4.8, 0.16, 0.007), answer(16.0, 0.17, 0.16, 0.005), answer(17.2, 0.17, 0.15, 0.006)]
    wins = [(9.0 + 0.1 * k, 9.1 + 0.1 * k, 100.0) for k in range(100)]
    agent = bench.summarize_agent(answers, wins, 100.0)
    assert agent["first"]["staging_and_request_s"] == pytest.approx(4.64)
    assert agent["steady"]["n"] == 2 and agent["steady"]["stall_ms_max"] == 6.0
    assert agent["stall_ms"] == [7.0, 5.0, 6.0]
    assert agent["job_throughput_loss"] == 0.0
    assert agent["first"]["job_iters_per_s_during"] == 100.0 and agent["first"]["job_throughput_loss"] == 0.0
    assert agent["steady"]["job_iters_per_s_during"] == 100.0 and agent["steady"]["job_throughput_loss"] == 0.0
    assert agent["first"]["job_longest_iteration_s"] is None  # no log given
    log = [(9.0 + 0.1 * k, 100.0, 0.5 if 10.0 <= 9.0 + 0.1 * k <= 15.0 else 0.01) for k in range(100)]
    with_log = bench.summarize_agent(answers, wins, 100.0, log)
    assert with_log["first"]["job_longest_iteration_s"] == 0.5
    assert with_log["steady"]["job_longest_iteration_s"] == 0.01
    driver = {"ok": True, "stall_s": 7.9, "checkpoint_s": 5.6, "restore_s": 2.2, "checkpoint_gbps": 1.6,
              "restore_gbps": 4.1, "bytes": 9 << 30, "bytes_source": "nvml", "job_iters_per_s_during": 2.0,
              "job_throughput_loss": 0.98}
    sbs = bench.side_by_side(agent, driver)
    assert sbs["stall_ratio_driver_over_agent"] == pytest.approx(7900 / 6.0, rel=1e-3)
    assert sbs["targets"]["P1_agent_stall_le_10ms"] is True
    assert sbs["targets"]["P2_agent_ge_45gbps"] is True
    assert bench.side_by_side(agent, {"ok": False, "error": "x"})["stall_ms"]["driver"] is None
    out = {"job": "cupy", "gib": 8.0, "job_iters_per_s_before": 100.0, "agent": agent, "side_by_side": sbs,
           "driver": {**driver, "lock_s": 0.001, "unlock_s": 0.001, "between_steps_s": 0.01}}
    text = bench.human(out)
    no_driver = {k: v for k, v in out.items() if k != "driver"} | {"driver_version": "580.159.04"}
    assert "agent steady" in bench.human(no_driver) and "driver" not in bench.human(no_driver)
    assert "agent first snapshot" in text and "stall ratio" in text


class FakeAPI:
    """The driver's checkpoint state machine; each step sleeps a little; ``fail`` names a failing step."""

    fail: str | None = None

    def __init__(self) -> None:
        self.info = SimpleNamespace(gpus=[], version=13000, version_string="13.0", release="580.0")
        self.version = 13000
        self.st = "running"

    def get_state(self, pid: int):
        return self.st, None

    def _go(self, step: str, want: str, to: str, seconds: float):
        if self.st != want:
            return "CUDA_ERROR_ILLEGAL_STATE"
        time.sleep(seconds)
        if FakeAPI.fail == step:
            return "CUDA_ERROR_NOT_SUPPORTED"
        self.st = to
        return None

    def lock(self, pid, timeout_ms):
        return self._go("lock", "running", "locked", 0.01)

    def checkpoint(self, pid):
        return self._go("checkpoint", "locked", "checkpointed", 0.05)

    def restore(self, pid, pairs=None):
        return self._go("restore", "checkpointed", "locked", 0.02)

    def unlock(self, pid):
        return self._go("unlock", "locked", "running", 0.01)


@pytest.fixture
def fake_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(registry.ENV, str(tmp_path / "state"))
    monkeypatch.setattr(ckpt_driver, "DriverAPI", FakeAPI)
    monkeypatch.setattr(FakeAPI, "fail", None)
    with fake_cuda_process(tmp_path) as proc:
        yield proc


def test_driver_path_times_lock_to_unlock(fake_job) -> None:
    out = bench.driver_path(fake_job.pid, 1000, fallback_bytes=1 << 30)
    assert out["ok"], out
    assert out["checkpoint_s"] >= 0.05 and out["restore_s"] >= 0.02
    assert out["stall_s"] >= out["steps_s"] >= 0.09
    assert out["between_steps_s"] >= 0 and out["between_steps_s"] == pytest.approx(out["stall_s"] - out["steps_s"],
                                                                                   abs=1e-5)
    assert out["wall_unlock_end"] - out["wall_lock_start"] == pytest.approx(out["stall_s"], abs=0.01)
    assert out["bytes_source"] == "agent" and out["checkpoint_gbps"] == pytest.approx((1 << 30) / out["checkpoint_s"]
                                                                                        / 1e9, rel=1e-2)
    assert sorted(out["calls"]) == ["checkpoint", "lock", "restore", "unlock"]


def test_driver_path_failure_is_reported_and_the_job_left_running(fake_job, monkeypatch) -> None:
    monkeypatch.setattr(FakeAPI, "fail", "checkpoint")
    out = bench.driver_path(fake_job.pid, 1000, fallback_bytes=None)
    assert not out["ok"]
    assert "checkpoint of PID" in out["error"] and out["state"] == "running"
    assert "stall_s" not in out


FAKE_JOB = """
import mmap, os, sys, time
f = open(sys.argv[1], 'rb')
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # a CUDA process to everything but the driver
log = open(os.environ["GPUOS_JOB_LOG"], "w", buffering=1)
time.sleep(0.2)
with open(os.environ["GPUOS_JOB_READY"] + ".tmp", "w") as r:
    r.write(str(os.getpid()))
os.rename(os.environ["GPUOS_JOB_READY"] + ".tmp", os.environ["GPUOS_JOB_READY"])
while not os.path.exists(os.environ["GPUOS_JOB_STOP"]):
    time.sleep(0.1)
    log.write(f"{time.time():.6f} 1000.0\\n")
"""


def test_run_end_to_end_with_a_fake_job(fake_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole control flow of run(): the job started and stopped, the agent's answers, the driver
    path, the health check after it, the JSON; only the job, the agent and the driver are fakes."""
    prog = tmp_path / "fake_job.py"
    prog.write_text(FAKE_JOB)
    lib = tmp_path / "fakelib" / "libcuda.so.1"
    monkeypatch.setattr(bench, "JOBS", {"fake": (prog.name, ())})
    monkeypatch.setattr(bench, "WORKLOADS", tmp_path)
    monkeypatch.setattr(bench, "missing_modules", lambda names: [])
    monkeypatch.setattr(bench, "job_command", lambda program, stage_ahead=False: [sys.executable, str(program), str(lib)])
    monkeypatch.setattr(bench, "gpu_info", lambda: {"gpu": "fake"})

    def snapshot(pid: int, timeout: float) -> dict:
        start = time.time()
        time.sleep(0.05)
        return answer(start, time.time() - start, 0.04, 0.002)

    monkeypatch.setattr(bench, "snapshot", snapshot)
    args = bench.parse(["--job", "fake", "--gib", "0.5", "--snapshots", "2", "--settle", "0.6", "--after", "0.6"])
    out, failures = bench.run(args)
    assert failures == [], failures
    assert out["job_exit"] == 0 and out["job_iters_per_s_before"] == pytest.approx(1000, rel=0.1)
    assert out["agent"]["first"] and out["agent"]["steady"]["n"] == 1
    d = out["driver"]
    assert d["ok"] and d["healthy_after"] and d["job_windows_after"] >= 3
    assert d["job_iters_per_s_during"] is not None
    assert out["agent_after_driver"]["ok"]
    assert out["side_by_side"]["stall_ratio_driver_over_agent"] > 1
    json.dumps(out)
    assert "stall ratio" in bench.human(out)


def test_hook_costs_split_before_and_after_the_first_snapshot() -> None:
    h0 = {"calls": 1000, "seconds": 0.002, "predicted": 0, "epoch": 7}
    h1 = {"calls": 3000, "seconds": 0.012, "predicted": 40, "epoch": 9}
    c = bench.hook_costs(h0, h1)
    assert c["before"] == {"launches": 1000, "us_per_launch": 2.0, "predicted": 0}
    assert c["after_first"] == {"launches": 2000, "us_per_launch": 5.0, "predicted": 40}
    assert c["epochs_after_first"] == 2
    assert bench.hook_costs(None, h1) is None
