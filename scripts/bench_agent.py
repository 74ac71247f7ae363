#!/usr/bin/env python3
"""The agent's concurrent snapshot on a big job: program-visible stall, bandwidth to host RAM,
copy-on-write, and the job's throughput while the snapshot runs (issue 6, P1/P2).

Starts tests/gpu/progs/agent_job.py (a CuPy job holding --gib GiB, updating 256 MiB arrays on two
streams) under `gpu-trace run --agent`, takes --snapshots snapshots through the control socket
(no digests), and reports each answer plus the job's iterations/s before and during. JSON to
--json. The driver path's figures for the same size are in BENCHMARKS.md (scripts/bench_ckpt.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuos_tools.agent.control import request, socket_path  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--snapshots", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        env = dict(os.environ, GPU_JOB_GIB=str(args.gib), GPUOS_JOB_STOP=str(t / "stop"),
                   GPUOS_JOB_LOG=str(t / "log"), GPUOS_JOB_READY=str(t / "ready"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o", os.devnull,
             "--", sys.executable, str(ROOT / "tests" / "gpu" / "progs" / "agent_job.py")], cwd=ROOT, env=env,
            start_new_session=True)  # so that a failure here kills the job too, not only gpu-trace
        try:
            deadline = time.time() + 300
            while not (t / "ready").exists():
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"the job did not start (exit {proc.poll()})")
                time.sleep(0.1)
            pid = int((t / "ready").read_text())
            time.sleep(1.5)  # steady state
            answers = []
            for _ in range(args.snapshots):
                start = time.time()
                a = request(socket_path(pid), "snapshot", digest=False)
                a.pop("allocations", None)
                a["wall_start"], a["wall_end"] = start, time.time()
                answers.append(a)
                print(json.dumps(a), file=sys.stderr, flush=True)
                time.sleep(1.0)
            (t / "stop").touch()
            proc.wait(timeout=120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rates = [tuple(map(float, line.split())) for line in (t / "log").read_text().splitlines()]
    during = [r for ts, r in rates if any(a["wall_start"] <= ts <= a["wall_end"] + 0.1 for a in answers)]
    before = [r for ts, r in rates if ts < answers[0]["wall_start"]]
    out = {
        "gib": args.gib,
        "snapshots": answers,
        "job_iters_per_s_before": round(statistics.median(before), 1) if before else None,
        "job_iters_per_s_during": round(statistics.median(during), 1) if during else None,
        "stall_ms": [round(1e3 * a["stall_s"], 3) for a in answers],
        "gbps": [a["gbps"] for a in answers],
    }
    print(json.dumps({k: v for k, v in out.items() if k != "snapshots"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
