#!/usr/bin/env python3
"""LinnOS on eBPF-collected traces under mixed load; JSON to --json, a short table on stderr.

1. Load: collect's O_DIRECT reads and writes (--write-fraction) on files in each --dir (one per
   disk to measure), plus a bursty writer on the first (--burst-mib of buffered writes then
   fsync, at random pauses up to --burst-pause-ms): the writeback bursts stand for the slow
   periods (an SSD's garbage collection) LinnOS learns to see coming.
2. Trace: the block-layer program (`collect --source ebpf`'s loader) records every read and write
   of those disks for --seconds, with LinnOS's 31 inputs as the kernel computed them.
3. Train: `train`'s code on the first 80% of the reads in time; accuracy on the last 20%
   against always answering "fast", and the LinnOS paper's 87-97%.
4. Hedging: `gpu-kinfer-bridge replay` (a daemon of its own, decisions through the ring, each
   read charged the round trip measured at the trace's pace, with the load stopped) on the
   held-out reads: p50/p99
   read latency with no prediction, LinnOS and the oracle. With one disk the replica is
   `--replica shifted` (a model of an identical independent disk), else the next disk.
5. Live (--live-seconds > 0): `watch`'s path under the same load with the trained model:
   accuracy of the decisions made at issue, and how long after the issue they were known.

Needs root (BPF) and a folder on a real block device per --dir. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402

from gpuos_tools.kinfer import ring as R  # noqa: E402
from gpuos_tools.kinfer.bpf import unavailable_reason  # noqa: E402
from gpuos_tools.kinfer.bpf.collect import Converter, WatchStats, capture, disk_name, resolve_disk  # noqa: E402
from gpuos_tools.kinfer.bpf.loader import Loader  # noqa: E402
from gpuos_tools.kinfer.linnos import train_trace  # noqa: E402
from gpuos_tools.kinfer.traces import Load  # noqa: E402

BRIDGE = [sys.executable, str(ROOT / "cmd" / "gpu-kinfer-bridge")]
PAPER = "LinnOS (OSDI'20): 87-97% accuracy"


def log(message: str) -> None:
    print(f"linnos_ebpf: {message}", file=sys.stderr, flush=True)


def record_trace(disks: list[int], seconds: float) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    conv = Converter(time.monotonic_ns())
    rows: list[dict[str, Any]] = []
    with Loader(disks) as loader:
        done = capture(loader, lambda recs: rows.extend(conv.records(recs)), seconds=seconds)
        stats = loader.stats()
    rows.sort(key=lambda r: r["t_us"])
    return rows, {"seconds": round(done.seconds, 3), "records": done.records, "reads": done.reads, **stats}, conv.disks()


def start_daemon(model: Path) -> tuple[subprocess.Popen[bytes], str]:
    name = f"linnos-ebpf-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([*BRIDGE, "serve", "--ring", name, "--model", str(model), "--gpu", "off", "-o", os.devnull],
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if R.served_by(name, proc.pid):
            return proc, name
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("daemon did not start")


def live(disks: list[int], model: Path, threshold: float, seconds: float) -> dict[str, Any]:
    proc, name = start_daemon(model)
    try:
        conv = Converter(time.monotonic_ns())
        stats = WatchStats(threshold)
        with Loader(disks, predict=True) as loader:
            loader.attach_ring(R.ring_path(name))
            done = capture(loader, lambda recs: stats.add(conv.records(recs)), seconds=seconds)
            counters = loader.stats()
        return {"seconds": round(done.seconds, 3), "disks": stats.reports("total", done.seconds), "loader": counters}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        R.ring_path(name).unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--dir", action="append", required=True, help="a folder on a disk to load and trace (repeat per disk)")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of the recorded trace")
    ap.add_argument("--live-seconds", type=float, default=10.0, help="live decisions afterwards (0: skip)")
    ap.add_argument("--write-fraction", type=float, default=0.3)
    ap.add_argument("--depth", type=int, default=4, help="O_DIRECT threads per file (two files per folder)")
    ap.add_argument("--size-mib", type=int, default=256, help="size of each O_DIRECT file")
    ap.add_argument("--burst-mib", type=int, default=64, help="bursty writer: MiB per burst (0: none)")
    ap.add_argument("--burst-pause-ms", type=float, default=400.0)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--label", default="inflection", choices=["inflection", "percentile"], help="how slow reads are told (train's)")
    ap.add_argument("--percentile", type=float, default=90.0, help="with --label percentile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", help="also write the recorded trace here (.zst compresses)")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        log(f"cannot run: {reason}")
        return 2
    dirs = [Path(d) for d in args.dir]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    disks = sorted({resolve_disk(str(d)) for d in dirs})
    result: dict[str, Any] = {
        "host": socket.gethostname(), "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:],
        "disks": [disk_name(d) for d in disks],
        "load": {"write_fraction": args.write_fraction, "depth_per_file": args.depth, "files_per_dir": 2,
                 "burst_mib": args.burst_mib, "burst_pause_ms": args.burst_pause_ms},
        "paper": PAPER,
    }
    def new_load() -> Load:
        return Load(dirs, depth=args.depth, file_size=args.size_mib << 20, write_fraction=args.write_fraction, seed=args.seed,
                    burst_mib=args.burst_mib, burst_pause_ms=args.burst_pause_ms)

    load = new_load()
    log(f"load on {', '.join(map(str, dirs))} ({', '.join(result['disks'])}); tracing {args.seconds:g} s")
    load.start()
    try:
        rows, result["collect"], result["trace_disks"] = record_trace(disks, args.seconds)
    finally:
        load.close()  # the replay's round trips are measured on a quiet machine; the live phase has its own load
    reads = [r for r in rows if r["op"] == "R"]
    log(f"{len(rows)} I/Os, {len(reads)} reads")
    if args.trace:
        from gpuos_tools.stream import make_header, open_output

        with open_output(args.trace) as w:
            w.write(make_header("gpu-kinfer-bridge", trace="collected", source="ebpf", **result["load"]))
            w.write_many(rows)
    model, report = train_trace(rows, epochs=args.epochs, seed=args.seed, label=args.label, percentile=args.percentile)
    result["train"] = {k: report[k] for k in ("reads", "train_reads", "threshold_us", "label", "slow_fraction", "train", "holdout")}
    ho = report["holdout"]
    cut_t = sorted(r["t_us"] for r in reads)[report["train_reads"]]
    held = [r for r in rows if r["t_us"] >= cut_t]
    ho_reads = [r for r in held if r["op"] == "R"]
    slow_share = float(np.mean([r["lat_us"] > report["threshold_us"] for r in ho_reads]))
    result["accuracy"] = {"holdout": ho["accuracy"], "always_fast": round(1 - slow_share, 4),
                          "false_fast": ho["false_fast"], "false_slow": ho["false_slow"], "paper": "87-97%"}
    log(f"holdout accuracy {ho['accuracy']:.3f} (always fast {1 - slow_share:.3f}); missed slow reads {ho['false_fast']:.2f}")
    with tempfile.TemporaryDirectory(prefix="linnos-ebpf-") as tmp:
        mpath = Path(tmp) / "linnos.npz"
        model.save(mpath)
        tpath = Path(tmp) / "holdout.ndjson"
        tpath.write_text("".join(json.dumps(r) + "\n" for r in held))
        n_disks = len({r["dev"] for r in ho_reads})
        replica = "next" if n_disks > 1 else "shifted"
        done = subprocess.run([*BRIDGE, "replay", str(tpath), "--model", str(mpath), "--replica", replica],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"replay failed: {done.stderr}")
        rep = [json.loads(line) for line in done.stdout.splitlines()][-1]
        result["replay"] = {k: rep[k] for k in ("reads", "devices", "replica", "threshold_us", "slow_fraction", "rerouted",
                                                "accuracy", "always_fast_accuracy", "false_fast", "false_slow",
                                                "inference", "none", "linnos", "linnos_uncharged", "oracle")}
        if args.live_seconds > 0:
            log(f"live decisions for {args.live_seconds:g} s, under the same load")
            load = new_load()
            load.start()
            try:
                result["live"] = live(disks, mpath, float(report["threshold_us"]), args.live_seconds)
            finally:
                load.close()
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    rp = result["replay"]
    print(f"{'':24} {'p50 us':>9} {'p99 us':>9} {'p99.9 us':>9}", file=sys.stderr)
    for key in ("none", "linnos", "linnos_uncharged", "oracle"):
        s = rp[key]
        print(f"{key:24} {s['p50']:>9.1f} {s['p99']:>9.1f} {s['p99.9']:>9.1f}", file=sys.stderr)
    print(f"holdout accuracy {result['accuracy']['holdout']:.4f}, always fast {result['accuracy']['always_fast']:.4f} "
          f"({PAPER}); replica {rp['replica']}; charged {rp['inference']['charged_us']} us per read", file=sys.stderr)
    for d in result.get("live", {}).get("disks", []):
        added, decided = d["added_us"] or {}, d["decided_us"] or {}
        print(f"live {d['disk']}: {d['predicted']}/{d['reads']} reads predicted, accuracy {d['accuracy']}, always fast "
              f"{d['always_fast_accuracy']}; decided p50/p99 {decided.get('p50')}/{decided.get('p99')} us after the issue, "
              f"seen by the loader {added.get('p50')}/{added.get('p99')} us", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
