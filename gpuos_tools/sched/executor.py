"""Online execution inside the program (`gpu-prefetch-sched run`): the agent's launch path asks
the online policy (gpuos_tools/sched/online.py) what to do and carries it out through the
residency engine (gpuos_tools/agent/engine.py) -- the engine of issue 7, not a second one.

`OnlineAgent` is the agent with this added; gpuos_tools/agent/tracer.py makes one instead of a
plain Agent when GPUOS_SCHED_ONLINE is set (JSON: budget or fraction, policy, lookahead, the
summary file's path), which `gpu-prefetch-sched run` does along with GPUOS_AGENT_OWN=1.

Before each launch, copy and memset of the program (its thread, the agent's lock held):

1. the records the operation touches: the engine's predictor's allocation ids mapped to owned
   records (None when the prediction is unknown; a graph launch is always unknown);
2. the policy's actions, in order: ``evict`` -> `ResidencyEngine.evict_from_operation` (the
   save is ordered here after everything the program has enqueued, on the engine's evict
   stream; the release follows on the engine's evict thread once the save is done);
   ``require`` -> room is waited for first (see below), then `ResidencyEngine.require` loads
   what is released on the engine's demand stream and makes the operation's stream wait on
   the GPU for every load of its records; ``prefetch`` -> queued to the mover thread;
3. the agent's own hooks run after (snapshots, the engine's first-touch bookkeeping).

The mover thread issues the queued prefetches in order, each once there is room for it under
the budget (the records evicted for it have been released), through
`ResidencyEngine.prefetch` (make resident + load on the engine's prefetch stream). So loads,
evictions and the program's kernels run on three streams at once, and the program's thread
never waits for a prefetch.

Room. The budget holds physical memory: a record counts from the moment it is mapped until its
release, so an eviction frees room only when its save has completed. A demand load (the
policy's require of a record that is not resident: before a period is known, or when a
prediction failed) waits on the host until evictions in flight free the room; that wait is a
stall, counted (`room_waits`, `room_wait_s`). Allocations are the program's: a new record is
mapped at once, so the memory can rise above the budget between an allocation and the next
launch, which then evicts (`over_physical` counts decisions that found it so afterwards).

Timeline. With the config's ``timeline`` (a path), the executor also keeps a bounded log of
events ``[t_s, kind, value]`` (seconds from its start) and writes it there at the end (JSON:
`sched_timeline`, read by gpuos_tools/sched/plot.py): ``mapped`` (owned bytes mapped, measured
after each decision and each prefetch), ``budget`` (when the budget a decision uses changes),
``evict`` (a record's bytes, at the eviction's issue), ``load`` (bytes a launch's require
loads, at its issue), ``prefetch`` (a record's bytes, at the mover's issue), ``wait`` (a host
wait for room: value = seconds, t = its start). Past ``timeline_max`` events (default 200000)
the rest are counted in ``dropped``, not kept.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from bisect import bisect_right
from typing import Any

from gpuos_tools.agent.agent import Agent, _stream_of
from gpuos_tools.agent.engine import _opaque_copy
from gpuos_tools.sched.online import OnlinePolicy

ENV = "GPUOS_SCHED_ONLINE"
ROOM_TIMEOUT_S = 10.0  #: longest wait for room before a load goes ahead over the budget
POLL_S = 50e-6


def config_from_environment(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """GPUOS_SCHED_ONLINE's JSON (removed from the environment: children run plain)."""
    env = os.environ if environ is None else environ
    text = env.pop(ENV, "")
    return json.loads(text) if text else None


