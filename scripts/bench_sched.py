#!/usr/bin/env python3
"""Offline speed of gpu-prefetch-sched's simulation: launches per second on one core (CPU only).

The workload is the PyTorch training step recorded on an H200 (tests/data/recorded/torch.ndjson.zst),
run through gpu-predict-access (range granularity) and then repeated N times as one long job
(N/20 times at 64 KiB chunks, where each step uses ~30x more chunks):
the same steps on the same memory, as a training loop repeats its step (the recorded step frees
nothing, so repeating it keeps every allocation consistent). Budgets are fractions of the
footprint (66%: 150% oversubscription). Measured, best of 3, after the access stream is parsed:
each policy's simulation alone (planning, next-use index build included, time model), and
Belady with its schedule records encoded to /dev/null as the command writes them. Parsing the
access stream into steps is measured separately.

    scripts/bench_sched.py [--copies N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from gpuos_tools.access import Predictor
from gpuos_tools.sched.schedule import write_schedule
from gpuos_tools.sched.simulate import Config, simulate
from gpuos_tools.sched.workload import Chunks, Workload, load_job, working_footprint
from gpuos_tools.stream import open_input
from gpuos_tools.stream.writer import open_output


def best(fn, reps: int = 3) -> float:  # type: ignore[no-untyped-def]
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=5000, help="repetitions at 2 MiB chunks (64 KiB: a 20th)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    with open_input(ROOT / "tests" / "data" / "recorded" / "torch.ndjson.zst") as reader:
        access = list(Predictor("range").annotate(list(reader)))
    results = []
    parse_s = best(lambda: load_job(access, Chunks(2 << 20)), 3)
    parse_rate = sum(r["type"] == "access" for r in access) / parse_s
    for chunk, copies in ((2 << 20, args.copies), (64 << 10, max(1, args.copies // 20))):
        chunks = Chunks(chunk)
        job = load_job(access, chunks, 0, "torch")
        steps = job.steps * copies
        job.steps = steps
        launches = sum(st.of in ("launch", "graph_launch") for st in steps)
        w = Workload(chunks, [job], steps, [], working_footprint(steps, chunks.sizes))
        for fraction in (0.66, 0.5):
            cfg = Config(int(w.footprint * fraction))
            uses = sum(len(st.ws) for st in steps)
            row = {"chunk": chunk, "budget_fraction": fraction, "copies": copies, "steps": len(steps),
                   "launches": launches, "chunks": len(chunks), "chunk_uses": uses}  # fmt: skip
            for policy in ("belady", "lru", "demand"):
                secs = best(lambda p=policy, w=w, cfg=cfg: simulate(w, p, cfg))
                row[f"{policy}_launches_per_s"] = launches / secs
                row[f"{policy}_steps_per_s"] = len(steps) / secs
                row[f"{policy}_chunk_uses_per_s"] = uses / secs
            with open_output("/dev/null") as writer:
                secs = best(lambda w=w, cfg=cfg, out=writer.write: write_schedule(w, "belady", cfg, out))
            row["belady_with_records_launches_per_s"] = launches / secs
            s = simulate(w, "belady", cfg)
            row["belady_bytes_in"] = s["bytes_in"]
            row["over_budget_steps"] = s["over_budget"]
            results.append(row)
            print(
                f"chunk {chunk >> 10:>5} KiB budget {fraction:.0%}: {len(steps):,} steps, {launches:,} launches, "
                f"{uses / len(steps):.1f} chunks per step; "
                + ", ".join(f"{p} {row[f'{p}_launches_per_s'] / 1e3:,.0f}k" for p in ("belady", "lru", "demand"))
                + f", belady+records {row['belady_with_records_launches_per_s'] / 1e3:,.0f}k launches/s"
                + f" (belady {row['belady_chunk_uses_per_s'] / 1e6:.1f}M chunk uses/s)",
                flush=True,
            )
    print(f"parsing access records into steps: {parse_rate / 1e3:,.0f}k records/s")
    if args.json:
        meta = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "node": platform.node(),
            "copies": args.copies,
            "parse_access_records_per_s": parse_rate,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
