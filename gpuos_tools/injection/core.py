"""The agent's native per-operation core (csrc/gpuos_core.c, linked into the tracer built with
-DGPUOS_AGENT): build it, drive it, and answer its upcalls.

The C side sees every launch, copy, memset, free and graph launch of the program in the
program's thread and does the per-operation work itself; it calls `Upcalls.dispatch` only when
Python must act (docs/native-core.md). This module also gives the agent the core's lock as its
own (`NativeLock`), its own-thread table (`OwnThreads`), and the queue of allocation and
pointer-bearing copy events that keeps the agent's predictor (gpuos_tools/agent/view.py) in step
with the C allocation table (`NativeCore.drain_view`).
"""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from gpuos_tools import cbuild
from gpuos_tools.agent.view import ProcessView
from gpuos_tools.injection import tracelib
from gpuos_tools.model import binary, wire

HERE = Path(__file__).resolve().parent
SOURCES = (tracelib.RECORDER, HERE / "csrc" / "gpuos_core.c")
INCLUDE = HERE / "include"

# flags (gpuos_core.c F_*)
F_ENGINE, F_EXEC, F_GATE, F_TOUCH, F_SKIP_CAPTURED, F_FAST = 1, 2, 4, 8, 16, 32
# upcalls (gpuos_core.h UP_*)
UP_LAUNCH, UP_WRITE, UP_GRAPH, UP_PREDICT, UP_PROTECT, UP_REFERENCE, UP_GATE, UP_CUT = range(1, 9)
NO_ARGS = 0xFFFFFFFF
PTSZ = 0x80  #: bit of a handler kind: the API is a per-thread-stream variant
COUNTERS = ("ops", "enters", "upcalls", "enter_ns", "upcall_ns", "memo_misses", "memo_hits", "protects",
            "epoch", "allocations", "memo_entries", "gil_aware", "epoch_allocs", "epoch_frees",
            "epoch_pointer_copies", "epoch_writes_over_pointers", "epoch_module_unloads", "epoch_python", "fast")
VIEW_DRAIN_BYTES = 1 << 20  #: the background drain takes the view queue past this size


def build(cache: Path | None = None) -> Path:
    """The tracer and the core as one library (built once per version of their sources)."""
    return cbuild.build_library(cache, source=tracelib.SOURCE, stem="libgpuos_agent", flags=("-O2", "-DGPUOS_AGENT"),
                                includes=(INCLUDE,), sources=SOURCES)


class Upcall(ctypes.Structure):
    """gpuos_core.h upcall_t."""

    _fields_ = [
        ("what", ctypes.c_uint32), ("cbid", ctypes.c_uint32),
        ("stream", ctypes.c_uint64), ("raw_stream", ctypes.c_uint64), ("func", ctypes.c_uint64),
        ("name", ctypes.c_char_p), ("sizes", ctypes.POINTER(ctypes.c_uint32)),
        ("nparams", ctypes.c_uint32), ("args_len", ctypes.c_uint32), ("args", ctypes.c_void_p),
        ("dst", ctypes.c_uint64), ("src", ctypes.c_uint64),
        ("unknown", ctypes.c_int32), ("nw", ctypes.c_uint32), ("nt", ctypes.c_uint32), ("cap", ctypes.c_uint32),
        ("ids", ctypes.POINTER(ctypes.c_uint64)),
        ("ntargets", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("targets", ctypes.POINTER(ctypes.c_uint32)),
        ("n", ctypes.c_uint64),
    ]


UPCALL_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Upcall))