class Executor:
    """The policy's actions carried out through the engine (module docstring)."""

    def __init__(self, engine: Any, cfg: dict[str, Any], lib: Any = None) -> None:
        self.engine = engine
        self.lib = lib if lib is not None else engine.ops.lib
        self.cfg = cfg
        self.policy = OnlinePolicy(cfg.get("budget"), cfg.get("policy", "belady"), int(cfg.get("lookahead", 2)),
                                   fraction=cfg.get("fraction"))
        self._records: dict[int, int] = {}
        self._unpinned: list[int] = []  #: records whose host copy the mover has not pinned yet
        self._bases: list[int] = []
        self._total = 0
        self._key: tuple | None = None
        self._budget = 0
        self._moves: queue.Queue[Any] = queue.Queue()
        self._mover: threading.Thread | None = None
        self._load_lock = threading.Lock()  #: a room check and the load it allows, together
        self._demand = threading.Event()  #: the program's thread waits for room: the mover holds off
        self.counts = {"room_waits": 0, "room_wait_s": 0.0, "room_timeouts": 0, "over_physical": 0,
                       "peak_resident": 0, "peak_settled": 0, "settled": 0, "evict_refused": 0,
                       "prefetch_skipped": 0, "mover_errors": 0, "pins": 0, "pin_errors": 0}
        self._under = False
        self._settled_key: tuple | None = None
        self.error: str | None = None
        self._closing = False
        self._over_pending = False
        self.t0 = time.perf_counter()
        self._log: list[list] | None = [] if cfg.get("timeline") else None
        self._log_max = int(cfg.get("timeline_max", 200_000))
        self._log_dropped = 0
        self._log_budget = -1

    def _event(self, kind: str, value: float, t: float | None = None) -> None:
        log = self._log
        if log is None:
            return
        if len(log) >= self._log_max:
            self._log_dropped += 1
            return
        log.append([round((time.perf_counter() if t is None else t) - self.t0, 6), kind, value])

    # -- the owned records -------------------------------------------------------------------

    def records(self) -> dict[int, int]:
        """base -> bytes of every owned record (released ones included), re-read when the
        allocator's counts moved."""
        st = self.lib.stats()
        key = (st["mallocs"], st["frees"], st["reserved_bytes"])
        if key != self._key:
            old = self._records
            self._records = {r.base: r.size for r in self.lib.table()}
            if self.cfg.get("prepin", True):
                # pinning 64 MiB takes ~30 ms: on the mover, not on the program's thread at an eviction
                self._unpinned.extend(b for b in self._records if b not in old)
            self._bases = sorted(self._records)
            self._total = sum(self._records.values())
            self._key = key
        return self._records

    def bases_of(self, addrs) -> list[int]:
        """The records holding any of ``addrs`` (others: not owned, nothing to do)."""
        out = []
        for a in addrs:
            i = bisect_right(self._bases, a) - 1
            if i >= 0 and a < self._bases[i] + self._records[self._bases[i]]:
                out.append(self._bases[i])
        return out

    def physical(self) -> int:
        """Bytes of owned records mapped now: all but the released ones."""
        eng = self.engine
        with eng.lock:
            released = sum(e.size for e in eng.pending.values() if e.state == "released")
        return self._total - released

    # -- per operation (program thread, agent's lock held) ----------------------------------

    def before(self, kernel: str, addrs, stream: Any) -> None:
        """Before an operation touching the allocations at ``addrs`` (None: unknown)."""
        recs = self.records()
        if self._unpinned and getattr(self.engine.agent, "ctx", None) is not None:
            # the mover pins in the program's context, known once the program has made it current
            self._start_mover()
            for b in self._unpinned:
                if b in recs:
                    self._moves.put(("pin", b, recs[b]))
            self._unpinned.clear()
        over_before = self.policy.stats.over_budget
        bases = None if addrs is None else self.bases_of(addrs)
        with self._load_lock:  # the mover checks the policy's books and loads under it too
            actions = self.policy.before(kernel, bases, recs)
            self._budget = budget = self.policy.budget(recs)
            over = self.policy.stats.over_budget != over_before
            if over:
                self._over_pending = True  # the mover's measures meanwhile must not count it
            if self._log is not None and budget != self._log_budget:
                self._log_budget = budget
                self._event("budget", budget)
            for op, arg in actions:
                if op == "evict":
                    self._evict(arg)
        for op, arg in actions:
            if op == "require":
                self._require(arg, recs, budget, stream)
            elif op == "prefetch":
                self._start_mover()
                self._moves.put(arg)
        self._measure(budget, over)
        self._over_pending = False

    def _evict(self, base: int) -> None:
        try:
            ok = self.engine.evict_from_operation(base)
        except Exception as exc:  # noqa: BLE001 (safe: it stays resident, over the budget)
            ok = False
            self.error = f"evict {base:#x}: {type(exc).__name__}: {exc}"
        if not ok:
            self.counts["evict_refused"] += 1
        else:
            self._event("evict", self._records.get(base, 0))

    def _measure(self, budget: int, over_budget: bool) -> None:
        """Mapped bytes after a decision (or a prefetch): the peak; and, from the first time
        they were within the budget since the last allocation or over-budget launch, the peak
        and the decisions that found them above it."""
        now = self.physical()
        self._event("mapped", now)
        c = self.counts
        c["peak_resident"] = max(c["peak_resident"], now)
        if self._key != self._settled_key or over_budget or self._over_pending:
            # the program allocated (its new memory is mapped at once), or a launch needed more
            # than the budget: above it until the evictions that follow complete
            self._under = False
            self._settled_key = self._key
        if not self._under and now <= budget:
            self._under = True
            c["settled"] += 1
        if self._under:
            c["peak_settled"] = max(c["peak_settled"], now)
            if now > budget and not over_budget:
                c["over_physical"] += 1

    def _released(self, bases) -> int:
        eng = self.engine
        with eng.lock:
            return sum(eng.pending[b].size for b in bases if b in eng.pending and eng.pending[b].state == "released")

    def _require(self, bases, recs: dict[int, int], budget: int, stream: Any) -> None:
        """The engine's require of ``bases`` (None: all), once what it loads fits under the
        budget beside what is mapped: evictions in flight free the room (a host wait, a stall)."""
        ws = list(recs) if bases is None else bases
        too_big = sum(recs[b] for b in ws if b in recs) > budget  # over budget anyway: no wait
        t = time.perf_counter()
        waited = False
        self._demand.set()  # the mover holds off: the launch at hand goes first
        try:
            while True:
                with self._load_lock:
                    need = self._released(ws)
                    late = time.perf_counter() - t > ROOM_TIMEOUT_S
                    if not need or too_big or late or self.physical() + need <= budget:
                        if late:
                            self.counts["room_timeouts"] += 1
                        if need:
                            self._event("load", need)
                        self.engine.require(bases, stream)
                        break
                waited = True
                time.sleep(POLL_S)
        finally:
            self._demand.clear()
        if waited:
            self.counts["room_waits"] += 1
            self.counts["room_wait_s"] += time.perf_counter() - t
            self._event("wait", round(time.perf_counter() - t, 6), t)

    # -- the mover ----------------------------------------------------------------------------

    def _start_mover(self) -> None:
        if self._mover is None:
            self._mover = threading.Thread(target=self._move_loop, name="gpuos-sched-mover", daemon=True)
            self._mover.start()

    def _move_loop(self) -> None:
        eng = self.engine
        while True:
            base = self._moves.get()
            if base is None:
                return
            if self._closing:
                continue
            if isinstance(base, tuple):  # ("pin", base, size): the engine's host copy, made ahead
                try:
                    with eng.lock, eng._own():
                        eng.ops.enter()
                        eng.ops.host(base[1], base[2])
                    self.counts["pins"] += 1
                except Exception as exc:  # noqa: BLE001 (the eviction pins it then, on the program's thread)
                    self.counts["pin_errors"] += 1
                    self.counts["pin_error"] = f"{type(exc).__name__}: {exc}"
                continue
            try:
                t = time.perf_counter()
                while not self._closing:
                    with self._load_lock:
                        if base not in self.policy.resident:  # evicted again before its turn
                            self.counts["prefetch_skipped"] += 1
                            break
                        if not self._demand.is_set():
                            need = self._released([base])
                            late = time.perf_counter() - t > ROOM_TIMEOUT_S
                            if not need or late or self.physical() + need <= self._budget:
                                if late:
                                    self.counts["room_timeouts"] += 1
                                # a load from the engine's own host copy leaves it clean until written
                                if need:
                                    self._event("prefetch", need)
                                eng.prefetch(base)
                                break
                    time.sleep(POLL_S)
                self._measure(self._budget, False)
            except Exception as exc:  # noqa: BLE001 (the launch that needs it loads it on demand)
                self.counts["mover_errors"] += 1
                self.error = f"{type(exc).__name__}: {exc}"

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """At the program's exit: prefetches not issued yet are dropped (no launch will need
        them), the mover ends."""
        self._closing = True
        if self._mover is not None:
            self._moves.put(None)
            self._mover.join(30)

    def timeline(self) -> dict[str, Any]:
        """The event log (module docstring) with what a picture's title needs."""
        return {"type": "sched_timeline", "version": 1, "policy": self.policy.policy,
                "lookahead": self.policy.lookahead, "fraction": self.cfg.get("fraction"),
                "footprint": self._total, "events": list(self._log or []), "dropped": self._log_dropped,
                "max_events": self._log_max}

    def summary(self) -> dict[str, Any]:
        eng = self.engine.stats()
        pol = self.policy.stats.as_dict()
        out = {
            "policy": self.policy.policy, "lookahead": self.policy.lookahead,
            "budget": pol["budget_max"], "fraction": self.cfg.get("fraction"),
            "footprint": self._total, "launches": pol["launches"], "unknown": pol["unknown"],
            "bytes_in": eng.get("loaded_bytes", 0), "bytes_out": eng.get("saved_bytes", 0),
            "loads": eng.get("prefetches", 0) + eng.get("demand_loads", 0), "prefetches": eng.get("prefetches", 0),
            "demand_loads": eng.get("demand_loads", 0), "evictions": eng.get("evictions", 0),
            "evict_saves": eng.get("evict_saves", 0), "stream_waits": eng.get("stream_waits", 0),
            # evictions whose host copy was current (engine.py, "Digests"): by digest, or clean
            "digest": eng.get("digest"), "digests": eng.get("digests", 0), "digest_skips": eng.get("digest_skips", 0),
            "bytes_not_written_back": eng.get("unsaved_bytes", 0),
            "stalls": pol["stalls"], "over_budget": pol["over_budget"], "over_budget_bytes": pol["over_budget_bytes"],
            "peak_resident": self.counts["peak_resident"], "peak_settled": self.counts["peak_settled"],
            "over_physical": self.counts["over_physical"], "peak_planned": pol["peak_resident"],
            "periods": pol["periods"], "predicted": pol["predicted"],
            "wall_s": round(time.perf_counter() - self.t0, 6),
            "executor": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.counts.items()},
            "policy_stats": pol, "engine": eng,
        }
        if self.error:
            out["error"] = self.error
        return out


