"""`gpu-prefetch-sched serve` on a real GPU (pytest -m gpu): three CuPy stencil jobs of different
sizes, seeds of work and lengths, whose memory together is ~175% of the budget, served
time-sliced on one GPU (gpuos_tools/sched/serve.py, the executor's gate), with the serial and
the (experimental) overlapped switch: each job's final arrays bit-identical to the same job run
alone untraced, switches between them, and the ledger's sum of every job's booked bytes (a
bound of their true combined owned memory at every instant) never taken past the budget by a
load (allocations may: reported); no early grant with the serial switch."""

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
MIB = 1 << 20
#: (arrays, MiB each, periods, work): 256 + 288 + 240 = 784 MiB together, ~1.5 s of loop each alone
JOBS = [(8, 32, 40, 16384), (6, 48, 40, 12288), (10, 24, 40, 16384)]
BUDGET = 448 * MIB  # 175%


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    e.pop("GPUOS_AGENT_OWN", None)
    return e


def args(j: tuple[int, int, int, int]) -> list[str]:
    return ["--arrays", str(j[0]), "--mib", str(j[1]), "--periods", str(j[2]), "--work", str(j[3])]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    out = []
    for k, j in enumerate(JOBS):
        path = tmp_path_factory.mktemp("plain") / f"plain{k}.json"
        p = subprocess.run([sys.executable, str(JOB), *args(j), "--out", str(path)], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        out.append(json.loads(path.read_text()))
    return out


def serve(tmp: Path, *opts: str, backend: str = "python") -> tuple[dict, list[dict]]:
    report = tmp / "serve.json"
    cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "serve", "--budget", f"{BUDGET}B",
           *opts, "--json", str(report)]
    for j in JOBS:
        cmd += ["--job", " ".join([sys.executable, str(JOB), *args(j)])]
    p = subprocess.run(cmd, cwd=ROOT, env={**env(), "GPUOS_AGENT_BACKEND": backend}, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stderr[-8000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert recs[0]["type"] == "header" and recs[-1]["type"] == "serve_summary", recs
    assert [r["type"] for r in recs[1:-1]] == ["serve_job"] * len(JOBS)
    result = json.loads(report.read_text())
    sys.stderr.write(p.stderr[-3000:])
    return result, result["jobs"]


@pytest.mark.parametrize("policy,switch,backend,plan", [
    ("belady", "overlap", "python", "count"), ("lru", "overlap", "python", "count"),
    ("belady", "serial", "python", "count"),
    ("belady", "serial", "native", "time"),  # the jobs' agents on the native core (its GPU-turn gate), planning by time
])
def test_three_jobs_over_the_budget_served_together_are_bit_identical_and_within_it(tmp_path, plain, policy, switch,
                                                                                    backend, plan):
    result, jobs = serve(tmp_path, "--slice", "50ms", "--policy", policy, "--switch", switch, "--plan", plan,
                         backend=backend)
    footprint = sum(p["total_bytes"] for p in plain)
    assert 1.5 * BUDGET <= footprint <= 2.0 * BUDGET, footprint / BUDGET
    for r, ref in zip(jobs, plain):
        assert r["exit"] == 0 and r["ok"], r
        out = r["output"]
        assert out["digests"] == ref["digests"], f"job {r['job']}: not bit-identical"
        assert r["throughput_unit"] == "steps/s" and r["throughput"] > 0
        s = r["summary"]
        assert s["footprint"] >= ref["total_bytes"], s
        assert s["unknown"] == 0 and "error" not in s, s
        assert s["plan"] == plan, s["plan"]
        assert s["engine"].get("evict_errors", 0) == 0, (s["engine"].get("evict_errors"), s["engine"].get("evict_error"))
        assert s["executor"]["mover_errors"] == 0, s["executor"]
        sv = s["serve"]
        assert sv["gate_errors"] == 0 and sv["release_timeouts"] == 0, sv
        assert r["grants"] >= 1 and sv["prepares"] == r["grants"], (r, sv)
        assert s["over_physical"] == 0, s["executor"]
        assert sv["forced_loads"] == 0 and sv["unreserved_maps"] == 0, {k: sv[k] for k in (
            "forced_loads", "unreserved_maps", "ledger_waits", "ledger_wait_s", "room_asks", "squeezes")}
        assert r["bytes_in"] > 0 and r["bytes_out"] > 0, r
    assert result["switches"] > 0 and sum(r["switches"] for r in jobs) > 0, result
    # the ledger's true instantaneous sum of every job's booked bytes (>= what is mapped): no
    # load ever took it past the budget; allocations may (a job maps its arrays as it makes
    # them), reported as combined_peak
    assert result["combined_peak_loads"] <= BUDGET, result["combined_peak_loads"] / MIB
    assert result["forced_loads"] == 0 and result["unreserved_maps"] == 0, result
    sys.stderr.write(f"{switch}: combined peak {result['combined_peak'] / MIB:.0f} MiB, at loads "
                     f"{result['combined_peak_loads'] / MIB:.0f} MiB, early grants {result['early_grants']}\n")
    if switch == "serial":
        assert result["early_grants"] == 0, result["early_grants"]
    # every job waited for the turn at least once (its first operation, or after a switch)
    assert all(r["turn_waits"] >= 1 for r in jobs), [r["turn_waits"] for r in jobs]


def test_a_job_that_fails_is_reported_and_the_others_finish(tmp_path, plain):
    """One job dies early (a bad argument to the program): exit 1 from serve, its status in its
    record, the others' results unchanged."""
    report = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "serve", "--budget", f"{BUDGET}B",
           "--json", str(report),
           "--job", " ".join([sys.executable, str(JOB), *args(JOBS[0])]),
           "--job", f"{sys.executable} {JOB} --arrays notanumber"]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-4000:]
    jobs = json.loads(report.read_text())["jobs"]
    assert jobs[0]["ok"] and jobs[0]["output"]["digests"] == plain[0]["digests"]
    assert not jobs[1]["ok"] and jobs[1]["exit"] not in (0, None) and "failed" in p.stderr
