"""Checking the access speculation on the GPU, inside the traced program (`gpu-trace run --validate`).

For a sample of launches (the first few of each kernel, then every power of two), at the launch's
API enter and with the context idle:

1. every live device allocation is hashed in 128-byte chunks by a small PTX kernel (H0), and
   copied into a scratch snapshot (device memory; pinned host memory when that fails);
2. the kernel is launched again with the very same arguments: once untouched (the control), then
   with every byte outside the predicted read set set to 0x00, then to 0xFF, and, for extents,
   with the tail of each pointed-to range set to 0x00 (a bisection per pointer); after each trial
   the allocations are hashed and the snapshot written back, so the program sees none of it;
3. the program's own launch then runs; at its API exit everything is hashed again (H1): the
   chunks that changed are the bytes the kernel wrote, exactly, at chunk granularity.

Writes outside the predicted write set are missed writes. A trial under poison whose output
differs from the control's read poisoned memory: a missed read. Its output is every chunk the
poison did not touch, and, in the chunks it touched that the control wrote, every byte the control
visibly wrote (its value after the control differs from before): a kernel that does not read the
poison writes the same values there, so a difference is a read of what the launch overwrites (an
update in place); a byte the control did not visibly change is never compared, as it may be one
the kernel does not write (it keeps the poison) or rewrites with the same value. If the control
and the real run differ, the kernel is not deterministic (atomics, clocks, random numbers) and the
read checks are inconclusive. The extents (how far past each pointer the kernel reads and writes)
are the raw material of `gpu-predict-access --learn` size templates.

The prediction checked here is gpu-predict-access's at `range` granularity, made in-process from
the same records; the `validation` record carries absolute addresses so that any later
prediction (another granularity, templates) can be scored against the observation.

Known limits: a write that stores the value already there is invisible; poisoning with 0x00
cannot show reads of memory that already holds zeros (0xFF covers that for the whole-set check,
not for extents); an update in place is seen only where the poisoned input changes a value
the control visibly wrote (x *= 2 of a zeroed x: seen, except where x was zero already), and only
while the control wrote at most `INPLACE_MAX_BYTES` (64 MiB) in at most `INPLACE_MAX_PIECES`
pieces (the record's `why` says when it wrote more); memory outside traced allocations (module globals)
is neither hashed nor restored; a launch from another thread between the enter and exit
callbacks is attributed to the validated kernel (a false missed write, never a silent pass); host
(pinned) allocations are not checked.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import threading
import time
from typing import Any

import numpy as np

from gpuos_tools.agent.view import DEVICE_KINDS, ProcessView, launch_record
from gpuos_tools.model.allocs import Allocation

CHUNK = 128  #: bytes per hashed chunk (the PTX kernel below is written for this size)
POISONS = (0x00, 0xFF)
#: the most bytes (the chunks the control run changed, with the gaps between them) the in-place
#: comparison keeps on the host, two bytes each (the value after the control, and whether it
#: changed); a trial downloads those it poisoned
INPLACE_MAX_BYTES = 64 << 20
#: the most pieces those bytes may lie in (a trial downloads each piece it poisoned with a copy)
INPLACE_MAX_PIECES = 4096
#: changed chunks of one allocation closer than this are downloaded as one piece
INPLACE_GAP = 64 << 10
#: bytes downloaded at once when a trial's written bytes are compared
_FETCH = 8 << 20
_SEED = 0x9E3779B97F4A7C15

# One thread per 128-byte chunk: h = seed; for each 8-byte word w: h = (h ^ w) * FNV prime;
# h ^= h >> 29 (no position in the seed: a chunk hashes alike in any layout). Every step is a bijection of h, so any single changed word changes h.
# flags[index] = 1 when some word lies in [lo, hi) (the hull of live device allocations): the
# chunk may hold device pointers, which a trial must never poison.
_HASH_PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry gpuos_chunk_hash(
    .param .u64 p_src,
    .param .u64 p_out,
    .param .u64 p_n,
    .param .u64 p_seed,
    .param .u64 p_flags,
    .param .u64 p_lo,
    .param .u64 p_hi
)
{
    .reg .pred %p<6>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<20>;

    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd1, %r1, %r2;
    cvt.u64.u32 %rd2, %r3;
    add.u64 %rd1, %rd1, %rd2;
    ld.param.u64 %rd3, [p_n];
    setp.ge.u64 %p1, %rd1, %rd3;
    @%p1 bra DONE;
    ld.param.u64 %rd4, [p_src];
    cvta.to.global.u64 %rd4, %rd4;
    shl.b64 %rd5, %rd1, 7;
    add.u64 %rd4, %rd4, %rd5;
    ld.param.u64 %rd6, [p_seed];
    ld.param.u64 %rd13, [p_lo];
    ld.param.u64 %rd14, [p_hi];
    mov.u32 %r4, 0;
    mov.u64 %rd7, 0;
LOOP:
    add.u64 %rd8, %rd4, %rd7;
    ld.global.u64 %rd9, [%rd8];
    setp.ge.u64 %p3, %rd9, %rd13;
    setp.lt.u64 %p4, %rd9, %rd14;
    and.pred %p5, %p3, %p4;
    selp.u32 %r5, 1, 0, %p5;
    or.b32 %r4, %r4, %r5;
    xor.b64 %rd6, %rd6, %rd9;
    mul.lo.u64 %rd6, %rd6, 1099511628211;
    shr.u64 %rd10, %rd6, 29;
    xor.b64 %rd6, %rd6, %rd10;
    add.u64 %rd7, %rd7, 8;
    setp.lt.u64 %p2, %rd7, 128;
    @%p2 bra LOOP;
    ld.param.u64 %rd11, [p_out];
    cvta.to.global.u64 %rd11, %rd11;
    shl.b64 %rd12, %rd1, 3;
    add.u64 %rd11, %rd11, %rd12;
    st.global.u64 [%rd11], %rd6;
    ld.param.u64 %rd15, [p_flags];
    cvta.to.global.u64 %rd15, %rd15;
    add.u64 %rd15, %rd15, %rd1;
    st.global.u8 [%rd15], %r4;
DONE:
    ret;
}
"""