_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "core_lock_py": (None, []),
    "core_trylock_py": (ctypes.c_int, [ctypes.c_double]),
    "core_unlock": (None, []),
    "core_settle": (ctypes.c_int, [ctypes.c_double, ctypes.c_int]),
    "core_own": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "core_skip": (ctypes.c_int, []),
    "core_streams": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]),
    "core_used_streams": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]),
    "core_take_dirty": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.POINTER(ctypes.c_int)]),
    "core_forget_dirty": (None, []),
    "core_touches": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]),
    "core_snap_begin": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32]),
    "core_snap_done": (None, [ctypes.c_uint32]),
    "core_snap_safe": (None, [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32]),
    "core_snap_end": (None, []),
    "core_set_references": (None, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32]),
    "core_bump_epoch": (None, []),
    "core_view_take": (ctypes.c_void_p, [ctypes.POINTER(ctypes.c_size_t)]),
    "core_view_len": (ctypes.c_size_t, []),
    "core_free": (None, [ctypes.c_void_p]),
    "core_set_flags": (None, [ctypes.c_uint32, ctypes.c_uint32]),
    "core_flags": (ctypes.c_uint32, []),
    "core_set_upcall": (None, [UPCALL_FN]),
    "core_counters": (None, [ctypes.POINTER(ctypes.c_uint64)]),
    "core_ops": (ctypes.c_uint64, []),
    "core_context": (ctypes.c_uint64, []),
    "core_collectives": (None, [ctypes.POINTER(ctypes.c_uint64)]),
    "core_arm": (ctypes.c_int, [ctypes.c_uint64]),
    "core_collective_name": (ctypes.c_int, [ctypes.c_char_p]),
    "gpuos_trace_error": (None, [ctypes.c_char_p]),
    # the tracer's side, for tests that drive the core without CUPTI
    "core_enter": (None, [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                          ctypes.c_uint64, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32,
                          ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]),
    "core_issued": (None, []),
    "core_last_access": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32,
                                        ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]),
    "core_lock_program": (None, []),
    "core_after_alloc": (None, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32]),
    "core_after_free": (None, [ctypes.c_uint64]),
    "core_after_write": (None, [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]),
    "core_stream_event": (None, [ctypes.c_uint64, ctypes.c_int]),
    # the scheduler's fast path
    "core_fast_allow": (None, [ctypes.c_int64]),
    "core_fast_mark": (None, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32, ctypes.c_int]),
    "core_fast_mark_on": (None, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32, ctypes.c_int, ctypes.c_uint64]),
    "core_fast_unready": (None, [ctypes.c_uint64, ctypes.c_uint64]),
    "core_fast_unready_all": (None, []),
    "core_fast_slow_cbid": (None, [ctypes.c_uint32]),
    "core_fast_uncovered": (ctypes.c_uint32, [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                              ctypes.c_uint32]),
    "core_fast_take": (ctypes.c_void_p, [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint32)]),
    "core_fast_counts": (None, [ctypes.POINTER(ctypes.c_uint64)]),
    "core_fast_last_unready": (ctypes.c_uint64, []),
}

_V_HDR = struct.Struct("<II")
_F_HDR = struct.Struct("<IIQIIQ")  #: fast queue entry: kind, bytes, operation, cbid, name length, stream
_F_LAUNCH, _F_WRITE = 1, 2
#: the counts of core_fast_counts after its first three, in order (the core's enum W_*)
FAST_WHY = ("why_left", "why_moved", "why_full", "why_unknown", "why_unready_write", "why_unready_read",
            "why_slow_write", "marks_dropped", "why_other_stream")
#: the fast path's calls, made on the program's thread in each of its upcalls: they return at once
#: and take no lock; through CDLL each call lets the GIL go and takes it back (a few µs each, and a
#: wait when another Python thread, the mover or the engine's, took it meanwhile); PyDLL keeps it
HOLD_GIL = ("core_fast_allow", "core_fast_mark", "core_fast_take", "core_fast_counts", "core_fast_last_unready")
_F_COUNTS = struct.Struct("<II")  #: a launch's written and touched ids
_F_PAIR = struct.Struct("<QQ")  #: a write's destination and source
_V_ALLOC = struct.Struct("<4Q")
_V_WRITE = struct.Struct("<3Q")


