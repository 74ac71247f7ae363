"""The residency engine's evictions: a record is saved to the engine's own pinned host copy
after the program's last use of it (unless the host copy is known current) and released once
the save has completed, on a thread of the engine's; an operation that touches it meanwhile
cancels the eviction (docs/residency-engine.md, "Evictions"). A part of ``ResidencyEngine``
(engine.py): its methods use the engine's lock, ``pending``, ``ops`` and the digests."""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext
from typing import Any

from gpuos_tools.cuda.driver import relax_capture
from gpuos_tools.memory.states import EVICTING, LOADING, RELEASED, Entry

#: how long an eviction from inside an operation waits for other threads' operations to reach the driver
OTHERS_SETTLE_S = 0.05
PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD: from another thread, the legacy stream orders after it


class Eviction:
    """The evict thread and its queue, and what an eviction enqueues (mixed into
    ``ResidencyEngine``)."""

    def _start_eviction(self) -> None:
        """The evict thread's state (from the engine's ``__init__``); the thread starts at the
        first eviction."""
        #: record bases (``evict``) or started evictions (``evict_from_operation``); None ends it
        self._evictq: queue.Queue[Any] = queue.Queue()
        self._evictor: threading.Thread | None = None

    def _to_evictor(self, item: Any) -> None:
        """Hand ``item`` to the evict thread (started if it is not running)."""
        if self._evictor is None or not self._evictor.is_alive():
            self._evictor = threading.Thread(target=self._evict_loop, name="gpuos-engine-evict", daemon=True)
            self._evictor.start()
        self._evictq.put(item)

    def evict(self, base: int) -> bool:
        """Save (if needed) and release the record at ``base`` after its last use, from the
        engine's evict thread; False when it is not a resident owned record."""
        r = self.ops.lookup(base)
        if r is None or r.base != base or not r.resident or getattr(self.agent, "snap", None) is not None:
            return False  # a snapshot in progress copies every buffer: none may go meanwhile
        with self.lock:
            if base in self.pending:
                return False
        self._to_evictor(base)
        return True

    def evict_from_operation(self, base: int, own: int = 1, after: Any = None) -> bool:
        """``evict`` for a caller inside one of the program's operation callbacks (the agent's
        lock held, that operation not issued yet: gpu-prefetch-sched's executor). The record's
        last use is what the program has enqueued so far, so the save is ordered here, on the
        caller's thread, after an event on each stream the program has used, once the
        operations other threads of the program are issuing have reached the driver (``settle``
        less the caller's own operation; they may touch the record, and a launch enqueued after
        the events would find it released) -- and only the wait for the save and the release
        go to the evict thread, which then needs the engine's lock alone: the caller may wait
        for the release without holding it up. A record still loading is saved after its load.
        False when it is not a resident owned record, it is released or being evicted already,
        or another thread's operation did not reach the driver within ``OTHERS_SETTLE_S`` (a
        synchronous copy, say): the record then stays resident. ``own``: the caller's operations
        counted as being issued (1 from its enter callback; 0 from before it, e.g. serve's gate).
        ``after``: an event the caller recorded on the program's only stream after the record's
        last use: the save waits for it alone, not for everything enqueued since."""
        ops = self.ops
        r = ops.lookup(base)
        if r is None or r.base != base or not r.resident or getattr(self.agent, "snap", None) is not None:
            return False  # a snapshot in progress copies every buffer: none may go meanwhile
        settle = getattr(self.agent, "settle", None)
        if settle is not None and settle(OTHERS_SETTLE_S, own=own):
            self.counts["evict_unsettled"] += 1
            return False
        if self._capturing():
            return False
        with self.lock, self._own():
            if self.digest_mode is None:
                self._digest_ready()
            side = self._stream("evict")
            e = self.pending.get(base)
            if e is not None:
                if e.state != LOADING:
                    return False
                ops.wait(side, e.event)  # the save comes after the load
                self._drop(base)
            pieces = ops.host(base, r.size)
            if after is not None:
                ops.wait(side, after)
            else:
                self._after_program(side)
            e, ev, how = self._start_save(base, r.size, pieces, side)
        self._to_evictor((base, e, ev, how))
        return True

    def _evict_loop(self) -> None:
        relax_capture()  # its event waits must not break a graph the program captures meanwhile
        with self._own():
            self.ops.enter()
            entered = getattr(self.agent, "ctx", None) is not None
            while True:
                item = self._evictq.get()
                if item is None:
                    return
                if not entered and getattr(self.agent, "ctx", None) is not None:
                    # started before the program's context was known (an eviction at serve's
                    # gate, before any operation's callback): current from now on, else every
                    # driver call of this thread fails (a suspect for evict errors seen on an H200)
                    self.ops.enter()
                    entered = True
                base = item if isinstance(item, int) else item[0]
                try:
                    if isinstance(item, int):
                        self._evict_one(base)
                    else:
                        self._evict_finish(*item)
                except Exception as exc:  # noqa: BLE001 (it stays resident; say so in stats)
                    with self.lock:
                        e = self.pending.get(base)
                        if e is not None and e.state == EVICTING:
                            self._drop(base)
                    self.counts["evict_errors"] = self.counts.get("evict_errors", 0) + 1
                    self.counts["evict_error"] = f"{base:#x}: {type(exc).__name__}: {exc}"

    def _last_use(self, stream: Any) -> None:
        """``stream`` (the evict stream) waits for everything the program has enqueued."""
        agent = self.agent
        lock = getattr(agent, "lock", None)
        with lock if lock is not None else nullcontext():
            if hasattr(agent, "settle"):
                agent.settle()
            self._after_program(stream)

    def _program_streams(self) -> set[Any]:
        """Every stream an operation of the program has used (the per-thread stream as the
        legacy one, which orders after it from another thread): a stream it only created holds
        none of its work, and recording and querying each stream at every eviction cost more than
        the eviction where libraries had made many."""
        agent = self.agent
        streams = getattr(agent, "used_streams", None)
        if streams is None:
            streams = getattr(agent, "streams", {0})
        return {0 if s == PER_THREAD_STREAM else s for s in streams}

    def _capturing(self) -> bool:
        """Whether a stream the program has used is capturing a CUDA graph: an eviction cannot be
        ordered after its work then (an event recorded there would be a node of the graph, and
        waiting on it from the evict stream invalidates the capture), so none starts; counted."""
        query = getattr(self.ops, "capturing", None)
        if query is None:
            return False
        if any(query(s) for s in self._program_streams()):
            self.counts["evict_capturing"] = self.counts.get("evict_capturing", 0) + 1
            return True
        return False

    def _after_program(self, stream: Any) -> None:
        """``stream`` waits on the GPU for what the program has enqueued so far, on every stream
        it has used (the device, when one of them is gone without our seeing it)."""
        ops = self.ops
        for s in sorted(self._program_streams()):
            ev = ops.event()
            try:
                ops.record(ev, s)
            except RuntimeError:  # a stream gone without our seeing it: wait for everything
                ops.destroy(ev)
                ops.sync_all()
                return
            ops.wait(stream, ev)
            ops.destroy(ev)  # released by the driver once recorded work completes

    def _evict_one(self, base: int) -> None:
        ops = self.ops
        r = ops.lookup(base)
        if r is None or r.base != base or not r.resident:
            return
        if self.digest_mode is None:
            self._digest_ready()
        side = self._stream("evict")
        pieces = ops.host(base, r.size)  # pinning is slow: before the program is held
        lock = getattr(self.agent, "lock", None)
        with lock if lock is not None else nullcontext():  # no operation starts until it is EVICTING
            if getattr(self.agent, "snap", None) is not None:  # a snapshot began since evict() was asked
                self.counts["evictions_refused"] = self.counts.get("evictions_refused", 0) + 1
                return
            if self._capturing():
                return
            self._last_use(side)
            with self.lock:
                if base in self.pending:
                    return
                e, ev, how = self._start_save(base, r.size, pieces, side)
        self._evict_finish(base, e, ev, how)

    def _start_save(self, base: int, size: int, pieces: Any, side: Any) -> tuple[Entry, Any, str]:
        """Mark the record EVICTING and enqueue on ``side`` what the eviction needs (engine lock
        held): nothing when its contents are dead (``how`` "dead": every torch block of it is
        freed), the digest to compare with the host copy's ("digest"), nothing when the host
        copy is known current without one ("clean"), else the save ("save"). Returns the entry,
        the event after it (the release waits for it: the program's last use), and ``how``."""
        e = Entry(base, size, EVICTING, pieces, own_copy=True)
        self._put(e)
        clean = base in self.clean
        if self._is_dead(base):  # nothing in it a tensor will read: no save, no copy back
            how = "dead"
            e.dead = True
            self.digests.pop(base, None)  # its device bytes will differ from the host copy
        elif self._backing_off(base):  # changed at its last check: save
            how = "save"
            self.digests.pop(base, None)
            self.ops.copy_out(base, pieces, side)
        elif self._digest_at_eviction(base, size, side):
            how = "digest"
            if clean:  # a change now is a write no prediction showed: who may have done it
                e.suspects = self._suspects(base)
        elif clean:
            how = "clean"
        else:
            how = "save"
            self.digests.pop(base, None)  # the host copy changes
            self.ops.copy_out(base, pieces, side)
        ev = self.ops.event()
        self.ops.record(ev, side)
        e.event = ev
        return e, ev, how

    def _evict_finish(self, base: int, e: Entry, ev: Any, how: str) -> None:
        """Once what ``_start_save`` enqueued has completed: with a digest, equal -> release,
        different -> save first; then release, unless an operation touched it meanwhile."""
        ops = self.ops
        ops.synchronize(ev)
        save = how == "save"
        if how == "digest":
            same = self._digests_equal(base, e.size)
            if not same:
                with self.lock:
                    if e.suspects is not None:  # evidence even if an operation cancels the eviction
                        self._mismatch(e)
                    if e.cancelled or self.pending.get(base) is not e:
                        ops.destroy(ev)
                        return
                    # an operation that touches it from here on cancels the eviction, as during a save
                    self._found_changed(base)
                    side = self._stream("evict")
                    ops.copy_out(base, e.pieces, side)
                    saved = ops.event()
                    ops.record(saved, side)
                    e.event = saved
                ops.destroy(ev)
                ev = saved
                ops.synchronize(ev)
                save = True
        with self.lock:
            if e.cancelled or self.pending.get(base) is not e:
                ops.destroy(ev)
                return
            t = time.perf_counter()
            ops.release(base)
            self.counts["release_s"] += time.perf_counter() - t
            self.clean.discard(base)
            # counted before the state says RELEASED, nothing between: a reader of ``counts``
            # without the lock (``state`` takes none) never sees a released record uncounted
            c = self.counts
            c["evictions"] += 1
            c["evict_saves"] += int(save)
            c["saved_bytes"] += e.size if save else 0
            if how == "dead":
                c["dead_evictions"] += 1
                c["dead_bytes"] += e.size
            else:
                c["unsaved_bytes"] += 0 if save else e.size
            if how == "digest" and not save:
                c["digest_skips"] += 1
                c["digest_skipped_bytes"] += e.size
                self._backoff.pop(base, None)
            self._restate(e, RELEASED)
            e.event = None
            ops.destroy(ev)
