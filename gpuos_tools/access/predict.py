"""Speculating each launch's, copy's and memset's buffer accesses from a trace, in one pass.

`Predictor.feed` takes the records of a trace in order, replays allocations and frees into an
`AllocTable`, and returns an ``access`` record (see gpuos_tools/access/__init__.py) for each
launch, memcpy, memset and graph_launch. Per kernel, the prototype analysis (demangling,
parsing, classifying each parameter) is done once and cached by mangled name and parameter
count; per launch the work is finding the pointer words and looking them up.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gpuos_tools.access.proto import CONST, POINTERS, STRUCT, VALUE, prototype
from gpuos_tools.cuda.elf import demangle
from gpuos_tools.trace.allocs import Allocation, AllocTable

GRANULARITIES = ("alloc", "range")

#: Basis of a parameter whose type is not known: the kernel is extern "C", or its prototype
#: does not match the launch's parameters.
UNTYPED = "untyped"

#: What each basis means for the memory behind a pointer found in that parameter.
BASIS_TEXT = {
    CONST: "a pointer to const: read only",
    "pointer": "a pointer to non-const: read and write",
    POINTERS: "a pointer to pointers: the buffers it lists are not followed",
    STRUCT: "passed by value (struct, array, lambda): direction unknown, read and write assumed",
    VALUE: "a scalar by its type, yet the word lies in a live allocation: read and write assumed",
    "reference": "a reference: direction unknown, read and write assumed",
    UNTYPED: "no parameter types (see the kernel's note): read and write assumed",
}

GRAPH_WHY = "graph contents are not traced yet"


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
    found: str  #: "dptr" (the driver said so) or "scan" (it lies in a live allocation)
    alloc: Allocation | None  #: None: a driver-confirmed pointer into no traced allocation


def _word(hexs: str, offset: int) -> int:
    return int.from_bytes(bytes.fromhex(hexs[2 * offset : 2 * offset + 16]), "little")


_WORDS_CACHE: dict[str, tuple[tuple[int, int], ...]] = {}


def _nonzero_words(hexs: str) -> tuple[tuple[int, int], ...]:
    """(offset, value) of each non-zero aligned 8-byte word of a parameter's bytes (cached)."""
    words = _WORDS_CACHE.get(hexs)
    if words is None:
        raw = bytes.fromhex(hexs)
        words = tuple(
            (off, v)
            for off in range(0, len(raw) - 7, 8)
            if (v := int.from_bytes(raw[off : off + 8], "little"))
        )
        if len(_WORDS_CACHE) > 65536:
            _WORDS_CACHE.clear()
        _WORDS_CACHE[hexs] = words
    return words


class Predictor:
    """Feed trace records in order; get an access record for each launch, copy and memset."""

    def __init__(self, granularity: str = "alloc") -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, not {granularity!r}")
        self.granularity = granularity
        self.allocs = AllocTable()
        self._kernels: dict[tuple[str, int], KernelInfo] = {}
        self._counts = {"memcpy": 0, "memset": 0, "graph_launch": 0}

    # -- the stream --------------------------------------------------------------------------

    def feed(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """Apply one record; the access record it causes, or None."""
        kind = rec["type"]
        if kind == "launch":
            return self.launch(rec)[0]
        if kind == "alloc":
            self.allocs.add(rec)
        elif kind == "free":
            self.allocs.remove(rec)
        elif kind == "memcpy":
            return self._memcpy(rec)
        elif kind == "memset":
            return self._memset(rec)
        elif kind == "graph_launch":
            self._counts["graph_launch"] += 1
            out = {"type": "access", "of": "graph_launch", "index": self._counts["graph_launch"]}
            if "graph" in rec:
                out["graph"] = rec["graph"]
            out.update(reads=[], writes=[], unknown=True, why=GRAPH_WHY)
            return out
        return None

    def annotate(self, records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Every record, each followed by the access record it causes."""
        feed = self.feed
        for rec in records:
            yield rec
            out = feed(rec)
            if out is not None:
                yield out

    # -- launches ----------------------------------------------------------------------------

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
        return out

    def launch(self, rec: dict[str, Any]) -> tuple[dict[str, Any], KernelInfo, list[Finding]]:
        """The access record of a launch, with what it was inferred from."""
        info = self.info(rec)
        found = self.findings(rec)
        bases = info.bases
        whole = self.granularity == "alloc"
        reads: dict[int, list] = {}
        writes: dict[int, list] = {}
        why: list[str] = []
        for f in found:
            alloc = f.alloc
            if alloc is None:
                why.append(
                    f"param {f.param} +{f.offset}: device pointer {f.word:#x} (driver) in no traced allocation"
                )
                continue
            basis = bases[f.param] if f.param < len(bases) else UNTYPED
            if basis == POINTERS:
                why.append(f"param {f.param} is {info.types[f.param]}: pointers stored in device memory are not followed")
            how = f"{f.found}:{basis}"
            if whole:
                offset, size = 0, alloc.size
            else:
                offset = f.word - alloc.addr
                size = alloc.size - offset
            _merge(reads, alloc.id, offset, size, how)
            if basis != CONST:
                _merge(writes, alloc.id, offset, size, how)
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

    # -- copies and memsets -------------------------------------------------------------------

    def _range(self, addr: int, extent: int, how: str, into: dict[int, list], why: list[str], device: bool) -> None:
        alloc = self.allocs.find(addr)
        if alloc is None:
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
        out = {"type": "access", "of": "memset", "index": self._counts["memset"],
               "reads": [], "writes": _entries(writes), "unknown": bool(why)}  # fmt: skip
        if why:
            out["why"] = "; ".join(why)
        return out


def _merge(into: dict[int, list], alloc_id: int, offset: int, size: int, how: str) -> None:
    """Add [offset, offset + size) of an allocation; ranges of one allocation become their hull."""
    entry = into.get(alloc_id)
    if entry is None:
        into[alloc_id] = [offset, size, how]
        return
    if entry[0] == offset and entry[1] == size and entry[2] == how:
        return
    end = max(entry[0] + entry[1], offset + size)
    entry[0] = min(entry[0], offset)
    entry[1] = end - entry[0]
    if how not in entry[2].split(","):
        entry[2] += "," + how


def _entries(ranges: dict[int, list]) -> list[dict[str, Any]]:
    return [{"alloc": a, "offset": o, "size": s, "how": h} for a, (o, s, h) in ranges.items()]