def parse_view(data: bytes) -> list[tuple]:
    """The view queue's records -> ("alloc", id, addr, size, kind) / ("free", addr) /
    ("copy" | "set", dst, bytes, payload or None)."""
    out: list[tuple] = []
    pos, end = 0, len(data)
    while pos < end:
        tag, length = _V_HDR.unpack_from(data, pos)
        if length < 8 or pos + length > end:
            raise ValueError(f"view record at byte {pos} runs past its buffer")
        body = pos + 8
        if tag == 1:
            i, addr, size, kind = _V_ALLOC.unpack_from(data, body)
            out.append(("alloc", i, addr, size, binary.ALLOC_KINDS[kind] if kind < len(binary.ALLOC_KINDS) else "device"))
        elif tag == 2:
            out.append(("free", struct.unpack_from("<Q", data, body)[0]))
        elif tag in (3, 4):
            dst, n, plen = _V_WRITE.unpack_from(data, body)
            payload = bytes(data[body + 24 : body + 24 + plen]) if plen else None
            out.append(("copy" if tag == 3 else "set", dst, n, payload))
        else:
            raise ValueError(f"unknown view record tag {tag} at byte {pos}")
        pos += length
    return out


#: launch bodies kept by ``parse_fast``'s memo at most (then it starts again)
FAST_MEMO_MAX = 65536


def parse_fast(data: bytes, memo: dict[bytes, tuple] | None = None) -> list[tuple]:
    """The fast path's queue (gpuos_core.c core_fast_take) -> ("launch", op, cbid, stream, name,
    written ids, touched ids) / ("write", op, cbid, stream, dst, src), in the program's order.

    ``memo`` (the caller's, kept between takes): a launch's name and ids by the bytes that hold
    them. A loop queues the same launches every step, so each is decoded once, and the entries
    of one launch share their name and id tuples (the replay keys on them)."""
    out: list[tuple] = []
    append = out.append
    unpack = _F_HDR.unpack_from
    pos, end = 0, len(data)
    while pos < end:
        kind, length, n, cbid, nlen, stream = unpack(data, pos)
        if length < 32 or pos + length > end:
            raise ValueError(f"fast queue entry at byte {pos} runs past its buffer")
        body = pos + 32
        if kind == _F_LAUNCH:
            nw, nt = _F_COUNTS.unpack_from(data, body)
            at = body + 8 + 8 * (nw + nt)
            if at + nlen > pos + length:
                raise ValueError(f"fast queue entry at byte {pos} runs past its buffer")
            key = data[body : at + nlen] if memo is not None else None
            hit = memo.get(key) if memo is not None else None
            if hit is None:
                ids = struct.unpack_from(f"<{nw + nt}Q", data, body + 8)
                hit = (bytes(data[at : at + nlen]).decode(errors="replace"), ids[:nw], ids[nw:])
                if memo is not None:
                    if len(memo) >= FAST_MEMO_MAX:
                        memo.clear()
                    memo[key] = hit
            append(("launch", n, cbid, stream, *hit))
        elif kind == _F_WRITE:
            dst, src = _F_PAIR.unpack_from(data, body)
            append(("write", n, cbid, stream, dst, src))
        else:
            raise ValueError(f"unknown fast queue entry kind {kind} at byte {pos}")
        pos += length
    return out


def apply_view(view: ProcessView, events: list[tuple]) -> None:
    """Replay view events into the agent's ProcessView (allocation ids are the core's)."""
    for ev in events:
        kind = ev[0]
        if kind == "alloc":
            view.next_id = ev[1]
            view.on_alloc(ev[2], ev[3], ev[4])
        elif kind == "free":
            view.observe((wire.FREE, 0, 0, 0, ev[1], -1, 0))
        elif kind == "copy":
            rec: dict[str, Any] = {"type": "memcpy", "dir": "default", "dst": ev[1], "src": 0, "bytes": ev[2]}
            if ev[3] is not None:
                rec["data"] = ev[3].hex()
            view.pred.feed(rec)
        else:
            view.pred.feed({"type": "memset", "dst": ev[1], "bytes": ev[2]})


