#!/usr/bin/env python3
"""Randomised correctness trials of the agent's concurrent snapshots, on the GPU.

Each seed runs a trial program under `gpu-trace run --agent` with snapshots requested at random
moments while random kernels, memsets and copies run on three streams (--program cupy:
workloads/snapshot_prog.py, raw kernels and CuPy; --program torch: snapshot_prog_torch.py,
PyTorch ops with cuBLAS, cuDNN and the caching allocator), then runs it again (the twin)
stopping the world at exactly the operation counts of those snapshots; every snapshot must be
bit-identical (sha256 per allocation) to its reference. Seeds go on until --trials snapshots
were compared. JSON to --json: the program, the count, mismatches, and the distribution of the
program-visible stall, copy-on-write and stream waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from workloads.snapshot_trials import PROGRAMS, trials


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--per-run", type=int, default=40, help="snapshots requested per run")
    ap.add_argument("--first-seed", type=int, default=100)
    ap.add_argument("--ops", type=int, default=6000, help="operations per run")
    ap.add_argument("--program", choices=sorted(PROGRAMS), default="cupy", help="the trial program")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    stats: list[dict] = []
    bad: list[str] = []
    compared = 0
    seed = args.first_seed
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        while compared < args.trials:
            n, b = trials(Path(tmp), seed, args.per_run, ops=args.ops, stats=stats, program=args.program)
            compared += n
            bad += b
            print(f"seed {seed}: {n} compared, {len(b)} mismatches (total {compared})", file=sys.stderr, flush=True)
            seed += 1
            if args.json:  # after every seed: a run cut short still leaves its count
                args.json.write_text(json.dumps(summary(stats, bad, compared, args.first_seed, seed, t0, args), indent=1) + "\n")
    out = summary(stats, bad, compared, args.first_seed, seed, t0, args)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if not bad else 1


def summary(stats: list[dict], bad: list[str], compared: int, first: int, seed: int, t0: float,
            args: argparse.Namespace) -> dict:
    stalls = sorted(s["stall_s"] for s in stats) or [0.0]
    return {
        "program": args.program, "ops_per_run": args.ops, "snapshots_per_run": args.per_run,
        "trials": compared, "mismatches": len(bad), "mismatch_detail": bad[:20],
        "seeds": [first, seed - 1], "wall_s": round(time.time() - t0, 1),
        "stall_ms": {"median": round(1e3 * statistics.median(stalls), 3),
                     "p99": round(1e3 * stalls[int(0.99 * (len(stalls) - 1))], 3), "max": round(1e3 * stalls[-1], 3)},
        "with_cow": sum(1 for s in stats if s["cow"]), "cow_total": sum(s["cow"] for s in stats),
        "with_host_saves": sum(1 for s in stats if s["host_saves"]),
        "with_stream_waits": sum(1 for s in stats if s["stream_waits"]),
        "unsettled": sum(1 for s in stats if s.get("unsettled")),
        "bytes_median": statistics.median(s["bytes"] for s in stats) if stats else None,
    }


if __name__ == "__main__":
    sys.exit(main())
