"""The agent's snapshot trials: a trial program run under `gpu-trace run --agent` with snapshots
requested at random moments, then its twin run stopped at exactly those operation counts; each
snapshot must equal the twin's reference bit for bit. tests/gpu/test_agent_gpu.py and
scripts/trials_snapshot.py run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: the trial programs: random work on several streams while snapshots are taken (same protocol)
PROGRAMS = {"cupy": HERE / "snapshot_prog.py", "torch": HERE / "snapshot_prog_torch.py"}


def traced_run(tmp: Path, name: str, env_extra: dict, program: str = "cupy") -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
         str(tmp / f"{name}.ndjson.zst"), "--", sys.executable, str(PROGRAMS[program])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def trials(tmp: Path, seed: int, snapshots: int, ops: int = 3000, stats: list | None = None,
           program: str = "cupy", env_extra: dict | None = None) -> tuple[int, list[str]]:
    """(snapshots compared, mismatches) for one seed of ``program`` (a key of PROGRAMS): a run
    with snapshots, then its twin. ``stats`` collects each compared snapshot's answer (without
    digests)."""
    tag = "" if program == "cupy" else f"{program}-"
    env = {"GPUOS_TRIAL_SEED": str(seed), "GPUOS_TRIAL_OPS": str(ops), **(env_extra or {})}
    report = tmp / f"{tag}a{seed}.json"
    a = traced_run(tmp, f"{tag}a{seed}", {**env, "GPUOS_TRIAL_SNAPSHOTS": str(snapshots),
                                          "GPUOS_TEST_REPORT": str(report)}, program)
    assert a.returncode == 0, a.stderr[-12000:]
    answers = json.loads(report.read_text())["answers"]
    assert answers, "no snapshot was taken"
    refs = tmp / f"{tag}b{seed}.refs"
    refs.unlink(missing_ok=True)  # the agent appends
    b = traced_run(tmp, f"{tag}b{seed}", {**env, "GPUOS_TRIAL_SNAPSHOTS": "0", "GPUOS_AGENT_REFERENCE_OUT": str(refs),
                                          "GPUOS_AGENT_REFERENCE_AT": ",".join(str(x["ops_before"]) for x in answers)},
                   program)
    assert b.returncode == 0, b.stderr[-12000:]
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
            bad.append(f"{program} seed {seed} ops_before {x['ops_before']}: buffers {diff} differ "
                       f"(cow {x['cow']}, host saves {x['host_saves']}, waits {x['stream_waits']})")
    return compared, bad
