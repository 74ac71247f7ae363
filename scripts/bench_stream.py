#!/usr/bin/env python3
"""Records per second through gpuos_tools.stream on one core: write, read, filter; checked and not.

Two corpora, each as a plain and a .zst file in a temp directory:

- "small": a header, then N {"type":"launch","seq":i,"x":1} made by a generator as a tracer would;
- "recorded": the records of the traces recorded on the GPU machines (tests/data/recorded/*.ndjson.zst:
  launches with their parameters, allocations, copies, modules, validation results), repeated in order
  up to --recorded-n records after one header.

Figures: "write" (unchecked), "write chk" (every record checked as GPUOS_CHECK_RECORDS=1 does), "read chk"
(what every tool does: records checked against their schemas), "read" (open_input(check=False)),
"filter" (a checked read copied through passthrough()). The runs of one corpus and format are
interleaved, --repeat rounds, and each figure is the median. Pinned to one CPU. --profile prints
where a checked read of the recorded corpus spends its time (cProfile).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuos_tools.stream import make_header, open_input, open_output, passthrough
from gpuos_tools.stream.writer import CHECK_ENV

RECORDED = Path(__file__).resolve().parent.parent / "tests" / "data" / "recorded"
FIGURES = ("write", "write_checked", "read_checked", "read", "filter")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def small_records(n: int) -> Iterator[dict[str, Any]]:
    yield make_header("bench_stream")
    for i in range(n):
        yield {"type": "launch", "seq": i, "x": 1}


def recorded_corpus() -> list[dict[str, Any]]:
    """Every record of the recorded traces but their headers, in file order."""
    corpus = []
    for path in sorted(RECORDED.glob("*.ndjson.zst")):
        with open_input(path) as reader:
            corpus.extend(r for r in reader if r["type"] != "header")
    if not corpus:
        raise SystemExit(f"no recorded traces in {RECORDED}")
    return corpus


@contextlib.contextmanager
def checking(on: bool) -> Iterator[None]:
    """Writers opened inside check every record (the writer reads the variable when opened)."""
    before = os.environ.get(CHECK_ENV)
    os.environ[CHECK_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[CHECK_ENV]
        else:
            os.environ[CHECK_ENV] = before


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def bench(path: Path, make: Callable[[], Iterator[dict[str, Any]]], n: int, repeat: int) -> dict[str, Any]:
    copy = path.with_name("copy-" + path.name)

    def write(check: bool) -> Callable[[], None]:
        def run() -> None:
            with checking(check), open_output(path) as writer:
                writer.write_many(make())
        return run

    def read(check: bool) -> Callable[[], None]:
        def run() -> None:
            count = 0
            with open_input(path, check=check) as reader:
                for _ in reader:
                    count += 1
            assert count == n + 1, count
        return run

    def filter_copy() -> None:
        with checking(False), open_input(path) as reader, open_output(copy) as writer:
            passthrough(reader, writer, {"launch"}, lambda record: (record,))

    runs = {"write": write(False), "write_checked": write(True), "read_checked": read(True), "read": read(False),
            "filter": filter_copy}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):  # interleaved, so that the machine's moods fall on every figure alike
        for name, run in runs.items():
            times[name].append(timed(run))
    out: dict[str, Any] = {name: n / statistics.median(t) for name, t in times.items()}
    out["roundtrip"] = n / (statistics.median(times["write"]) + statistics.median(times["read_checked"]))
    out["bytes"] = path.stat().st_size
    copy.unlink()
    return out


def profile(path: Path, top: int) -> str:
    """The functions a checked read of ``path`` spends its time in, heaviest first."""
    prof = cProfile.Profile()
    with open_input(path) as reader:
        prof.enable()
        for _ in reader:
            pass
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=1_000_000, help="small records per run (default 1,000,000)")
    parser.add_argument("--recorded-n", type=int, default=300_000,
                        help="recorded records per run (default 300,000; 0 leaves the corpus out)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median counts (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--dir", help="where to put the temp files (default: the system temp dir)")
    parser.add_argument("--profile", type=int, metavar="TOP", default=0,
                        help="print the TOP functions of a checked read of the recorded corpus (cProfile)")
    args = parser.parse_args()

    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    corpora: dict[str, tuple[int, Callable[[], Iterator[dict[str, Any]]]]] = {
        "small": (args.n, lambda: small_records(args.n)),
    }
    if args.recorded_n:
        corpus = recorded_corpus()
        n = args.recorded_n

        def recorded() -> Iterator[dict[str, Any]]:
            yield make_header("bench_stream")
            yield from itertools.islice(itertools.cycle(corpus), n)

        corpora["recorded"] = (n, recorded)
    results: dict[str, Any] = {
        "n": {name: n for name, (n, _) in corpora.items()},
        "cpu": cpu,
        "machine": cpu_model(),
        "python": platform.python_version(),
        "repeat": args.repeat,
        "results": {},
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for corpus_name, (n, make) in corpora.items():
            for label, suffix in (("plain", ""), ("zst", ".zst")):
                path = Path(tmp) / f"{corpus_name}.ndjson{suffix}"
                results["results"].setdefault(corpus_name, {})[label] = bench(path, make, n, args.repeat)
            if corpus_name == "recorded" and args.profile:
                with checking(False), open_output(Path(tmp) / "recorded.ndjson") as writer:
                    writer.write_many(make())
                print(profile(Path(tmp) / "recorded.ndjson", args.profile), file=sys.stderr)

    print(f"one core (cpu {cpu}, {results['machine']}), Python {results['python']}, "
          f"median of {args.repeat}; records/s")
    head = ("write", "write chk", "read chk", "read", "chk/unchk", "filter", "bytes/rec")
    print(f"{'':16}" + "".join(f"{h:>11}" for h in head))
    for corpus_name, by_format in results["results"].items():
        n = results["n"][corpus_name]
        for label, r in by_format.items():
            cells = [f"{r[k]:>11,.0f}" for k in ("write", "write_checked", "read_checked", "read")]
            cells += [f"{r['read_checked'] / r['read']:>11.2f}", f"{r['filter']:>11,.0f}", f"{r['bytes'] / n:>11,.0f}"]
            print(f"{corpus_name + ' ' + label:16}" + "".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
