#!/usr/bin/env python3
"""Throughput of the checkpoint image format on the CPU (gpuos_tools.image): no GPU.

1. Checksums of one 64 MiB chunk: sha256, crc32, blake2b on one thread, and sha256/crc32 on
   1..N threads at once (hashlib and zlib release the GIL on large buffers), in GB/s.
2. The host's own memory copy (one 1 GiB `dst[:] = src`), the ceiling for anything that touches
   every byte once.
3. An image of --total bytes in buffers of --buffer-size, written from host memory with
   ImageWriter (every chunk hashed and fsynced, the directory renamed), verified (verify():
   every chunk read back and hashed), and read back into a preallocated buffer (Image.read with
   out=), each timed end to end, with the images' checksum (--checksum, crc32 by default); uncompressed and zstd level 1, on random bytes (what fp32
   weights look like to zstd: ~1.08x) and on zeros.

4. Side by side (--compare, also part of the full run): the raw sequential write speed of the
   same filesystem, one file written by one thread with large writes and fsynced (buffered, and
   with O_DIRECT where the filesystem takes it; the faster counts), against ImageWriter writing
   the same bytes (default threads, checksum "auto", O_DIRECT "auto"), alternated in the same run;
   the ratio is the image's time over the raw time (1.0: the storage's speed).

Figures are the best of --repeat runs, in GB/s (10^9 bytes per second). --dir picks where the
images go (default /dev/shm, which is RAM: the agent's case of a fast target). The page cache
is not dropped between writing and reading, so reads from a disk directory measure the cache
unless the image is larger than free memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


from gpuos_tools.image import chunkio
from gpuos_tools import image as img
from gpuos_tools.units import parse_size


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def best(repeat: int, run: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def threaded(f: Callable[[memoryview], Any], views: list[memoryview]) -> None:
    ts = [threading.Thread(target=f, args=(v,)) for v in views]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def bench_checksums(repeat: int, threads: list[int]) -> dict[str, Any]:
    chunk = memoryview(os.urandom(64 << 20))
    out: dict[str, Any] = {}
    fns = {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "crc32": zlib.crc32,
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=32).digest(),
    }
    if chunkio.available("xxh3"):
        fns["xxh3"] = chunkio.CHECKSUMS["xxh3"]
    for name, f in fns.items():
        out[f"{name}_1t_gbps"] = round(len(chunk) / best(repeat, lambda f=f: f(chunk)) / 1e9, 3)
    for name in ("sha256", "crc32", "xxh3"):
        if name not in fns:
            continue
        for n in threads:
            views = [chunk] * n
            run = lambda f=fns[name], v=views: threaded(f, v)
            out[f"{name}_{n}t_gbps"] = round(n * len(chunk) / best(repeat, run) / 1e9, 3)
    return out


def bench_memcpy(repeat: int) -> float:
    src = bytearray(os.urandom(1 << 20)) * 1024
    dst = bytearray(len(src))
    dst[:] = src  # touch the pages first
    mv_d, mv_s = memoryview(dst), memoryview(src)

    def copy() -> None:
        mv_d[:] = mv_s

    return round(len(src) / best(repeat, copy) / 1e9, 3)


def raw_write(path: Path, block: memoryview, n: int, direct: bool) -> None:
    """One file, ``n`` times ``block`` appended by one thread in large writes, fsynced: the
    filesystem's own sequential write speed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        piece = chunkio.DIRECT_PIECE if direct else len(block)
        for _ in range(n):
            done = 0
            while done < len(block):
                done += os.write(fd, block[done:done + piece])
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_compare(directory: Path, total: int, buffer_size: int, chunk_size: int, repeat: int,
                  threads: int | None, checksum: str) -> dict[str, Any]:
    """Raw sequential writes against ImageWriter, alternated, the same bytes to the same filesystem."""
    import mmap

    raw_block = mmap.mmap(-1, buffer_size)  # page-aligned, so O_DIRECT takes it as it is
    raw_block[:] = os.urandom(buffer_size)
    block = memoryview(raw_block)
    n = max(1, total // buffer_size)
    nbytes = n * buffer_size
    fs = chunkio.fs_info(str(directory))
    direct_ok = chunkio.fs_info(str(directory), "on").direct
    raw_path, img_path = directory / "raw.bin", directory / "compare.img"
    times: dict[str, list[float]] = {"raw_buffered": [], "raw_direct": [], "image": []}
    summary: dict[str, Any] = {}

    def image() -> None:
        with img.ImageWriter(img_path, {"bench": True}, chunk_size=chunk_size, threads=threads,
                             checksum=checksum) as w:
            for i in range(n):
                w.add(i, 0x7F0000000000 + i * buffer_size, buffer_size, block, wait=False)
            summary.update(w.commit())
            summary["checksum"] = w.checksum

    for _ in range(repeat):
        for name in times:
            if name == "raw_direct" and not direct_ok:
                continue
            for p in (raw_path, img_path):
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
            t = time.perf_counter()
            if name == "image":
                image()
            else:
                raw_write(raw_path, block, n, direct=name == "raw_direct")
            times[name].append(time.perf_counter() - t)
    for p in (raw_path, img_path):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    best = {k: min(v) for k, v in times.items() if v}
    raw_best = min(best.get("raw_buffered", float("inf")), best.get("raw_direct", float("inf")))
    return {
        "dir": str(directory), "filesystem": fs.fstype, "direct": fs.direct, "direct_why": fs.why,
        "bytes": nbytes, "checksum": summary.get("checksum"), "threads": threads or min(16, os.cpu_count() or 1),
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items() if v},
        "gbps": {k: round(nbytes / v / 1e9, 3) for k, v in best.items()},
        "ratio": round(best["image"] / raw_best, 3),
    }


