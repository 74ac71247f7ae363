"""The residency engine: which owned records are on the GPU, and making the program's operations
wait on the GPU -- never on the host -- for the records they touch (issue 7, items 3 and 4).

The agent consults it before each launch, copy, memset, graph launch and free of the program
(``Agent.before_launch`` / ``before_write`` / ``before_graph``, with the agent's lock held). A
record of the owned allocator (gpuos_tools/memory/owned.py: a large buffer, or a segment of small
ones) is, for the engine:

- resident: mapped, its device copy the truth. Not in ``pending``; nothing to do.
- loading: mapped, a copy from its host copy enqueued; ``event`` completes after it.
- released: no physical memory, its contents in a host copy (the suspend's staging, or the
  engine's own pinned memory after an ``evict``).
- evicting: resident, its save to the host copy enqueued or done, its release to come. An
  operation that touches it cancels the eviction (the record just stays resident).

``require(bases, stream)`` before an operation on ``stream`` that touches ``bases`` (None:
not known -- every record): each released one is made resident and its load enqueued on the
engine's demand stream, and ``stream`` is made to wait (cuStreamWaitEvent) on the load event
of each record still loading. The program's thread enqueues and returns; the GPU orders the
operation after the load. The cost of "unknown" is that the operation waits for every record
that is not yet back, i.e. for the whole of a lazy resume.

What an operation touches (``bases_of_launch``, ``bases_of_addrs``): a launch's reads and
writes as the agent's predictor gives them (gpu-predict-access at range granularity, memoised
per arguments), None when the prediction says unknown or the launch's layout is not known; a
copy's source and destination, a memset's destination (a 3D copy or one through a CUDA array:
every record). A kernel that reaches a released record
by a pointer the prediction does not see (a pointer stored in device memory the predictor did
not see written, an address computed from another buffer's) would fault: such launches must
come out unknown, which is what the predictor's rules are for (gpuos_tools/access).

Lazy resume (``adopt`` + ``load_rest``): the suspend hands over every released record with the
pieces of staging holding its contents; the program goes on at once, each operation waiting
only for what it touches, while a background thread loads the rest in predicted access order --
the records the program touched most recently first (``recent``: every operation while the
engine is consulted anyway, else one in ``SAMPLE``; newest first, so that a loop's working set
comes before what was touched once long ago), then in the order first touched since the agent's
start (``first_touch``), then by address -- on its own stream, a bounded amount ahead. While a
demand load is in flight the loader issues nothing more (``_yield_to_demand``), so that the
demand copy waits at most for what was enqueued when it came (measured on an H100: with the
loader feeding on, a demand copy on another stream ran only after the whole reload). The first
demand loads of a lazy load are timed on the GPU (``stats()['lazy']['demand']``).

``evict(base)`` (for gpu-prefetch-sched; refused while a snapshot is in progress, which copies
every buffer): on a thread of the engine's, the agent's lock is
taken briefly so that no operation of the program is between its callback and the driver, an
event is recorded on every stream the program has used (the record's last use is before it),
the record is saved on the evict stream after those events unless its host copy is current,
and released once the save has completed. It counts as resident until released.

Is the host copy current? With a GPU digest (below), the digest decides; without one, ``clean``
does (loaded from the engine's own host copy and not written since, as predicted -- which the
predictor cannot always know: CuPy's kernels are extern "C" without parameter types, so every
array argument counts as written, and a kernel that writes through a ``const`` pointer is not
seen writing at all).

Digests (``GPUOS_ENGINE_NO_DIGEST=1`` turns them off). When a record is loaded from the
engine's own host copy, a small kernel (NVRTC, compiled once per process in the background
to a CUBIN for the GPU, loaded with cuModuleLoadData at the first eviction) computes a 128-bit digest of its device
bytes on the load's stream, after the copy and before the load's event, so that no operation
of the program can write the record before it is taken: it is the digest of the host copy.
At the record's next eviction the digest is taken again on the evict stream, ordered after
the program's last use exactly as the save would be, and compared on the host by the evict
thread: equal -> the host copy is current, the record is released without a save; different
-> it is saved (and its digest dropped: the host copy changes) and released. A save or a new
host copy (another size) makes the old digest invalid; ``digests`` holds the valid ones. The
digest: two 64-bit lanes, each the sum mod 2^64 over the record's 8-byte words of a 64-bit
finaliser (splitmix64's; murmur3's fmix64) of the word mixed with its index (a reordered or
shifted record changes it), the last partial word zero-padded and the length mixed in. Not
cryptographic: a change that leaves both lanes equal would be missed and the stale host copy
kept -- for changes that are not constructed to collide, about 2^-64 per lane and eviction.
Records below ``DIGEST_MIN`` bytes are saved as before (a save costs little there).

Back-off: a changed record's save can only be enqueued once the evict thread has compared the
digests -- a host round trip after the program's last use, during which the save's link time
is lost and the release (the room a load waits for) comes later: on a transfer-bound loop
whose every eviction follows a write (BENCHMARKS.md, the stencil at 150%) checking every
eviction cost a quarter of the speed. So after a check finds a record changed, its next
BACKOFF[0] evictions save at once, without digests (none is taken at its loads either), then
it is checked again; each further change doubles the run, up to BACKOFF[1]; a check that
finds it unchanged ends the back-off. Saving is always safe; only a skipped save needs the
check. The
engine's digest launches, memsets and copies run on its own threads (``agent.own``): the
tracer does not see them as the program's. Without NVRTC (or if the kernel cannot be built)
the engine goes on without digests and says so once on stderr.

Mismatches (issue 8, item 2: a mismatch detected at run time makes the engine conservative for
that kernel). A record that is ``clean`` when its eviction's digest finds it changed was written
by a launch whose prediction did not show the write (a write through a ``const`` pointer, or by a
pointer the predictor did not see). Reads outside a prediction cannot be caught that way (on a
released record they fault), writes can. Attribution: while a record is clean (from its load
on), the names of the launches predicted to read it are kept (``_readers``, at most
READERS_MAX), and every launch's name with the sequence number of its last launch
(``_last_launch``, at most LAUNCH_NAMES_MAX names); the suspects are the readers, or when none
read it (or too many did), every kernel launched since its load (the launch last before it
included: one being issued as a prefetch loads it may run after). Each mismatch is counted
(``mismatches``) and logged (``mismatch``: record, bytes, suspects, how found), and each suspect
becomes ``conservative``: from then on its launches are unknown -- to the agent's predictor
(``Agent.predict_launch``: the executor's policy, snapshots) and here (every record required) -- and
count as writing everything resident: ``clean`` is cleared and every digest dropped, so the
evictions after them save without relying on a digest (a graph launch drops the digests too
once a kernel is conservative: it may run one). At the detection, the clean records that a new
suspect may already have written (launched since their load) lose their clean mark and digest
as well. ``GPUOS_ENGINE_NO_CONSERVE=1`` reports mismatches without acting on them (to measure
what the rule keeps).

Detection needs a digest: with ``GPUOS_ENGINE_NO_DIGEST=1`` (or no NVRTC) nothing is detected
and the engine trusts the predictions (a hidden write to a clean record is lost, as before);
records under DIGEST_MIN are never checked (saved unless clean); during a record's back-off its
evictions save without a check, so a hidden write to it is kept but found only at its next
check (the suspects: the launches since the load before that check). Kernels made conservative
stay so when the check is backed off or turned off later: their writes are saved whatever the
digests say. ``GPUOS_ENGINE_DIGEST_OFF_AFTER=N`` (tests) turns the check off after the Nth
mismatch, leaving the rule alone to keep the writes.

Locks: the program's callbacks hold the agent's lock and then take the engine's; the engine's
threads take the engine's lock alone, or the agent's and then the engine's; never the other
way round. The engine's driver calls are the agent's own (the tracer skips them).

Lazy rollback (``adopt(..., mapped=True)`` + ``load_rest``): the same, for buffers that stay
mapped and whose device copy is stale -- the image's contents are in the agent's staging, each
buffer only needs its write-back (``Entry.mapped``: no make_resident, no check against the owned
library's table). It covers plain allocations too (a program whose memory is not owned): the
engine needs no mapping there, and a free of a pending buffer reaches ``freeing`` through the
tracer's cuMemFree/cuMemUnmap hooks, like an owned record's unmap. What differs from a lazy
resume: a kernel that reaches a pending buffer by a pointer the prediction does not see reads
the buffer's old contents instead of faulting.

Not for: a snapshot, suspend or rollback while records are pending (the agent refuses those
until ``settled``).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

from gpuos_tools.cuda.driver import ok as _ok

RESIDENT, LOADING, RELEASED, EVICTING = "resident", "loading", "released", "evicting"
AHEAD = 512 << 20  #: bytes the background loader keeps enqueued ahead of completion (at most; or one record)
SAMPLE = 16  #: once everything is learnt, one operation of the program in SAMPLE is looked at for recency
RECENT_MAX = 4096  #: allocation ids kept in ``recent`` (the least recent dropped beyond it)
PROBES = 8  #: demand loads of a lazy load timed on the GPU (its figures: ``stats()['lazy']['demand']``)
#: how long an eviction from inside an operation waits for other threads' operations to reach the driver
OTHERS_SETTLE_S = 0.05
PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD: from another thread, the legacy stream orders after it
DIGEST_MIN = 256 << 10  #: smaller records get no digest (their save is cheap)
DIGEST_SLOTS = 8192  #: 16-byte result slots, two per record base (bases beyond: no digest)
BACKOFF = (4, 32)  #: evictions saved without a check after a check found the record changed: first, most
READERS_MAX = 16  #: kernel names kept per clean record as predicted readers (more: every launch suspected)
LAUNCH_NAMES_MAX = 4096  #: kernel names whose last launch is kept (the least recently launched dropped beyond)
MISMATCH_LOG = 64  #: mismatches logged in ``stats()['mismatch']`` (all counted)

Pieces = list[tuple[int, int]]  #: (host address, bytes), contiguous over a record, in order


class Ops(Protocol):
    """What the engine asks of the owned library and the driver (DriverOps; a fake in tests)."""

    def lookup(self, addr: int) -> Any: ...  # an owned.Record (base, size, resident) or None
    def make_resident(self, base: int) -> None: ...
    def release(self, base: int) -> None: ...
    def copy_in(self, base: int, pieces: Pieces, stream: Any) -> None: ...
    def copy_out(self, base: int, pieces: Pieces, stream: Any) -> None: ...
    def host(self, base: int, size: int) -> Pieces: ...  # the engine's own pinned copy
    def stream(self) -> Any: ...
    def event(self) -> Any: ...
    def record(self, ev: Any, stream: Any) -> None: ...
    def wait(self, stream: Any, ev: Any) -> None: ...
    def done(self, ev: Any) -> bool: ...
    def synchronize(self, ev: Any) -> None: ...
    def destroy(self, ev: Any) -> None: ...
    def timer(self) -> Any: ...  # an event that keeps its time (for the lazy load's figures)
    def elapsed_ms(self, start: Any, end: Any) -> float: ...  # between two completed timers
    def sync_all(self) -> None: ...  # the context's work has completed
    def enter(self) -> None: ...  # make the program's context current on this thread
    # optional (DriverOps has them; without them the engine takes no digests):
    # digest_prepare() -> None: start building the digest kernel (no context needed)
    # digest_init() -> str | None: load it (the program's context current); None, or why not
    # digest(base, size, slot, stream) -> None: enqueue the digest of the device bytes into slot
    # digest_value(slot) -> bytes: a slot's 16 bytes, once an event after its digest completed


@dataclass
class Entry:
    """A record that is not simply resident."""

    base: int
    size: int
    state: str
    pieces: Pieces  #: where its host copy is
    event: Any = None  #: loading: after the load; evicting: after the save
    ordered: set = field(default_factory=set)  #: streams already waiting on ``event`` (loading)
    cancelled: bool = False  #: evicting: an operation touched it, it stays
    on_demand: bool = False
    own: bool = False  #: ``pieces`` are the engine's own pinned copy (kept after the load)
    mapped: bool = False  #: a lazy rollback's: mapped all along, only the load is missing
    #: evicting with a digest check while clean: the kernels that may have written it (a mismatch)
    suspects: tuple[list[str], str, bool] | None = None


class ResidencyEngine:
    """Residency of the owned records (module docstring). ``agent``: the Agent (its lock,
    streams, predictor, ``own`` thread set); ``ops``: the driver side."""

    def __init__(self, agent: Any = None, ops: Ops | None = None, ahead: int = AHEAD, owned: bool = True) -> None:
        self.agent = agent
        #: whether the program's memory is owned (records can be released); False: an engine made
        #: for a lazy rollback of plain allocations, which only loads into mapped memory
        self.owned = owned
        self.ops = ops if ops is not None else DriverOps(agent, owned=owned)
        self.ahead = ahead
        #: the loader pauses while a demand load is in flight (``_yield_to_demand``); off only
        #: with GPUOS_ENGINE_NO_YIELD=1, to measure what it buys (scripts/bench_rollback.py)
        self.yield_to_demand = os.environ.get("GPUOS_ENGINE_NO_YIELD") != "1"
        self.lock = threading.RLock()
        self.pending: dict[int, Entry] = {}  #: base -> entry, records not simply resident
        self._bases: list[int] = []  #: sorted keys of pending
        self.clean: set[int] = set()  #: resident records whose own host copy equals the device's
        self.first_touch: dict[int, None] = {}  #: allocation ids in the order first touched
        #: allocation ids, least recently touched first (every operation while the engine is
        #: consulted anyway, else one in SAMPLE): a loop's working set is at the end
        self.recent: dict[int, None] = {}
        self._unwatched = 0  #: operations not looked at since the last sample
        self._streams: dict[str, Any] = {}
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
        self._evictq: queue.Queue[int | None] = queue.Queue()
        self._evictor: threading.Thread | None = None
        self.counts = {"demand_loads": 0, "background_loads": 0, "prefetches": 0, "stream_waits": 0,
                       "unknown_requires": 0, "evictions": 0, "evict_saves": 0, "saved_bytes": 0, "evictions_cancelled": 0,
                       "loaded_bytes": 0, "freed_while_pending": 0, "evict_unsettled": 0, "unsaved_bytes": 0, "digests": 0,
                       "digest_skips": 0, "digest_skipped_bytes": 0, "digest_changed": 0, "digest_backoff_saves": 0,
                       "mismatches": 0, "conservative_launches": 0}
        #: kernel names whose launches are unknown since a mismatch named them (module docstring)
        self.conservative: set[str] = set()
        self.conserve = os.environ.get("GPUOS_ENGINE_NO_CONSERVE") != "1"
        self.mismatch_log: list[dict[str, Any]] = []
        self._digest_off_after = int(os.environ.get("GPUOS_ENGINE_DIGEST_OFF_AFTER") or 0)
        self._seq = 0  #: launches seen (``launch``)
        #: kernel -> the sequence number of its last launch, least recently launched first
        self._last_launch: dict[str, int] = {}
        self._names_dropped = 0  #: the highest sequence number of a name dropped from _last_launch
        self._since: dict[int, int] = {}  #: base -> the sequence number at its load (clean records)
        self._readers: dict[int, set[str] | None] = {}  #: base -> predicted readers since its load (None: too many)
        self._base_of_id: dict[int, int] = {}  #: allocation id -> its record's base (cache)
        #: digests of host copies (module docstring): base -> the size of the host copy whose
        #: digest is in the base's first slot
        self.digests: dict[int, int] = {}
        self._slot_of: dict[int, int] = {}  #: base -> k: its slots are 2k (host copy), 2k+1 (at eviction)
        #: base -> [evictions left to save without a check, the last run's length] (back-off)
        self._backoff: dict[int, list[int]] = {}
        #: "on", "off (...)", "unavailable: ..."; None: not decided until the first eviction
        self.digest_mode: str | None = None
        if os.environ.get("GPUOS_ENGINE_NO_DIGEST") == "1":
            self.digest_mode = "off (GPUOS_ENGINE_NO_DIGEST=1)"
        elif not hasattr(self.ops, "digest"):
            self.digest_mode = "unavailable: the driver side has no digest"
        elif owned:
            prepare = getattr(self.ops, "digest_prepare", None)
            if prepare is not None:
                prepare()
        self.lazy: dict[str, Any] | None = None  #: the last lazy resume's figures
        self._counts_at_start: dict[str, Any] = {}

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
        if e.base not in self.pending:
            self._bases.insert(bisect_right(self._bases, e.base), e.base)
        self.pending[e.base] = e

    def _drop(self, base: int, destroy: bool = True) -> None:
        """Forget a pending record (lock held). Its event is destroyed, unless a thread of the
        engine may still wait on it: the evictor's own (``destroy`` False), or any load event
        while the background loader runs (it is destroyed when the loader ends)."""
        e = self.pending.pop(base, None)
        if e is not None:
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

    @contextmanager
    def _own(self) -> Iterator[None]:
        """This thread's driver calls are the agent's while inside."""
        own = getattr(self.agent, "own", None)
        me = threading.get_native_id()
        mine = own is not None and me not in own
        if mine:
            own.add(me)
        try:
            yield
        finally:
            if mine:
                own.discard(me)

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
        self._seq += 1  # before the require: a record it loads counts this launch as after its load
        last = self._last_launch
        last.pop(kernel, None)
        last[kernel] = self._seq
        if len(last) > LAUNCH_NAMES_MAX:
            for k in list(last)[: LAUNCH_NAMES_MAX // 2]:
                self._names_dropped = max(self._names_dropped, last.pop(k))
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
                for i in writes:
                    self.clean.discard(self._id_base(i))
                for i in touched:  # the predicted readers of clean records (a mismatch's suspects)
                    if i in writes:
                        continue
                    b = self._id_base(i)
                    if b in self.clean:
                        r = self._readers.get(b, set())
                        if r is not None:
                            r.add(kernel)
                            self._readers[b] = r if len(r) <= READERS_MAX else None
        if not suspect and self.conservative and kernel in self.conservative:
            # a mismatch named it while this launch was being decided: what its require loaded
            # came after the detection's own pass over the clean records
            with self.lock:
                self.digests.clear()
            self.clean.clear()

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
            self.clean.discard(self._record_base(dst))

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
                if e.state == RELEASED:
                    demand = self._stream("demand")
                    probe = self._loading and self._t0 is not None and len(self._probes) < PROBES
                    if probe:
                        before = self.ops.timer()
                        self.ops.record(before, demand)
                    if not self._load(e, demand):
                        if probe:
                            self.ops.destroy(before)
                        continue
                    if probe:
                        after = self.ops.timer()
                        self.ops.record(after, demand)
                        self._probes.append((before, after, time.perf_counter(), e.size))
                    if self._loading and self.yield_to_demand:
                        self._demands.append(e.event)
                    e.on_demand = True
                    self.counts["demand_loads"] += 1
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
        self.ops.make_resident(e.base)
        r = self.ops.lookup(e.base)
        if r is None or r.base != e.base:  # a free came during make_resident and was carried out
            self._drop(e.base)
            self.counts["freed_while_pending"] += 1
            return False
        return self._copy(e, stream)

    def _copy(self, e: Entry, stream: Any) -> bool:
        self.ops.copy_in(e.base, e.pieces, stream)
        if e.own:  # before the load's event: no operation of the program runs before the digest
            self._digest_host_copy(e.base, e.size, stream)
        ev = self.ops.event()
        self.ops.record(ev, stream)
        e.event, e.state, e.ordered = ev, LOADING, set()
        self.counts["loaded_bytes"] += e.size
        if e.own:  # later writes are ordered after the load and discard it from clean
            self._busy()
            self.clean.add(e.base)
            self._since[e.base] = self._seq
            self._readers.pop(e.base, None)
        return True

    # -- digests ------------------------------------------------------------------------------

    def _digest_ready(self) -> bool:
        """Whether digests are taken. The first call (at the first eviction, on a thread of the
        engine's with the program's context current) loads the kernel, or says once on stderr
        why there are none."""
        if self.digest_mode is None:
            init = getattr(self.ops, "digest_init", None)
            try:
                why = init() if init is not None else None
            except Exception as exc:  # noqa: BLE001 (no digests: saves as before)
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                self.digest_mode = "on"
            else:
                self._no_digests(why)
        return self.digest_mode == "on"

    def _no_digests(self, why: str) -> None:
        self.digest_mode = f"unavailable: {why}"
        self.digests.clear()
        print(f"gpuos engine: no GPU digests ({why}); evicted records not known clean are saved",
              file=sys.stderr, flush=True)

    def _slots(self, base: int, size: int) -> int | None:
        """The base's slot pair, None when its record gets no digest (small, unaligned, or no
        slot left). A base keeps its slots: a result can only be overwritten by a digest of
        the same base, and those are ordered (a load of it after the eviction that read them)."""
        if size < DIGEST_MIN or base % 8:
            return None
        k = self._slot_of.get(base)
        if k is None:
            if len(self._slot_of) >= DIGEST_SLOTS // 2:
                return None
            k = self._slot_of[base] = len(self._slot_of)
        return k

    def _digest_host_copy(self, base: int, size: int, stream: Any) -> None:
        """After a load from the engine's own host copy (engine's lock held, own thread):
        enqueue the digest of what was loaded, i.e. of the host copy."""
        self.digests.pop(base, None)
        if self.digest_mode != "on":
            return
        b = self._backoff.get(base)
        if b is not None and b[0] > 0:  # its next eviction saves without a check
            return
        k = self._slots(base, size)
        if k is None:
            return
        try:
            self.ops.digest(base, size, 2 * k, stream)
        except Exception as exc:  # noqa: BLE001 (the load stands; no digests from now on)
            self._no_digests(f"{type(exc).__name__}: {exc}")
            return
        self.digests[base] = size
        self.counts["digests"] += 1

    def _digest_at_eviction(self, base: int, size: int, side: Any) -> bool:
        """Enqueue on ``side`` (after the program's last use) the digest to compare with the
        host copy's; False when there is nothing to compare with (then the usual rules)."""
        if self.digest_mode != "on" or self.digests.get(base) != size:
            return False
        k = self._slot_of.get(base)
        if k is None:
            return False
        try:
            self.ops.digest(base, size, 2 * k + 1, side)
        except Exception as exc:  # noqa: BLE001 (saved as before)
            self._no_digests(f"{type(exc).__name__}: {exc}")
            return False
        self.counts["digests"] += 1
        return True

    def _digests_equal(self, base: int) -> bool:
        """The host copy's digest against the one taken at eviction (both complete)."""
        k = self._slot_of[base]
        return self.ops.digest_value(2 * k) == self.ops.digest_value(2 * k + 1)

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
                if not self._load(e, self._stream("prefetch")):
                    return None
                self.counts["prefetches"] += 1
            return e.event

    # -- lazy resume --------------------------------------------------------------------------

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
        when it came (BENCHMARKS.md, issue 7: the whole reload)."""
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
                        if not self._load(e, self._stream("background")):
                            continue
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

    # -- evict --------------------------------------------------------------------------------

    def evict(self, base: int) -> bool:
        """Save (if needed) and release the record at ``base`` after its last use, from the
        engine's evict thread; False when it is not a resident owned record."""
        r = self.ops.lookup(base)
        if r is None or r.base != base or not r.resident or getattr(self.agent, "snap", None) is not None:
            return False  # a snapshot in progress copies every buffer: none may go meanwhile
        with self.lock:
            if base in self.pending:
                return False
        if self._evictor is None or not self._evictor.is_alive():
            self._evictor = threading.Thread(target=self._evict_loop, name="gpuos-engine-evict", daemon=True)
            self._evictor.start()
        self._evictq.put(base)
        return True

    def evict_from_operation(self, base: int, own: int = 1) -> bool:
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
        counted as being issued (1 from its enter callback; 0 from before it, e.g. serve's gate)."""
        ops = self.ops
        r = ops.lookup(base)
        if r is None or r.base != base or not r.resident or getattr(self.agent, "snap", None) is not None:
            return False  # a snapshot in progress copies every buffer: none may go meanwhile
        settle = getattr(self.agent, "settle", None)
        if settle is not None and settle(OTHERS_SETTLE_S, own=own):
            self.counts["evict_unsettled"] += 1
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
            self._after_program(side)
            e, ev, how = self._start_save(base, r.size, pieces, side)
        if self._evictor is None or not self._evictor.is_alive():
            self._evictor = threading.Thread(target=self._evict_loop, name="gpuos-engine-evict", daemon=True)
            self._evictor.start()
        self._evictq.put((base, e, ev, how))
        return True

    def _evict_loop(self) -> None:
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
        with lock if lock is not None else _nothing():
            if hasattr(agent, "settle"):
                agent.settle()
            self._after_program(stream)

    def _after_program(self, stream: Any) -> None:
        """``stream`` waits on the GPU for what the program has enqueued so far, on every stream
        it has used (the device, when one of them is gone without our seeing it)."""
        ops = self.ops
        streams = {0 if s == PER_THREAD_STREAM else s for s in getattr(self.agent, "streams", {0})}
        for s in sorted(streams):
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
        with lock if lock is not None else _nothing():  # no operation starts until it is EVICTING
            if getattr(self.agent, "snap", None) is not None:  # a snapshot began since evict() was asked
                self.counts["evictions_refused"] = self.counts.get("evictions_refused", 0) + 1
                return
            self._last_use(side)
            with self.lock:
                if base in self.pending:
                    return
                e, ev, how = self._start_save(base, r.size, pieces, side)
        self._evict_finish(base, e, ev, how)

    def _start_save(self, base: int, size: int, pieces: Any, side: Any) -> tuple[Entry, Any, str]:
        """Mark the record EVICTING and enqueue on ``side`` what the eviction needs (engine lock
        held): the digest to compare with the host copy's (``how`` "digest"), nothing when the
        host copy is known current without one ("clean"), else the save ("save"). Returns the
        entry, the event after it, and ``how``."""
        e = Entry(base, size, EVICTING, pieces, own=True)
        self._put(e)
        clean = base in self.clean
        back = self._backoff.get(base)
        if back is not None and back[0] > 0:  # changed at its last check: save, count down
            back[0] -= 1
            self.counts["digest_backoff_saves"] += 1
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
            same = self._digests_equal(base)
            if not same:
                with self.lock:
                    if e.suspects is not None:  # evidence even if an operation cancels the eviction
                        self._mismatch(e)
                    if e.cancelled or self.pending.get(base) is not e:
                        ops.destroy(ev)
                        return
                    # an operation that touches it from here on cancels the eviction, as during a save
                    self.digests.pop(base, None)
                    self.counts["digest_changed"] += 1
                    last = self._backoff.get(base, [0, 0])[1]
                    n = min(BACKOFF[1], max(BACKOFF[0], 2 * last))
                    self._backoff[base] = [n, n]
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
            ops.release(base)
            e.state, e.event = RELEASED, None
            ops.destroy(ev)
            self.clean.discard(base)
            c = self.counts
            c["evictions"] += 1
            c["evict_saves"] += int(save)
            c["saved_bytes"] += e.size if save else 0
            c["unsaved_bytes"] += 0 if save else e.size
            if how == "digest" and not save:
                c["digest_skips"] += 1
                c["digest_skipped_bytes"] += e.size
                self._backoff.pop(base, None)

    # -- mismatches (module docstring) ---------------------------------------------------------

    def _suspects(self, base: int) -> tuple[list[str], str, bool]:
        """The kernels that may have written the clean record at ``base`` since its load (engine
        lock held): its predicted readers, else every kernel launched since; how they were found,
        and whether the list may be incomplete (names dropped past LAUNCH_NAMES_MAX)."""
        readers = self._readers.get(base, set())
        if readers:
            return sorted(readers), "predicted to read it", False
        since = self._since.get(base, 0)
        names = []
        for k in reversed(self._last_launch):  # most recently launched first
            if self._last_launch[k] < since:
                break
            names.append(k)
        return sorted(names), "launched since its load", since <= self._names_dropped

    def _mismatch(self, e: Entry) -> None:
        """A clean record's digest changed (engine lock held, evict thread): count and log it,
        make its suspects conservative, and take the clean mark and digest of every record one
        of them may have written already."""
        names, how, incomplete = e.suspects
        c = self.counts
        c["mismatches"] += 1
        self.clean.discard(e.base)
        self.digests.pop(e.base, None)
        new = [k for k in names if k not in self.conservative] if self.conserve else []
        if len(self.mismatch_log) < MISMATCH_LOG:
            self.mismatch_log.append({"base": hex(e.base), "bytes": e.size, "kernels": [k[:160] for k in names],
                                      "found": how, "incomplete": incomplete, "new": len(new),
                                      "evictions": c["evictions"], "launches": self._seq})
        if new:
            self.conservative.update(new)
            bump = getattr(self.agent, "predictions_changed", None)
            if bump is not None:  # the native core's memoised access sets of these are stale
                bump()
            self._busy()
            why = getattr(self.agent, "unknown_why", None)
            for k in new:
                if isinstance(why, dict):
                    why[k] = "conservative: it may have written a record its prediction did not show (a mismatch)"
            lasts = [self._last_launch.get(k, -1) for k in new]
            for b in list(self.clean):  # one launched since that record's load: maybe written already
                since = self._since.get(b, 0)
                if any(t >= since for t in lasts):
                    self.clean.discard(b)
                    self.digests.pop(b, None)
            print(f"gpuos engine: record {e.base:#x} ({e.size} bytes) changed without a predicted write; "
                  f"conservative from now on ({how}): {', '.join(k[:120] for k in new)}", file=sys.stderr, flush=True)
        elif c["mismatches"] == 1:
            print(f"gpuos engine: record {e.base:#x} ({e.size} bytes) changed without a predicted write "
                  f"({how}: {', '.join(k[:120] for k in names) or 'none'}); "
                  f"{'nothing made conservative (GPUOS_ENGINE_NO_CONSERVE=1)' if not self.conserve else 'all conservative already'}",
                  file=sys.stderr, flush=True)
        if self._digest_off_after and c["mismatches"] >= self._digest_off_after and self.digest_mode == "on":
            self.digest_mode = f"off (GPUOS_ENGINE_DIGEST_OFF_AFTER={self._digest_off_after}: after that many mismatches)"
            self.digests.clear()

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
                "conservative": sorted(k[:160] for k in self.conservative), "mismatch": list(self.mismatch_log),
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


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# -- the driver side ----------------------------------------------------------------------------


#: The digest kernel (module docstring, "Digests"): grid-stride over the 8-byte words, each word
#: mixed with its index by two different 64-bit finalisers, summed per lane (mod 2^64) per thread,
#: per warp (shuffles), per block (shared memory), then one atomicAdd per lane and block into
#: ``out`` (zeroed before). Block 0's thread 0 adds the zero-padded last partial word and the length.
DIGEST_SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 mix_a(u64 z) {  /* splitmix64's finaliser */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
__device__ __forceinline__ u64 mix_b(u64 z) {  /* murmur3's fmix64 */
    z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdULL;
    z = (z ^ (z >> 33)) * 0xc4ceb9fe1a85ec53ULL;
    return z ^ (z >> 33);
}
__device__ __forceinline__ u64 lane_a(u64 w, u64 i) { return mix_a(w ^ mix_a(i + 0x9e3779b97f4a7c15ULL)); }
__device__ __forceinline__ u64 lane_b(u64 w, u64 i) { return mix_b(w + mix_b(i * 0xc2b2ae3d27d4eb4fULL + 0x165667b19e3779f9ULL)); }
extern "C" __global__ void gpuos_engine_digest(const u64* __restrict__ p, u64 nbytes, u64* out) {
    const u64 words = nbytes >> 3;
    u64 a = 0, b = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        const u64 w = __ldg(p + i);
        a += lane_a(w, i);
        b += lane_b(w, i);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const u64 rest = nbytes & 7;
        if (rest) {
            const unsigned char* t = (const unsigned char*)(p + words);
            u64 w = 0;
            for (u64 k = 0; k < rest; ++k) w |= (u64)t[k] << (8 * k);
            a += lane_a(w, words);
            b += lane_b(w, words);
        }
        a += mix_a(nbytes ^ 0x6a09e667f3bcc909ULL);
        b += mix_b(nbytes ^ 0xbb67ae8584caa73bULL);
    }
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, o);
        b += __shfl_down_sync(0xffffffffu, b, o);
    }
    __shared__ u64 sa[32], sb[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) { sa[warp] = a; sb[warp] = b; }
    __syncthreads();
    if (warp == 0) {
        a = lane < warps ? sa[lane] : 0;
        b = lane < warps ? sb[lane] : 0;
        for (int o = 16; o > 0; o >>= 1) {
            a += __shfl_down_sync(0xffffffffu, a, o);
            b += __shfl_down_sync(0xffffffffu, b, o);
        }
        if (lane == 0) { atomicAdd(out, a); atomicAdd(out + 1, b); }
    }
}
"""
DIGEST_THREADS = 256


def digest_reference(data: bytes) -> bytes:
    """What the digest kernel computes, on the CPU (numpy): 16 bytes, lanes a then b, each
    little-endian. The definition the GPU tests compare the kernel with."""
    import numpy as np

    def mix_a(z: Any) -> Any:
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def mix_b(z: Any) -> Any:
        z = (z ^ (z >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
        z = (z ^ (z >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
        return z ^ (z >> np.uint64(33))

    n = len(data)
    nw = n // 8
    rest = data[nw * 8:]
    w = np.frombuffer(data, dtype="<u8", count=nw).astype(np.uint64)
    if rest:
        w = np.append(w, np.uint64(int.from_bytes(rest, "little")))
    i = np.arange(len(w), dtype=np.uint64)
    ln = np.array([n], dtype=np.uint64)
    with np.errstate(over="ignore"):
        a = np.sum(mix_a(w ^ mix_a(i + np.uint64(0x9E3779B97F4A7C15))), dtype=np.uint64)
        b = np.sum(mix_b(w + mix_b(i * np.uint64(0xC2B2AE3D27D4EB4F) + np.uint64(0x165667B19E3779F9))),
                   dtype=np.uint64)
        a = a + mix_a(ln ^ np.uint64(0x6A09E667F3BCC909))[0]
        b = b + mix_b(ln ^ np.uint64(0xBB67AE8584CAA73B))[0]
    return int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")
DIGEST_BLOCKS = 2048  #: at most (a grid-stride loop beyond): enough to keep HBM busy on an H100/H200


def device_arch(device: Any = None) -> int | None:
    """Compute capability as 90 for 9.0: of ``device`` (a CUdevice), else of the current
    context's device, else of device 0 (None when the driver cannot say)."""
    from cuda.bindings import driver as drv

    try:
        if device is None:
            err, device = drv.cuCtxGetDevice()
            if err != drv.CUresult.CUDA_SUCCESS:
                drv.cuInit(0)
                device = _ok(drv.cuDeviceGet(0), "cuDeviceGet")
        a = drv.CUdevice_attribute
        major = _ok(drv.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "major")
        minor = _ok(drv.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "minor")
        return int(major) * 10 + int(minor)
    except Exception:  # noqa: BLE001 (then PTX for the lowest architecture)
        return None


