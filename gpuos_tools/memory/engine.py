"""The residency engine: which owned records are on the GPU, and making the program's operations
wait on the GPU -- never on the host -- for the records they touch. The agent consults it before
each launch, copy, memset, graph launch and free of the program, with the agent's lock held.

This module holds the engine itself: its state, what an operation touches, the agent's hooks,
``require`` and the loads. Its other parts are mixed in from their own modules: lazy loads
(lazy.py), evictions and the evict thread (eviction.py), digests of host copies (digests.py),
the conservative rule after a mismatch (conservative.py); the driver side is driver_ops.py.
The design, the rules and the switches (settings.py): docs/residency-engine.md.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

from gpuos_tools.memory.conservative import Mismatches
from gpuos_tools.memory.digests import Digests
from gpuos_tools.memory.driver_ops import DriverOps, Ops
from gpuos_tools.memory.eviction import Eviction
from gpuos_tools.memory.lazy import AHEAD, LazyLoader
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.states import EVICTING, LOADING, RELEASED, RESIDENT, Entry
from gpuos_tools.memory.threads import WaitCountingLock, agents_thread

SAMPLE = 16  #: once everything is learnt, one operation of the program in SAMPLE is looked at for recency
RECENT_MAX = 4096  #: allocation ids kept in ``recent`` (the least recent dropped beyond it)


class ResidencyEngine(LazyLoader, Eviction, Digests, Mismatches):
    """Residency of the owned records (docs/residency-engine.md). ``agent``: the Agent (its
    lock, streams, predictor, ``own`` thread set); ``ops``: the driver side; ``settings``: its
    switches (default: the agent's ``engine_settings``, else the defaults)."""

    def __init__(self, agent: Any = None, ops: Ops | None = None, ahead: int = AHEAD, owned: bool = True,
                 settings: EngineSettings | None = None) -> None:
        self.agent = agent
        self.settings = settings or getattr(agent, "engine_settings", None) or EngineSettings()
        #: whether the program's memory is owned (records can be released); False: an engine made
        #: for a lazy rollback of plain allocations, which only loads into mapped memory
        self.owned = owned
        self.ops = ops if ops is not None else DriverOps(agent, owned=owned)
        self.ahead = ahead
        self.lock = WaitCountingLock()  #: re-entrant; counts who waited for it (``stats``)
        self.pending: dict[int, Entry] = {}  #: base -> entry, records not simply resident
        self._bases: list[int] = []  #: sorted keys of pending
        #: bytes of the pending records RELEASED, kept at every change of ``pending`` or of an
        #: entry's state (``_put``, ``_drop``, ``_restate``): the executor's room checks read it
        #: after every decision, and summing ``pending`` there cost more than the decision
        self.released_bytes = 0
        self.clean: set[int] = set()  #: resident records whose own host copy equals the device's
        self.first_touch: dict[int, None] = {}  #: allocation ids in the order first touched
        #: allocation ids, least recently touched first (every operation while the engine is
        #: consulted anyway, else one in SAMPLE): a loop's working set is at the end
        self.recent: dict[int, None] = {}
        self._unwatched = 0  #: operations not looked at since the last sample
        self._streams: dict[str, Any] = {}
        self._base_of_id: dict[int, int] = {}  #: allocation id -> its record's base (cache)
        self.counts = {"demand_loads": 0, "background_loads": 0, "prefetches": 0, "stream_waits": 0,
                       "unknown_requires": 0, "evictions": 0, "evict_saves": 0, "saved_bytes": 0, "evictions_cancelled": 0,
                       "loaded_bytes": 0, "freed_while_pending": 0, "evict_unsettled": 0, "unsaved_bytes": 0, "digests": 0,
                       "digest_skips": 0, "digest_skipped_bytes": 0, "digest_changed": 0, "digest_backoff_saves": 0,
                       "mismatches": 0, "conservative_launches": 0, "dead_evictions": 0, "dead_bytes": 0,
                       "dead_loads": 0,
                       # seconds in the driver's unmaps (evict thread) and maps (loads), engine lock held
                       "release_s": 0.0, "map_s": 0.0}
        self._start_lazy()
        self._start_eviction()
        self._start_mismatches()
        self._start_digests(owned)

    # -- state --------------------------------------------------------------------------------

    def state(self, base: int) -> str:
        e = self.pending.get(base)
        return RESIDENT if e is None else e.state

    @property
    def settled(self) -> bool:
        """Every record resident, nothing loading or evicting."""
        return not self.pending

    def _find(self, addr: int) -> Entry | None:
        i = bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        e = self.pending[self._bases[i]]
        return e if addr < e.base + e.size else None

    def _busy(self) -> None:
        """The engine has work on the program's operations (a record pending or clean): the
        native core, when the agent runs on one, calls the agent's hooks from now on."""
        busy = getattr(self.agent, "engine_busy", None)
        if busy is not None:
            busy()

    @property
    def needs_operations(self) -> bool:
        """Whether the agent's hooks must see the program's operations: records pending or clean,
        or digests that a conservative kernel's launch must drop."""
        return bool(self.pending or self.clean or (self.conservative and self.digests))

    def _put(self, e: Entry) -> None:
        self._busy()
        # the native core's fast path lets no operation on it go by without the hooks from now on
        # (before the eviction's save or the load is enqueued: the caller holds the agent's lock)
        unready = getattr(self.agent, "fast_unready", None)
        if unready is not None:
            unready(e.base, e.size)
        old = self.pending.get(e.base)
        if old is None:
            self._bases.insert(bisect_right(self._bases, e.base), e.base)
        elif old.state == RELEASED:
            self.released_bytes -= old.size
        if e.state == RELEASED:
            self.released_bytes += e.size
        self.pending[e.base] = e

    def _restate(self, e: Entry, state: str) -> None:
        """Set a pending entry's state (lock held), keeping ``released_bytes``."""
        if self.pending.get(e.base) is e:
            self.released_bytes += e.size * ((state == RELEASED) - (e.state == RELEASED))
        e.state = state

    def _drop(self, base: int, destroy: bool = True) -> None:
        """Forget a pending record (lock held). Its event is destroyed, unless a thread of the
        engine may still wait on it: the evictor's own (``destroy`` False), or any load event
        while the background loader runs (it is destroyed when the loader ends)."""
        e = self.pending.pop(base, None)
        if e is not None:
            if e.state == RELEASED:
                self.released_bytes -= e.size
            del self._bases[bisect_right(self._bases, base) - 1]
            if e.event is not None and destroy:
                if self._loading:
                    self._retired.append(e.event)
                else:
                    self.ops.destroy(e.event)

    def _stream(self, name: str) -> Any:
        s = self._streams.get(name)
        if s is None:
            s = self._streams[name] = self.ops.stream()
        return s

    def make_streams(self, *names: str) -> None:
        """Make the named streams ("demand", "prefetch", "background", "evict") now, not in the
        program's first callback that needs one."""
        for name in names:
            self._stream(name)

    def pin_host(self, base: int, size: int) -> None:
        """Make the host copy of record ``base`` (``size`` bytes) now, on the caller's thread
        (pinning holds the driver's lock: the executor's mover does it ahead of evictions)."""
        with self.lock, self._own():
            self.ops.enter()
            self.ops.host(base, size)

    def _own(self) -> AbstractContextManager[None]:
        """This thread's driver calls are the agent's while inside."""
        return agents_thread(getattr(self.agent, "own", None))

    # -- what an operation touches -----------------------------------------------------------

    def bases_of_addrs(self, addrs: Iterable[int]) -> set[int]:
        """The pending records holding any of ``addrs`` (addresses elsewhere need nothing)."""
        out = set()
        with self.lock:  # the loader drops entries as their loads complete
            for a in addrs:
                if a:
                    e = self._find(a)
                    if e is not None:
                        out.add(e.base)
        return out

    def bases_of_launch(self, kernel: str, sizes: Any, args: Any) -> set[int] | None:
        """The pending records a launch reads or writes, by the agent's predictor; None when
        the prediction is unknown (then every record counts)."""
        unknown, touched, _ = self.agent.launch_touches(kernel, sizes, args)
        if unknown:
            return None
        by_id = self.agent.by_id
        return self.bases_of_addrs(by_id[i].addr for i in touched if i in by_id)

    # -- the agent's hooks (program thread, agent's lock held) --------------------------------

    @property
    def watching(self) -> bool:
        """Whether this operation needs a prediction: records pending or clean, first touches
        still to record, or (one operation in SAMPLE) recency to sample. Asked once per
        operation of the program."""
        a = self.agent
        if self.pending or self.clean or len(self.first_touch) < len(a.by_id) or (self.conservative and self.digests):
            return True
        self._unwatched += 1
        if self._unwatched < SAMPLE:
            return False
        self._unwatched = 0
        return True

    def _touched(self, i: int) -> None:
        """Allocation ``i`` is touched now (program thread, agent's lock held)."""
        if i not in self.first_touch:
            self.first_touch[i] = None
        recent = self.recent
        recent.pop(i, None)
        recent[i] = None
        if len(recent) > RECENT_MAX:
            for j in list(recent)[: RECENT_MAX // 2]:
                del recent[j]

    def launch(self, stream: int, kernel: str, sizes: Any, args: Any) -> None:
        """Before a launch on ``stream``."""
        unknown, touched, writes = self.agent.launch_touches(kernel, sizes, args)
        suspect = bool(self.conservative) and kernel in self.conservative
        if suspect:  # a mismatch named it: unknown, and it writes everything resident
            unknown = True
            self.counts["conservative_launches"] += 1
        self._launched(kernel)  # before the require: a record it loads counts this launch as after its load
        for i in touched:
            self._touched(i)
        if self.pending:
            if unknown:
                self.require(None, stream)
            else:
                by_id = self.agent.by_id
                bases = self.bases_of_addrs(by_id[i].addr for i in touched if i in by_id)
                if bases:
                    self.require(bases, stream)
        if suspect:
            with self.lock:  # the evict thread reads them under it
                self.digests.clear()
        if self.clean:  # after the require: a record it loads from the engine's copy is clean until this write
            if unknown:
                self.clean.clear()
            else:
                self.written(ids=writes)
                for i in touched:  # the predicted readers of clean records (a mismatch's suspects)
                    if i in writes:
                        continue
                    b = self._id_base(i)
                    if b in self.clean:
                        self._read_while_clean(b, kernel)
        if not suspect and self.conservative and kernel in self.conservative:
            # a mismatch named it while this launch was being decided: what its require loaded
            # came after the detection's own pass over the clean records
            with self.lock:
                self.digests.clear()
            self.clean.clear()

    def written(self, ids: Iterable[int] = (), addrs: Iterable[int] = ()) -> None:
        """Allocations ``ids`` and the records holding ``addrs`` were written (by an operation
        at hand, or by ones the native core let go by): their host copies are stale, none of
        them is clean any more (program thread, agent's lock held)."""
        clean = self.clean
        for i in ids:
            clean.discard(self._id_base(i))
        for a in addrs:
            clean.discard(self._record_base(a))

    def _id_base(self, i: int) -> int | None:
        """The record base of allocation ``i`` (its address when not owned; None: not known)."""
        b = self._base_of_id.get(i)
        if b is None:
            a = self.agent.by_id.get(i)
            if a is None:
                return None
            r = self.ops.lookup(a.addr)
            if r is None:  # not owned (or not yet in the table): not cached
                return a.addr
            b = r.base
            if len(self._base_of_id) >= 65536:
                self._base_of_id.clear()
            self._base_of_id[i] = b
        return b

    def access(self, api: str, stream: int, dst: int, src: int = 0) -> None:
        """Before a copy or memset (``api``) on ``stream`` into ``dst`` (from ``src``, 0: none),
        or a free or unmap of ``dst``."""
        if api.startswith(("cuMemFree", "cuMemUnmap")):
            if self.pending or self.clean:
                self.freeing(dst)
            return
        allocs = getattr(getattr(self.agent, "pred", None), "allocs", None)
        if allocs is not None:
            for addr in (dst, src):
                a = allocs.find(addr) if addr else None
                if a is not None:
                    self._touched(a.id)
        if opaque_copy(api):  # 3D copies and copies through arrays: addresses not read here
            if self.pending:
                self.require(None, stream)
            self.clean.clear()
            return
        if self.pending:
            bases = self.bases_of_addrs((dst, src))
            if bases:
                self.require(bases, stream)
        if self.clean and dst:  # after the require, as in ``launch``
            self.written(addrs=(dst,))

    def graph(self, stream: int) -> None:
        """Before a graph launch: what its kernels touch is not predicted here (and one of
        them may be conservative: then it writes everything resident)."""
        self.clean.clear()
        if self.conservative and self.digests:
            with self.lock:
                self.digests.clear()
        if self.pending:
            self.require(None, stream)

    def freeing(self, addr: int) -> None:
        """The program frees (or the library unmaps) the record holding ``addr``: a load into
        it must complete first (an unmap is not ordered on any stream); then it is forgotten."""
        with self.lock:
            e = self._find(addr)
            if e is None:
                return
            if e.state == LOADING or (e.state == EVICTING and e.event is not None):
                with self._own():
                    self.ops.synchronize(e.event)
            evicting = e.state == EVICTING
            e.cancelled = True
            self._drop(e.base, destroy=not evicting)
            self.counts["freed_while_pending"] += 1
        self.clean.discard(addr)

    def _record_base(self, addr: int) -> int:
        r = self.ops.lookup(addr)
        return r.base if r is not None else addr

    # -- require ------------------------------------------------------------------------------

    def require(self, bases: Iterable[int] | None, stream: Any) -> int:
        """Make ``stream``'s next operation come after every record in ``bases`` (None: all) is
        resident and loaded; enqueues only, never waits on the host. Returns the stream waits
        added."""
        waits = 0
        with self.lock, self._own():
            if bases is None:
                self.counts["unknown_requires"] += 1
                targets = list(self.pending.values())
            else:
                targets = [self.pending[b] for b in bases if b in self.pending]
            for e in targets:
                if e.state == EVICTING:
                    e.cancelled = True  # it stays resident; the evictor sees it under the lock
                    self._drop(e.base, destroy=False)
                    self.counts["evictions_cancelled"] += 1
                    continue
                if e.state == RELEASED and not self._load_on_demand(e):
                    continue
                if e.state == LOADING:
                    if self.ops.done(e.event):
                        self._drop(e.base)
                        continue
                    if stream not in e.ordered:
                        self.ops.wait(stream, e.event)
                        e.ordered.add(stream)
                        waits += 1
        self.counts["stream_waits"] += waits
        return waits

    def _load(self, e: Entry, stream: Any) -> bool:
        """make_resident + copy_in on ``stream`` (engine's lock held); False when the record is
        gone (freed meanwhile: forgotten). A ``mapped`` entry (a lazy rollback's) only loads:
        its memory stayed mapped, and a free of it comes through ``freeing``."""
        if e.mapped:
            return self._copy(e, stream)
        r = self.ops.lookup(e.base)
        if r is None or r.base != e.base or r.size != e.size or r.resident:
            # freed meanwhile (the library frees a released record without a driver call the
            # tracer sees), or its addresses already serve a new allocation: nothing to load
            self._drop(e.base)
            self.counts["freed_while_pending"] += 1
            return False
        t = time.perf_counter()
        self.ops.make_resident(e.base)
        self.counts["map_s"] += time.perf_counter() - t
        r = self.ops.lookup(e.base)
        if r is None or r.base != e.base:  # a free came during make_resident and was carried out
            self._drop(e.base)
            self.counts["freed_while_pending"] += 1
            return False
        if e.dead or self._is_dead(e.base):  # dead at its eviction or since: mapped, nothing to copy or wait for
            e.dead = True
            self._drop(e.base)
            self.counts["dead_loads"] += 1
            return True
        return self._copy(e, stream)

    def _is_dead(self, base: int) -> bool:
        """Whether the record's contents are dead now (the ops' ``dead``, where they have it and
        the switch is on: evictions and loads ask); an error of the question counts as live (it
        is saved and copied back)."""
        dead = getattr(self.ops, "dead", None)
        if dead is None or not self.settings.drop_dead:
            return False
        try:
            return bool(dead(base))
        except Exception:  # noqa: BLE001
            return False

    def _copy(self, e: Entry, stream: Any) -> bool:
        self.ops.copy_in(e.base, e.pieces, stream)
        if e.own_copy:  # before the load's event: no operation of the program runs before the digest
            self._digest_host_copy(e.base, e.size, stream)
        ev = self.ops.event()
        self.ops.record(ev, stream)
        self._restate(e, LOADING)
        e.event, e.ordered = ev, set()
        self.counts["loaded_bytes"] += e.size
        if e.own_copy:  # later writes are ordered after the load and discard it from clean
            self._busy()
            self.clean.add(e.base)
            self._since[e.base] = self._seq
            self._readers.pop(e.base, None)
        return True

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, base: int) -> Any:
        """Start loading the record at ``base`` if released (on the prefetch stream); the event
        a caller may wait on, None when it is resident (an eviction in progress is cancelled)."""
        with self.lock, self._own():
            self.ops.enter()
            e = self.pending.get(base)
            if e is None:
                return None
            if e.state == EVICTING:
                e.cancelled = True
                self._drop(base, destroy=False)
                self.counts["evictions_cancelled"] += 1
                return None
            if e.state == RELEASED:
                if not self._load(e, self._stream("prefetch")) or e.dead:
                    return None  # gone, or dead: mapped at once, nothing loading
                self.counts["prefetches"] += 1
            return e.event

    # -- report -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.lock:
            by_state: dict[str, list[int]] = {}
            for e in self.pending.values():
                by_state.setdefault(e.state, []).append(e.size)
            out: dict[str, Any] = {
                "pending": {s: {"records": len(v), "bytes": sum(v)} for s, v in by_state.items()},
                "clean": len(self.clean), "first_touched": len(self.first_touch), **self.counts,
                "digest": self.digest_mode, "digested": len(self.digests),
                "digest_checks": [{"size": n, "unchanged": t[0], "changed": t[1]}
                                  for n, t in sorted(self.checked_sizes.items())],
                "conservative": sorted(k[:160] for k in self.conservative), "mismatch": list(self.mismatch_log),
                "lock_waits": self.lock.waits(),
            }
        if self.lazy is not None:
            out["lazy"] = {k: v for k, v in self.lazy.items() if not k.startswith("t_")}
        return out

    def close(self) -> None:
        if self._evictor is not None and self._evictor.is_alive():
            self._evictq.put(None)
            self._evictor.join(30)
        if self._loader is not None:
            self._loader.join(60)


def opaque_copy(api: str) -> bool:
    """A copy whose device addresses the tracer's hook does not give (cuMemcpy3D*, and copies to
    or from CUDA arrays: cuMemcpyDtoA, AtoD, AtoH, HtoA, AtoA): it counts as touching every record."""
    return api.startswith("cuMemcpy") and ("3D" in api or "toA" in api or "Ato" in api)