class NativeCore:
    """The loaded library's core functions."""

    def __init__(self, library: str | Path) -> None:
        self.path = str(library)
        self.lib = ctypes.CDLL(self.path)
        self._fast_memo: dict[bytes, tuple] = {}  #: ``parse_fast``'s
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype = res
            fn.argtypes = args
        #: the same library (dlopen gives the same handle) with the GIL held across the call, for
        #: the fast path's calls (``HOLD_GIL``)
        self._held = ctypes.PyDLL(self.path)
        for name in HOLD_GIL:
            fn = getattr(self._held, name)
            fn.restype, fn.argtypes = _SIGNATURES[name]
        self._upcall: Any = None  # the ctypes callback, kept alive

    # -- state the agent reads ------------------------------------------------------------------

    def ops(self) -> int:
        return int(self.lib.core_ops())

    def streams(self, used: bool = False) -> set[int]:
        """The streams the program used or created; ``used``: only those an operation used."""
        read = self.lib.core_used_streams if used else self.lib.core_streams
        cap = 256
        while True:
            buf = (ctypes.c_uint64 * cap)()
            n = read(buf, cap)
            if n <= cap:
                return {int(buf[i]) for i in range(n)}
            cap = n

    def take_dirty(self) -> set[int] | None:
        """The allocation ids written since the last take (None: not known); a new period starts.
        Core lock held."""
        cap = self.counters()["allocations"] + 16  # at most one id per live allocation
        buf = (ctypes.c_uint64 * cap)()
        all_ = ctypes.c_int()
        n = self.lib.core_take_dirty(buf, cap, ctypes.byref(all_))
        return None if all_.value else {int(buf[i]) for i in range(min(n, cap))}

    def forget_dirty(self) -> None:
        self.lib.core_forget_dirty()

    def touches(self) -> list[tuple[int, int, int]]:
        """(allocation id, first touch, last touch) of the live allocations touched so far."""
        cap = 4096
        while True:
            buf = (ctypes.c_uint64 * (3 * cap))()
            n = self.lib.core_touches(buf, cap)
            if n <= cap:
                return [(int(buf[3 * i]), int(buf[3 * i + 1]), int(buf[3 * i + 2])) for i in range(n)]
            cap = n

    def counters(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(COUNTERS))()
        self.lib.core_counters(out)
        return {k: int(v) for k, v in zip(COUNTERS, out)}

    def context(self) -> int:
        return int(self.lib.core_context())

    def collectives(self) -> dict[str, int]:
        """NCCL collective launches counted, graph launches, collectives captured into graphs,
        the collective an armed cut waits for (0: none), whether any capture began."""
        out = (ctypes.c_uint64 * 5)()
        self.lib.core_collectives(out)
        return {"collectives": int(out[0]), "graphs": int(out[1]), "captured": int(out[2]), "armed": int(out[3]),
                "capture_begun": int(out[4])}

    def arm(self, k: int) -> bool:
        """Arm the cut at collective ``k`` (0: disarm), core lock held; False: the program is at
        or past ``k`` already, nothing armed."""
        return self.lib.core_arm(k) == 0

    # -- what the agent sets ----------------------------------------------------------------------

    def set_flag(self, flag: int, on: bool) -> None:
        self.lib.core_set_flags(flag, flag if on else 0)

    def flags(self) -> int:
        return int(self.lib.core_flags())

    def bump_epoch(self) -> None:
        self.lib.core_bump_epoch()

    def set_references(self, ns: list[int]) -> None:
        arr = (ctypes.c_uint64 * max(1, len(ns)))(*sorted(ns))
        self.lib.core_set_references(arr, len(ns))

    def snap_begin(self, ids: list[int]) -> None:
        arr = (ctypes.c_uint64 * max(1, len(ids)))(*ids)
        if self.lib.core_snap_begin(arr, len(ids)) != 0:
            raise MemoryError("the native core could not allocate the snapshot's table")

    def snap_done(self, i: int) -> None:
        self.lib.core_snap_done(i)

    def snap_safe(self, i: int, streams: set[int] | list[int]) -> None:
        s = list(streams)
        arr = (ctypes.c_uint64 * max(1, len(s)))(*s)
        self.lib.core_snap_safe(i, arr, len(s))

    def snap_end(self) -> None:
        self.lib.core_snap_end()

    def settle(self, timeout: float, own: int) -> int:
        return int(self.lib.core_settle(timeout, own))

    def error(self, message: str) -> None:
        """An in-band error record in the trace."""
        self.lib.gpuos_trace_error(message.encode(errors="replace")[:4000])

    # -- the view queue -------------------------------------------------------------------------

    def _taken(self, ptr: Any, n: ctypes.c_size_t) -> bytes:
        """The bytes of a queue the core handed over (``ptr``, ``n`` long), freed."""
        if not ptr:
            return b""
        try:
            return ctypes.string_at(ptr, n.value)
        finally:
            self.lib.core_free(ptr)

    def take_view(self) -> list[tuple]:
        """The view events queued since the last take (core lock held)."""
        n = ctypes.c_size_t()
        return parse_view(self._taken(self.lib.core_view_take(ctypes.byref(n)), n))

    def view_pending(self) -> int:
        return int(self.lib.core_view_len())

    def last_access(self) -> tuple[bool, tuple[int, ...], tuple[int, ...]] | None:
        """(unknown, written ids, touched ids) of the last launch the core looked up; None when
        it looked none up (nothing needed it)."""
        cap = 1 << 16
        buf = (ctypes.c_uint64 * cap)()
        nw, nt = ctypes.c_uint32(), ctypes.c_uint32()
        rc = self.lib.core_last_access(buf, cap, ctypes.byref(nw), ctypes.byref(nt))
        if rc == -1:
            return None
        if rc == -2:
            raise OverflowError("more ids than the buffer holds")
        ids = [int(buf[i]) for i in range(nw.value + nt.value)]
        return bool(rc), tuple(ids[: nw.value]), tuple(ids[nw.value :])

    # -- the scheduler's fast path (gpuos_core.c, "the scheduler's fast path"; core lock held) --

    def fast_allow(self, left: int) -> None:
        """The next ``left`` decisions may go on without a call (0: every one calls)."""
        self._held.core_fast_allow(max(0, int(left)))

    def fast_mark(self, addrs, level: int) -> None:
        """The allocations holding ``addrs``: 2, an operation may write or read them without a
        call; 1, only read them; 0, neither."""
        a = list(addrs)
        if a:
            self._held.core_fast_mark((ctypes.c_uint64 * len(a))(*a), len(a), int(level))

    def fast_mark_on(self, addrs, level: int, stream: int) -> None:
        """As ``fast_mark``, for operations on ``stream`` alone (its effective handle): a record
        still loading, whose load that stream was made to wait for. The core lock must be held
        (any thread: the allocation table must not change meanwhile)."""
        a = list(addrs)
        if a:
            self.lib.core_fast_mark_on((ctypes.c_uint64 * len(a))(*a), len(a), int(level), int(stream))

    def fast_unready(self, base: int, size: int) -> None:
        self.lib.core_fast_unready(base, size)

    def fast_unready_all(self) -> None:
        self.lib.core_fast_unready_all()

    def fast_slow_cbid(self, cbid: int) -> None:
        """Copies of this API always go to Python (their addresses are not the core's to read)."""
        self.lib.core_fast_slow_cbid(cbid)

    def fast_uncovered(self, records: dict[int, int]) -> int:
        """How many of ``records`` (base -> bytes) no allocation of the core holds whole."""
        if not records:
            return 0
        n = len(records)
        bases = (ctypes.c_uint64 * n)(*records.keys())
        sizes = (ctypes.c_uint64 * n)(*records.values())
        return int(self.lib.core_fast_uncovered(bases, sizes, n))

    def fast_take(self) -> list[tuple]:
        """The operations that went without a call since the last take (``parse_fast``)."""
        n = ctypes.c_size_t()
        k = ctypes.c_uint32()
        return parse_fast(self._taken(self._held.core_fast_take(ctypes.byref(n), ctypes.byref(k)), n), self._fast_memo)

    def fast_counts(self) -> dict[str, int]:
        """Operations let go, the allowance left, entries queued; then why operations that
        would call the hooks did (``FAST_WHY``: the allowance spent, an allocation came or went,
        the queue full, an unknown access set, a record written not ready, one read not
        readable, a write that always calls), how often every mark was dropped at once, and
        an allocation marked for another stream than the operation's."""
        out = (ctypes.c_uint64 * (3 + len(FAST_WHY)))()
        self._held.core_fast_counts(out)
        return {"fast": int(out[0]), "left": int(out[1]), "queued": int(out[2]),
                **{k: int(v) for k, v in zip(FAST_WHY, out[3:])}}

    def fast_last_unready(self) -> int:
        """The start of the allocation whose missing mark made the last operation call, then
        forgotten (0: none since the last ask). Core lock held."""
        return int(self._held.core_fast_last_unready())

    def set_upcall(self, fn: Callable[[Any], int]) -> None:
        self._upcall = UPCALL_FN(fn)
        self.lib.core_set_upcall(self._upcall)