def compile_digest(arch: int | None) -> tuple[bytes, int | None]:
    """The digest kernel built by NVRTC (no context needed): a CUBIN for ``arch`` when NVRTC
    supports it (no JIT: PTX from an NVRTC newer than the driver would not load), else PTX for
    the lowest architecture NVRTC supports (the driver JITs it); the image and the arch of a
    CUBIN (None: PTX). RuntimeError saying why not."""
    from cuda.bindings import nvrtc

    def check(result: tuple, what: str) -> Any:
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {getattr(result[0], 'name', result[0])}")
        return result[1] if len(result) == 2 else None

    try:
        archs = [int(a) for a in nvrtc.nvrtcGetSupportedArchs()[-1]]
    except Exception:  # noqa: BLE001 (an older binding: Turing's, the oldest CUDA 13 supports)
        archs = []
    cubin = arch is not None and arch in archs
    target = f"sm_{arch}" if cubin else f"compute_{min(archs) if archs else 75}"
    prog = check(nvrtc.nvrtcCreateProgram(DIGEST_SOURCE.encode(), b"gpuos_engine_digest.cu", 0, [], []),
                 "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={target}".encode(), b"-default-device"]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            n = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"nvrtcCompileProgram({target}): {getattr(res[0], 'name', res[0])}: "
                               f"{log.decode(errors='replace').strip()[:500]}")
        if cubin:
            n = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = b" " * n
            check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
            return image, arch
        n = check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * n
        check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.rstrip(b"\0 ") + b"\0", None
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class DriverOps:
    """Ops on the owned library (gpuos_tools/memory/owned.py) and the CUDA driver, in the
    agent's context."""

    def __init__(self, agent: Any = None, owned: bool = True) -> None:
        self.agent = agent
        self.lib = None  #: None: the program's memory is not owned (only loads into mapped memory)
        if owned:
            from gpuos_tools.memory import owned as owned_lib

            self.lib = owned_lib.OwnedLibrary.load()
        self._hosts: dict[int, tuple[int, int]] = {}  #: base -> (pinned address, size), the engine's own
        self._image: tuple[bytes, int | None] | None = None  #: compile_digest's
        self._image_error: str | None = None
        self._builder: threading.Thread | None = None
        self._digest_fn: Any = None
        self._slots_dev = 0  #: DIGEST_SLOTS x 16 bytes on the GPU (the kernel's sums)
        self._slots_host = 0  #: the same in pinned host memory (copied after each digest)

    # -- digests (engine module docstring) --

    def digest_prepare(self) -> None:
        """Start compiling the digest kernel on a thread (NVRTC takes ~0.1-0.5 s)."""
        def build() -> None:
            # its driver calls (the device's architecture) are the agent's own: the tracer must
            # not take the agent's lock for them, which the first eviction holds while it joins
            own = getattr(self.agent, "own", None)
            me = threading.get_native_id()
            if own is not None:
                own.add(me)
            try:
                self._image = compile_digest(device_arch())
            except Exception as exc:  # noqa: BLE001 (digest_init says why)
                self._image_error = f"{type(exc).__name__}: {exc}"
            finally:
                if own is not None:
                    own.discard(me)

        self._builder = threading.Thread(target=build, name="gpuos-engine-nvrtc", daemon=True)
        self._builder.start()

    def digest_init(self) -> str | None:
        """Load the kernel into the current context and allocate the result slots; None when
        ready, else why not."""
        import ctypes

        from cuda.bindings import driver as drv

        if self._builder is None:
            self.digest_prepare()
        self._builder.join()
        if self._image is None:
            return self._image_error or "the digest kernel was not built"
        arch = device_arch()
        if self._image[1] is not None and arch is not None and arch != self._image[1]:
            self._image = compile_digest(arch)  # built for device 0, the program runs on another kind
        image = ctypes.create_string_buffer(self._image[0], len(self._image[0]))
        module = _ok(drv.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData(digest)")
        self._digest_fn = _ok(drv.cuModuleGetFunction(module, b"gpuos_engine_digest"), "cuModuleGetFunction(digest)")
        n = DIGEST_SLOTS * 16
        self._slots_dev = int(_ok(drv.cuMemAlloc(n), "cuMemAlloc(digest slots)"))
        self._slots_host = int(_ok(drv.cuMemHostAlloc(n, 0), "cuMemHostAlloc(digest slots)"))
        ctypes.memset(self._slots_host, 0, n)
        return None

    def digest(self, base: int, size: int, slot: int, stream: Any) -> None:
        """Enqueue on ``stream``: zero the slot, the kernel over ``size`` bytes at ``base``, the
        slot's 16 bytes to pinned host memory."""
        import ctypes

        from cuda.bindings import driver as drv

        dev = self._slots_dev + 16 * slot
        _ok(drv.cuMemsetD8Async(dev, 0, 16, stream), "cuMemsetD8Async(digest)")
        words = size // 8
        blocks = max(1, min(DIGEST_BLOCKS, (words + DIGEST_THREADS - 1) // DIGEST_THREADS))
        args = (ctypes.c_uint64(base), ctypes.c_uint64(size), ctypes.c_uint64(dev))
        params = (ctypes.c_void_p * 3)(*(ctypes.addressof(a) for a in args))
        _ok(drv.cuLaunchKernel(self._digest_fn, blocks, 1, 1, DIGEST_THREADS, 1, 1, 0, stream,
                               ctypes.addressof(params), 0), "cuLaunchKernel(digest)")
        _ok(drv.cuMemcpyDtoHAsync(self._slots_host + 16 * slot, dev, 16, stream), "cuMemcpyDtoHAsync(digest)")

    def digest_value(self, slot: int) -> bytes:
        import ctypes

        return ctypes.string_at(self._slots_host + 16 * slot, 16)

    def enter(self) -> None:
        from cuda.bindings import driver as drv

        ctx = getattr(self.agent, "ctx", None)
        if ctx is not None:
            _ok(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def lookup(self, addr: int) -> Any:
        return self.lib.lookup(addr) if self.lib is not None else None

    def make_resident(self, base: int) -> None:
        if self.lib is None:
            raise RuntimeError("not owned: nothing can be mapped")
        self.lib.make_resident(base)

    def release(self, base: int) -> None:
        if self.lib is None:
            raise RuntimeError("not owned: nothing can be released")
        self.lib.release(base)

    def copy_in(self, base: int, pieces: Pieces, stream: Any) -> None:
        from cuda.bindings import driver as drv

        off = 0
        for host, n in pieces:
            _ok(drv.cuMemcpyHtoDAsync(base + off, host, n, stream), "cuMemcpyHtoDAsync(load)")
            off += n

    def copy_out(self, base: int, pieces: Pieces, stream: Any) -> None:
        from cuda.bindings import driver as drv

        off = 0
        for host, n in pieces:
            _ok(drv.cuMemcpyDtoHAsync(host, base + off, n, stream), "cuMemcpyDtoHAsync(save)")
            off += n

    def host(self, base: int, size: int) -> Pieces:
        from cuda.bindings import driver as drv

        h = self._hosts.get(base)
        if h is None or h[1] != size:
            if h is not None:
                drv.cuMemFreeHost(h[0])
            h = (int(_ok(drv.cuMemHostAlloc(size, 0), "cuMemHostAlloc")), size)
            self._hosts[base] = h
        return [h]

    def stream(self) -> Any:
        from cuda.bindings import driver as drv

        return _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def event(self) -> Any:
        from cuda.bindings import driver as drv

        return _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def record(self, ev: Any, stream: Any) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuEventRecord(ev, stream), "cuEventRecord")

    def wait(self, stream: Any, ev: Any) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")

    def done(self, ev: Any) -> bool:
        from cuda.bindings import driver as drv

        err = drv.cuEventQuery(ev)[0]
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery: {getattr(err, 'name', err)}")

    def synchronize(self, ev: Any) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuEventSynchronize(ev), "cuEventSynchronize")

    def destroy(self, ev: Any) -> None:
        from cuda.bindings import driver as drv

        drv.cuEventDestroy(ev)

    def timer(self) -> Any:
        from cuda.bindings import driver as drv

        return _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate(timer)")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        from cuda.bindings import driver as drv

        f = getattr(drv, "cuEventElapsedTime", None) or drv.cuEventElapsedTime_v2
        return float(_ok(f(start, end), "cuEventElapsedTime"))

    def sync_all(self) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