def extent_targets(found) -> list[tuple[int, int, int, int, int]]:
    """(param, offset, pointer, end, allocation start) of each pointer into device memory whose
    read extent is measured: up to the next pointer into the same allocation, or its end."""
    by_alloc: dict[int, list] = {}
    for f in found:
        if f.alloc is not None and f.alloc.kind in DEVICE_KINDS:
            by_alloc.setdefault(f.alloc.id, []).append(f)
    out = []
    for fs in by_alloc.values():
        starts = sorted({f.word for f in fs})
        for f in fs:
            nxt = [s for s in starts if s > f.word]
            out.append((f.param, f.offset, f.word, nxt[0] if nxt else f.alloc.end, f.alloc.addr))
    return out


def extent_cuts(ptr: int, end: int, base: int) -> list[int]:
    """The places a read extent may end: the pointer, each chunk boundary of its allocation
    (which starts at ``base``) after it, the end."""
    first = base + ((ptr - base) // CHUNK + 1) * CHUNK
    return [ptr, *range(first, end, CHUNK), end]


def shortest_prefix(cuts: list[int], ok) -> tuple[int, int]:
    """Binary search: the index of the first cut for which ``ok`` holds (the last is assumed
    to), and how many times ``ok`` was asked."""
    lo, hi, steps = -1, len(cuts) - 1, 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        steps += 1
        if ok(cuts[mid]):
            hi = mid
        else:
            lo = mid
    return hi, steps


class CudaFailure(Exception):
    """A driver call made by the validator failed."""


def _ok(result: tuple, what: str) -> Any:
    from cuda.bindings import driver as drv

    err = result[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaFailure(f"{what}: {err.name if hasattr(err, 'name') else err}")
    return result[1] if len(result) == 2 else result[1:]


_LAUNCH_ARGTYPES = {
    "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3,
    "cuLaunchCooperativeKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2,
    "cuLaunchKernelEx": [ctypes.c_void_p] * 4,
}


class Layout:
    """The chunks of a set of regions: which chunk covers which bytes."""

    def __init__(self, regions: list[Allocation], hull: tuple[int, int] | None = None):
        self.regions = regions
        starts, lens, base = [], [], []
        n = 0
        for a in regions:
            full, tail = divmod(a.size, CHUNK)
            base.append(n)
            k = full + (1 if tail else 0)
            starts.append(a.addr + CHUNK * np.arange(k, dtype=np.uint64))
            ln = np.full(k, CHUNK, dtype=np.uint64)
            if tail:
                ln[-1] = tail
            lens.append(ln)
            n += k
        self.base = base
        self.n = n
        self.addr = np.concatenate(starts) if starts else np.zeros(0, np.uint64)
        self.len = np.concatenate(lens) if lens else np.zeros(0, np.uint64)
        self.total = sum(a.size for a in regions)
        self.hull = hull or (min((a.addr for a in regions), default=0), max((a.end for a in regions), default=0))

    def subset(self, m: np.ndarray) -> Layout:
        """A layout of just the chunks in ``m``, in the same order (runs inside one region)."""
        parts = []
        for a, base in zip(self.regions, self.base):
            k = -(-a.size // CHUNK)
            idx = np.flatnonzero(m[base : base + k])
            if not len(idx):
                continue
            breaks = np.flatnonzero(np.diff(idx) != 1) + 1
            for run in np.split(idx, breaks):
                start = a.addr + CHUNK * int(run[0])
                end = min(a.addr + CHUNK * (int(run[-1]) + 1), a.end)
                parts.append(Allocation(0, start, end - start, a.kind))
        return Layout(parts)

    def mask(self, ranges: list[tuple[int, int]]) -> np.ndarray:
        """Chunks that overlap any of the [start, end) byte ranges."""
        m = np.zeros(self.n, dtype=bool)
        if not ranges or not self.n:
            return m
        ends = self.addr + self.len
        for start, end in ranges:
            lo = np.searchsorted(ends, np.uint64(start), side="right")
            hi = np.searchsorted(self.addr, np.uint64(end), side="left")
            if hi > lo:
                m[lo:hi] = True
        return m

    def runs(self, m: np.ndarray) -> list[tuple[int, int]]:
        """[start, end) byte ranges of the chunks in a mask, chunks that touch merged."""
        idx = np.flatnonzero(m)
        if not len(idx):
            return []
        starts = self.addr[idx]
        ends = starts + self.len[idx]
        cut = np.flatnonzero(starts[1:] != ends[:-1]) + 1
        return list(zip(starts[np.r_[0, cut]].tolist(), ends[np.r_[cut - 1, len(idx) - 1]].tolist()))

    def chunks_at(self, addrs) -> np.ndarray:
        """A mask of the chunks holding any of the addresses (each inside some chunk)."""
        m = np.zeros(self.n, dtype=bool)
        if len(addrs):
            m[np.searchsorted(self.addr, np.asarray(addrs, dtype=np.uint64), side="right") - 1] = True
        return m

    def pieces(self, m: np.ndarray, gap: int) -> list[tuple[int, int]]:
        """[start, end) byte ranges covering the chunks in a mask, runs of one region less than
        ``gap`` bytes apart merged (one driver copy never spans two allocations)."""
        out: list[tuple[int, int]] = []
        for a, base in zip(self.regions, self.base):
            k = -(-a.size // CHUNK)
            idx = np.flatnonzero(m[base : base + k])
            if not len(idx):
                continue
            cut = np.flatnonzero(np.diff(idx) * CHUNK > gap + CHUNK) + 1
            for first, last in zip(idx[np.r_[0, cut]].tolist(), idx[np.r_[cut - 1, len(idx) - 1]].tolist()):
                out.append((a.addr + CHUNK * first, min(a.addr + CHUNK * (last + 1), a.end)))
        return out

    def ranges(self, m: np.ndarray) -> list[list[int]]:
        """[start, size] byte ranges of the chunks in a mask, adjacent chunks merged."""
        out: list[list[int]] = []
        idx = np.flatnonzero(m)
        for i in idx:
            a, ln = int(self.addr[i]), int(self.len[i])
            if out and out[-1][0] + out[-1][1] == a:
                out[-1][1] += ln
            else:
                out.append([a, ln])
        return out


class WrittenBytes:
    """The bytes of some pieces of memory as a control run left them, and which of them it visibly
    wrote (changed from their value before the launch).

    A trial that changed the launch's inputs and left one of those bytes otherwise computed it
    from what the trial changed: a kernel that does not read it writes the same value to the same
    place (it is deterministic: the control and the real run agreed). Bytes the control did not
    visibly change are never compared: the kernel may not write them (a trial's poison stays
    there) or write the value they held."""

    def __init__(self, pieces: list[tuple[int, int]], after: list[np.ndarray], before: list[np.ndarray]):
        self.pieces = pieces  # [start, end), by address, disjoint
        self.after = after
        self.visible = [a != b for a, b in zip(after, before)]

    def differing(self, ranges: list[tuple[int, int]], fetch, first: bool = False) -> list[int]:
        """Start addresses of the 128-byte chunks (counted from each piece's start) in which a
        visibly written byte inside the sorted [start, end) ``ranges`` now differs from the
        control's value; ``fetch(addr, n)`` reads the bytes there now. With ``first``, at most
        one."""
        out: list[int] = []
        i = j = 0
        while i < len(self.pieces) and j < len(ranges):
            (ps, pe), (rs, re) = self.pieces[i], ranges[j]
            lo, hi = max(ps, rs), min(pe, re)
            for pos in range(lo, hi, _FETCH):
                n = min(_FETCH, hi - pos)
                vis = self.visible[i][pos - ps : pos - ps + n]
                if not vis.any():
                    continue
                off = np.flatnonzero((fetch(pos, n) != self.after[i][pos - ps : pos - ps + n]) & vis)
                if len(off):
                    starts = np.unique((pos - ps + off) // CHUNK) * CHUNK + ps
                    out.extend(starts[:1].tolist() if first else starts.tolist())
                    if first:
                        return out
            if pe < re:
                i += 1
            else:
                j += 1
        return sorted(set(out))


def complement(regions: list[Allocation], keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges of the regions outside every [start, end) in ``keep``."""
    keep = sorted(keep)
    out = []
    for a in regions:
        pos = a.addr
        for s, e in keep:
            if e <= pos or s >= a.end:
                continue
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
        if pos < a.end:
            out.append((pos, a.end))
    return out


class Validator(ProcessView):
    """Samples launches and checks their predicted access sets (see the module docstring)."""

    def __init__(self, samples: int = 3, max_bytes: int = 8 << 30, extents: bool = True,
                 max_launches: int = 100_000, inplace_max_bytes: int = INPLACE_MAX_BYTES) -> None:
        self.samples = samples
        self.max_bytes = max_bytes
        self.extents = extents
        self.max_launches = max_launches
        self.inplace_max_bytes = inplace_max_bytes
        super().__init__()
        self.seen: dict[int, int] = {}  # func -> launches seen
        self.validated = 0
        self.busy_tid = 0  # the thread inside the validator: its own CUDA calls are not traced
        self.lock = threading.RLock()
        self.pending: dict[int, dict[str, Any]] = {}
        self._hash_fn: dict[int, Any] = {}  # context -> hash kernel
        self._launchers: dict[str, Any] = {}

    def regions(self) -> list[Allocation]:
        return self.device_allocations()

    # -- sampling -----------------------------------------------------------------------------

    def wants(self, func: int) -> bool:
        n = self.seen.get(func, 0) + 1
        self.seen[func] = n
        if self.validated >= self.max_launches:
            return False
        return n <= self.samples or (n & (n - 1)) == 0

    # -- driver helpers -----------------------------------------------------------------------

    def _hash_kernel(self):
        from cuda.bindings import driver as drv

        ctx = int(_ok(drv.cuCtxGetCurrent(), "cuCtxGetCurrent"))
        fn = self._hash_fn.get(ctx)
        if fn is None:
            mod = _ok(drv.cuModuleLoadData(_HASH_PTX + b"\0"), "cuModuleLoadData(hash kernel)")
            fn = _ok(drv.cuModuleGetFunction(mod, b"gpuos_chunk_hash"), "cuModuleGetFunction")
            self._hash_fn[ctx] = fn
        return fn

    def hash(self, layout: Layout, out_dev: int, flags: np.ndarray | None = None) -> np.ndarray:
        """Per-chunk hashes of every region, as uint64 (tails hashed on the host). With
        ``flags``, also mark the chunks holding a word inside the allocations' hull."""
        from cuda.bindings import driver as drv

        fn = self._hash_kernel()
        lo, hi = layout.hull
        flags_dev = out_dev + 8 * layout.n
        vals = (ctypes.c_uint64 * 7)()
        ptrs = (ctypes.c_void_p * 7)(*[ctypes.addressof(vals) + 8 * i for i in range(7)])
        tails = []
        for a, base in zip(layout.regions, layout.base):
            full, tail = divmod(a.size, CHUNK)
            if full:
                vals[:] = [a.addr, out_dev + 8 * base, full, _SEED, flags_dev + base, lo, hi]
                _ok(drv.cuLaunchKernel(fn, (full + 255) // 256, 1, 1, 256, 1, 1, 0, 0,
                                       ctypes.addressof(ptrs), 0), "cuLaunchKernel(hash)")
            if tail:
                tails.append((base + full, a.addr + CHUNK * full, tail))
        out = np.empty(layout.n, dtype=np.uint64)
        _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        if layout.n:
            _ok(drv.cuMemcpyDtoH(out.ctypes.data, out_dev, 8 * layout.n), "cuMemcpyDtoH(hashes)")
            if flags is not None:
                _ok(drv.cuMemcpyDtoH(flags.ctypes.data, flags_dev, layout.n), "cuMemcpyDtoH(flags)")
        buf = ctypes.create_string_buffer(CHUNK)
        for index, addr, n in tails:
            _ok(drv.cuMemcpyDtoH(ctypes.addressof(buf), addr, n), "cuMemcpyDtoH(tail)")
            data = buf.raw[:n]
            out[index] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
            if flags is not None:
                flags[index] = any(lo <= w < hi for (w,) in struct.iter_unpack("<Q", data[: n // 8 * 8]))
        return out

    def stored_pointers(self, layout: Layout, flags: np.ndarray) -> list[list[int]]:
        """[where, target] for each word in a flagged chunk that points into a live allocation."""
        from cuda.bindings import driver as drv

        found = []
        buf = ctypes.create_string_buffer(CHUNK)
        for i in np.flatnonzero(flags):
            addr, n = int(layout.addr[i]), int(layout.len[i])
            _ok(drv.cuMemcpyDtoH(ctypes.addressof(buf), addr, n), "cuMemcpyDtoH(pointer chunk)")
            for k, (w,) in enumerate(struct.iter_unpack("<Q", buf.raw[: n // 8 * 8])):
                if self.pred.allocs.find(w) is not None:
                    found.append([addr + 8 * k, w])
        return found

    def _download(self, addr: int, n: int) -> np.ndarray:
        from cuda.bindings import driver as drv

        out = np.empty(n, dtype=np.uint8)
        if n:
            _ok(drv.cuMemcpyDtoH(out.ctypes.data, addr, n), "cuMemcpyDtoH(written bytes)")
        return out

    def _written_pieces(self, layout: Layout, changed: np.ndarray, why: list[str]) -> list[tuple[int, int]] | None:
        """The pieces of memory whose bytes the in-place comparison keeps: the chunks the control
        changed; None (and why) when they are more than the limits allow."""
        pieces = layout.pieces(changed, INPLACE_GAP)
        size = sum(e - s for s, e in pieces)
        if size > self.inplace_max_bytes or len(pieces) > INPLACE_MAX_PIECES:
            why.append(f"in-place reads not compared: the launch wrote {size} B in {len(pieces)} pieces (at most "
                       f"{self.inplace_max_bytes} B in {INPLACE_MAX_PIECES} are compared)")
            return None
        return pieces

    def _copy(self, pairs) -> None:
        from cuda.bindings import driver as drv

        for dst, src, n in pairs:
            _ok(drv.cuMemcpy(dst, src, n), "cuMemcpy(snapshot)")

    def _relaunch(self, launch: tuple) -> None:
        api, args = launch
        fn = self._launchers.get(api)
        if fn is None:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = getattr(lib, api)
            base = api.removesuffix("_ptsz").removesuffix("_ptds")
            fn.argtypes = _LAUNCH_ARGTYPES[base]
            fn.restype = ctypes.c_int
            self._launchers[api] = fn
        err = fn(*args)
        if err:
            raise CudaFailure(f"{api} (relaunch) returned CUresult {err}")

    # -- the check ----------------------------------------------------------------------------

    def enter(self, tid: int, api: str, raw: tuple, func: int, kernel: str, sizes: tuple | None,
              args: bytes | None, geometry: tuple | None = None) -> None:
        """At a sampled launch's API enter: trials under poison, then let the real launch run
        (``geometry``, what the validator process needs, goes unused here)."""
        from cuda.bindings import driver as drv

        t0 = time.perf_counter()
        acc, _info, found = self.pred.launch(launch_record(kernel, sizes, args, func))
        state: dict[str, Any] = {"kernel": kernel, "func": func, "t0": t0}
        state["reads"] = self._absolute(acc["reads"])
        state["writes"] = self._absolute(acc["writes"])
        state["unknown"] = acc["unknown"]
        regions = self.regions()
        layout = Layout(regions)
        why: list[str] = []
        if layout.total > self.max_bytes:
            why.append(f"live device memory {layout.total} B exceeds the validation limit {self.max_bytes} B")
            self.pending[tid] = {"skip": self._skipped(state, why)}
            return
        self.validated += 1
        state["layout"] = layout
        out_dev = int(_ok(drv.cuMemAlloc(max(16, 9 * layout.n)), "cuMemAlloc(hashes)"))
        state["out_dev"] = out_dev
        _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        flags = np.zeros(layout.n, dtype=np.uint8)
        state["h0"] = h0 = self.hash(layout, out_dev, flags)
        # chunks holding device pointers are never poisoned (a poisoned pointer faults)
        state["stored"] = stored = self.stored_pointers(layout, flags)
        holders = layout.mask([(w, w + 8) for w, _ in stored])
        state["holders"] = holders
        snap, host = self._snapshot(layout.total)
        trials: dict[str, Any] = {}
        state["trials"] = trials
        if snap is None:
            why.append("no memory for a snapshot: read checks skipped")
        else:
            saves, restores = [], []
            off = 0
            for a in regions:
                saves.append((snap + off, a.addr, a.size))
                restores.append((a.addr, snap + off, a.size))
                off += a.size
            try:
                self._copy(saves)
                run = lambda: (self._relaunch(raw), self.hash(layout, out_dev))[1]  # noqa: E731
                pieces, after, written = None, [], None
                try:
                    trials["control"] = run()
                    changed = trials["control"] != h0
                    if not state["unknown"]:  # what the control wrote, as it left it
                        pieces = self._written_pieces(layout, changed, why)
                        after = [self._download(s, e - s) for s, e in pieces or ()]
                finally:
                    self._copy(restores)
                if pieces is not None:  # and as it was before the launch
                    written = WrittenBytes(pieces, after, [self._download(s, e - s) for s, e in pieces])
                if state["unknown"]:
                    why.append("unknown launch: reads not checked (it may read anything)")
                else:
                    keep = [(s, s + n) for s, n in state["reads"]]
                    keep += [(int(layout.addr[i]), int(layout.addr[i] + layout.len[i])) for i in np.flatnonzero(holders)]
                    poison = complement(regions, keep)
                    trials["poison_mask"] = layout.mask(poison)
                    touched = layout.runs(trials["poison_mask"] & changed)
                    trials["in_place"] = {}
                    for value in POISONS:
                        try:
                            for s, e in poison:
                                _ok(drv.cuMemsetD8(s, value, e - s), "cuMemsetD8(poison)")
                            trials[value] = run()
                            if written is not None and touched:
                                seen = written.differing(touched, self._download)
                                trials["in_place"][value] = layout.chunks_at(seen)
                        finally:
                            self._copy(restores)
                    if self.extents:
                        # a trial's output can only differ where the kernel writes: hash just that
                        sub = layout.subset(changed)
                        sub_dev = int(_ok(drv.cuMemAlloc(max(16, 9 * sub.n)), "cuMemAlloc(hashes)"))
                        try:
                            run_sub = lambda: (self._relaunch(raw), self.hash(sub, sub_dev))[1]  # noqa: E731
                            trials["extents"] = self._bisect(found, sub, run_sub, restores, trials["control"][changed],
                                                             holders, layout, written)
                        finally:
                            drv.cuMemFree(sub_dev)
            except CudaFailure as exc:
                why.append(f"trial stopped: {exc}")
            finally:
                self._release(snap, host)
        state["why"] = why
        # the hash of the restored state must equal H0, or the program would see our trials
        if snap is not None and not np.array_equal(self.hash(layout, out_dev), h0):
            why.append("the snapshot did not restore every chunk: state after the trials differs")
        self.pending[tid] = state

    def _bisect(self, found, layout: Layout, run, restores, control: np.ndarray,
                holders: np.ndarray, full: Layout, written: WrittenBytes | None = None) -> list[dict[str, Any]]:
        """How far past each pointer the kernel reads: the shortest prefix whose poisoned tail
        (0x00, from there to the next pointer or the allocation's end) leaves every untouched
        chunk as the control run left it, and, with ``written``, every byte the control visibly
        wrote in the touched chunks (``layout`` holds just the chunks the control changed).
        Binary search over chunk boundaries (reads assumed to form a prefix; a hole in them makes
        the answer an upper bound, never too small). ``in_place``: the steps where only the
        written bytes showed the read."""
        from cuda.bindings import driver as drv

        out = []
        done: dict[tuple[int, int], dict[str, Any]] = {}
        pointer_chunks = [(int(full.addr[i]), int(full.addr[i] + full.len[i])) for i in np.flatnonzero(holders)]
        for param, offset, p, end, base in extent_targets(found):
            if (p, end) in done:  # the same pointer passed twice: measured once
                out.append(dict(done[(p, end)], param=param, offset=offset, steps=0))
                continue
            cuts = extent_cuts(p, end, base)
            in_place = [0]

            def ok(cut: int, end: int = end) -> bool:
                spans = complement([Allocation(0, cut, end - cut)], pointer_chunks)
                try:
                    for s, e in spans:
                        _ok(drv.cuMemsetD8(s, 0, e - s), "cuMemsetD8(extent)")
                    h = run()
                    touched = layout.mask(spans)
                    if not np.array_equal(h[~touched], control[~touched]):
                        return False
                    if written is not None and written.differing(layout.runs(touched), self._download, first=True):
                        in_place[0] += 1
                        return False
                    return True
                finally:
                    self._copy(restores)

            hi, steps = shortest_prefix(cuts, ok)
            done[(p, end)] = {"param": param, "offset": offset, "ptr": p, "limit": end - p,
                              "read": cuts[hi] - p, "steps": steps}
            if written is not None:
                done[(p, end)]["in_place"] = in_place[0]
            out.append(done[(p, end)])
        return out

    def _snapshot(self, total: int) -> tuple[int | None, bool]:
        from cuda.bindings import driver as drv

        if total == 0:
            return None, False
        err, ptr = drv.cuMemAlloc(total)
        if err == drv.CUresult.CUDA_SUCCESS:
            return int(ptr), False
        err, ptr = drv.cuMemHostAlloc(total, 0)
        if err == drv.CUresult.CUDA_SUCCESS:
            return int(ptr), True
        return None, False

    def _release(self, ptr: int | None, host: bool) -> None:
        from cuda.bindings import driver as drv

        if ptr is not None:
            drv.cuMemFreeHost(ptr) if host else drv.cuMemFree(ptr)

    def _absolute(self, entries: list[dict[str, Any]]) -> list[list[int]]:
        out = []
        for e in entries:
            a = self.by_id.get(e["alloc"])
            if a is not None:
                out.append([a.addr + e["offset"], e["size"]])
        return out

    @staticmethod
    def _skipped(state: dict[str, Any], why: list[str]) -> dict[str, Any]:
        return {"kernel": state["kernel"], "checked": False,
                "predicted": {"reads": state["reads"], "writes": state["writes"], "unknown": state["unknown"]},
                "why": "; ".join(why)}  # fmt: skip

    def exit(self, tid: int, result: int) -> dict[str, Any] | None:
        """At the API exit: hash again, compare, and return the validation record's body."""
        from cuda.bindings import driver as drv

        state = self.pending.pop(tid, None)
        if state is None:
            return None
        if "skip" in state:
            return state["skip"]
        layout: Layout = state["layout"]
        out_dev = state["out_dev"]
        try:
            if result:
                return {"kernel": state["kernel"], "checked": False, "why": f"the launch failed (CUresult {result})"}
            _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            h1 = self.hash(layout, out_dev)
        finally:
            drv.cuMemFree(out_dev)
        h0, trials, why = state["h0"], state["trials"], state["why"]
        changed = h1 != h0
        wmask = layout.mask([(s, s + n) for s, n in state["writes"]])
        missed_w = changed & ~wmask
        rec: dict[str, Any] = {
            "kernel": state["kernel"],
            "checked": True,
            "predicted": {"reads": state["reads"], "writes": state["writes"], "unknown": state["unknown"]},
            "chunk": CHUNK,
            "checked_bytes": layout.total,
            "written": layout.ranges(changed),
            "missed_writes": layout.ranges(missed_w),
        }
        if state["stored"]:
            rec["stored_pointers"] = state["stored"][:256]
        control = trials.get("control")
        if control is None:
            rec["reads"] = "skipped"
        elif not np.array_equal(control, h1):
            rec["reads"] = "nondeterministic"
            rec["nondeterministic"] = layout.ranges(control != h1)
        elif state["unknown"]:
            rec["reads"] = "skipped"
        else:
            untouched = ~trials["poison_mask"]
            diff = np.zeros(layout.n, dtype=bool)
            for value in POISONS:
                if value in trials:
                    diff |= (trials[value] != control) & untouched
                if value in trials.get("in_place", {}):  # written bytes in chunks the poison touched
                    diff |= trials["in_place"][value]
            rec["reads"] = "missed" if diff.any() else "ok"
            if diff.any():
                rec["read_effects"] = layout.ranges(diff)
        ext = trials.get("extents")
        if ext is not None and rec["reads"] == "nondeterministic":
            ext = None  # the bisection compared against a control that does not repeat
        if ext is not None:
            for e in ext:
                lo = layout.mask([(e["ptr"], e["ptr"] + e["limit"])])
                w = changed & lo
                if w.any():
                    last = np.flatnonzero(w)[-1]
                    e["written"] = int(layout.addr[last] + layout.len[last]) - e["ptr"]
                else:
                    e["written"] = 0
            rec["extents"] = ext
        if why:
            rec["why"] = "; ".join(why)
        rec["ms"] = round((time.perf_counter() - state["t0"]) * 1000, 3)
        return rec
