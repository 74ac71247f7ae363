#!/usr/bin/env python3
"""The swap pipeline of the residency engine (the swap-pipeline target in DESIGN.md: ">= 90 GB/s
both directions on an H200"): owned records evicted to the engine's pinned host copies while others
are loaded back, at the same time, through the engine itself (gpuos_tools/memory/eviction.py:
evict_from_operation -> save on its evict stream, release on its evict thread; prefetch -> make
resident + load on its prefetch stream), not through bare cudaMemcpy.

Two sets of owned records (gpuos_tools/memory/owned.py), A and B, --gib GiB each in records of
--record-mib MiB, filled with a non-zero pattern; the engine's pinned host copies made before
any timing (as the executor's mover pins ahead). Each trial, from A resident and B released:

- evict:  every record of A evicted (saved, released)            device -> host alone
- load:   every record of A loaded back (made resident, copied)   host -> device alone
- both:   A evicted while B is loaded, the calls interleaved      both directions at once
          (then A and B swap roles for the next trial)

The engine's trials run once per --park mode, in order: "off", released records' physical memory
goes back to the driver (cuMemRelease) and loads create new memory (cuMemCreate), as before the
park existed; "on", the owned library parks it (up to one set's bytes) and a load maps parked
memory of the record's size again. Creating and releasing physical memory makes the driver clear
it on a copy engine in the background, which halves host-to-device copies meanwhile
(scripts/probe_swap.py); parking avoids it. --settle seconds pass after each mode.

Before each eviction phase every record of A is written (a memset, and the engine told as the
tracer would tell it), so that each eviction is a save; each run checks that it was: the engine's
counts (read through its stats, under its lock) grew by exactly 2 x records x trials evictions,
each a save of the whole record, none released without one. Per phase the wall time from the first
call to the last record's completion (host clock, loads and releases polled together), and
GB/s = bytes / time; for "both", each direction's GB/s (bytes / its own last completion) and the
combined (2 x bytes / the later). Also the raw ceiling on the
same pinned memory: cuMemcpyDtoHAsync / HtoDAsync of the same records on two streams of our own,
each direction alone and both at once. Medians of --trials. The digest check is off
(the engine's digest switch): unchanged records would otherwise skip their saves.

    python3 scripts/bench_swap.py [--gib 4] [--record-mib 256] [--trials 3] [--park off,on] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuos_tools.cuda.driver import ok
from gpuos_tools.cuda.nvml import nvml_session
from gpuos_tools.memory.driver_ops import DriverOps
from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.memory.owned import OwnedLibrary
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.states import RELEASED, RESIDENT

POLL_S = 20e-6


class BenchAgent:
    """What the engine reads of an agent: its lock, own threads, the program's streams (the
    legacy stream: nothing of a program runs here), the context."""

    def __init__(self, ctx: Any) -> None:
        self.lock = threading.RLock()
        self.own: set[int] = set()
        self.streams = {0}
        self.ctx = ctx
        self.by_id: dict = {}
        self.snap = None


def wait_all(eng: ResidencyEngine, bases: list[int], state: str, t0: float, timeout: float = 120) -> float:
    """Seconds from t0 until every record in ``bases`` is in ``state``."""
    left = set(bases)
    while left:
        left = {b for b in left if eng.state(b) != state}
        if not left:
            break
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"{len(left)} records not {state} after {timeout} s: {eng.stats()}")
        time.sleep(POLL_S)
    return time.perf_counter() - t0


def completion(eng: ResidencyEngine, events: list[Any], loaded: list[int], evicted: list[int], t0: float,
               timeout: float = 120) -> tuple[float | None, float | None]:
    """Seconds from t0 until the loads (their ``events``) and the evictions of ``evicted``
    (released) have each completed, polled together so that each direction gets its own time;
    None for a direction with nothing in it."""
    evs = [ev for ev in events if ev is not None]
    left = set(evicted)
    t_in = None if evs else 0.0
    t_out = None if left else 0.0
    while t_in is None or t_out is None:
        now = time.perf_counter() - t0
        if t_in is None:
            evs = [ev for ev in evs if not eng.ops.done(ev)]
            if not evs:
                t_in = now
        if t_out is None:
            left = {b for b in left if eng.state(b) != RELEASED}
            if not left:
                t_out = now
        if now > timeout:
            raise RuntimeError(f"not done after {timeout} s: {len(evs)} loads, {len(left)} evictions: {eng.stats()}")
        time.sleep(POLL_S)
    eng.require(loaded, 0)  # drops the completed loads from pending: resident
    return (t_in if events else None), (t_out if evicted else None)


def dirty(eng: ResidencyEngine, bases: list[int], pattern: int) -> None:
    """Write every record (a memset on the legacy stream, as a program would) and tell the
    engine, as the tracer does for a program's memset: the host copies are stale, every
    eviction must save (a record loaded back and not written since would be released without
    a copy, and the digest check is off). Untimed: synchronised before the phase starts."""
    from cuda.bindings import driver as drv

    for i, x in enumerate(bases):
        ok(drv.cuMemsetD32Async(x, (pattern * 0x9E3779B1 + i) & 0xFFFFFFFF, eng.ops.lookup(x).size // 4, 0),
           "cuMemsetD32Async")
        eng.access("cuMemsetD32Async", 0, x)
    ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")


def release_set(eng: ResidencyEngine, bases: list[int]) -> None:
    """Evict every record of ``bases`` through the engine and wait until all are released."""
    t = time.perf_counter()
    for x in bases:
        if not eng.evict_from_operation(x):
            raise RuntimeError(f"the engine refused to evict {x:#x}: {eng.stats()}")
    wait_all(eng, bases, RELEASED, t)


SAVE_KEYS = ("evictions", "evict_saves", "saved_bytes", "unsaved_bytes")


def save_counts(eng: ResidencyEngine) -> dict[str, int]:
    """The engine's eviction counts, through ``stats()``, under the engine's lock: a consistent
    view of all of them (the evict thread counts an eviction before its record reads RELEASED,
    but a reader of ``eng.counts`` without the lock could see one count moved and not the next)."""
    st = eng.stats()
    return {k: st[k] for k in SAVE_KEYS}


def check_saves(before: dict[str, int], after: dict[str, int], evictions: int, nbytes: int, what: str) -> None:
    """That the run between the two ``save_counts`` evicted exactly ``evictions`` records, each
    with a save, ``nbytes`` in all, and released none without one; RuntimeError saying what the
    engine counted otherwise."""
    got = {k: after[k] - before[k] for k in SAVE_KEYS}
    if got != {"evictions": evictions, "evict_saves": evictions, "saved_bytes": nbytes, "unsaved_bytes": 0}:
        raise RuntimeError(f"{what}: expected {evictions} evictions, each a save ({nbytes} bytes in all), none "
                           f"released unsaved; the engine counted {got['evictions']} evictions, {got['evict_saves']} "
                           f"saves, {got['saved_bytes']} bytes saved, {got['unsaved_bytes']} bytes released unsaved")


def engine_trials(eng: ResidencyEngine, lib: Any, a: list[int], b: list[int], park: int, trials: int,
                  write: Callable[[list[int], int], None], settle: float = 0.0,
                  ) -> tuple[list[dict[str, Any]], list[int], list[int]]:
    """``trials`` trials of the three phases, from ``a`` resident and ``b`` released, with ``park``
    bytes of parking in the owned library ``lib`` (0: off); ``write(bases, pattern)`` writes the
    records and tells the engine (``dirty``). Returns the rows and the sets as they end (A and B
    swap roles each trial). Checks that every eviction timed was a save (``check_saves``)."""
    lib.set_park_limit(park)
    rows: list[dict[str, Any]] = []
    before = save_counts(eng)
    total = sum(eng.ops.lookup(x).size for x in a)  # bytes each way per phase: what the engine copies

    def written(bases: list[int], pattern: int) -> None:
        write(bases, pattern)
        if eng.clean.intersection(bases):
            raise RuntimeError("records written, still clean to the engine: their evictions would not save")

    for k in range(trials):
        row: dict[str, Any] = {}
        written(a, 2 * k)
        t = time.perf_counter()
        for x in a:
            assert eng.evict_from_operation(x)
        row["evict_gbps"] = gbps(total, wait_all(eng, a, RELEASED, t))
        t = time.perf_counter()
        evs = [eng.prefetch(x) for x in a]
        t_in, _ = completion(eng, evs, a, [], t)
        row["load_gbps"] = gbps(total, t_in)
        assert all(eng.state(x) == RESIDENT for x in a)
        written(a, 2 * k + 1)
        t = time.perf_counter()
        evs = []
        for x, y in zip(a, b):
            assert eng.evict_from_operation(x)
            evs.append(eng.prefetch(y))
        t_in, t_out = completion(eng, evs, b, a, t)
        row.update(both_out_gbps=gbps(total, t_out), both_in_gbps=gbps(total, t_in),
                   both_combined_gbps=gbps(2 * total, max(t_in, t_out)))
        rows.append(row)
        print(f"park {park >> 20} MiB, trial {k}: {row}", file=sys.stderr)
        a, b = b, a
    check_saves(before, save_counts(eng), 2 * len(a) * trials, 2 * total * trials,
                f"park {park >> 20} MiB, {trials} trials of {len(a)} records")
    lib.set_park_limit(0)
    time.sleep(settle)  # the driver's clearing of released memory runs on after the release
    return rows, a, b


def gbps(n: int, s: float) -> float:
    return round(n / s / 1e9, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="GiB per set (A and B)")
    ap.add_argument("--record-mib", type=int, default=256)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--park", default="off,on",
                    help="engine runs, in order: off (released memory goes back to the driver), on (parked: "
                         "a released record's physical memory mapped again for the next load; one set's bytes)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds between engine runs (the driver's clearing)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not set(args.park.split(",")) <= {"off", "on"}:
        ap.error(f"--park {args.park!r}: a list of off and on")

    from cuda.bindings import driver as drv

    ok(drv.cuInit(0), "cuInit")
    dev = ok(drv.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ok(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    name = ok(drv.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0", 1)[0].decode()
    lib = OwnedLibrary.load()
    agent = BenchAgent(ctx)
    ops = DriverOps(agent)
    eng = ResidencyEngine(agent, ops, settings=EngineSettings(digest=False))

    rec = args.record_mib << 20
    n = max(1, int(args.gib * (1 << 30)) // rec)
    sets = []
    for s in range(2):
        bases = []
        for i in range(n):
            p = lib.malloc(rec)
            if not p:
                raise SystemExit(f"bench_swap: owned malloc of {rec} bytes refused")
            ok(drv.cuMemsetD32(p, 0x9E3779B9 ^ (s << 16 | i), rec // 4), "cuMemsetD32")
            ops.host(p, rec)  # pinned ahead, out of the timing
            bases.append(p)
        sets.append(bases)
    ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    total = n * rec
    a, b = sets
    release_set(eng, b)  # B released to start with (untimed)

    def write(bases: list[int], pattern: int) -> None:
        dirty(eng, bases, pattern)

    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in args.park.split(","):
        # a mode asked again keeps its earlier run: on.2 is the second "on"
        key = next(k for k in (mode, *(f"{mode}.{i}" for i in range(2, 100))) if k not in runs)
        runs[key], a, b = engine_trials(eng, lib, a, b, total if mode == "on" else 0, args.trials, write, args.settle)
    st = eng.stats()
    assert st.get("evict_errors", 0) == 0, st

    # the raw ceiling: the same pinned host copies and records, bare async copies on two streams
    ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    for x in b:  # everything resident for the raw copies
        if eng.state(x) == RELEASED:
            eng.prefetch(x)
    ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    eng.require(None, 0)
    s_out = ops.stream()
    s_in = ops.stream()

    def raw(direction: str) -> dict[str, float]:
        t = time.perf_counter()
        ev_out = ev_in = None
        if direction in ("out", "both"):
            for x in a:
                h = ops.host(x, rec)[0][0]
                ok(drv.cuMemcpyDtoHAsync(h, x, rec, s_out), "cuMemcpyDtoHAsync")
            ev_out = ops.event()
            ops.record(ev_out, s_out)
        if direction in ("in", "both"):
            for y in b:
                h = ops.host(y, rec)[0][0]
                ok(drv.cuMemcpyHtoDAsync(y, h, rec, s_in), "cuMemcpyHtoDAsync")
            ev_in = ops.event()
            ops.record(ev_in, s_in)
        res = {}
        for key, ev in (("out", ev_out), ("in", ev_in)):
            if ev is not None:
                ops.synchronize(ev)
                res[key] = time.perf_counter() - t
        return res

    raws: list[dict[str, Any]] = []
    for _ in range(args.trials):
        r1 = raw("out")
        r2 = raw("in")
        r3 = raw("both")
        raws.append({"out_gbps": gbps(total, r1["out"]), "in_gbps": gbps(total, r2["in"]),
                     "both_out_gbps": gbps(total, r3["out"]), "both_in_gbps": gbps(total, r3["in"]),
                     "both_combined_gbps": gbps(2 * total, max(r3["out"], r3["in"]))})

    def med(rows: list[dict[str, Any]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    out = {"bench": "swap", "date": time.strftime("%Y-%m-%d", time.gmtime()), "host": platform.node(),
           "gpu": name, "driver": _driver(), "gib_per_set": round(total / (1 << 30), 3), "records_per_set": n,
           "record_bytes": rec, "runs": {m: {"trials": t, "median": med(t)} for m, t in runs.items()},
           "raw_trials": raws, "raw_median": med(raws),
           "engine": {k: v for k, v in st.items() if not isinstance(v, dict)}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    r = out["raw_median"]
    print(f"{'path':<11} {'evict/out':>10} {'load/in':>8} {'both: out':>10} {'in':>7} {'combined':>9}  (GB/s, median of "
          f"{args.trials}, {total / (1 << 30):.1f} GiB each way)", file=sys.stderr)
    for mode, run in out["runs"].items():
        m = run["median"]
        print(f"{'engine/' + mode:<11} {m['evict_gbps']:>10} {m['load_gbps']:>8} {m['both_out_gbps']:>10} "
              f"{m['both_in_gbps']:>7} {m['both_combined_gbps']:>9}", file=sys.stderr)
    print(f"{'raw':<11} {r['out_gbps']:>10} {r['in_gbps']:>8} {r['both_out_gbps']:>10} {r['both_in_gbps']:>7} "
          f"{r['both_combined_gbps']:>9}", file=sys.stderr)
    eng.close()
    return 0


def _driver() -> str | None:
    with nvml_session() as nv:
        return nv.driver_release() if nv is not None else None


if __name__ == "__main__":
    sys.exit(main())
