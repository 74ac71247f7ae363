#!/usr/bin/env python3
"""Driver checkpoint and restore time against GPU memory size (GPU machine): the baseline that the
concurrent checkpoint path must beat (DESIGN.md's targets for the stall, checkpoint and restore
bandwidth).

For each size, a child (scripts/bench_ckpt_child.py) puts N GiB of pseudo-random data on GPU 0
and waits; it is suspended (lock + checkpoint) and resumed (restore + unlock) through
gpuos_tools.ckpt, a few times; medians of each step. The child checks afterwards that its data
is unchanged. Sizes that do not fit in the GPU's free memory or the host's available memory are
skipped, and the JSON says so.

    python3 scripts/bench_ckpt.py [--sizes 1,8,32] [--reps 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpuos_tools.ckpt.driver import Checkpointer
from gpuos_tools.cuda.nvml import nvml_session

ROOT = Path(__file__).resolve().parent.parent

CHILD = ROOT / "scripts" / "bench_ckpt_child.py"
GIB = 1 << 30


def host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gpu0() -> dict:
    with nvml_session() as nv:
        if nv is None:
            raise SystemExit("bench_ckpt needs nvidia-ml-py (NVML)")
        return {**nv.gpus()[0], "driver": nv.driver_release()}


def read_line(proc: subprocess.Popen, prefix: str) -> dict:
    for line in proc.stdout:
        if line.startswith(prefix + " "):
            return json.loads(line[len(prefix) + 1:])
    raise SystemExit(f"bench child ended (status {proc.wait()}) before {prefix!r}")


def bench_size(gib: int, reps: int) -> dict:
    gpu = gpu0()
    if gpu["memory_free"] < (gib + 1) * GIB:
        return {"gib": gib, "skipped": f"GPU 0 has {gpu['memory_free'] / GIB:.1f} GiB free"}
    if host_available() < (gib + 4) * GIB:
        return {"gib": gib, "skipped": f"host has {host_available() / GIB:.1f} GiB available"}
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
    proc = subprocess.Popen([sys.executable, str(CHILD), "--gib", str(gib)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    ckpt = Checkpointer()
    rows: list[dict] = []
    try:
        before = read_line(proc, "ready")["checksum"]
        for rep in range(reps):
            t = time.monotonic()
            s = ckpt.suspend(proc.pid)
            suspend_s = time.monotonic() - t
            t = time.monotonic()
            r = ckpt.resume(proc.pid)
            resume_s = time.monotonic() - t
            rows.append({"suspend_s": suspend_s, "resume_s": resume_s, "lock_s": s["lock_s"],
                         "checkpoint_s": s["checkpoint_s"], "restore_s": r["restore_s"], "unlock_s": r["unlock_s"],
                         "bytes": s["bytes"]})
            print(f"  {gib} GiB rep {rep}: checkpoint {s['checkpoint_s']:.3f} s, restore {r['restore_s']:.3f} s",
                  file=sys.stderr, flush=True)
        proc.stdin.write("check\n")
        proc.stdin.flush()
        after = read_line(proc, "check")["checksum"]
    finally:
        if proc.poll() is None:
            try:
                if ckpt.state(proc.pid) in ("checkpointed", "locked"):
                    ckpt.resume(proc.pid)
            except Exception as e:  # noqa: BLE001 (report, then end the child anyway)
                print(f"bench_ckpt: could not resume the child: {e}", file=sys.stderr)
            proc.kill()
        proc.wait()
    if after != before:
        raise SystemExit(f"{gib} GiB: the data changed across checkpoint/restore ({before} != {after})")

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    nbytes = rows[0]["bytes"] or gib * GIB
    return {
        "gib": gib,
        "reps": reps,
        "bytes": rows[0]["bytes"],
        "suspend_s": med("suspend_s"),
        "resume_s": med("resume_s"),
        "lock_s": med("lock_s"),
        "checkpoint_s": med("checkpoint_s"),
        "restore_s": med("restore_s"),
        "unlock_s": med("unlock_s"),
        "checkpoint_gbps": nbytes / med("checkpoint_s") / 1e9,
        "restore_gbps": nbytes / med("restore_s") / 1e9,
        "verified": True,
        "all": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=os.environ.get("BENCH_CKPT_SIZES") or "1,8,32",
                    help="GiB, comma-separated (default $BENCH_CKPT_SIZES or 1,8,32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    gpu = gpu0()
    results = []
    for gib in sizes:
        print(f"bench_ckpt: {gib} GiB", file=sys.stderr, flush=True)
        results.append(bench_size(gib, args.reps))
    out = {
        "benchmark": "bench_ckpt",
        "gpu": gpu["name"],
        "gpu_uuid": gpu["uuid"],
        "gpu_memory": gpu["memory"],
        "driver": gpu["driver"],
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"driver checkpoint/restore on {gpu['name']} (driver {gpu['driver']}), median of {args.reps}")
    print(f"{'GiB':>5} {'process bytes':>14} {'lock s':>8} {'ckpt s':>8} {'GB/s':>6} {'restore s':>9} {'GB/s':>6} "
          f"{'unlock s':>8} {'suspend s':>9} {'resume s':>8}")
    for r in results:
        if "skipped" in r:
            print(f"{r['gib']:>5} skipped: {r['skipped']}")
            continue
        print(f"{r['gib']:>5} {r['bytes'] or 0:>14} {r['lock_s']:>8.4f} {r['checkpoint_s']:>8.3f} "
              f"{r['checkpoint_gbps']:>6.2f} {r['restore_s']:>9.3f} {r['restore_gbps']:>6.2f} {r['unlock_s']:>8.4f} "
              f"{r['suspend_s']:>9.3f} {r['resume_s']:>8.3f}")


if __name__ == "__main__":
    main()
