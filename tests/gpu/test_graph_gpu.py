"""CUDA graphs under `gpu-prefetch-sched run` on a real GPU (pytest -m gpu): a PyTorch program
captures graphs (torch.cuda.graph, global capture mode) while the executor evicts and loads its
memory at a budget below its footprint, replays them between eager steps, and ends with the same
bytes as the program alone (tests/gpu/progs/torch_graph_job.py). A graph's launch is one
operation whose records the predictor does not see: everything is made resident for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "progs" / "torch_graph_job.py"
ARGS = ["--arrays", "12", "--mib", "32", "--graphs", "3", "--replays", "3"]


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    e.pop("GPUOS_AGENT_OWN", None)
    return e


def run(tmp: Path, *sched: str) -> tuple[dict, dict | None, str]:
    out = tmp / f"job{len(sched)}.json"
    cmd = [sys.executable, str(JOB), *ARGS, "--out", str(out)]
    if sched:
        cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", *sched, "--", *cmd]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-6000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    return json.loads(out.read_text()), (recs[-1] if sched else None), p.stderr


@pytest.mark.parametrize("budget", ["66%", "50%"])
def test_graphs_captured_while_memory_moves_replay_bit_identical(tmp_path, budget):
    plain, _, _ = run(tmp_path)
    job, s, err = run(tmp_path, "--budget", budget)
    assert s["type"] == "sched_summary", s
    assert job["digest"] == plain["digest"], (job, plain, err[-3000:])
    assert s["evictions"] > 0 and s["bytes_in"] > 0, s
    assert "error" not in s and s["executor"]["mover_errors"] == 0, s
    assert s["engine"].get("evict_errors", 0) == 0, s["engine"]
