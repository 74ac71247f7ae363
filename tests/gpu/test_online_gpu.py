"""`gpu-prefetch-sched run` on a real GPU (pytest -m gpu): a CuPy stencil loop whose arrays are
half again as large as the budget runs to the same bytes as without it, with the mapped
memory within the budget once the program's allocations stopped, and its launch period learned
and used for prefetching (gpuos_tools/sched/online.py, executor.py, memory/engine.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "workloads" / "stencil_job.py"
ARGS = ["--arrays", "8", "--mib", "32", "--periods", "8", "--work", "32"]


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    e.pop("GPUOS_AGENT_OWN", None)
    return e


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plain") / "plain.json"
    p = subprocess.run([sys.executable, str(JOB), *ARGS, "--out", str(out)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def sched_run(tmp: Path, *opts: str) -> tuple[dict, dict]:
    out = tmp / "job.json"
    cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", *opts, "--",
           sys.executable, str(JOB), *ARGS, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-6000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert recs[0]["type"] == "header" and recs[-1]["type"] == "sched_summary", recs
    return json.loads(out.read_text()), recs[-1]


@pytest.mark.parametrize(("budget", "policy", "plan"), [("66%", "belady", "count"), ("50%", "belady", "count"),
                                                      ("66%", "lru", "count"), ("66%", "belady", "time"),
                                                      ("50%", "belady", "time")])
def test_stencil_over_budget_is_bit_identical_and_stays_within_the_budget(tmp_path, plain, budget, policy, plan):
    job, s = sched_run(tmp_path, "--budget", budget, "--policy", policy, "--plan", plan)
    assert job["digests"] == plain["digests"]
    total = plain["total_bytes"]
    assert s["footprint"] >= total and s["budget"] <= s["footprint"]
    assert s["evictions"] > 0 and s["bytes_in"] > 0 and s["bytes_out"] > 0, s
    assert s["unknown"] == 0, s
    # only the first fill (one array, more than the share of one array) is over the budget
    assert s["over_budget"] <= 1, s
    assert s["executor"]["settled"] >= 1 and s["peak_settled"] <= s["budget"], s
    assert s["over_physical"] == 0 and s["executor"]["room_timeouts"] == 0, s
    assert "error" not in s and s["executor"]["mover_errors"] == 0, s
    assert s["executor"]["pin_errors"] == 0 and s["executor"]["pins"] >= plain["arrays"], s["executor"]
    assert s["engine"].get("evict_errors", 0) == 0, s["engine"]
    if policy == "belady":
        assert s["periods"] and s["periods"][0] == 8, s
    # every array has one size: loads map parked memory again (executor.py, "Parking")
    assert s["park"]["park_reuses"] > 0 and s["park"]["parked_bytes"] <= s["budget"], s["park"]
    if budget == "66%" and policy == "belady":
        assert s["prefetches"] > 0, s
    assert s["plan"] == plan
    if plan == "time":  # the operations' GPU times were sampled and reached the policy
        assert s["executor"]["samples"] > 0 and s["executor"]["sample_errors"] == 0, s["executor"]


def test_a_budget_above_the_footprint_moves_nothing(tmp_path, plain):
    job, s = sched_run(tmp_path, "--budget", "8GiB")
    assert job["digests"] == plain["digests"]
    assert s["evictions"] == 0 and s["bytes_in"] == 0 and s["over_budget"] == 0, s


def test_the_timeline_is_recorded_and_matches_the_summary(tmp_path, plain):
    tl = tmp_path / "timeline.json"
    job, s = sched_run(tmp_path, "--budget", "66%", "--timeline", str(tl))
    assert job["digests"] == plain["digests"]
    data = json.loads(tl.read_text())
    assert data["type"] == "sched_timeline" and data["dropped"] == 0
    kinds = [e[1] for e in data["events"]]
    assert kinds.count("evict") == s["evictions"] > 0, (kinds.count("evict"), s["evictions"])
    moved = sum(e[2] for e in data["events"] if e[1] in ("load", "prefetch"))
    assert moved == s["bytes_in"], (moved, s["bytes_in"])
    # a measure after each decision, but one per replay for those the fast path let go by
    assert kinds.count("mapped") >= s["launches"] - s["fast"]["replayed"], (kinds.count("mapped"), s["fast"])


def test_the_managed_memory_baseline_faults_back_what_it_pushed_out(tmp_path, plain):
    """stencil_job.py --managed: the same arrays in managed memory under a software budget,
    evicted to the host before each kernel, faulted back by the kernels: bit-identical."""
    out = tmp_path / "um.json"
    p = subprocess.run([sys.executable, str(JOB), *ARGS, "--managed", "0.5", "--out", str(out)], cwd=ROOT,
                       env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    um = json.loads(out.read_text())
    assert um["digests"] == plain["digests"]
    assert um["um_budget"] == plain["total_bytes"] // 2 and um["um_peak_resident"] <= um["um_budget"]
    # the cyclic loop under LRU: one array out and one faulted back per step (the first step:
    # its four arrays, the fill having left the last four resident)
    assert um["um_evictions"] == um["um_faulted_in"] == um["steps"] + 3, um
    assert um["gpu_free_before"] >= plain["total_bytes"] and um["um_evict_path"], um


GEMM = ROOT / "workloads" / "gemm_job.py"
GEMM_ARGS = ["--rows", "3", "--inner", "2", "--cols", "3", "--mib", "16", "--periods", "4"]


def gemm_run(tmp: Path, sched: list[str] | None, *job_opts: str, extra_env: dict | None = None) -> tuple[dict, dict | None]:
    out = tmp / "gemm.json"
    cmd = [sys.executable, str(GEMM), *GEMM_ARGS, *job_opts, "--out", str(out)]
    if sched is not None:
        cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", *sched, "--", *cmd]
    p = subprocess.run(cmd, cwd=ROOT, env={**env(), **(extra_env or {})}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-6000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.strip()] if sched is not None else []
    return json.loads(out.read_text()), (recs[-1] if recs else None)


def test_the_out_of_core_gemm_and_its_hand_written_loop_match_the_job_alone(tmp_path):
    """workloads/gemm_job.py under `run --budget 66%` (saves after each victim's last use, and
    with GPUOS_SCHED_LAST_USE=0 after everything enqueued) and its hand-written double-buffered
    loop: every block bit-identical to the job all on the GPU."""
    alone, _ = gemm_run(tmp_path, None)
    manual, _ = gemm_run(tmp_path, None, "--manual")
    assert manual["digests"] == alone["digests"] and manual["device_bytes"] < manual["total_bytes"]
    job, s = gemm_run(tmp_path, ["--budget", "66%"])
    assert job["digests"] == alone["digests"]
    assert s["evictions"] > 0 and s["unknown"] == 0 and s["peak_settled"] <= s["budget"], s
    assert s["executor"]["marks"] > 0 and s["executor"]["last_use_saves"] > 0 and "error" not in s, s["executor"]
    job, s = gemm_run(tmp_path, ["--budget", "66%"], extra_env={"GPUOS_SCHED_LAST_USE": "0"})
    assert job["digests"] == alone["digests"]
    assert s["evictions"] > 0 and s["executor"]["marks"] == 0 and s["executor"]["last_use_saves"] == 0, s["executor"]
