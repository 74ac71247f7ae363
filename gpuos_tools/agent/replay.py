"""The validator process: replays a sampled launch in its own CUDA context, never in the program's.

`gpu-trace run --validate` starts one of these per traced program (lazily, at the first sampled
launch; gpuos_tools/agent/offload.py is the program's side). The program copies the bytes the
prediction names into a shared staging file and sends a request; this process

1. reserves the program's virtual addresses with the VMM API (its placeholders and address
   strategies are vaspace.py's), or, when the request says ``relocate``, maps the spans it could
   not have elsewhere and moves every word that points into them (``Moves``);
2. maps only the granules the prediction names: the predicted bytes hold their launch-time
   contents, the rest a poison, granules only read are mapped read-only where the driver takes it;
3. loads the kernel from its module image and launches it twice, under poisons 0x00 and 0xFF,
   then, where asked, bisects each pointer's read extent (``Replayer._extents``).

An illegal address is an access outside the prediction; changed chunks are the writes; bytes
that differ between the poisons were computed from unpredicted memory, a missed read. After a
sticky error the process answers, then exits, and the program's side starts a fresh one. The
verdicts, the limits and the read bisection are described in docs/access-prediction.md
("Where validation runs").
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import numpy as np

from gpuos_tools.agent.cuda_device import TIMED_OUT, CudaDevice, ReplayError
from gpuos_tools.agent.validate import CHUNK, Layout, extent_cuts, shortest_prefix
from gpuos_tools.agent.vaspace import KNOWN_STRATEGIES, STRATEGIES
from gpuos_tools.model.allocs import Allocation

#: the exit status after a sticky error: the program's side restarts the validator, quietly
EXIT_CONTEXT_LOST = 3
#: the exit status when the program went away
EXIT_ORPHANED = 4
#: driver errors that mean the kernel touched an address with no mapping (or wrote a read-only one)
ACCESS_FAULTS = ("CUDA_ERROR_ILLEGAL_ADDRESS",)
#: errors after which the context is unusable
STICKY = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_FAILED",
          "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_PC",
          "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_LAUNCH_TIMEOUT",
          TIMED_OUT)
POISONS = (0x00, 0xFF)
#: the byte that replaces zeros a launch updated in place, where zeroing them cannot show a read
#: (0x3F3F... is 0.75 as float32 and bfloat16, 1.8 as float16, 4.8e-4 as float64)
ZERO_POISON = 0x3F
#: a replay under ZERO_POISON runs at most this many times the control's time (a kernel that
#: waits on a counter it was given at zero may never end), and at least TIMEOUT_FLOOR_S
TIMEOUT_FACTOR = 50
TIMEOUT_FLOOR_S = 2.0
#: replays a launch's read-extent measurement may take (each a bisection step of one pointer)
EXTENT_RUNS = 256
#: reservations tried in one driver area of the program's refused whole (halves, then quarters...)
AREA_TRIES = 512

_LEN = struct.Struct("<I")
MAX_FRAME = 64 << 20


# ------------------------------------------------------------------ framing (both sides)

#: CUlaunchAttributeID values a replay may drop: they change when or how fast a grid runs, never
#: what it computes (an L2 access-policy window, programmatic stream serialization, which a
#: kernel's grid-dependency wait then meets at once, the event it triggers, a priority, memory
#: synchronization domains). Clusters and cooperative launches change what a kernel may do.
DROPPED_ATTRIBUTES = {0: "ignore", 1: "access policy window", 6: "programmatic stream serialization",
                      7: "programmatic event", 8: "priority", 9: "memory sync domain map", 10: "memory sync domain"}
#: the size of a CUlaunchAttribute: a 4-byte id, 4 of padding, a 64-byte value
LAUNCH_ATTRIBUTE_SIZE = 72


#: CUlaunchAttributeID values the replay launches with, as the program did (cuLaunchKernelEx):
#: a kernel may rely on its cluster (distributed shared memory) or on all its blocks being resident
REPLAYED_ATTRIBUTES = {2: "cooperative", 4: "cluster dimension", 5: "cluster scheduling policy preference"}


def attributes_refusal(ids: list[int]) -> str | None:
    """Why a launch with these launch attribute ids cannot be replayed, or None."""
    kept = sorted({i for i in ids if i not in DROPPED_ATTRIBUTES and i not in REPLAYED_ATTRIBUTES})
    if not kept:
        return None
    return f"launch attributes {', '.join(map(str, kept))} are not replayed"


def write_frame(f: BinaryIO, obj: Any) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def read_frame(f: BinaryIO) -> Any | None:
    """The next frame, None at a clean end of file; ValueError for a torn or oversized one."""
    head = f.read(_LEN.size)
    if not head:
        return None
    if len(head) < _LEN.size:
        raise ValueError("truncated frame header")
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    data = f.read(n)
    if len(data) < n:
        raise ValueError("truncated frame")
    return json.loads(data)


# ------------------------------------------------------------------ the device

class Space(Protocol):
    """This process's hold on the program's addresses (vaspace.AddressClaims; tests pass a fake)."""

    def claim(self, windows: list[tuple[int, int]]) -> list[tuple[int, int]]: ...
    def release(self, addr: int, size: int) -> None: ...
    def holder(self, addr: int, size: int) -> str: ...
    def by_driver(self, addr: int, size: int) -> bool: ...


class Device(Protocol):
    """What the replay needs of the GPU (CudaDevice; unit tests pass a fake)."""

    granularity: int

    def reserve(self, addr: int, size: int) -> int: ...
    def free_address(self, addr: int, size: int) -> None: ...
    def map(self, addr: int, size: int) -> None: ...
    def unmap(self, addr: int, size: int) -> None: ...
    def protect(self, addr: int, size: int, read_only: bool) -> bool: ...
    def upload(self, addr: int, data: np.ndarray) -> None: ...
    def download(self, addr: int, size: int) -> np.ndarray: ...
    def load(self, image: bytes, name: str) -> tuple[Any, Any]: ...
    def unload(self, module: Any) -> None: ...
    def set_variable(self, module: Any, name: str, data: bytes) -> None: ...
    def launch(self, fn: Any, grid: list[int], block: list[int], shared: int, params: list[bytes],
               attributes: list[tuple[int, bytes]] = (), timeout: float | None = None) -> str | None: ...


# ------------------------------------------------------------------ the replay

@dataclass
class Region:
    """Bytes the prediction names, as staged: [addr, addr + size) at ``offset`` in the staging file."""

    addr: int
    size: int
    offset: int
    mode: str  #: "r", "w" or "rw"


def spans_of(regions: list[Region], granularity: int) -> list[tuple[int, int, bool]]:
    """(start, size, read only) of the granule-aligned spans covering the regions, merged."""
    out: list[list[Any]] = []
    for r in sorted(regions, key=lambda r: r.addr):
        lo = r.addr // granularity * granularity
        hi = -(-(r.addr + r.size) // granularity) * granularity
        ro = r.mode == "r"
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
            out[-1][2] = out[-1][2] and ro
        else:
            out.append([lo, hi, ro])
    return [(lo, hi - lo, ro) for lo, hi, ro in out]


class Moves:
    """Spans replayed away from the program's addresses: [lo, hi) of the program's moved to ``to``.

    A kernel finds its buffers through pointers: in its parameters, in memory it reads (pointer
    tables, argument structures), in its module's variables. Every aligned 8-byte word there whose
    value lies in a moved span (or at its end, where no other span starts) is moved with it. A
    word of data that happens to hold such a value (a subnormal double, an integer near 2^47) would
    be moved too; a pointer the kernel builds from something else (an offset from another buffer,
    a 32-bit index) is not, and reads the program's address, where this process has its own
    memory or nothing."""

    def __init__(self, moved: list[tuple[int, int, int]], spans: list[tuple[int, int, bool]]):
        self.moved = sorted(moved)
        starts = {s for s, _, _ in spans}
        #: the span ends a one-past-the-end pointer may name without meaning the next span
        self._ends = {hi for _, hi, _ in self.moved if hi not in starts}

    def __bool__(self) -> bool:
        return bool(self.moved)

    def address(self, addr: int) -> int:
        """Where the program's ``addr`` is in this process."""
        for lo, hi, to in self.moved:
            if lo <= addr < hi:
                return to + addr - lo
        return addr

    def words(self, words: np.ndarray, eligible: np.ndarray | None = None) -> np.ndarray:
        """Indices of the uint64 ``words`` that point into a moved span (only where ``eligible``),
        and their values moved; in place."""
        hit = np.zeros(len(words), dtype=bool)
        out = words.copy()
        for lo, hi, to in self.moved:
            m = (words >= np.uint64(lo)) & (words < np.uint64(hi))
            if hi in self._ends:
                m |= words == np.uint64(hi)
            if eligible is not None:
                m &= eligible
            if m.any():
                out[m] = words[m] - np.uint64(lo) + np.uint64(to)
                hit |= m
        idx = np.flatnonzero(hit)
        words[idx] = out[idx]
        return idx

    def patch(self, data: bytes) -> tuple[bytes, int]:
        """``data`` (a parameter, a variable) with its aligned words moved, and how many were."""
        n = len(data) // 8 * 8
        if not n:
            return data, 0
        words = np.frombuffer(data[:n], dtype="<u8").copy()
        idx = self.words(words)
        return (words.tobytes() + data[n:], len(idx)) if len(idx) else (data, 0)


