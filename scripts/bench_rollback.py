#!/usr/bin/env python3
"""Rollback of a >= 8 GiB CuPy job through the agent, eager against --lazy, same job (lazy
restore on rollback).

The job is workloads/suspend_job.py (--gib GiB of pseudo-random data in 256 MiB arrays,
then a small kernel about every millisecond) under `gpu-trace run --agent`, its memory plain
CuPy (`plain`) or owned (`owned`, GPUOS_AGENT_OWN=1). Once: a full image of it (a snapshot
written to --dir). Then --reps times eager, then --reps times lazy: the job overwrites all its
data (D/damage), the bench rolls it back to the image and checks the job's checksum is the
image's again.

Resume-to-first-kernel: from the moment the agent stopped the program (the rollback answer's
hold_at, CLOCK_MONOTONIC) to the end of the first of the job's launches that completed after the
agent let it go (go_at): while D/stamps exists the job synchronises its stream after each
launch and notes time.monotonic(). It includes a stream synchronisation; the image's read and
check, which come before the hold while the program runs, are apart (read_s). Eager: the hold
includes the whole write-back. Lazy: the hold is the synchronisation of work already
submitted; the first kernel then waits on the GPU for the write-back of what it touches (here
the 1 MiB array it adds to). Lazy full write-back: the engine's background thread from its
start to every buffer back (ping's residency.lazy).

Each lazy rep also gives the engine's GPU timing of its demand loads (ms from the background
loader's start: issued on the host, copy start and end on the GPU) and when the background
copies ended on the GPU; a `-noyield` mode runs the job with the loader not pausing for them.

    python3 scripts/bench_rollback.py [--gib 8] [--reps 2] [--modes plain,owned,plain-noyield] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_suspend import JOB, check, demand_text, stop, wait_file, wait_lazy_done  # scripts/, beside this one

ROOT = Path(__file__).resolve().parents[1]

GIB = 1 << 30


def start(d: Path, gib: float, owned: bool, no_yield: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("GPUOS_AGENT_OWN", None)
    env.pop("GPUOS_ENGINE_NO_YIELD", None)
    if owned:
        env["GPUOS_AGENT_OWN"] = "1"
    if no_yield:  # the engine's loader keeps feeding while a demand load is in flight (as before 2026-11-24)
        env["GPUOS_ENGINE_NO_YIELD"] = "1"
    cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
           str(d / "trace.ndjson.zst"), "--", sys.executable, str(JOB), "--gib", str(gib), "--dir", str(d)]
    return subprocess.Popen(cmd, env=env, cwd=ROOT)


def one_job(gib: float, reps: int, owned: bool, where: Path, no_yield: bool = False) -> dict[str, Any]:
    from gpuos_tools.agent import control

    d = Path(tempfile.mkdtemp(prefix="bench-rollback-", dir=where))
    proc = start(d, gib, owned, no_yield)
    rows: list[dict[str, Any]] = []
    try:
        ready = wait_file(d / "ready", proc)
        sock = control.resolve(str(ready["pid"]))
        img = d / "job.img"
        t = time.perf_counter()
        snap = control.request(sock, "snapshot", timeout=600, digest=False, image=str(img))
        image_s = time.perf_counter() - t
        print(f"  {'owned' if owned else 'plain'}: image of {snap['bytes'] / GIB:.2f} GiB in {image_s:.2f} s "
              f"(staging {snap['staging_s']:.2f} s)", file=sys.stderr, flush=True)
        for mode in ["eager"] * reps + ["lazy"] * reps:
            (d / "damage").write_text("")
            damaged = wait_file(d / "damage.json", proc)["checksum"]
            (d / "damage.json").unlink()
            (d / "stamps.json").unlink(missing_ok=True)
            (d / "stamps").write_text("")
            time.sleep(0.05)
            ans = control.request(sock, "rollback", timeout=600, image=str(img), **({"lazy": True} if mode == "lazy" else {}))
            res = wait_lazy_done(sock) if mode == "lazy" else None
            time.sleep(0.05)
            (d / "stamps").unlink()
            times = wait_file(d / "stamps.json", proc)["t"]
            after = [x for x in times if x > ans["go_at"]]
            to_kernel = after[0] - ans["hold_at"] if after else None
            same = check(d, proc) == ready["checksum"]
            row: dict[str, Any] = {"mode": mode, "rollback": ans, "resume_to_first_kernel_s": to_kernel,
                                   "checksum_same": same, "damaged_differs": damaged != ready["checksum"],
                                   "residency": res}
            lz = ((res or {}).get("lazy") or {})
            if res is not None:
                row["writeback_s"], row["writeback_gbps"] = lz.get("load_s"), lz.get("load_gbps")
            rows.append(row)
            more = (f", write-back {lz.get('load_s')} s @ {lz.get('load_gbps')} GB/s (demand {lz.get('demand_loads')}, "
                    f"background {lz.get('background_loads')}, unknown {lz.get('unknown_requires')}, "
                    f"in order {ans.get('order_predicted')}){demand_text(lz)}"
                    if res is not None else f" ({ans['gbps']} GB/s)")
            print(f"  {'owned' if owned else 'plain'}{'-noyield' if no_yield else ''} {mode}: read+check {ans['read_s']:.2f} s, held "
                  f"{ans['stall_s'] * 1000:.2f} ms{more}, to first kernel "
                  f"{to_kernel * 1000 if to_kernel is not None else float('nan'):.2f} ms, data same {same}",
                  file=sys.stderr, flush=True)
    finally:
        stop(d, proc)
        shutil.rmtree(d, ignore_errors=True)
    return {"owned": owned, "no_yield": no_yield, "bytes": snap["bytes"], "image_s": round(image_s, 3), "rows": rows}


def med(rows: list[dict[str, Any]], get: Any) -> float | None:
    vals = [v for v in (get(r) for r in rows) if v is not None]
    return round(statistics.median(vals), 6) if vals else None


def summary(job: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": job["bytes"]}
    for mode in ("eager", "lazy"):
        rs = [r for r in job["rows"] if r["mode"] == mode]
        out[mode] = {
            "held_s": med(rs, lambda r: r["rollback"]["stall_s"]),
            "read_s": med(rs, lambda r: r["rollback"]["read_s"]),
            "resume_to_first_kernel_s": med(rs, lambda r: r["resume_to_first_kernel_s"]),
            "resume_to_first_kernel_s_each": [r["resume_to_first_kernel_s"] for r in rs],
            "checksum_same": all(r["checksum_same"] and r["damaged_differs"] for r in rs),
        }
        if mode == "eager":
            out[mode]["gbps"] = med(rs, lambda r: r["rollback"]["gbps"])
        else:
            out[mode]["writeback_s"] = med(rs, lambda r: r.get("writeback_s"))
            out[mode]["writeback_gbps"] = med(rs, lambda r: r.get("writeback_gbps"))
            out[mode]["demand_loads"] = [((r["residency"] or {}).get("lazy") or {}).get("demand_loads") for r in rs]
            out[mode]["unknown_requires"] = [((r["residency"] or {}).get("lazy") or {}).get("unknown_requires") for r in rs]
            out[mode]["order_predicted"] = [r["rollback"].get("order_predicted") for r in rs]
            out[mode]["demand_gpu"] = [((r["residency"] or {}).get("lazy") or {}).get("demand") for r in rs]
            out[mode]["background_gpu_ms"] = [((r["residency"] or {}).get("lazy") or {}).get("background_gpu_ms") for r in rs]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="plain,owned",
                    help="plain, owned or both (comma-separated); a mode with -noyield (plain-noyield, owned-noyield): "
                         "the same job with GPUOS_ENGINE_NO_YIELD=1, the loader not pausing for demand loads")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the image goes (--gib GiB)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    from gpuos_tools.cuda.nvml import open_nvml

    nv = open_nvml()
    if nv is None:
        raise SystemExit("bench_rollback needs NVML (nvidia-ml-py)")
    gpu = nv.gpus()[0]
    if gpu["memory_free"] < (args.gib + 2) * GIB:
        raise SystemExit(f"GPU 0 has {gpu['memory_free'] / GIB:.1f} GiB free; {args.gib + 2} GiB needed")
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
                           "gpu": gpu["name"], "driver_version": nv.driver_release(), "gib": args.gib,
                           "reps": args.reps, "jobs": {}, "summary": {}}
    nv.close()
    rc = 0
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        kind, _, variant = mode.partition("-")
        if kind not in ("plain", "owned") or variant not in ("", "noyield"):
            raise SystemExit(f"--modes: {mode!r} is not plain, owned, plain-noyield or owned-noyield")
        print(f"bench_rollback: {mode}", file=sys.stderr, flush=True)
        try:
            job = one_job(args.gib, args.reps, kind == "owned", Path(args.dir), no_yield=variant == "noyield")
        except Exception as e:  # noqa: BLE001 (the other mode's figures still stand)
            out["jobs"][mode] = {"error": f"{type(e).__name__}: {e}"}
            print(f"bench_rollback: {mode}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            rc = 1
            continue
        out["jobs"][mode] = job
        out["summary"][mode] = s = summary(job)
        if not (s["eager"]["checksum_same"] and s["lazy"]["checksum_same"]):
            rc = 1
        if args.json:  # after each job: a timeout later keeps what is done
            Path(args.json).write_text(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
