#!/usr/bin/env python3
"""The whole `gpu-ckpt --agent PID --image DIR` against the raw sequential write of the same bytes
to the same filesystem, side by side in one run (the durable-image target: within 1.25x of the
raw write time; at least 5 GB/s into tmpfs).

Starts workloads/agent_job.py (--gib GiB in 256 MiB arrays, updated on two streams) under
`gpu-trace run --agent`, takes one warm-up snapshot (it pins the agent's host staging, which
later snapshots reuse; its time is reported as "first"), then for each --dirs directory,
--repeat times alternately:

- raw: one file of the job's bytes written by one thread in 256 MiB writes from a page-aligned
  buffer and fsynced, buffered and with O_DIRECT where the filesystem takes it (the faster counts);
- image: the wall time of the command `gpu-ckpt --agent PID --image DIR` (its defaults: checksum
  auto, O_DIRECT auto, the CPUs' threads), from its start to its exit, image verified after.

JSON to --json: per directory the filesystem, best and all times, GB/s, and the ratio of the
image's best time to the raw best. Directories without room for twice the bytes are skipped.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuos_tools.agent.control import socket_path
from gpuos_tools.image import chunkio
from gpuos_tools.image import verify

ROOT = Path(__file__).resolve().parent.parent

PROG = ROOT / "workloads" / "agent_job.py"


def raw_write(path: Path, block: memoryview, total: int, direct: bool) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        left = total - total % chunkio.DIRECT_ALIGN if direct else total  # O_DIRECT: whole blocks
        while left:
            n = os.write(fd, block[:min(len(block), left)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t
    path.unlink()
    return seconds


def gpu_ckpt(pid: int, image: Path) -> tuple[float, dict]:
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "--agent", str(pid), "--image",
                           str(image)], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    seconds = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"gpu-ckpt --agent failed ({done.returncode}): {done.stderr[-2000:]}")
    rec = [json.loads(x) for x in done.stdout.splitlines() if '"agent_snapshot"' in x][-1]
    return seconds, rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--dirs", default="/dev/shm,/var/tmp", help="comma-separated directories (default /dev/shm,/var/tmp)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-durable-"))
    env = dict(os.environ, GPU_JOB_GIB=str(args.gib), GPUOS_JOB_STOP=str(work / "stop"),
               GPUOS_JOB_LOG=str(work / "log"), GPUOS_JOB_READY=str(work / "ready"))
    job = subprocess.Popen([sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
                            os.devnull, "--", sys.executable, str(PROG)], cwd=ROOT, env=env, start_new_session=True)
    result: dict = {"tool": "bench_durable", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
                    "cpus": os.cpu_count(), "gib": args.gib, "dirs": []}
    rc = 0
    try:
        deadline = time.time() + 300
        while not (work / "ready").exists():
            if job.poll() is not None or time.time() > deadline:
                raise RuntimeError("the job did not start")
            time.sleep(0.1)
        pid = int((work / "ready").read_text())
        while not socket_path(pid).exists():
            time.sleep(0.05)
        first_dir = Path(tempfile.mkdtemp(prefix="bench-durable-", dir=args.dirs.split(",")[0]))
        seconds, rec = gpu_ckpt(pid, first_dir / "warmup")
        nbytes = int(rec["bytes"])
        result.update(bytes=nbytes, first={"seconds": round(seconds, 3), "staging_s": rec.get("staging_s"),
                                          "image": rec.get("image")})
        shutil.rmtree(first_dir)
        block_map = mmap.mmap(-1, 256 << 20)
        block_map[:] = os.urandom(1 << 20) * 256
        block = memoryview(block_map)
        for d in args.dirs.split(","):
            free = shutil.disk_usage(d).free
            if free < 2 * nbytes + (1 << 30):
                result["dirs"].append({"dir": d, "skipped": f"{free / 2**30:.1f} GiB free"})
                continue
            where = Path(tempfile.mkdtemp(prefix="bench-durable-", dir=d))
            fs = chunkio.fs_info(str(where))
            direct_ok = chunkio.fs_info(str(where), "on").direct
            times: dict[str, list[float]] = {"raw_buffered": [], "raw_direct": [], "image": []}
            snaps = []
            for i in range(args.repeat):
                times["raw_buffered"].append(raw_write(where / "raw", block, nbytes, False))
                if direct_ok:
                    times["raw_direct"].append(raw_write(where / "raw", block, nbytes, True))
                image = where / f"img{i}"
                seconds, rec = gpu_ckpt(pid, image)
                problems = verify(image, data=i == 0)
                if problems:
                    raise RuntimeError(f"{image}: {problems[:3]}")
                shutil.rmtree(image)
                times["image"].append(seconds)
                snaps.append({k: rec.get(k) for k in ("seconds", "stall_s", "gbps", "staging_s")}
                             | {"write_s": (rec.get("image") or {}).get("seconds")})
            shutil.rmtree(where, ignore_errors=True)
            best = {k: min(v) for k, v in times.items() if v}
            raw = min(best.get("raw_buffered", 1e9), best.get("raw_direct", 1e9))
            entry = {"dir": d, "filesystem": fs.fstype, "direct": fs.direct, "direct_why": fs.why,
                     "seconds": {k: [round(x, 3) for x in v] for k, v in times.items() if v},
                     "gbps": {k: round(nbytes / v / 1e9, 3) for k, v in best.items()},
                     "ratio": round(best["image"] / raw, 3), "snapshots": snaps}
            result["dirs"].append(entry)
            print(f"{d} ({fs.fstype}): raw {nbytes / raw / 1e9:.2f} GB/s, whole gpu-ckpt --agent "
                  f"{nbytes / best['image'] / 1e9:.2f} GB/s, ratio {entry['ratio']}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 (said in the JSON and the status)
        result["error"] = f"{type(e).__name__}: {e}"
        print(result["error"], file=sys.stderr)
        rc = 1
    finally:
        (work / "stop").touch()
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