def _chunks(byte_mask: np.ndarray) -> np.ndarray:
    return byte_mask.reshape(-1, CHUNK).any(axis=1)


class Replayer:
    """Replays requests on a Device and turns what it saw into validation record bodies."""

    def __init__(self, device: Device, space: Space | None = None, whole: bool = False):
        if device.granularity % CHUNK:
            raise ValueError(f"granularity {device.granularity} is not a multiple of {CHUNK}")
        self.device = device
        self.space = space
        self.reserved: dict[int, int] = {}  #: start -> size of the reservations held at the program's addresses
        self.lost = False  #: a sticky error ended the context: answer, then exit
        self.whole = whole  #: the ``whole`` address strategy: the program's driver areas reserved whole
        #: each area tried -> the runs of it that could not be had: [start, end, by, why]
        self.areas: dict[tuple[int, int], list[tuple[int, int, str, str]]] = {}

    def take_areas(self, areas: list[list[int]] | list[tuple[int, int]]) -> None:
        """Under ``whole``: reserve each of the program's driver areas ([addr, size]) at its
        address, once. An area refused whole is taken in halves, and so on down to single
        granules (at most ``AREA_TRIES`` reservations an area): what this process's own driver
        already uses in it stays refused, everything around that is held, so that neither its
        later module loads nor its own allocations can land on the program's addresses."""
        if not self.whole:
            return
        g = self.device.granularity
        for a, n in areas:
            lo, hi = int(a) - int(a) % g, -(-(int(a) + int(n)) // g) * g
            if (lo, hi) in self.areas or hi <= lo:
                continue
            refused: list[tuple[int, int, str, str]] = []
            self._take(lo, hi, refused, [AREA_TRIES])
            merged: list[tuple[int, int, str, str]] = []
            for r in refused:  # adjacent runs refused by the same holder, as one
                if merged and merged[-1][1] == r[0] and merged[-1][2] == r[2]:
                    merged[-1] = (merged[-1][0], r[1], r[2], merged[-1][3])
                else:
                    merged.append(r)
            self.areas[(lo, hi)] = merged

    def _take(self, lo: int, hi: int, refused: list, tries: list[int]) -> None:
        g = self.device.granularity
        if tries[0] <= 0:
            refused.append((lo, hi, "untried", "not asked for (too many refusals in the area)"))
            return
        tries[0] -= 1
        got = self._reserve(lo, hi - lo)
        if got is None:
            return
        if hi - lo <= g:
            refused.append((lo, hi, got[1], got[0]))
            return
        mid = lo + (hi - lo) // 2 // g * g or lo + g
        self._take(lo, mid, refused, tries)
        self._take(mid, hi, refused, tries)

    def _area_note(self, addr: int) -> str:
        """Under ``whole``, for a refused address: what became of the program's driver area
        around it (held whole, or all but the runs refused, and the refusal at this address), so
        that a run says why."""
        if not self.whole:
            return ""
        for (lo, hi), refused in self.areas.items():
            if lo <= addr < hi:
                head = f"; its driver area [{lo:#x}, {hi:#x})"
                for s, e, by, why in refused:
                    if s <= addr < e:
                        return f"{head} was held but for [{s:#x}, {e:#x}), refused by the {by}: {why}"
                lost = sum(e - s for s, e, _, _ in refused)
                return f"{head} was held" + (f" but for {lost} bytes elsewhere in it" if lost else " whole")
        return f"; no driver area of the program's was named around it ({len(self.areas)} named)"

    def area_counts(self) -> dict[str, int]:
        """Areas held whole, held but for some runs, and the bytes of those runs."""
        out = {"held": 0, "held_in_part": 0, "refused_bytes": 0}
        for refused in self.areas.values():
            out["held_in_part" if refused else "held"] += 1
            out["refused_bytes"] += sum(e - s for s, e, _, _ in refused)
        return out

    def hold(self, windows: list[list[int]]) -> None:
        """Keep the program's [addr, size] windows free of anything of this process's own (a
        request names them before this process maps its staging or loads a module)."""
        if self.space is not None and windows:
            self._claim([(int(a), int(n)) for a, n in windows])

    def _claim(self, windows: list[tuple[int, int]]) -> None:
        """Hold the windows, less what this process has reserved there already."""
        held = sorted((s, s + n) for s, n in self.reserved.items())
        parts = []
        for a, n in windows:
            pos, end = a, a + n
            for s, e in held:
                if e <= pos or s >= end:
                    continue
                if s > pos:
                    parts.append((pos, s - pos))
                pos = max(pos, e)
            if pos < end:
                parts.append((pos, end - pos))
        self.space.claim(parts)

    def _reserve(self, start: int, size: int) -> tuple[str, str] | None:
        """Make [start, start + size) part of a reservation at exactly that address: None, or why
        it cannot be had and who refused it ("driver": nothing of this process's but the driver's
        sits there; "validator": something else of this process's does). A reservation it
        overlaps is grown into one covering both."""
        dev, end = self.device, start + size
        if any(s <= start and end <= s + n for s, n in self.reserved.items()):
            return None
        overlap = [(s, n) for s, n in self.reserved.items() if s < end and start < s + n]
        lo = min([start] + [s for s, _ in overlap])
        hi = max([end] + [s + n for s, n in overlap])
        for s, n in overlap:
            dev.free_address(s, n)
            del self.reserved[s]
        if self.space is not None:
            self.space.release(lo, hi - lo)
        got = dev.reserve(lo, hi - lo)
        if got == lo:
            self.reserved[lo] = hi - lo
            return None
        dev.free_address(got, hi - lo)
        held = self.space.holder(start, size) if self.space is not None else "the driver gave another address"
        by = "driver" if self.space is None or self.space.by_driver(start, size) else "validator"
        for s, n in overlap:  # what was ours a moment ago
            if dev.reserve(s, n) == s:
                self.reserved[s] = n
        if self.space is not None:
            self._claim([(lo, hi - lo)])
        return f"unvalidated: address unavailable ({start:#x}: {held}; the driver offered {got:#x})", by

    def _room_elsewhere(self, spans: list[tuple[int, int]], live: list[list[int]]) -> list[tuple[int, int, int]]:
        """Reserve room for each (start, size) span where the driver offers, never over one of the
        program's ``live`` [addr, size] allocations (an unpredicted access to one must fault here,
        not land in a moved copy): (start, end, address) of those placed, all of them or none."""
        dev, g = self.device, self.device.granularity
        busy = sorted((int(a), int(a) + int(n)) for a, n in live)
        top = max([e for _, e in busy] + [s + n for s, n in spans])
        placed: list[tuple[int, int, int]] = []
        for start, size in spans:
            got = None
            for hint in (0, -(-top // g) * g + (1 << 30)):  # anywhere; else above all the program's
                addr = dev.reserve(hint, size)
                if not any(s < addr + size and addr < e for s, e in busy + [(t, t + h - l) for l, h, t in placed]):
                    got = addr
                    break
                dev.free_address(addr, size)
            if got is None:
                for lo, hi, to in placed:
                    dev.free_address(to, hi - lo)
                return []
            placed.append((start, start + size, got))
        return placed

    def close(self) -> None:
        """Give back every reservation (at the end of the input)."""
        for s, n in self.reserved.items():
            self.device.free_address(s, n)
        self.reserved.clear()

    def replay(self, req: dict[str, Any], staging: memoryview | bytes, image: bytes) -> dict[str, Any]:
        base = {"kernel": req["kernel"], "mode": "validator",
                "predicted": {"reads": req["reads"], "writes": req["writes"], "unknown": False}}
        if req.get("attributes"):
            base["attributes"] = sorted({ident for ident, _ in req["attributes"]})
        regions = [Region(*r) for r in req["regions"]]
        if not regions:
            return dict(base, checked=False, why="unvalidated: the prediction names no device memory")
        spans = spans_of(regions, self.device.granularity)
        dev = self.device
        mapped: list[tuple[int, int]] = []
        module = None
        moves = Moves([], spans)
        try:
            refusals = []
            for start, size, _ in spans:
                refused = self._reserve(start, size)
                if refused is not None:
                    if not req.get("relocate"):
                        return dict(base, checked=False, why=refused[0] + self._area_note(start),
                                    refused_by=refused[1])
                    refusals.append((start, size))
            if refusals:
                moved = self._room_elsewhere(refusals, req.get("live") or [])
                moves = Moves(moved, spans)
                if len(moved) < len(refusals):
                    return dict(base, checked=False, why="unvalidated: address unavailable, and no "
                                "address away from the program's live allocations to move it to")
            at = moves.address
            for start, size, _ in spans:
                dev.map(at(start), size)
                mapped.append((at(start), size))
            module, fn = dev.load(image, req["function"])
            params = _split(bytes.fromhex(req["params"]), req["sizes"])
            total = sum(s for _, s, _ in spans)
            predicted = self._predicted_mask(spans, regions, total)
            runs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            ro_taken: list[bool] = []
            variables = [(name, bytes(staging[off : off + n])) for name, off, n in req.get("variables", ())]
            pointers = None
            if moves:
                params, n_params = zip(*(moves.patch(p) for p in params)) if params else ((), ())
                params = list(params)
                variables = [(name, *moves.patch(data)) for name, data in variables]
                n_vars = sum(n for _, _, n in variables)
                variables = [(name, data) for name, data, _ in variables]
                # the pointers in the predicted bytes: words wholly predicted, found once (the
                # poison around them must not decide which words are pointers)
                words = self._image(spans, regions, staging, 0, total).view("<u8")
                idx = moves.words(words, predicted.reshape(-1, 8).all(axis=1))
                pointers = (idx, words[idx])
                base["relocated"] = {"spans": [[lo, hi - lo, to] for lo, hi, to in moves.moved],
                                     "pointers": {"parameters": int(sum(n_params)), "memory": int(len(idx)),
                                                  "variables": int(n_vars)}}
            control_s = 0.0
            for fill in POISONS:
                init = self._image(spans, regions, staging, fill, total)
                if pointers is not None:
                    init.view("<u8")[pointers[0]] = pointers[1]
                began = time.monotonic()
                err = self._run(spans, init, module, fn, req, params, variables, ro_taken, at)
                control_s = max(control_s, time.monotonic() - began)
                if err is not None:
                    return self._failed(base, err, total)
                runs[fill] = (init, self._read(spans, total, at))
            rec = self._judge(base, spans, req, predicted, runs)
            if rec["reads"] == "missed":
                init = runs[POISONS[0]][0]
                err = self._run(spans, init, module, fn, req, params, variables, ro_taken, at)
                if err is not None:
                    return self._failed(base, err, total)
                again = self._read(spans, total, at)
                if np.any((again != runs[POISONS[0]][1]) & self._judged(predicted, runs)):
                    rec["reads"] = "nondeterministic"
                    rec["nondeterministic"] = rec.pop("read_effects")
            if any(ro for _, _, ro in spans):
                rec["read_only"] = "enforced" if all(ro_taken) else "refused"
            if req.get("extents") and rec["reads"] != "nondeterministic":
                holders = self._pointer_words(spans, regions, staging, predicted, total)
                deadline = max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * control_s)
                ext = self._extents(req["extents"], spans, predicted, holders, runs, rec["written"],
                                    lambda image, timeout=None: self._run(spans, image, module, fn, req, params,
                                                                          variables, [], at, timeout),
                                    lambda idx: self._read_spans(spans, idx, at), deadline)
                if ext is not None:
                    rec["extents"] = ext
            return rec
        except ReplayError as exc:
            if exc.code in STICKY:
                self.lost = True
            return dict(base, checked=False, why=f"unvalidated: {exc}")
        finally:
            if not self.lost:
                if module is not None:
                    dev.unload(module)
                for start, size in mapped:
                    dev.unmap(start, size)
                for lo, hi, to in moves.moved:  # held for this replay only
                    dev.free_address(to, hi - lo)

    def _pointer_words(self, spans, regions: list[Region], staging, predicted: np.ndarray, total: int) -> np.ndarray:
        """Bytes of the aligned words, wholly predicted, that hold an address inside a span: a
        measurement never poisons them (a zeroed pointer would fault)."""
        words = self._image(spans, regions, staging, 0, total).view("<u8")
        hit = np.zeros(len(words), dtype=bool)
        for start, size, _ in spans:
            hit |= (words >= np.uint64(start)) & (words < np.uint64(start + size))
        hit &= predicted.reshape(-1, 8).all(axis=1)
        return np.repeat(hit, 8)

    def _extents(self, targets, spans, predicted: np.ndarray, holders: np.ndarray, runs, written,
                 run, read, deadline: float | None = None) -> list[dict[str, Any]] | None:
        """How far past each pointer the kernel reads, as the in-process validator measures it
        (validate.Validator._bisect): the shortest prefix of [pointer, end) whose predicted
        tail, zeroed, leaves every chunk the launch wrote as the control run (poison 0x00) left
        it, the zeroed bytes aside except those the control visibly wrote (an update in place
        reads them: a kernel that does not read them writes there what the control wrote); and
        how far past it the launch wrote. ``in_place``: the steps where only those bytes showed
        the read.

        Zeroing bytes that held zeros shows nothing, so an update in place of zeros (optimizer
        state at its first step, an output accumulated from zero) looked unread. Once every
        pointer is measured, a second bisection over the rest of each tail gives those bytes
        ZERO_POISON instead (``in_place_zeros``: the steps it showed a read), each run bounded
        by ``deadline`` seconds; where such a run fails the context is lost and the pointers not
        yet measured so keep the first answer. At most ``EXTENT_RUNS`` runs a launch; None when a
        run of the first bisection failed (the control then does not hold)."""
        init, control = runs[POISONS[0]]
        visible = init != control
        # zeros the control overwrote: zeroing them cannot show whether the kernel read them
        zero_updates = visible & (init == 0) & predicted & ~holders
        chunks = np.zeros(len(predicted) // CHUNK, dtype=bool)
        for i, after in runs.values():
            chunks |= _chunks(i != after)
        compare = np.repeat(chunks, CHUNK)
        offsets = np.cumsum([0] + [n for _, n, _ in spans])
        needed = [k for k in range(len(spans)) if compare[offsets[k] : offsets[k + 1]].any()]
        done: dict[tuple[int, int], dict[str, Any]] = {}
        order: list[tuple[int, int, tuple[int, int]]] = []  # (param, offset, its pointer's done key)
        budget = [EXTENT_RUNS]
        failed: list[str] = []

        def tail(cut: int, end: int) -> np.ndarray:
            zeroed = np.zeros(len(predicted), dtype=bool)
            for k, (s, n, _) in enumerate(spans):
                lo, hi = max(cut, s), min(end, s + n)
                if lo < hi:
                    zeroed[offsets[k] + lo - s : offsets[k] + hi - s] = True
            return zeroed & predicted & ~holders

        def unchanged(cut: int, end: int, seen: list[int], fill: bool) -> bool:
            """Whether poisoning [cut, end) left the launch's output as the control's."""
            if failed or budget[0] <= 0:
                raise _Stop
            budget[0] -= 1
            zeroed = tail(cut, end)
            image = init.copy()
            image[zeroed] = 0
            if fill:
                image[zeroed & zero_updates] = ZERO_POISON
            err = run(image, deadline) if fill else run(image)
            if err is not None:
                failed.append(err)
                raise _Stop
            got = read(needed)
            keep = compare & ~zeroed
            if not all(np.array_equal(got[k][keep[offsets[k] : offsets[k + 1]]],
                                      control[offsets[k] : offsets[k + 1]][keep[offsets[k] : offsets[k + 1]]])
                       for k in needed):
                return False
            overwritten = zeroed & visible
            if any(np.any((got[k] != control[offsets[k] : offsets[k + 1]])
                          & overwritten[offsets[k] : offsets[k + 1]]) for k in needed):
                seen[0] += 1
                return False
            return True

        later: list[tuple[dict[str, Any], list[int], int, int]] = []  # second bisection: (extent, cuts, from, held)
        for param, offset, ptr, end, base in targets:
            if not any(s <= ptr < s + n for s, n, _ in spans):
                continue  # not mapped here: the prediction named none of it
            if (ptr, end) in done:  # the same pointer passed twice: measured once
                order.append((param, offset, (ptr, end)))
                continue
            cuts = extent_cuts(ptr, end, base)
            in_place = [0]
            try:
                hi, steps = shortest_prefix(cuts, lambda cut, end=end: unchanged(cut, end, in_place, False))
            except _Stop:
                break
            wrote = [min(a + n, end) - ptr for a, n in written if a < end and ptr < a + n]
            # a pointer stored in the range is never zeroed, so the bisection cannot see it read:
            # those the argument points at count as read (a kernel finds its buffers through them)
            held = self._held_end(holders, spans, offsets, ptr, end, cuts)
            done[(ptr, end)] = {"param": param, "offset": offset, "ptr": ptr, "limit": end - ptr,
                                "read": max(cuts[hi], held) - ptr, "written": max(wrote, default=0),
                                "steps": steps, "in_place": in_place[0]}
            order.append((param, offset, (ptr, end)))
            if hi < len(cuts) - 1 and (tail(cuts[hi], end) & zero_updates).any():
                later.append((done[(ptr, end)], cuts, hi, held))
        if failed:
            if failed[0] in STICKY:
                self.lost = True
            return None
        for ext, cuts, first, held in later:
            seen = [0]
            end = cuts[-1]
            try:
                more, steps = shortest_prefix(cuts[first:], lambda cut: unchanged(cut, end, seen, True))
            except _Stop:
                break
            ext["read"] = max(cuts[first + more], held) - ext["ptr"]
            ext["steps"] += steps
            ext["in_place_zeros"] = seen[0]
        if failed and failed[0] in STICKY:
            self.lost = True
        return [done[key] if (done[key]["param"], done[key]["offset"]) == (param, offset)
                else dict(done[key], param=param, offset=offset, steps=0) for param, offset, key in order]

    @staticmethod
    def _held_end(holders: np.ndarray, spans, offsets, ptr: int, end: int, cuts: list[int]) -> int:
        """The first cut at or past the end of the pointer-holding words that start at ``ptr``
        (a table of pointers the argument points at), or ptr. Pointers stored further on, past
        bytes the bisection may zero, count only where it finds them read: a table that a
        caching allocator put after the array the argument names (cuBLAS's batched pointer
        arrays in CuPy's pool) is not the launch's."""
        last = ptr
        for k, (s, n, _) in enumerate(spans):
            if not s <= last < s + n:
                continue
            run = holders[offsets[k] + last - s : offsets[k] + min(end, s + n) - s]
            stop = np.flatnonzero(~run)
            last += int(stop[0]) if len(stop) else len(run)
            if len(stop) or last >= end:
                break
        return next(c for c in cuts if c >= last) if last > ptr else ptr

    def _read_spans(self, spans, idx: list[int], at) -> dict[int, np.ndarray]:
        return {k: self.device.download(at(spans[k][0]), spans[k][1]) for k in idx}

    @staticmethod
    def _predicted_mask(spans, regions: list[Region], total: int) -> np.ndarray:
        mask = np.zeros(total, dtype=bool)
        for r in regions:
            pos = _position(spans, r.addr)
            mask[pos : pos + r.size] = True
        return mask

    @staticmethod
    def _image(spans, regions: list[Region], staging, fill: int, total: int) -> np.ndarray:
        """The spans' contents at the launch: staged bytes where predicted, ``fill`` elsewhere."""
        init = np.full(total, fill, dtype=np.uint8)
        for r in regions:
            pos = _position(spans, r.addr)
            init[pos : pos + r.size] = np.frombuffer(staging, np.uint8, r.size, r.offset)
        return init

    def _run(self, spans, init: np.ndarray, module, fn, req, params, variables: list[tuple[str, bytes]],
             ro_taken: list[bool], at=lambda addr: addr, timeout: float | None = None) -> str | None:
        dev = self.device
        for name, data in variables:  # the module's variables as the program's were at its launch
            dev.set_variable(module, name, data)
        pos = 0
        for start, size, ro in spans:
            where = at(start)
            if ro:
                dev.protect(where, size, False)
            dev.upload(where, init[pos : pos + size])
            if ro:
                ro_taken.append(dev.protect(where, size, True))
            pos += size
        attributes = [(ident, bytes.fromhex(value)) for ident, value in req.get("attributes", ())]
        if timeout is None:
            return dev.launch(fn, req["grid"], req["block"], req["shared"], params, attributes)
        return dev.launch(fn, req["grid"], req["block"], req["shared"], params, attributes, timeout=timeout)

    def _read(self, spans, total: int, at=lambda addr: addr) -> np.ndarray:
        out = np.empty(total, dtype=np.uint8)
        pos = 0
        for start, size, _ in spans:
            out[pos : pos + size] = self.device.download(at(start), size)
            pos += size
        return out

    def _failed(self, base: dict[str, Any], err: str, total: int) -> dict[str, Any]:
        if err in STICKY:
            self.lost = True
        if err in ACCESS_FAULTS:
            return dict(base, checked=True, chunk=CHUNK, checked_bytes=total, written=[], missed_writes=[],
                        reads="missed", fault=err,
                        why="the replay faulted: the kernel touched memory outside the prediction "
                            "(or wrote memory it said it only reads)")
        return dict(base, checked=False, fault=err, why=f"unvalidated: the replay failed ({err})")

    @staticmethod
    def _judged(predicted: np.ndarray, runs) -> np.ndarray:
        """The bytes on which the two poisons' runs must agree: the predicted (the same launch-time
        contents in both), and those either run visibly wrote (changed from its image): a kernel
        that does not read the poison writes them alike in both, so an unpredicted byte updated
        in place is a missed read too; a byte neither run changed may be one no run writes."""
        (i0, a), (i1, b) = runs[POISONS[0]], runs[POISONS[1]]
        return predicted | (i0 != a) | (i1 != b)

    @staticmethod
    def _judge(base, spans, req, predicted: np.ndarray, runs) -> dict[str, Any]:
        layout = Layout([Allocation(0, s, n, "vmm") for s, n, _ in spans])
        written_b = np.zeros(len(predicted), dtype=bool)
        for init, after in runs.values():
            written_b |= init != after
        written = _chunks(written_b)
        wmask = layout.mask([(s, s + n) for s, n in req["writes"]])
        (_, a), (_, b) = runs[POISONS[0]], runs[POISONS[1]]
        effects = _chunks((a != b) & Replayer._judged(predicted, runs))
        rec = dict(base, checked=True, chunk=CHUNK, checked_bytes=int(len(predicted)),
                   written=layout.ranges(written), missed_writes=layout.ranges(written & ~wmask),
                   reads="missed" if effects.any() else "ok")
        if effects.any():
            rec["read_effects"] = layout.ranges(effects)
        return rec


class _Stop(Exception):
    """A read-extent measurement ends early (out of runs, or a run failed)."""


def _position(spans, addr: int) -> int:
    pos = 0
    for start, size, _ in spans:
        if start <= addr < start + size:
            return pos + addr - start
        pos += size
    raise ValueError(f"{addr:#x} is in no span")


def _split(data: bytes, sizes: list[int]) -> list[bytes]:
    out, pos = [], 0
    for n in sizes:
        out.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise ValueError(f"{len(data)} parameter bytes for sizes adding up to {pos}")
    return out


# ------------------------------------------------------------------ the process

def serve(replayer: Replayer, inp: BinaryIO, out: BinaryIO, directory: str) -> int:
    """Answer requests until end of input (0) or a lost context (EXIT_CONTEXT_LOST)."""
    while True:
        req = read_frame(inp)
        if req is None:
            replayer.close()
            return 0
        try:
            rec = _answer(replayer, req, directory)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            rec = {"kernel": req.get("kernel", ""), "checked": False, "mode": "validator",
                   "why": f"unvalidated: bad request ({type(exc).__name__}: {exc})"}
        rec["seq"] = req.get("seq")
        if replayer.lost:
            rec["restart"] = True  # this process exits: the program's side starts another
        write_frame(out, rec)
        if replayer.lost:
            return EXIT_CONTEXT_LOST


def _answer(replayer: Replayer, req: dict[str, Any], directory: str) -> dict[str, Any]:
    replayer.take_areas(req.get("areas") or [])  # areas the program's driver added since
    replayer.hold(req.get("claims") or [])  # first: the staging's mapping must not land there
    name = os.path.basename(req["staging"])  # only files of the program's private directory
    with open(os.path.join(directory, os.path.basename(req["image"]) + ".image"), "rb") as f:
        image = f.read()
    with open(os.path.join(directory, name), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return replayer.replay(req, b"", image)
        with mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            return replayer.replay(req, memoryview(m), image)


def _orphan_watch(parent: int, interval: float = 1.0) -> None:
    """End this process when the program that started it is gone, even in the middle of a replay
    that hangs (the end of its input is only seen between requests)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="gpuos-validator-watch", daemon=True).start()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpuos-validator", description="Replay sampled launches (see module doc).")
    ap.add_argument("--device", required=True, help="the PCI bus id of the program's GPU")
    ap.add_argument("--dir", required=True, help="the program's private staging directory")
    ap.add_argument("--claims", help="a JSON file naming the program's address windows and driver areas, held "
                                     "before the driver is loaded (python -m gpuos_tools.agent.validator does that)")
    ap.add_argument("--strategy", choices=KNOWN_STRATEGIES, default=STRATEGIES[0],
                    help="how to get the program's addresses (gpuos_tools/agent/vaspace.py)")
    return ap


def open_device(bus_id: str, strategy: Any = None) -> CudaDevice:
    """The validator's context, made the way the address strategy says (vaspace.AddressStrategy):
    the driver's library loaded first, so that its code is mapped before ``steer`` fills the
    address space; if the driver will not start with the placeholders in place, once more
    without them."""
    if strategy is None:
        return CudaDevice(bus_id)
    try:
        from cuda.bindings import driver as drv

        drv.cuDriverGetVersion()  # loads libcuda without initialising it
        strategy.before_init()
        device = CudaDevice(bus_id)
    except ReplayError as exc:
        print(f"gpuos-validator: {exc} with the program's windows held ({strategy.name}); again without them",
              file=sys.stderr)
        strategy.abandon()
        return CudaDevice(bus_id)
    strategy.after_init()
    for note in strategy.notes:
        print(f"gpuos-validator: {note}", file=sys.stderr)
    return device


def main(argv: list[str] | None = None, strategy: Any = None) -> int:
    """Serve requests on stdin/stdout. ``strategy`` (vaspace.AddressStrategy) holds the program's
    windows already: the entry point gpuos_tools/agent/validator.py starts it before this module,
    numpy and the driver load."""
    args = parser().parse_args(argv)
    _orphan_watch(os.getppid())
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    try:
        device = open_device(args.device, strategy)
    except ReplayError as exc:
        write_frame(out, {"ready": False, "why": str(exc)})
        return 1
    whole = strategy is not None and strategy.name == "whole"
    replayer = Replayer(device, strategy.space if strategy is not None else None, whole=whole)
    if whole:
        replayer.take_areas(strategy.areas)
    ready = {"ready": True, "granularity": replayer.device.granularity,
             "strategy": strategy.name if strategy is not None else None}
    if whole:
        ready["areas"] = replayer.area_counts()
    write_frame(out, ready)
    return serve(replayer, inp, out, args.dir)


if __name__ == "__main__":
    sys.exit(main())
