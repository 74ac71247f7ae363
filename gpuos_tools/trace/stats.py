"""The analysis behind ``gpu-trace stats TRACE``: what a trace holds, in one streaming pass.

`compute_stats` reads records once, in order, keeping only running totals, one row per distinct
kernel and copy direction, the live allocations (an `AllocTable`, needed to resolve pointers) and
a downsampled timeline, so a trace of any length fits in memory. `stats_records` turns the result
into NDJSON records for pipes; `render_stats` draws it as tables for a terminal.

"Unknown pointer arguments" are the numbers to watch before predicting a kernel's accesses from
its arguments: 8-byte argument words that look like device addresses but lie in no live
allocation. They come from memory allocated outside what the tracer sees (another allocator, a
library's own pool), from use after free, or from values that only look like addresses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuos_tools.cuda.elf import demangle
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.model.allocs import AllocTable
from gpuos_tools.model.records import pointer_words
from gpuos_tools.names import short_names
from gpuos_tools.stream.records import BYTES, COUNT, register_output
from gpuos_tools.stream.schema import Anything, Field, List, Map, Num, RecordType, Str
from gpuos_tools.units import format_size

#: How far outside the allocations seen so far a word may lie and still count as an address.
#: Device allocations cluster in a few regions of the address space; small integers, floats'
#: bit patterns and host pointers fall far outside them.
ADDRESS_MARGIN = 256 << 20
TIMELINE_POINTS = 200


@dataclass(slots=True)
class KernelStats:
    """Launches of one kernel. ``example`` is the first unknown pointer argument seen:
    (parameter index, byte offset inside that parameter, value)."""

    name: str
    mangled: str | None
    launches: int = 0
    layout_none: int = 0
    unknown_ptrs: int = 0
    unknown_ptr_launches: int = 0
    example: tuple[int, int, int] | None = None


@dataclass(slots=True)
class CopyStats:
    count: int = 0
    bytes: int = 0


class Timeline:
    """Live bytes after each allocation change, downsampled while it is recorded.

    Each kept point stands for a stretch of ``stride`` consecutive samples and is the highest of
    them, so the peaks survive; when ``max_points`` stretches are full, neighbours are merged in
    pairs and the stride doubles. The last sample is always kept too, so the end state shows.
    """

    def __init__(self, max_points: int = TIMELINE_POINTS):
        self.max_points = max_points
        self._points: list[tuple[int, int]] = []
        self._stride = 1
        self._filled = 0  # samples in the stretch of the last point
        self._last: tuple[int, int] | None = None

    def add(self, ts: int, value: int) -> None:
        sample = (ts, value)
        self._last = sample
        if self._filled == 0:
            self._points.append(sample)
        elif value > self._points[-1][1]:
            self._points[-1] = sample
        self._filled += 1
        if self._filled == self._stride:
            self._filled = 0
            if len(self._points) >= self.max_points:
                pts = self._points
                self._points = [
                    max(a, b, key=lambda p: p[1]) for a, b in zip(pts[::2], pts[1::2], strict=False)
                ]
                if len(pts) % 2:
                    self._points.append(pts[-1])
                self._stride *= 2

    def points(self) -> list[tuple[int, int]]:
        if self._last is not None and (not self._points or self._points[-1] != self._last):
            return [*self._points, self._last]
        return list(self._points)


@dataclass
class Stats:
    """Everything `compute_stats` gathers from one trace."""

    schema: str | None = None
    tool: str | None = None
    argv: list[str] = field(default_factory=list)
    records: int = 0
    types: Counter[str] = field(default_factory=Counter)
    first_ts: int | None = None
    last_ts: int | None = None
    launches: int = 0
    graph_launches: int = 0
    layout_none: int = 0
    kernels: dict[str, KernelStats] = field(default_factory=dict)
    copies: dict[str, CopyStats] = field(default_factory=dict)
    memsets: CopyStats = field(default_factory=CopyStats)
    allocs: int = 0
    alloc_bytes: int = 0
    frees: int = 0
    table: AllocTable = field(default_factory=AllocTable)
    timeline: Timeline = field(default_factory=Timeline)
    modules: int = 0
    module_formats: Counter[str] = field(default_factory=Counter)
    streams: set[int] = field(default_factory=set)
    streams_created: int = 0
    streams_destroyed: int = 0
    libraries: int = 0
    errors: int = 0
    failed_launches: int = 0
    captured_launches: int = 0
    exit: dict[str, Any] | None = None

    @property
    def duration_ns(self) -> int | None:
        if self.first_ts is None or self.last_ts is None:
            return None
        return self.last_ts - self.first_ts

    @property
    def unknown_ptrs(self) -> int:
        return sum(k.unknown_ptrs for k in self.kernels.values())

    @property
    def unknown_ptr_launches(self) -> int:
        return sum(k.unknown_ptr_launches for k in self.kernels.values())

    def copies_by_bytes(self) -> list[tuple[str, CopyStats]]:
        """(direction, totals), most bytes first; ties by direction."""
        return sorted(self.copies.items(), key=lambda item: (-item[1].bytes, item[0]))

    def top_kernels(self, n: int | None = None) -> list[KernelStats]:
        """Kernels by launches, most first; ties by name so the order is stable."""
        ranked = sorted(self.kernels.values(), key=lambda k: (-k.launches, k.name))
        return ranked if n is None else ranked[:n]


# --- the pass ------------------------------------------------------------------------------------


def compute_stats(records: Iterable[dict[str, Any]]) -> Stats:
    """Gather `Stats` from a trace's records in one pass.

    Records of types this does not know are counted in ``types`` and otherwise ignored. A
    record that lacks a field its type needs, or has one of the wrong type, stops the pass with
    `ExitCode.BAD_INPUT`, naming the record's position.
    """
    stats = Stats()
    for n, rec in enumerate(records, 1):
        try:
            _feed(stats, rec)
        except GpuosError as e:
            raise GpuosError(f"record {n}: {e}", e.code) from e
        except KeyError as e:
            raise GpuosError(f"record {n} ({_type(rec)}): no field {e}", ExitCode.BAD_INPUT) from e
        except (TypeError, ValueError, AttributeError) as e:
            raise GpuosError(f"record {n} ({_type(rec)}): {e}", ExitCode.BAD_INPUT) from e
    return stats


def _type(rec: object) -> str:
    return repr(rec.get("type")) if isinstance(rec, dict) else type(rec).__name__


def _feed(stats: Stats, rec: dict[str, Any]) -> None:
    kind = rec["type"]
    stats.records += 1
    stats.types[kind] += 1
    ts = rec.get("ts")
    if isinstance(ts, int):
        if stats.first_ts is None:
            stats.first_ts = ts
        stats.last_ts = ts
    handler = _HANDLERS.get(kind)
    if handler is not None:
        handler(stats, rec)
        if rec.get("stream") is not None:
            stats.streams.add(_int(rec, "stream"))


def _int(rec: dict[str, Any], key: str) -> int:
    value = rec[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"field {key!r} is {value!r}, not an integer")
    return value


def _on_header(stats: Stats, rec: dict[str, Any]) -> None:
    stats.schema = rec.get("schema")
    stats.tool = rec.get("tool")
    stats.argv = [str(a) for a in rec.get("argv") or ()]


def _on_alloc(stats: Stats, rec: dict[str, Any]) -> None:
    _int(rec, "addr")
    size = _int(rec, "size")
    stats.table.add(rec)
    stats.allocs += 1
    stats.alloc_bytes += size
    stats.timeline.add(stats.last_ts or 0, stats.table.live_bytes)


def _on_free(stats: Stats, rec: dict[str, Any]) -> None:
    _int(rec, "addr")
    stats.frees += 1
    if stats.table.remove(rec) is not None:
        stats.timeline.add(stats.last_ts or 0, stats.table.live_bytes)


def _on_launch(stats: Stats, rec: dict[str, Any]) -> None:
    if rec.get("result"):
        # The driver refused the launch: no kernel ran and no argument was used.
        stats.failed_launches += 1
        return
    if rec.get("captured"):
        # recorded into a CUDA graph while the stream was captured: runs with each graph_launch
        stats.captured_launches += 1
        return
    mangled = rec.get("kernel")
    name = rec.get("name") or (demangle(mangled) if mangled else "<unknown>")
    k = stats.kernels.get(name)
    if k is None:
        k = stats.kernels[name] = KernelStats(name, mangled)
    k.launches += 1
    stats.launches += 1
    if rec.get("layout") == "none":
        k.layout_none += 1
        stats.layout_none += 1
    found = 0
    for param, offset, value in _pointer_candidates(stats, rec):
        if stats.table.resolve(value) is None:
            found += 1
            if k.example is None:
                k.example = (param, offset, value)
    if found:
        k.unknown_ptrs += found
        k.unknown_ptr_launches += 1


def _pointer_candidates(stats: Stats, rec: dict[str, Any]) -> Iterator[tuple[int, int, int]]:
    """Argument words that are device pointers: exactly the driver's ``dptrs`` when the trace was
    recorded with --check-pointers, otherwise every word near recorded allocations (a guess:
    uninitialised bytes of by-value structs can look like addresses)."""
    dptrs = rec.get("dptrs")
    if dptrs is not None:
        params = rec.get("params") or ()
        for param, offset, _memtype in dptrs:
            raw = bytes.fromhex(params[param]["hex"])[offset : offset + 8]
            yield param, offset, int.from_bytes(raw, "little")
        return
    hull = stats.table.hull
    if hull is None:
        return
    low, high = hull[0] - ADDRESS_MARGIN, hull[1] + ADDRESS_MARGIN
    for param, offset, value in pointer_words(rec):
        if low <= value < high:
            yield param, offset, value


def _on_memcpy(stats: Stats, rec: dict[str, Any]) -> None:
    c = stats.copies.setdefault(rec["dir"], CopyStats())
    c.count += 1
    c.bytes += _int(rec, "bytes")


def _on_memset(stats: Stats, rec: dict[str, Any]) -> None:
    stats.memsets.count += 1
    stats.memsets.bytes += _int(rec, "bytes")


def _on_module(stats: Stats, rec: dict[str, Any]) -> None:
    stats.modules += 1
    stats.module_formats[rec.get("format") or "unknown"] += 1


def _on_stream(stats: Stats, rec: dict[str, Any]) -> None:
    _int(rec, "stream")
    if rec.get("event") == "create":
        stats.streams_created += 1
    elif rec.get("event") == "destroy":
        stats.streams_destroyed += 1


def _on_graph_launch(stats: Stats, rec: dict[str, Any]) -> None:
    stats.graph_launches += 1


def _on_library(stats: Stats, rec: dict[str, Any]) -> None:
    stats.libraries += 1


def _on_error(stats: Stats, rec: dict[str, Any]) -> None:
    stats.errors += 1


def _on_exit(stats: Stats, rec: dict[str, Any]) -> None:
    stats.exit = {k: v for k, v in rec.items() if k != "type"}


_HANDLERS = {
    "header": _on_header,
    "alloc": _on_alloc,
    "free": _on_free,
    "launch": _on_launch,
    "memcpy": _on_memcpy,
    "memset": _on_memset,
    "module": _on_module,
    "stream": _on_stream,
    "graph_launch": _on_graph_launch,
    "library": _on_library,
    "error": _on_error,
    "exit": _on_exit,
}


# --- output --------------------------------------------------------------------------------------

_N = Num(0)
#: The records `gpu-trace stats --json` writes, as data (gpuos_tools.stream.schema).
STATS_SUMMARY = RecordType("stats_summary", "what the trace holds, in all.", (
    Field("schema", Str(), "the trace's schema", null=True), Field("tool", Str(), "who wrote it", null=True),
    Field("argv", Anything(), "the traced command", null=True), Field("records", COUNT, required=True),
    Field("types", Map(COUNT), "records per type"), Field("duration_ns", COUNT, null=True),
    Field("launches", COUNT, required=True), Field("kernels", COUNT, "distinct kernels"),
    Field("unknown_ptrs", COUNT, "argument words that look like device addresses but lie in no live allocation"),
    Field("peak_bytes", BYTES), Field("live_bytes", BYTES), Field("exit", Anything(), "the `exit` record's code "
                                                                                         "and signal", null=True),
))
STATS_KERNEL = RecordType("stats_kernel", "one kernel, most launched first.", (
    Field("name", Str(), required=True), Field("mangled", Str(), null=True), Field("launches", COUNT, required=True),
    Field("share", Num(0, 1), "of all launches"), Field("layout_none", COUNT, "launches without a parameter layout"),
    Field("unknown_ptrs", COUNT), Field("unknown_ptr_launches", COUNT),
    Field("unknown_ptr_example", Anything(), "one such word: {param, offset, value}", null=True),
))
STATS_COPY = RecordType("stats_copy", "the copies of one direction, most bytes first.", (
    Field("dir", Str(), required=True), Field("count", COUNT, required=True), Field("bytes", _N, required=True),
))
STATS_ALLOC_TIMELINE = RecordType("stats_alloc_timeline", "live allocated bytes over time, downsampled.", (
    Field("points", List(List(_N, length=2)), "[ts, bytes]", required=True),
))
STATS_TYPES = (STATS_SUMMARY, STATS_KERNEL, STATS_COPY, STATS_ALLOC_TIMELINE)
register_output(*STATS_TYPES)



def stats_records(stats: Stats) -> Iterator[dict[str, Any]]:
    """The stats as records: a summary, one per kernel (most launched first), one per copy
    direction (most bytes first), then the allocation timeline."""
    table = stats.table
    yield {
        "type": "stats_summary",
        "schema": stats.schema,
        "tool": stats.tool,
        "argv": stats.argv,
        "records": stats.records,
        "types": dict(sorted(stats.types.items())),
        "duration_ns": stats.duration_ns,
        "launches": stats.launches,
        "graph_launches": stats.graph_launches,
        "failed_launches": stats.failed_launches,
        "captured_launches": stats.captured_launches,
        "kernels": len(stats.kernels),
        "layout_none": stats.layout_none,
        "unknown_ptrs": stats.unknown_ptrs,
        "unknown_ptr_launches": stats.unknown_ptr_launches,
        "memcpys": sum(c.count for c in stats.copies.values()),
        "memcpy_bytes": sum(c.bytes for c in stats.copies.values()),
        "memsets": stats.memsets.count,
        "memset_bytes": stats.memsets.bytes,
        "allocs": stats.allocs,
        "alloc_bytes": stats.alloc_bytes,
        "frees": stats.frees,
        "unknown_frees": table.unknown_frees,
        "evicted_allocs": table.evicted,
        "peak_bytes": table.peak_bytes,
        "live_bytes": table.live_bytes,
        "live_allocs": table.live_count,
        "modules": stats.modules,
        "module_formats": dict(sorted(stats.module_formats.items())),
        "libraries": stats.libraries,
        "streams": len(stats.streams),
        "streams_created": stats.streams_created,
        "streams_destroyed": stats.streams_destroyed,
        "errors": stats.errors,
        "exit": stats.exit,
    }
    for k in stats.top_kernels():
        yield {
            "type": "stats_kernel",
            "name": k.name,
            "mangled": k.mangled,
            "launches": k.launches,
            "share": k.launches / stats.launches,
            "layout_none": k.layout_none,
            "unknown_ptrs": k.unknown_ptrs,
            "unknown_ptr_launches": k.unknown_ptr_launches,
            "unknown_ptr_example": _example(k.example),
        }
    for direction, c in stats.copies_by_bytes():
        yield {"type": "stats_copy", "dir": direction, "count": c.count, "bytes": c.bytes}
    yield {"type": "stats_alloc_timeline", "points": [[ts, b] for ts, b in stats.timeline.points()]}


def _example(example: tuple[int, int, int] | None) -> dict[str, Any] | None:
    if example is None:
        return None
    param, offset, value = example
    return {"param": param, "offset": offset, "value": hex(value)}


def human_duration(ns: int) -> str:
    """Nanoseconds in the largest unit that keeps the number at or above 1: "1.500 ms"."""
    for unit, scale in (("s", 10**9), ("ms", 10**6), ("µs", 10**3)):
        if ns >= scale:
            return f"{ns / scale:.3f} {unit}"
    return f"{ns} ns"


_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[int], width: int = 60) -> str:
    """Values drawn as block characters, scaled to the largest; at most ``width`` wide."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        values = [max(values[int(i * step) : int((i + 1) * step)]) for i in range(width)]
    top = max(values) or 1
    return "".join(_SPARK[v * (len(_SPARK) - 1) // top] for v in values)


def _name_width(console: Console, others: int) -> int:
    """Characters left for a kernel name in a row whose other columns take about ``others``."""
    return max(30, min(100, console.width - others))


def render_stats(stats: Stats, console: Console, top: int = 20) -> None:
    """Draw the stats as tables: summary, top kernels, copies, allocations, unknown pointers."""
    title = " ".join([stats.tool or "trace", *stats.argv])
    console.rule(f"[bold]{title}" + (f" [dim]({stats.schema})" if stats.schema else ""))

    summary = Table(title="Summary", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    duration = stats.duration_ns
    summary.add_row("records", f"{stats.records:,}")
    if duration is not None:
        summary.add_row("duration", human_duration(duration))
    summary.add_row("kernel launches", f"{stats.launches:,}")
    summary.add_row("distinct kernels", f"{len(stats.kernels):,}")
    summary.add_row("graph launches", f"{stats.graph_launches:,}")
    if stats.failed_launches:
        summary.add_row("failed launches", f"{stats.failed_launches:,}")
    if stats.captured_launches:
        summary.add_row("launches captured into graphs", f"{stats.captured_launches:,}")
    summary.add_row("launches with unknown layout", f"{stats.layout_none:,}")
    summary.add_row("modules", f"{stats.modules:,} (+{stats.libraries:,} library loads)")
    summary.add_row("streams", f"{len(stats.streams):,}")
    if stats.errors:
        summary.add_row("tracer errors", f"[red]{stats.errors:,}")
    if stats.exit is not None:
        signal = stats.exit.get("signal")
        how = f"signal {signal}" if signal else f"code {stats.exit.get('code')}"
        if stats.exit.get("complete") is False:
            how += " [red](tracer ended early: records may be missing)"
        summary.add_row("program exit", how)
    console.print(summary)

    if stats.kernels:
        kernels = Table(
            title=f"Top kernels ({min(top, len(stats.kernels))} of {len(stats.kernels)})"
        )
        kernels.add_column("#", justify="right")
        kernels.add_column("kernel", no_wrap=True, overflow="ellipsis")
        kernels.add_column("launches", justify="right")
        kernels.add_column("share", justify="right")
        kernels.add_column("unknown ptrs", justify="right")
        shown = stats.top_kernels(top)
        for rank, (k, name) in enumerate(zip(shown, short_names([k.name for k in shown], _name_width(console, 45))), 1):
            share = f"{100 * k.launches / stats.launches:.1f}%"
            kernels.add_row(str(rank), name, f"{k.launches:,}", share, f"{k.unknown_ptrs:,}")
        console.print(kernels)

    if stats.copies or stats.memsets.count:
        copies = Table(title="Copies")
        copies.add_column("direction")
        copies.add_column("count", justify="right")
        copies.add_column("bytes", justify="right")
        for direction, c in stats.copies_by_bytes():
            copies.add_row(direction, f"{c.count:,}", format_size(c.bytes))
        if stats.memsets.count:
            copies.add_row("memset", f"{stats.memsets.count:,}", format_size(stats.memsets.bytes))
        console.print(copies)

    if stats.allocs or stats.frees:
        table = stats.table
        allocs = Table(title="Allocations", show_header=False)
        allocs.add_column(style="bold")
        allocs.add_column()
        allocs.add_row("allocations", f"{stats.allocs:,} ({format_size(stats.alloc_bytes)})")
        allocs.add_row("frees", f"{stats.frees:,} ({table.unknown_frees:,} of unknown addresses)")
        allocs.add_row("peak live", format_size(table.peak_bytes))
        allocs.add_row(
            "live at end", f"{format_size(table.live_bytes)} in {table.live_count:,} allocations"
        )
        allocs.add_row("over time", sparkline([b for _, b in stats.timeline.points()]))
        console.print(allocs)

    suspects = [k for k in stats.top_kernels() if k.unknown_ptrs]
    if suspects:
        unknown = Table(title="Unknown pointer arguments (near allocations, in none)")
        unknown.add_column("kernel", no_wrap=True, overflow="ellipsis")
        unknown.add_column("words", justify="right")
        unknown.add_column("launches", justify="right")
        unknown.add_column("example")
        suspects = sorted(suspects, key=lambda k: (-k.unknown_ptrs, k.name))
        for k, name in zip(suspects, short_names([k.name for k in suspects], _name_width(console, 70))):
            assert k.example is not None
            param, offset, value = k.example
            unknown.add_row(
                name,
                f"{k.unknown_ptrs:,}",
                f"{k.unknown_ptr_launches:,} of {k.launches:,}",
                f"param {param} +{offset}: {value:#x}",
            )
        console.print(unknown)
