"""Speculating each launch's, copy's and memset's buffer accesses from a trace, in one pass.

`Predictor.feed` takes the records of a trace in order, replays allocations and frees into an
`AllocTable`, and returns an ``access`` record (see gpuos_tools/access/__init__.py) for each
launch, memcpy, memset and graph_launch. Per kernel, the prototype analysis (demangling,
parsing, classifying each parameter) is done once and cached by mangled name and parameter
count; per launch the work is finding the pointer words and looking them up.
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gpuos_tools.access.decoded import Decoded, Span
from gpuos_tools.access.extents import Decoders
from gpuos_tools.access.proto import CONST, POINTERS, REFERENCE, STRUCT, VALUE, prototype
from gpuos_tools.access.score import score
from gpuos_tools.access.templates import Templates
from gpuos_tools.access.variables import ModuleVariables
from gpuos_tools.cuda.elf import demangle
from gpuos_tools.model.allocs import Allocation, AllocTable

GRANULARITIES = ("alloc", "range", "extent")

#: Basis of a parameter whose type is not known: the kernel is extern "C", or its prototype
#: does not match the launch's parameters.
UNTYPED = "untyped"

#: Basis of a pointer found in device memory that an argument points to (contents known from a
#: small host-to-device copy, the `data` of a memcpy record).
STORED = "stored"

#: Basis of a pointer held in a variable of the launched kernel's own module (contents known from
#: a host-to-device copy into the variable the program located by name).
VARIABLE = "variable"

#: What each basis means for the memory behind a pointer found in that parameter.
BASIS_TEXT = {
    CONST: "a pointer to const: read only",
    "pointer": "a pointer to non-const: read and write",
    POINTERS: "a pointer to pointers: the buffers it lists are not followed",
    STRUCT: "passed by value (struct, array, lambda): direction unknown, read and write assumed",
    VALUE: "a scalar by its type, yet the word lies in a live allocation: read and write assumed",
    "reference": "a reference: direction unknown, read and write assumed",
    UNTYPED: "no parameter types (see the kernel's note): read and write assumed",
    STORED: "stored in device memory an argument points to (copied from the host): read and write assumed",
    VARIABLE: "stored in a variable of the kernel's module (copied from the host): read and write assumed",
}

GRAPH_WHY = "the graph's contents were not seen (built without stream capture, or captured before tracing)"


@dataclass(slots=True)
class KernelInfo:
    """What the prototype of one kernel says about each of its parameters."""

    kernel: str  #: mangled name (or the extern "C" name)
    name: str  #: demangled name
    types: tuple[str | None, ...]  #: each parameter's C++ type, None where unknown
    bases: tuple[str, ...]  #: each parameter's basis (see BASIS_TEXT)
    note: str  #: where the types came from, for people


def kernel_info(kernel: str, name: str | None, sizes: list[int]) -> KernelInfo:
    """Analyse a kernel's prototype against the parameter sizes of one of its launches."""
    mangled = kernel.startswith("_Z")
    demangled = name or (demangle(kernel) if mangled else kernel)
    n = len(sizes)
    if not mangled:
        bases = tuple(STRUCT if size > 8 else UNTYPED for size in sizes)
        note = 'extern "C" kernel: no prototype; parameters over 8 bytes are by-value structs'
        return KernelInfo(kernel, demangled, (None,) * n, bases, note)
    proto = prototype(demangled)
    if proto is None:
        note = "the demangled prototype could not be parsed: parameter types unknown"
        return KernelInfo(kernel, demangled, (None,) * n, (UNTYPED,) * n, note)
    if len(proto) != n:
        note = f"the prototype has {len(proto)} parameters, the launch {n}: types not used"
        return KernelInfo(kernel, demangled, (None,) * n, (UNTYPED,) * n, note)
    return KernelInfo(
        kernel, demangled, tuple(t for t, _ in proto), tuple(b for _, b in proto), "demangled prototype"
    )


