"""The residency engine's lazy loads: after a suspend (lazy resume) or for a rollback (lazy
rollback), every pending record is handed over with the host pieces holding its contents; the
program goes on at once, each operation waiting only for what it touches (``require``), while a
background thread loads the rest in predicted access order, a bounded amount ahead, pausing while
a demand load is in flight (docs/residency-engine.md, "Lazy loads"). A part of
``ResidencyEngine`` (engine.py): its methods use the engine's lock, ``pending`` and ``ops``."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from gpuos_tools.cuda.driver import relax_capture
from gpuos_tools.memory.states import LOADING, RELEASED, Entry, Pieces

AHEAD = 512 << 20  #: bytes the background loader keeps enqueued ahead of completion (at most; or one record)
PROBES = 8  #: demand loads of a lazy load timed on the GPU (its figures: ``stats()['lazy']['demand']``)


class LazyLoader:
    """The background loader and the lazy load's figures (mixed into ``ResidencyEngine``)."""

    def _start_lazy(self) -> None:
        """The loader's state (from the engine's ``__init__``)."""
        #: the loader pauses while a demand load is in flight (``_yield_to_demand``); off only
        #: with GPUOS_ENGINE_NO_YIELD=1, to measure what it buys (scripts/bench_rollback.py)
        self.yield_to_demand = self.settings.yield_to_demand
        self._loader: threading.Thread | None = None
        self._loading = False  #: the background loader runs (it may wait on any load event)
        self._retired: list[Any] = []  #: events of dropped records, destroyed when it ends
        #: load events of demand loads issued while the loader runs: it issues nothing more until
        #: they have completed (``_yield_to_demand``)
        self._demands: list[Any] = []
        #: while the loader runs, (timer before, timer after, host time, bytes) of the first
        #: demand loads, and the timer recorded on the background stream at its start
        self._probes: list[tuple[Any, Any, float, int]] = []
        self._t0: Any = None
        self.lazy: dict[str, Any] | None = None  #: the last lazy load's figures
        self._counts_at_start: dict[str, Any] = {}

    def _load_on_demand(self, e: Entry) -> bool:
        """Load the released record of ``e`` on the demand stream (engine's lock held); False
        when it is gone. While the loader runs, the first PROBES demand loads are timed on the
        GPU, and the loader waits for each before it issues more."""
        demand = self._stream("demand")
        probe = self._loading and self._t0 is not None and len(self._probes) < PROBES
        if probe:
            before = self.ops.timer()
            self.ops.record(before, demand)
        loaded = self._load(e, demand)
        if not loaded or e.dead:  # gone, or dead: mapped without a copy, nothing to time, wait for or count
            if probe:
                self.ops.destroy(before)
            return loaded
        if probe:
            after = self.ops.timer()
            self.ops.record(after, demand)
            self._probes.append((before, after, time.perf_counter(), e.size))
        if self._loading and self.yield_to_demand:
            self._demands.append(e.event)
        e.on_demand = True
        self.counts["demand_loads"] += 1
        return True

    def adopt(self, base: int, size: int, pieces: Pieces, mapped: bool = False) -> None:
        """A released record whose contents are in ``pieces`` (the suspend's staging); with
        ``mapped``, a buffer still mapped whose contents are to be written back from ``pieces``
        (a lazy rollback's staging)."""
        with self.lock:
            self.clean.discard(base)
            self._put(Entry(base, size, RELEASED, list(pieces), mapped=mapped))

    def order(self) -> list[int]:
        """Pending released records in predicted access order: the most recently touched
        first (``recent``, newest first: what a loop touches every step, before what was last
        touched long ago), then in first-touch order, then by address."""
        return self._order()[0]

    def _order(self) -> tuple[list[int], int]:
        with self.lock:
            return self._order_locked()

    def _order_locked(self) -> tuple[list[int], int]:
        by_id = getattr(self.agent, "by_id", {})
        seen: dict[int, None] = {}
        touches = getattr(self.agent, "native_touches", None)
        if touches is not None:  # the native core saw every operation's touches: newest first
            ids = [i for i, _, _ in sorted(touches(), key=lambda t: -t[2])]
        else:
            ids = [*reversed(list(self.recent)), *list(self.first_touch)]
        for i in ids:
            a = by_id.get(i)
            if a is not None:
                e = self._find(a.addr)
                if e is not None:
                    seen.setdefault(e.base, None)
        rest = [b for b in self._bases if b not in seen]
        return list(seen) + rest, len(seen)

    def load_rest(self, kind: str = "resume") -> threading.Thread:
        """Load every released record in the background, in ``order()``; the thread. ``kind``
        (resume, rollback) goes into the figures ``stats`` shows."""
        with self.lock:
            order, predicted = self._order_locked()
            self.lazy = {"kind": kind, "records": len(self.pending), "bytes": sum(e.size for e in self.pending.values()),
                         "order_predicted": predicted, "yield_to_demand": self.yield_to_demand,
                         "t_start": time.perf_counter(), "done": False}
            self._counts_at_start = dict(self.counts)
            self._demands, self._probes, self._t0 = [], [], None
            try:  # the GPU's clock for the demand loads' figures, from before the first background copy
                with self._own():
                    self.ops.enter()
                    t0 = self.ops.timer()
                    self.ops.record(t0, self._stream("background"))
                self._t0 = t0
            except Exception as exc:  # noqa: BLE001 (figures only)
                self.lazy["timing_error"] = f"{type(exc).__name__}: {exc}"
        t = threading.Thread(target=self._load_all, args=(order,), name="gpuos-engine-loader", daemon=True)
        self._loader = t
        self._loading = True
        t.start()
        return t

    def _yield_to_demand(self) -> None:
        """Wait (on the host, this thread only) for the demand loads issued since the last call.
        The background loader issues nothing more meanwhile: a copy engine does not interleave
        one stream's queued copies with another's at a fine grain, so a demand copy otherwise
        waits behind as much as the loader keeps feeding, not only behind what was queued
        when it came (BENCHMARKS.md: the whole reload)."""
        with self.lock:
            evs, self._demands = self._demands, []
        if not evs:
            return
        t = time.perf_counter()
        for ev in evs:  # retired, not destroyed, while the loader runs (``_drop``)
            self.ops.synchronize(ev)
        lazy = self.lazy
        if lazy is not None:
            lazy["yields"] = lazy.get("yields", 0) + 1
            lazy["yield_s"] = round(lazy.get("yield_s", 0.0) + time.perf_counter() - t, 6)

    def _load_all(self, order: Sequence[int]) -> None:
        relax_capture()  # the loader's calls must not break a graph the program captures meanwhile
        lazy = self.lazy
        in_flight: list[tuple[Any, int]] = []
        t_end = None
        with self._own():
            self.ops.enter()
            try:
                for base in order:
                    with self.lock:
                        e = self.pending.get(base)
                        if e is None or e.state != RELEASED:
                            continue
                        size = e.size
                    # at most ``ahead`` bytes enqueued (or one record): what a demand copy may
                    # find ahead of it
                    while in_flight and sum(n for _, n in in_flight) + size > self.ahead:
                        self.ops.synchronize(in_flight.pop(0)[0])
                    self._yield_to_demand()
                    with self.lock:
                        e = self.pending.get(base)
                        if e is None or e.state != RELEASED:  # loaded on demand meanwhile, or freed
                            continue
                        if not self._load(e, self._stream("background")) or e.dead:
                            continue  # gone, or dead: mapped, nothing in flight
                        self.counts["background_loads"] += 1
                        in_flight.append((e.event, e.size))
                if self._t0 is not None:  # after the last background copy
                    try:
                        t_end = self.ops.timer()
                        self.ops.record(t_end, self._stream("background"))
                    except Exception:  # noqa: BLE001 (figures only)
                        t_end = None
                # what is left: loads (background or on demand) still in flight
                while True:
                    with self.lock:
                        loading = [e for e in self.pending.values() if e.state == LOADING]
                        released = [e for e in self.pending.values() if e.state == RELEASED and e.pieces]
                    if released:  # adopted meanwhile (a second lazy resume cannot, but be safe)
                        for e in released:
                            with self.lock:
                                if e.state == RELEASED and self._load(e, self._stream("background")):
                                    self.counts["background_loads"] += 1
                        continue
                    if not loading:
                        break
                    for e in loading:
                        self.ops.synchronize(e.event)
                    with self.lock:
                        for e in loading:
                            if self.pending.get(e.base) is e and e.state == LOADING:
                                self._drop(e.base)
                lazy["t_done"] = time.perf_counter()
                lazy["load_s"] = round(lazy["t_done"] - lazy["t_start"], 6)
                lazy["load_gbps"] = round(lazy["bytes"] / lazy["load_s"] / 1e9, 3) if lazy["load_s"] > 0 else None
                for k in ("demand_loads", "background_loads", "stream_waits", "unknown_requires"):  # this resume's
                    lazy[k] = self.counts[k] - self._counts_at_start[k]
                lazy["done"] = True
            except Exception as exc:  # noqa: BLE001 (the program goes on; records left pending are loaded on demand)
                lazy["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                with self.lock:
                    self._loading = False
                    for ev in self._retired:
                        self.ops.destroy(ev)
                    self._retired.clear()
                    self._demands = []
                    probes, self._probes = self._probes, []
                    t0, self._t0 = self._t0, None
                self._timings(lazy, t0, t_end, probes)

    def _timings(self, lazy: dict[str, Any], t0: Any, t_end: Any, probes: list[tuple[Any, Any, float, int]]) -> None:
        """The lazy load's GPU figures (ms from the timer recorded on the background stream at
        its start): ``background_gpu_ms``, when its last copy ended; ``demand``, per timed demand
        load, when it was issued (host, from ``load_rest``) and when its copy started and ended
        on the GPU. Destroys the timers."""
        ops = self.ops
        try:
            if t0 is None:
                return
            if t_end is not None:
                ops.synchronize(t_end)
                lazy["background_gpu_ms"] = round(ops.elapsed_ms(t0, t_end), 3)
            out = []
            for before, after, t_host, n in probes:
                ops.synchronize(after)
                out.append({"bytes": n, "issued_ms": round((t_host - lazy["t_start"]) * 1000, 3),
                            "gpu_start_ms": round(ops.elapsed_ms(t0, before), 3),
                            "gpu_end_ms": round(ops.elapsed_ms(t0, after), 3)})
            lazy["demand"] = out
        except Exception as exc:  # noqa: BLE001 (figures only)
            lazy["timing_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for ev in [t0, t_end] + [x for p in probes for x in p[:2]]:
                if ev is not None:
                    ops.destroy(ev)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Wait for the background loader (True: nothing pending any more)."""
        if self._loader is not None:
            self._loader.join(timeout)
        return self.settled