def bench_image(directory: Path, total: int, buffer_size: int, chunk_size: int, compress: bool, data: str,
                repeat: int, threads: int | None, checksum: str) -> dict[str, Any]:
    block = os.urandom(buffer_size) if data == "random" else bytes(buffer_size)
    n = max(1, total // buffer_size)
    view = memoryview(block)
    target = bytearray(buffer_size)
    path = directory / "bench.img"
    summary: dict[str, Any] = {}

    def write() -> None:
        if path.exists():
            shutil.rmtree(path)
        with img.ImageWriter(path, {"bench": True}, compress=compress, chunk_size=chunk_size,
                             threads=threads, checksum=checksum) as w:
            for i in range(n):
                w.add(i, 0x7F0000000000 + i * buffer_size, buffer_size, view)
            summary.update(w.commit())

    def verify() -> None:
        problems = img.verify(path)
        assert not problems, problems

    def read() -> None:
        im = img.open_image(path)
        for i in range(n):
            im.read(i, target, threads=threads)

    t_write = best(repeat, write)
    t_verify = best(repeat, verify)
    t_read = best(repeat, read)
    shutil.rmtree(path)
    raw = n * buffer_size
    return {"data": data, "compress": compress, "bytes": raw, "stored_bytes": summary["stored_bytes"],
            "ratio": round(raw / summary["stored_bytes"], 3), "write_gbps": round(raw / t_write / 1e9, 3),
            "verify_gbps": round(raw / t_verify / 1e9, 3), "read_gbps": round(raw / t_read / 1e9, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                    help="where images are written (default /dev/shm)")
    ap.add_argument("--total", default="1GiB", help="bytes per image (default 1GiB)")
    ap.add_argument("--buffer-size", default="256MiB", help="bytes per buffer (default 256MiB)")
    ap.add_argument("--chunk-size", default="64MiB", help="bytes per chunk (default 64MiB)")
    ap.add_argument("--threads", type=int, default=None, help="writer/reader threads (default: min(16, CPUs))")
    ap.add_argument("--checksum", default="auto", choices=chunkio.CHOICES,
                    help="the images' checksum (default auto, the writer's default)")
    ap.add_argument("--compare", action="store_true",
                    help="only the side-by-side part: raw sequential writes against the image writer")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE ('-': stdout) instead of a table")
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="bench-image-", dir=args.dir))
    try:
        result: dict[str, Any] = {
            "tool": "bench_image", "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpu": cpu_model(),
            "cpus": cpus, "python": platform.python_version(), "dir": args.dir,
            "filesystem": _fs_type(args.dir), "chunk_size": parse_size(args.chunk_size),
            "threads": args.threads or min(16, cpus), "checksum": args.checksum,
            "compare": bench_compare(work, parse_size(args.total), parse_size(args.buffer_size),
                                     parse_size(args.chunk_size), args.repeat, args.threads, args.checksum),
        }
        if not args.compare:
            result.update({
                "checksums": bench_checksums(args.repeat, sorted({1, 2, cpus})),
                "memcpy_gbps": bench_memcpy(args.repeat),
                "images": [bench_image(work, parse_size(args.total), parse_size(args.buffer_size),
                                       parse_size(args.chunk_size), compress, data, args.repeat, args.threads,
                                       args.checksum)
                           for data in ("random", "zeros") for compress in (False, True)],
            })
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        text = json.dumps(result, indent=1) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text, encoding="utf-8")
        return 0
    c = result["compare"]
    print(f"{result['cpu']} x{cpus}, {result['dir']} ({result['filesystem']}), chunks {args.chunk_size}, "
          f"{args.checksum} ({c['checksum']})")
    print(f"side by side, {c['bytes'] / 2**30:.2f} GiB, GB/s: " + ", ".join(f"{k} {v}" for k, v in c["gbps"].items())
          + f"; image/raw time {c['ratio']} (O_DIRECT: {c['direct_why']})")
    if args.compare:
        return 0
    print("checksums (GB/s): " + ", ".join(f"{k[:-5]} {v}" for k, v in result["checksums"].items()))
    print(f"memcpy 1 GiB: {result['memcpy_gbps']} GB/s")
    print(f"{'data':8} {'zstd':5} {'ratio':>6} {'write':>7} {'verify':>7} {'read':>7}  GB/s")
    for r in result["images"]:
        print(f"{r['data']:8} {r['compress']!s:5} {r['ratio']:6.2f} {r['write_gbps']:7.2f} {r['verify_gbps']:7.2f} "
              f"{r['read_gbps']:7.2f}")
    return 0


def _fs_type(path: str) -> str:
    best_match, kind = "", "?"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and os.path.realpath(path).startswith(parts[1]) and len(parts[1]) > len(best_match):
                    best_match, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


if __name__ == "__main__":
    sys.exit(main())
