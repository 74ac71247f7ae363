"""The agent's concurrent snapshots on a real GPU (pytest -m gpu): randomised trials against a
twin run's stop-the-world references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"


def traced_run(tmp: Path, name: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
         str(tmp / f"{name}.ndjson.zst"), "--", sys.executable, str(PROGS / "snapshot_prog.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def trials(tmp: Path, seed: int, snapshots: int, ops: int = 3000, stats: list | None = None) -> tuple[int, list[str]]:
    """(snapshots compared, mismatches) for one seed: a run with snapshots, then its twin.
    ``stats`` collects each compared snapshot's answer (without digests)."""
    report = tmp / f"a{seed}.json"
    a = traced_run(tmp, f"a{seed}", {"GPUOS_TRIAL_SEED": str(seed), "GPUOS_TRIAL_OPS": str(ops),
                                     "GPUOS_TRIAL_SNAPSHOTS": str(snapshots), "GPUOS_TEST_REPORT": str(report)})
    assert a.returncode == 0, a.stderr[-3000:]
    answers = json.loads(report.read_text())["answers"]
    assert answers, "no snapshot was taken"
    refs = tmp / f"b{seed}.refs"
    b = traced_run(tmp, f"b{seed}", {"GPUOS_TRIAL_SEED": str(seed), "GPUOS_TRIAL_OPS": str(ops),
                                     "GPUOS_TRIAL_SNAPSHOTS": "0", "GPUOS_AGENT_REFERENCE_OUT": str(refs),
                                     "GPUOS_AGENT_REFERENCE_AT": ",".join(str(x["ops_before"]) for x in answers)})
    assert b.returncode == 0, b.stderr[-3000:]
    by_ops = {}
    for line in refs.read_text().splitlines():
        r = json.loads(line)
        by_ops[r["ops_before"]] = r
    bad = []
    compared = 0
    for x in answers:
        ref = by_ops.get(x["ops_before"])
        if ref is None:
            continue  # taken after the last operation: no reference point in the twin
        compared += 1
        if stats is not None:
            stats.append({k: v for k, v in x.items() if k not in ("digests", "allocations")})
        if x["digests"] != ref["digests"]:
            diff = [i for i, (p, q) in enumerate(zip(x["digests"], ref["digests"])) if p != q]
            bad.append(f"seed {seed} ops_before {x['ops_before']}: buffers {diff} differ "
                       f"(cow {x['cow']}, host saves {x['host_saves']}, waits {x['stream_waits']})")
    return compared, bad


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_snapshots_equal_the_state_at_t0(tmp_path, seed):
    compared, bad = trials(tmp_path, seed, snapshots=25)
    assert not bad, bad
    assert compared >= 5