class OnlineAgent(Agent):
    """The agent with the online executor in front of its launch, copy and memset hooks."""

    def __init__(self, cfg: dict[str, Any], cow_budget: int | None = None) -> None:
        super().__init__(cow_budget)
        self.sched_cfg = cfg
        self.executor: Executor | None = None

    def start_engine(self) -> None:
        super().start_engine()
        self.executor = Executor(self.engine, self.sched_cfg)

    def _before_launch(self, api: str, stream: int, kernel: str, sizes, args) -> None:
        ex = self.executor
        if ex is not None:
            try:
                unknown, touched, _ = self._touches(kernel, sizes, args)
                by_id = self.by_id
                addrs = None if unknown else [by_id[i].addr for i in touched if i in by_id]
                ex.before(kernel, addrs, _stream_of(api, stream))
            finally:  # whatever happened, the engine's own hook still loads what the launch touches
                super()._before_launch(api, stream, kernel, sizes, args)
        else:
            super()._before_launch(api, stream, kernel, sizes, args)

    def before_write(self, api: str, addr: int, stream: int, src: int = 0) -> None:
        ex = self.executor
        try:
            if ex is not None and api.startswith(("cuMemcpy", "cuMemset")):
                # 3D copies and copies through CUDA arrays: the engine does not read their
                # addresses and loads everything; the policy counts them unknown the same way
                addrs = None if _opaque_copy(api) else [a for a in (addr, src) if a]
                ex.before(api, addrs, _stream_of(api, stream))
        finally:
            super().before_write(api, addr, stream, src)

    def before_graph(self, stream: int) -> None:
        ex = self.executor
        try:
            if ex is not None:
                ex.before("cuGraphLaunch", None, stream)
        finally:
            super().before_graph(stream)

    def stop_background(self) -> None:
        ex = self.executor
        if ex is not None:
            ex.close()
            tl = self.sched_cfg.get("timeline")
            if tl:
                data = ex.timeline()
                data["summary"] = {k: v for k, v in ex.summary().items() if not isinstance(v, (dict, list))}
                _write_json(tl, data, "timeline", separators=(",", ":"))
            path = self.sched_cfg.get("summary")
            if path:
                _write_json(path, ex.summary(), "summary")
        super().stop_background()


def _write_json(path: str, data: Any, what: str, **dump: Any) -> None:
    """JSON to ``path`` through a temp file and a rename; a failure is said, not raised (the
    program is ending)."""
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, **dump)
        os.rename(path + ".tmp", path)
    except OSError as exc:
        print(f"gpu-prefetch-sched: cannot write the {what}: {exc}", file=sys.stderr, flush=True)
