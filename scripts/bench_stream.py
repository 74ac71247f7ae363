#!/usr/bin/env python3
"""Records per second through gpuos_tools.stream on one core: write, read, round trip, filter.

For plain and .zst files in a temp directory: write N small records (a header, then
{"type":"launch","seq":i,"x":1}, made by a generator as a tracer would), read them all back,
and copy them through passthrough() as a filter does. "roundtrip" is N over write time plus
read time. Pinned to one CPU; each figure is the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


from gpuos_tools.stream import make_header, open_input, open_output, passthrough


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def records(n: int) -> Iterator[dict[str, Any]]:
    yield make_header("bench_stream")
    for i in range(n):
        yield {"type": "launch", "seq": i, "x": 1}


def best(repeat: int, run: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def bench(directory: Path, suffix: str, n: int, repeat: int) -> dict[str, float]:
    path = directory / f"bench.ndjson{suffix}"
    copy = directory / f"copy.ndjson{suffix}"

    def write() -> None:
        with open_output(path) as writer:
            writer.write_many(records(n))

    def read() -> None:
        count = 0
        with open_input(path) as reader:
            for _ in reader:
                count += 1
        assert count == n + 1, count

    def filter_copy() -> None:
        with open_input(path) as reader, open_output(copy) as writer:
            passthrough(reader, writer, {"launch"}, lambda record: (record,))

    t_write = best(repeat, write)
    t_read = best(repeat, read)
    t_filter = best(repeat, filter_copy)
    return {
        "write": n / t_write,
        "read": n / t_read,
        "roundtrip": n / (t_write + t_read),
        "filter": n / t_filter,
        "bytes": path.stat().st_size,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=1_000_000, help="records per run (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best counts (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--dir", help="where to put the temp files (default: the system temp dir)")
    args = parser.parse_args()

    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    results: dict[str, Any] = {
        "n": args.n,
        "cpu": cpu,
        "machine": cpu_model(),
        "python": platform.python_version(),
        "results": {},
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label, suffix in (("plain", ""), ("zst", ".zst")):
            results["results"][label] = bench(Path(tmp), suffix, args.n, args.repeat)

    print(f"{args.n:,} records, one core (cpu {cpu}), Python {results['python']}")
    print(f"{'':6} {'write/s':>12} {'read/s':>12} {'roundtrip/s':>12} {'filter/s':>12} {'bytes':>12}")
    for label, r in results["results"].items():
        print(
            f"{label:6} {r['write']:>12,.0f} {r['read']:>12,.0f} {r['roundtrip']:>12,.0f}"
            f" {r['filter']:>12,.0f} {r['bytes']:>12,}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