@dataclass(slots=True)
class Finding:
    """One argument word that points into memory the launch may touch."""

    param: int
    offset: int  #: byte offset of the word inside its parameter
    word: int
    found: str  #: "dptr" (the driver said so), "scan" (it lies in a live allocation) or "stored"
    alloc: Allocation | None  #: None: a driver-confirmed pointer into no traced allocation
    via: int | None = None  #: "stored": the device address the pointer was read from


def _word(hexs: str, offset: int) -> int:
    return int.from_bytes(bytes.fromhex(hexs[2 * offset : 2 * offset + 16]), "little")


_WORDS_CACHE: dict[str, tuple[tuple[int, int], ...]] = {}


def _start(piece: tuple[int, bytes]) -> int:
    return piece[0]


_UNPACKERS: dict[int, Any] = {}


def _unpack_words(n: int) -> Any:
    """unpack_from of ``n`` little-endian 8-byte words (cached per n)."""
    f = _UNPACKERS.get(n)
    if f is None:
        f = _UNPACKERS[n] = struct.Struct(f"<{n}Q").unpack_from
    return f


def _nonzero_words(hexs: str) -> tuple[tuple[int, int], ...]:
    """(offset, value) of each non-zero aligned 8-byte word of a parameter's bytes (cached)."""
    words = _WORDS_CACHE.get(hexs)
    if words is None:
        raw = bytes.fromhex(hexs)
        n = len(raw) >> 3
        words = tuple([(off << 3, v) for off, v in enumerate(_unpack_words(n)(raw)) if v]) if n else ()
        if len(_WORDS_CACHE) > 65536:
            _WORDS_CACHE.clear()
        _WORDS_CACHE[hexs] = words
    return words


