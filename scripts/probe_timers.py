#!/usr/bin/env python3
"""Where a program's host time goes inside the in-process agent: wraps named functions with
timers, runs the program in this interpreter, and writes per thread each function's calls,
inclusive seconds and longest call. cProfile cannot say it: the agent's hooks run on the
program's thread from the native core's upcalls and on the engine's own threads, and cProfile
follows one thread and loses the callers across an upcall.

Run it as the program under the tool whose path is measured, e.g.

    gpu-prefetch-sched run --budget 66% -- python3 scripts/probe_timers.py --sched \\
        --window gpuos_tools.sched.executor:current_counts --out timers.json \\
        -- workloads/torch_decode_job.py --tokens 9

--wrap module:function or module:Class.method (repeatable); --sched adds the scheduler's
per-operation path (executor, policy, engine, driver ops, owned library). --window F counts
only between the first and the second call of F (the torch jobs call current_counts at the
start and the end of their timed loop); without it, the whole run. A function is wrapped where
it is looked up at call time (a method, a module attribute); a name imported elsewhere with
``from m import f`` keeps the unwrapped one. Timers cost about a microsecond a call.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import runpy
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SCHED = (
    "gpuos_tools.sched.executor:Executor._before",
    "gpuos_tools.sched.executor:Executor._require",
    "gpuos_tools.sched.executor:Executor._measure",
    "gpuos_tools.sched.executor:Executor._evict",
    "gpuos_tools.sched.executor:Executor._fits",
    "gpuos_tools.sched.executor:Executor._mark",
    "gpuos_tools.sched.executor:Executor.physical",
    "gpuos_tools.sched.executor:Executor.fast_replay",
    "gpuos_tools.sched.executor:Executor.fast_after",
    "gpuos_tools.sched.executor:Executor._fast_horizon",
    "gpuos_tools.sched.executor:Executor._move_loop",
    "gpuos_tools.sched.online:OnlinePolicy.before",
    "gpuos_tools.memory.engine:ResidencyEngine.require",
    "gpuos_tools.memory.engine:ResidencyEngine.prefetch",
    "gpuos_tools.memory.engine:ResidencyEngine.launch",
    "gpuos_tools.memory.engine:ResidencyEngine._load",
    "gpuos_tools.memory.engine:ResidencyEngine._copy",
    "gpuos_tools.memory.eviction:Eviction.evict_from_operation",
    "gpuos_tools.memory.eviction:Eviction._evict_finish",
    "gpuos_tools.memory.eviction:Eviction._start_save",
    "gpuos_tools.memory.eviction:Eviction._capturing",
    "gpuos_tools.memory.eviction:Eviction._after_program",
    "gpuos_tools.memory.digests:Digests._digest_at_eviction",
    "gpuos_tools.memory.driver_ops:DriverOps.make_resident",
    "gpuos_tools.memory.driver_ops:DriverOps.release",
    "gpuos_tools.memory.driver_ops:DriverOps.copy_in",
    "gpuos_tools.memory.driver_ops:DriverOps.copy_out",
    "gpuos_tools.memory.driver_ops:DriverOps.host",
    "gpuos_tools.memory.driver_ops:DriverOps.digest",
    "gpuos_tools.memory.driver_ops:DriverOps.event",
    "gpuos_tools.memory.driver_ops:DriverOps.record",
    "gpuos_tools.memory.driver_ops:DriverOps.wait",
    "gpuos_tools.memory.driver_ops:DriverOps.done",
    "gpuos_tools.memory.driver_ops:DriverOps.synchronize",
    "gpuos_tools.memory.driver_ops:DriverOps.lookup",
    "gpuos_tools.memory.owned:OwnedLibrary.make_resident",
    "gpuos_tools.memory.owned:OwnedLibrary.release",
    "gpuos_tools.memory.owned:OwnedLibrary.parked_bytes",
    "gpuos_tools.memory.owned:OwnedLibrary.parked",
    "gpuos_tools.memory.owned:OwnedLibrary.trim_parked",
    "gpuos_tools.agent.agent:Agent.settle",
)


class Timers:
    """Per (thread name, function): [calls, seconds, longest call]."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[float]] = {}
        self.on = True
        self.t0 = time.perf_counter()
        self.window_s: float | None = None
        self.lock = threading.Lock()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kw: Any) -> Any:
            if not self.on:
                return fn(*args, **kw)
            t = clock()
            try:
                return fn(*args, **kw)
            finally:
                dt = clock() - t
                key = (threading.current_thread().name, name)
                row = self.rows.get(key)
                if row is None:
                    with self.lock:
                        row = self.rows.setdefault(key, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += dt
                if dt > row[2]:
                    row[2] = dt

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def window(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Counting starts at the first call of ``fn`` and stops at the second."""
        calls = [0]

        def marked(*args: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                self.rows.clear()
                self.on, self.t0 = True, time.perf_counter()
            elif calls[0] == 2:
                self.on, self.window_s = False, time.perf_counter() - self.t0
            return fn(*args, **kw)

        self.on = False
        return marked

    def report(self) -> dict[str, Any]:
        rows = [{"thread": th, "function": fn, "calls": int(r[0]), "s": round(r[1], 6),
                 "us_per_call": round(1e6 * r[1] / r[0], 2) if r[0] else None, "max_ms": round(1e3 * r[2], 3)}
                for (th, fn), r in self.rows.items()]
        rows.sort(key=lambda r: -r["s"])
        span = self.window_s if self.window_s is not None else time.perf_counter() - self.t0
        return {"span_s": round(span, 6), "windowed": self.window_s is not None, "rows": rows}


def resolve(spec: str) -> tuple[Any, str, Callable[..., Any]]:
    """``module:Qual.name`` -> (the object holding it, its attribute name, the function)."""
    mod_name, _, qual = spec.partition(":")
    if not qual:
        raise SystemExit(f"probe_timers: {spec!r}: expected module:function or module:Class.method")
    try:
        owner: Any = importlib.import_module(mod_name)
        *path, attr = qual.split(".")
        for p in path:
            owner = getattr(owner, p)
        return owner, attr, getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"probe_timers: {spec}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: probe_timers.py [--sched] [--wrap M:F ...] [--window M:F] [--out FILE] -- PROGRAM.py [ARGS]",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wrap", action="append", default=[], metavar="MODULE:FUNCTION")
    ap.add_argument("--sched", action="store_true", help="the scheduler's per-operation path")
    ap.add_argument("--window", default="", metavar="MODULE:FUNCTION")
    ap.add_argument("--out", default="", help="the JSON report (default: stderr)")
    args = ap.parse_args(argv[:cut])
    program = argv[cut + 1:]
    if not program:
        ap.error("no program after --")
    timers = Timers()
    for spec in [*(SCHED if args.sched else ()), *args.wrap]:
        owner, attr, fn = resolve(spec)
        setattr(owner, attr, timers.wrap(spec.partition(":")[2], fn))
    if args.window:
        owner, attr, fn = resolve(args.window)
        setattr(owner, attr, timers.window(args.window, fn))

    def dump() -> None:
        text = json.dumps(timers.report(), indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        else:
            print(text, file=sys.stderr)

    atexit.register(dump)
    sys.argv = program
    runpy.run_path(program[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