class NativeLock:
    """The core lock as the agent's lock (an RLock's interface). Acquiring it from Python lets the
    GIL go while waiting (ctypes), and then brings the agent's view up to date: no operation of
    the program can add to the view queue while it is held."""

    def __init__(self, core: NativeCore, on_acquire: Callable[[], None] | None = None) -> None:
        self._core = core
        self._on_acquire = on_acquire

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        lib = self._core.lib
        if not blocking:
            got = bool(lib.core_trylock_py(0.0))
        elif timeout is None or timeout < 0:
            lib.core_lock_py()
            got = True
        else:
            got = bool(lib.core_trylock_py(float(timeout)))
        if got and self._on_acquire is not None:
            try:
                self._on_acquire()
            except BaseException:
                lib.core_unlock()
                raise
        return got

    def release(self) -> None:
        self._core.lib.core_unlock()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class OwnThreads:
    """The agent's own thread ids (a set's add/discard/in), kept in the core too: the callback
    ignores their driver calls."""

    def __init__(self, core: NativeCore) -> None:
        self._core = core
        self._ids: set[int] = set()
        self._mu = threading.Lock()

    def add(self, tid: int) -> None:
        with self._mu:
            if tid not in self._ids and not self._core.lib.core_own(int(tid), 1):
                raise RuntimeError("the native core's table of agent threads is full")
            self._ids.add(tid)

    def discard(self, tid: int) -> None:
        with self._mu:
            if tid in self._ids:
                self._ids.discard(tid)
                self._core.lib.core_own(int(tid), 0)

    def __contains__(self, tid: object) -> bool:
        return tid in self._ids

    def __iter__(self):
        return iter(set(self._ids))

    def __len__(self) -> int:
        return len(self._ids)


def launch_args(u: Any) -> tuple[tuple[int, ...] | None, bytes | None]:
    """(parameter sizes, argument bytes) of an upcall's launch (None, None: not known)."""
    if u.args_len == NO_ARGS:
        return None, None
    sizes = tuple(u.sizes[i] for i in range(u.nparams))
    args = ctypes.string_at(u.args, u.args_len) if u.args_len else b""
    return sizes, args


def report(exc: BaseException, core: NativeCore, seen: set[str], what: str) -> None:
    """An exception inside an upcall: once per kind, in the trace and on stderr."""
    key = f"{what}: {type(exc).__name__}: {exc}"
    if key in seen:
        return
    seen.add(key)
    core.error(f"agent {key}")
    print(f"gpuos agent: {key}", file=sys.stderr, flush=True)