class Predictor:
    """Feed trace records in order; get an access record for each launch, copy and memset."""

    def __init__(self, granularity: str = "alloc", templates: Templates | None = None) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, not {granularity!r}")
        if templates is not None and granularity == "alloc":
            raise ValueError("size templates apply at range or extent granularity")
        self.granularity = granularity
        self.templates = templates if templates else None
        #: argument decoders: at extent their spans; at range which words are pointers and their
        #: directions (a word inside a decoded structure that is not one of its pointers is not a
        #: pointer: a size, a stride, the stack garbage in padding)
        self.decoders = Decoders() if granularity != "alloc" else None
        self.allocs = AllocTable()
        self._kernels: dict[tuple[str, int], KernelInfo] = {}
        self._counts = {"memcpy": 0, "memset": 0, "graph_launch": 0}
        #: allocation id -> [(offset, bytes)]: device memory whose contents came from the host
        self.contents: dict[int, list[tuple[int, bytes]]] = {}
        self.by_id: dict[int, Allocation] = {}  #: live allocations by id (for scoring)
        #: module variables the program located, and what it wrote into them
        self.variables = ModuleVariables()
        # A launch's prediction depends only on its kernel and argument bytes while the
        # allocation table and the known pointer arrays stay as they are; training loops repeat
        # the same launches, so predictions are memoized and the memo is dropped on any change.
        self._memo: dict[tuple, dict[str, Any]] = {}
        #: bumped whenever a launch's prediction may change for the same arguments (allocations
        #: added or removed, known device memory overwritten): callers' memos compare it
        self.epoch = 0
        # CUDA graphs: open stream captures (stream -> captured launch records), captured
        # graphs (graph -> records, None when the capture was not seen whole), executables
        self._captures: dict[int, list[dict[str, Any]]] = {}
        self._graphs: dict[int, list[dict[str, Any]] | None] = {}
        self._execs: dict[int, list[dict[str, Any]] | None] = {}
        #: access records found in the input by annotate(): dropped, each replaced by this
        #: predictor's own, so that a stream predicted twice is not a doubled workload
        self.replaced = 0
        #: at extent, (stream, address, bytes) while the last operation fed was a launch that
        #: wrote zeros to exactly those bytes (a decoded fill), else None: the launch after it on
        #: the same stream may bound a pointer by it (``Decoded.fresh``); any copy, memset, graph
        #: launch, free or other launch in between, on any stream, and it is gone
        self.last_zeroed: tuple[Any, int, int] | None = None
        self._zeroes: tuple[int, int] | None = None  #: what the last launch() zeroed, (address, bytes)

    # -- the stream --------------------------------------------------------------------------

    def feed(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """Apply one record; the access record it causes (with the record's ``ts``), or None."""
        out = self._feed(rec)
        if out is not None and "ts" in rec:
            out["ts"] = rec["ts"]
        return out

    def _feed(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        kind = rec["type"]
        if kind == "launch":
            return self._launch_memo(rec)
        if kind in ("memcpy", "memset", "graph_launch", "free"):
            self.last_zeroed = None
        if kind == "alloc":
            a = self.allocs.add(rec)
            self.by_id[a.id] = a
            self.invalidate()
        elif kind == "free":
            old = self.allocs.remove(rec)
            self.invalidate()
            if old is not None:
                self.contents.pop(old.id, None)
                self.by_id.pop(old.id, None)
        elif kind == "memcpy":
            return self._memcpy(rec)
        elif kind == "memset":
            return self._memset(rec)
        elif kind == "graph_launch":
            return self._graph_launch(rec)
        elif kind == "graph":
            self._graph_event(rec)
        elif kind == "symbol":
            self.variables.symbol(rec)
            self.invalidate()
        return None

    # -- CUDA graphs: a graph_launch runs the launches captured into its graph ---------------

    def _graph_event(self, rec: dict[str, Any]) -> None:
        event = rec.get("event")
        if event == "capture_begin":
            self._captures[rec.get("stream")] = []
        elif event == "capture_end":
            captured = self._captures.pop(rec.get("stream"), None)
            if rec.get("graph"):
                self._graphs[rec["graph"]] = captured
        elif event == "instantiate" and rec.get("exec"):
            self._execs[rec["exec"]] = self._graphs.get(rec.get("graph"))

    def _capture(self, rec: dict[str, Any]) -> None:
        """Keep a captured launch for the graph its stream's capture builds."""
        into = self._captures.get(rec.get("stream"))
        if into is None and self._captures:
            # a stream forked into the capture by an event: the newest capture it can belong to
            into = next(reversed(self._captures.values()))
        if into is not None:
            into.append(rec)

    def _graph_launch(self, rec: dict[str, Any]) -> dict[str, Any]:
        self._counts["graph_launch"] += 1
        out: dict[str, Any] = {"type": "access", "of": "graph_launch", "index": self._counts["graph_launch"]}
        if "graph" in rec:
            out["graph"] = rec["graph"]
        captured = self._execs.get(rec.get("graph"))
        if captured is None:
            out.update(reads=[], writes=[], unknown=True, why=GRAPH_WHY)
            return out
        # predicted now, against the allocations live now: the graph uses the addresses it baked in
        reads: dict[int, list] = {}
        writes: dict[int, list] = {}
        why: list[str] = []
        for launch in captured:
            acc = self.launch({**launch, "captured": False})[0]
            for into, entries in ((reads, acc["reads"]), (writes, acc["writes"])):
                for e in entries:
                    _merge(into, e["alloc"], e["offset"], e["size"], e["how"])
            if acc["unknown"]:
                why.append(f"captured launch {launch.get('seq')}: {acc.get('why', 'unknown')}")
        out.update(reads=_entries(reads), writes=_entries(writes), unknown=bool(why), launches=len(captured))
        if why:
            out["why"] = "; ".join(why)
        return out

    def annotate(self, records: Iterable[dict[str, Any]], validated: bool = False) -> Iterator[dict[str, Any]]:
        """Every record, each followed by the access record it causes.

        ``validated`` (the trace was made with --validate): a launch's access record is held
        until the next record, so that the `validation` following it can be scored into its
        ``validated`` entry (gpuos_tools/access/score.py).

        Access records already in the input (a stream predicted before) are dropped and
        counted in ``replaced``: the operations they describe get this predictor's records
        instead, so predicting twice gives one access record per operation, as once does.
        """
        feed = self.feed
        records = self._without_access(records)
        if not validated:
            for rec in records:
                yield rec
                out = feed(rec)
                if out is not None:
                    yield out
            return

        held = None
        for rec in records:
            if held is not None:
                if rec["type"] == "validation" and rec.get("seq") == held.get("seq"):
                    v = score(held, rec, self.by_id)
                    if v is not None:
                        held["validated"] = v
                yield held
                held = None
            yield rec
            out = feed(rec)
            if out is not None:
                if out["of"] == "launch":
                    held = out
                else:
                    yield out
        if held is not None:
            yield held

    def _without_access(self, records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for rec in records:
            if rec["type"] == "access":
                self.replaced += 1
            else:
                yield rec

    # -- launches ----------------------------------------------------------------------------

    def info_of(self, kernel: str, sizes: tuple[int, ...]) -> KernelInfo:
        """``info`` of a launch of ``kernel`` with parameters of ``sizes`` bytes."""
        info = self._kernels.get((kernel, len(sizes)))
        if info is None:
            info = self.info({"kernel": kernel, "params": [{"size": n} for n in sizes]})
        return info

    def info(self, rec: dict[str, Any]) -> KernelInfo:
        """The (cached) prototype analysis for a launch record's kernel."""
        params = rec.get("params") or ()
        kernel = rec.get("kernel") or rec.get("name") or ""
        key = (kernel, len(params))
        info = self._kernels.get(key)
        if info is None:
            info = kernel_info(kernel, rec.get("name"), [p.get("size", len(p.get("hex", "")) // 2) for p in params])
            self._kernels[key] = info
        return info

    def findings(self, rec: dict[str, Any]) -> list[Finding]:
        """The argument words of a launch that point into memory, in parameter order."""
        params = rec.get("params") or ()
        find = self.allocs.find
        out: list[Finding] = []
        dptrs = rec.get("dptrs")
        if dptrs is not None:
            for d in dptrs:
                i, off = d[0], d[1]
                word = _word(params[i]["hex"], off)
                out.append(Finding(i, off, word, "dptr", find(word)))
            return out
        hull = self.allocs.hull
        if hull is None:
            return out
        low, high = hull
        for i, p in enumerate(params):
            hexs = p.get("hex", "")
            if len(hexs) < 16:
                continue
            for off, word in _nonzero_words(hexs):
                if low <= word < high and (alloc := find(word)) is not None:
                    out.append(Finding(i, off, word, "scan", alloc))
        if self.contents:
            out += self._stored(out)
        return out

    def pointer_key(self, kernel: str, sizes: tuple[int, ...] | None, args: bytes | None) -> tuple | None:
        """What a range prediction of a launch (its parameter sizes, its argument bytes) depends
        on, with the allocation table and known contents as they are: (parameter, word, value)
        of each aligned 8-byte word of a parameter that lies inside the allocations' hull, as
        ``findings`` scans them. Launches with equal keys get equal predictions (the agent
        memoises on it). Where a decoder knows the kernel, the words its layout says are not
        pointers are left out and each pointer's direction is put in, so the key is as good as
        the decoded arguments. None where that is not all (arguments not decoded, or size
        templates, which read scalars too, and extent granularity, whose spans do)."""
        if sizes is None or args is None or self.templates is not None or self.granularity != "range":
            return None
        hull = self.allocs.hull
        if hull is None:
            return (kernel, sizes)
        low, high = hull
        found: list[tuple[int, int, int]] = []
        pos = 0
        for i, size in enumerate(sizes):
            n = size >> 3
            if n:
                ws = _unpack_words(n)(args, pos)
                if n == 1:
                    if low <= ws[0] < high:
                        found.append((i, 0, ws[0]))
                else:
                    found += [(i, j, w) for j, w in enumerate(ws) if low <= w < high]
            pos += size
        if found and self.decoders is not None:
            info = self.info_of(kernel, sizes)
            decoded = self.decoders.decode_raw(kernel, info.name, sizes, args)
            if decoded is not None:
                return (kernel, sizes, tuple(_laid_key(decoded, info.bases, found)), decoded.via)
        return (kernel, sizes, tuple(found))

    def _stored(self, found: list[Finding]) -> list[Finding]:
        """Pointers held in known device memory (a pointer array) that a found pointer reaches."""
        out: list[Finding] = []
        find = self.allocs.find
        for f in found:
            if f.alloc is None or f.alloc.id not in self.contents:
                continue
            at = f.word - f.alloc.addr
            pieces = self.contents[f.alloc.id]
            i = bisect_right(pieces, at, key=_start) - 1  # the one piece that can hold it
            if i >= 0 and at < pieces[i][0] + len(pieces[i][1]):
                start, data = pieces[i]
                first = at - start
                for k in range(first - first % 8 + (8 if first % 8 else 0), len(data) - 7, 8):
                    word = int.from_bytes(data[k : k + 8], "little")
                    if word and (alloc := find(word)) is not None:
                        out.append(Finding(f.param, f.offset, word, STORED, alloc, f.alloc.addr + start + k))
        return out

    def _known(self, addr: int, extent: int, data: bytes | None) -> None:
        """Bytes [addr, addr + extent) of device memory were overwritten, with ``data`` if known."""
        alloc = self.allocs.find(addr)
        if alloc is None:
            return
        off = addr - alloc.addr
        # the pieces are sorted by offset and never overlap: those overlapping the write are a
        # run [lo, hi), found by bisection (a PyTorch segment collects thousands of them)
        pieces = self.contents.get(alloc.id)
        gone: list[tuple[int, bytes]] = []
        lo = hi = 0
        if pieces:
            lo = bisect_right(pieces, off, key=_start)
            if lo and pieces[lo - 1][0] + len(pieces[lo - 1][1]) > off:
                lo -= 1
            hi = bisect_left(pieces, off + extent, key=_start)
            gone = pieces[lo:hi]
        # Predictions read stored contents only for the pointers in them: bytes with no word
        # that points into an allocation (a batch of labels, a scalar) change none, and must
        # not throw away every memoised prediction (a training step copies some each step).
        if (data and self._has_pointer(data)) or any(self._has_pointer(d) for _, d in gone):
            self.invalidate()
        if pieces is None:
            if data:
                self.contents[alloc.id] = [(off, data)]
            return
        pieces[lo:hi] = [(off, data)] if data else []
        if not pieces:
            self.contents.pop(alloc.id, None)

    def _has_pointer(self, data: bytes) -> bool:
        """Whether an aligned 8-byte word of ``data`` is an address inside an allocation."""
        hull = self.allocs.hull
        if hull is None:
            return False
        low, high = hull
        find = self.allocs.find
        n = len(data) >> 3
        return n > 0 and any(low <= w < high and find(w) is not None for w in _unpack_words(n)(data))

    def invalidate(self) -> None:
        """Forget memoised launch predictions: the allocation table or known memory changed
        (for callers that change ``allocs`` directly)."""
        self._memo.clear()
        self.epoch += 1

    def _launch_memo(self, rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("captured"):
            self._capture(rec)
        params = rec.get("params") or ()
        key = (rec.get("kernel"), tuple([p.get("hex") for p in params]), rec.get("captured"),
               rec.get("result"), rec.get("layout"), "dptrs" in rec)
        if self.decoders is not None:  # a decoder may check the launch's shape
            key += (tuple(rec.get("grid") or ()), tuple(rec.get("block") or ()))
        if self.variables and self.variables.of_function(rec.get("func")):
            key += (rec.get("func"),)  # the same kernel in two loaded modules: two sets of variables
        after = self.zeroed_before(rec)
        if after is not None:
            key += (after,)
        memo = self._memo.get(key)
        if memo is None:
            acc = self.launch(rec, after)[0]
            memo = (acc, self._zeroes)
            if len(self._memo) >= 65536:
                self._memo.clear()
            self._memo[key] = memo
        hit, zeroes = memo
        self.last_zeroed = (rec.get("stream"), *zeroes) if zeroes is not None and not rec.get("captured") else None
        out = hit.copy()  # the reads/writes lists are shared: records are not mutated downstream
        out["seq"] = rec.get("seq")
        return out

    def zeroed_before(self, rec: dict[str, Any]) -> tuple[Any, int, int] | None:
        """``last_zeroed`` when it is the operation just before this launch on its stream (the
        launch runs now: not one captured into a graph)."""
        last = self.last_zeroed
        return last if last is not None and last[0] == rec.get("stream") and not rec.get("captured") else None

    def launch(self, rec: dict[str, Any], after: tuple[Any, int, int] | None = None
               ) -> tuple[dict[str, Any], KernelInfo, list[Finding]]:
        """The access record of a launch, with what it was inferred from. ``after``: the
        ``last_zeroed`` of the operation just before it on its stream, where the caller fed it."""
        info = self.info(rec)
        self._zeroes = None
        found = self.findings(rec)
        bases = info.bases
        whole = self.granularity == "alloc"
        reads: dict[int, list] = {}
        writes: dict[int, list] = {}
        why: list[str] = []
        followed = {f.param for f in found if f.found == STORED}
        templates = self.templates
        params = rec.get("params") or ()
        decoded: Decoded | None = None
        if self.decoders is not None and rec.get("layout") != "none":
            decoded = self.decoders.decode(info.kernel, info.name, rec)
        exact = self.granularity == "extent"
        for f in found:
            alloc = f.alloc
            if decoded is not None and f.found != STORED and (exact or _layout_decides(bases, f.param)):
                spans = decoded.spans.get((f.param, f.offset))
                if exact and spans is not None and after is not None and (f.param, f.offset) in decoded.fresh:
                    spans = _fresh(spans, decoded.fresh[(f.param, f.offset)], f.word, after)
                if spans is None:
                    if decoded.laid_out(f.param, f.offset):
                        continue  # the decoded layout says this word is not a pointer
                elif alloc is not None:
                    how = f"{f.found}:{decoded.via}"
                    if exact:
                        for into, span in zip((reads, writes), spans):
                            if span is not None:
                                _merge_span(into, alloc, f.word, span, how)
                    else:  # range: in the decoded directions, to the end or a template's size
                        self._decoded_range(info, f, alloc, spans, params, reads, writes, how)
                    continue
            if alloc is None:
                why.append(
                    f"param {f.param} +{f.offset}: device pointer {f.word:#x} (driver) in no traced allocation"
                )
                continue
            basis = STORED if f.found == STORED else bases[f.param] if f.param < len(bases) else UNTYPED
            if basis == POINTERS and f.param not in followed:
                why.append(f"param {f.param} is {info.types[f.param]}: the pointers it lists are in device "
                           "memory not copied from the host, and are not followed")
            how = STORED if basis == STORED else f"{f.found}:{basis}"
            if whole:
                offset, size = 0, alloc.size
            else:
                offset = f.word - alloc.addr
                size = alloc.size - offset
                if templates is not None and basis != STORED:
                    sizes = templates.sizes(info.kernel, f.param, f.offset, params)
                    if sizes is not None:
                        rs, ws = sizes
                        if rs is None:
                            _merge(reads, alloc.id, offset, size, how)
                        elif rs > 0:
                            _merge(reads, alloc.id, offset, min(rs, size), "template:" + basis)
                        if basis != CONST:
                            if ws is None:
                                _merge(writes, alloc.id, offset, size, how)
                            elif ws > 0:
                                _merge(writes, alloc.id, offset, min(ws, size), "template:" + basis)
                        continue
            _merge(reads, alloc.id, offset, size, how)
            if basis != CONST:
                _merge(writes, alloc.id, offset, size, how)
        if self.variables:
            self._variable_pointers(rec.get("func"), reads, writes, whole)
        if exact and decoded is not None and decoded.zeroes is not None and not rec.get("result"):
            param, offset, size = decoded.zeroes
            word = next((f.word for f in found if (f.param, f.offset) == (param, offset) and f.found != STORED), None)
            self._zeroes = (word, size) if word is not None else None
        out: dict[str, Any] = {"type": "access", "of": "launch", "seq": rec.get("seq"), "kernel": info.kernel}
        if rec.get("captured"):
            out["captured"] = True
        if rec.get("layout") == "none":
            why.insert(0, "no parameter layout (layout none): the arguments were not decoded")
        result = rec.get("result")
        unknown = bool(why)
        if result:
            # The driver refused the launch: nothing ran, whatever its arguments say.
            reads, writes, unknown = {}, {}, False
            why = [f"the launch failed (CUresult {result}): nothing ran"]
        out["reads"] = _entries(reads)
        out["writes"] = _entries(writes)
        out["unknown"] = unknown
        if why:
            out["why"] = "; ".join(why)
        return out, info, found

    def _decoded_range(self, info: KernelInfo, f: Finding, alloc: Allocation, spans: tuple,
                       params: Any, reads: dict[int, list], writes: dict[int, list], how: str) -> None:
        """A decoded pointer at range granularity: read and written as decoded, from the
        pointer to the end of its allocation or as far as a size template says."""
        offset = f.word - alloc.addr
        size = alloc.size - offset
        bounds: tuple = (None, None)
        if self.templates is not None:
            bounds = self.templates.sizes(info.kernel, f.param, f.offset, params) or bounds
        for into, span, bound in zip((reads, writes), spans, bounds):
            if span is None:
                continue
            if bound is not None and bound > 0:
                _merge(into, alloc.id, offset, min(bound, size), "template:" + how.split(":")[-1])
            else:
                _merge(into, alloc.id, offset, size, how)

    def _variable_pointers(self, func: int | None, reads: dict[int, list], writes: dict[int, list],
                           whole: bool) -> None:
        """Pointers the host stored in the launched function's module variables."""
        find = self.allocs.find
        for var in self.variables.of_function(func):
            how = f"{VARIABLE}:{var.name}"
            for word in var.words():
                alloc = find(word)
                if alloc is None:
                    continue
                offset = 0 if whole else word - alloc.addr
                size = alloc.size - offset
                _merge(reads, alloc.id, offset, size, how)
                _merge(writes, alloc.id, offset, size, how)

    # -- copies and memsets -------------------------------------------------------------------

    def _range(self, addr: int, extent: int, how: str, into: dict[int, list], why: list[str], device: bool) -> None:
        alloc = self.allocs.find(addr)
        if alloc is None:
            if device and addr and self.variables.find(addr) is not None:
                return  # a module variable: the driver's memory, known by name (no allocation's)
            if device and addr:
                why.append(f"device address {addr:#x} ({how}) in no traced allocation")
            return
        offset = addr - alloc.addr
        if offset + extent > alloc.size:
            why.append(f"{how} of {extent} bytes at +{offset} runs past the end of allocation {alloc.id}")
        if self.granularity == "alloc":
            _merge(into, alloc.id, 0, alloc.size, how)
        else:
            _merge(into, alloc.id, offset, min(extent, alloc.size - offset), how)

    def _memcpy(self, rec: dict[str, Any]) -> dict[str, Any]:
        self._counts["memcpy"] += 1
        direction = rec.get("dir")
        n = rec.get("bytes") or 0
        height = rec.get("height")
        width = rec.get("width")
        src_extent = dst_extent = n
        if height and width:
            src_extent = (height - 1) * (rec.get("src_pitch") or width) + width
            dst_extent = (height - 1) * (rec.get("dst_pitch") or width) + width
        reads: dict[int, list] = {}
        writes: dict[int, list] = {}
        why: list[str] = []
        if n:
            self._range(rec.get("src") or 0, src_extent, "copy source", reads, why, direction in ("DtoH", "DtoD"))
            self._range(rec.get("dst") or 0, dst_extent, "copy destination", writes, why, direction in ("HtoD", "DtoD"))
            data = rec.get("data")
            if writes or self.contents:
                self._known(rec.get("dst") or 0, dst_extent, bytes.fromhex(data) if data else None)
            if not writes and self.variables and direction != "DtoH":
                if self.variables.write(rec.get("dst") or 0, dst_extent, bytes.fromhex(data) if data else None):
                    self.invalidate()
        out = {"type": "access", "of": "memcpy", "index": self._counts["memcpy"],
               "reads": _entries(reads), "writes": _entries(writes), "unknown": bool(why)}  # fmt: skip
        if why:
            out["why"] = "; ".join(why)
        return out

    def _memset(self, rec: dict[str, Any]) -> dict[str, Any]:
        self._counts["memset"] += 1
        n = rec.get("bytes") or 0
        height = rec.get("height")
        extent = n
        if height and rec.get("pitch"):
            extent = (height - 1) * rec["pitch"] + n // height
        writes: dict[int, list] = {}
        why: list[str] = []
        if n:
            self._range(rec.get("dst") or 0, extent, "memset", writes, why, True)
            if self.contents:
                self._known(rec.get("dst") or 0, extent, None)
            if not writes and self.variables and self.variables.write(rec.get("dst") or 0, extent, None):
                self.invalidate()
        out = {"type": "access", "of": "memset", "index": self._counts["memset"],
               "reads": [], "writes": _entries(writes), "unknown": bool(why)}  # fmt: skip
        if why:
            out["why"] = "; ".join(why)
        return out


#: parameters whose words the prototype cannot tell from pointers (nor their direction): at range
#: a decoder's layout decides them; a typed pointer keeps its prototype's direction
_SCANNED = frozenset((STRUCT, UNTYPED, REFERENCE))


def _layout_decides(bases: tuple[str, ...] | list[str], param: int) -> bool:
    return (bases[param] if param < len(bases) else UNTYPED) in _SCANNED


def _laid_key(decoded: Decoded, bases: Any, found: list[tuple[int, int, int]]) -> Iterator[tuple]:
    """The (param, word, value) of ``found`` that the decoded layout leaves as pointers, each
    with the directions decoded for it (None: a word the layout does not decide)."""
    for i, j, w in found:
        if not _layout_decides(bases, i):
            yield i, j, w, None
            continue
        spans = decoded.spans.get((i, 8 * j))
        if spans is not None:
            yield i, j, w, spans[0] is not None, spans[1] is not None
        elif not decoded.laid_out(i, 8 * j):
            yield i, j, w, None


def _fresh(spans: tuple, row: int, word: int, after: tuple[Any, int, int]) -> tuple:
    """A ``Decoded.fresh`` pointer's spans, stopped at the end of the bytes the operation just
    before zeroed (``after``) when they start at the pointer and are whole rows."""
    _stream, start, size = after
    if start != word or size <= 0 or size % row:
        return spans
    return tuple(None if sp is None else (sp[0], size if sp[1] is None else min(sp[1], size)) for sp in spans)


def _merge_span(into: dict[int, list], alloc: Allocation, word: int, span: Span, how: str) -> None:
    """Add a decoded span of the pointer ``word``, clipped to its allocation."""
    lo, hi = span
    start = max(alloc.addr, word + lo)
    end = alloc.end if hi is None else min(alloc.end, word + hi)
    if end > start:
        _merge(into, alloc.id, start - alloc.addr, end - start, how)


def _merge(into: dict[int, list], alloc_id: int, offset: int, size: int, how: str) -> None:
    """Add [offset, offset + size) of an allocation; overlapping or touching ranges of one
    allocation become one, disjoint ones stay separate entries."""
    ranges = into.get(alloc_id)
    if ranges is None:
        into[alloc_id] = [[offset, size, how]]
        return
    if len(ranges) == 1:
        r = ranges[0]
        if r[0] == offset and r[1] == size:
            if r[2] != how and how not in r[2].split(","):
                r[2] += "," + how
            return
    end = offset + size
    keep = []
    hows: list[str] = []
    for r in ranges:
        if r[0] <= end and offset <= r[0] + r[1]:
            end = max(end, r[0] + r[1])
            offset = min(offset, r[0])
            hows += [h for h in r[2].split(",") if h not in hows]
        else:
            keep.append(r)
    hows += [h for h in how.split(",") if h not in hows]
    keep.append([offset, end - offset, ",".join(hows)])
    keep.sort()
    into[alloc_id] = keep


def _entries(ranges: dict[int, list]) -> list[dict[str, Any]]:
    return [{"alloc": a, "offset": o, "size": s, "how": h} for a, rs in ranges.items() for o, s, h in rs]
