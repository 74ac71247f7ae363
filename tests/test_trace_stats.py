"""gpu-trace stats arithmetic, on tests/data/unit-small.ndjson and inline records.

unit-small.ndjson is written by hand in the record format of gpuos_tools/model/records.py, only
to check the arithmetic; every expected number below was worked out from it by hand. Its
addresses: A = 0x7f0000000000 (4 KiB, id 1), B = 0x7f0000100000 (1 MiB, id 2),
C = 0x7f0000400000 (2 MiB, id 3, allocated after A is freed).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.trace.stats import (
    ADDRESS_MARGIN,
    Timeline,
    compute_stats,
    human_duration,
    render_stats,
    sparkline,
    stats_records,
)
from gpuos_tools.units import format_size

DATA = Path(__file__).parent / "data"
A, B, C = 0x7F0000000000, 0x7F0000100000, 0x7F0000400000
MIB = 1 << 20


def unit_records() -> list[dict]:
    with open(DATA / "unit-small.ndjson") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def stats():
    return compute_stats(iter(unit_records()))  # an iterator: one pass, no len()


def test_counts(stats) -> None:
    assert stats.records == 25
    assert stats.types == {
        "header": 1, "module": 1, "library": 1, "stream": 2, "alloc": 3, "memcpy": 2,
        "launch": 8, "free": 2, "memset": 1, "graph_launch": 1, "error": 1, "note": 1, "exit": 1,
    }  # fmt: skip
    assert (stats.schema, stats.tool) == ("gpuos/1", "gpu-trace")
    assert stats.argv == ["python", "train.py", "--steps", "2"]
    assert stats.duration_ns == 20000 - 1000  # the header has no ts
    assert stats.modules == 1 and stats.module_formats == {"cubin": 1}
    assert stats.streams == {0, 1001}
    assert (stats.streams_created, stats.streams_destroyed) == (1, 1)
    assert stats.libraries == 1
    assert stats.errors == 1
    assert stats.graph_launches == 1
    assert stats.exit is not None
    assert (stats.exit["code"], stats.exit["complete"]) == (0, True)
    assert stats.exit["records"]["launch"] == 8


def test_kernels(stats) -> None:
    assert stats.launches == 7  # the eighth launch record failed (result 1)
    assert stats.failed_launches == 1
    assert stats.layout_none == 1
    top = stats.top_kernels()
    assert [(k.name, k.launches) for k in top] == [
        ("twice(float*)", 3),
        ("saxpy", 2),
        ("noargs()", 1),  # ties by name
        ("shift(Vec3*, Vec3, int)", 1),  # no "name" in its record: demangled from "kernel"
    ]
    assert [k.name for k in stats.top_kernels(2)] == ["twice(float*)", "saxpy"]
    assert stats.kernels["noargs()"].layout_none == 1
    assert stats.kernels["shift(Vec3*, Vec3, int)"].mangled == "_Z5shiftP4Vec3S_i"


def test_unknown_pointers(stats) -> None:
    k = stats.kernels
    # twice: A+16 resolves at seq 1, is freed memory at seq 3; 1.0f,1.0f at seq 4 is no address;
    # seq 7 passes freed A+16 again but failed, so it neither counts nor uses its arguments.
    assert (k["twice(float*)"].unknown_ptrs, k["twice(float*)"].unknown_ptr_launches) == (1, 1)
    assert k["twice(float*)"].example == (0, 0, A + 16)
    # saxpy: y = 0x7f0000300000 lies between B's end and C's start, before C exists; the
    # second launch's y is C.
    assert (k["saxpy"].unknown_ptrs, k["saxpy"].unknown_ptr_launches) == (1, 1)
    assert k["saxpy"].example == (2, 0, 0x7F0000300000)
    # shift: the by-value Vec3's second word is 0x7f00000fff00, in the gap between A and B.
    assert k["shift(Vec3*, Vec3, int)"].example == (1, 8, 0x7F00000FFF00)
    assert k["noargs()"].unknown_ptrs == 0 and k["noargs()"].example is None
    assert (stats.unknown_ptrs, stats.unknown_ptr_launches) == (3, 3)


def test_copies_and_allocations(stats) -> None:
    assert {d: (c.count, c.bytes) for d, c in stats.copies.items()} == {
        "HtoD": (1, 4096),
        "DtoH": (1, MIB),
    }
    assert (stats.memsets.count, stats.memsets.bytes) == (1, MIB)
    assert (stats.allocs, stats.alloc_bytes) == (3, 4096 + MIB + 2 * MIB)
    assert stats.frees == 2
    assert stats.table.unknown_frees == 1
    assert stats.table.peak_bytes == 3 * MIB
    assert (stats.table.live_bytes, stats.table.live_count) == (3 * MIB, 2)
    # The free of an unknown address changes nothing, so it adds no point.
    assert stats.timeline.points() == [
        (2000, 4096),
        (2500, 4096 + MIB),
        (5000, MIB),
        (11000, 3 * MIB),
    ]


def test_stats_records(stats) -> None:
    out = list(stats_records(stats))
    for rec in out:
        json.dumps(rec)  # plain JSON types only
    assert [r["type"] for r in out] == (
        ["stats_summary"] + ["stats_kernel"] * 4 + ["stats_copy"] * 2 + ["stats_alloc_timeline"]
    )
    summary = out[0]
    assert summary["launches"] == 7
    assert summary["kernels"] == 4
    assert summary["unknown_ptrs"] == 3
    assert summary["memcpys"] == 2 and summary["memcpy_bytes"] == 4096 + MIB
    assert summary["peak_bytes"] == 3 * MIB
    assert summary["unknown_frees"] == 1
    assert summary["streams"] == 2
    assert (summary["libraries"], summary["errors"], summary["failed_launches"]) == (1, 1, 1)
    assert summary["argv"] == ["python", "train.py", "--steps", "2"]
    twice = out[1]
    assert twice["name"] == "twice(float*)"
    assert twice["share"] == pytest.approx(3 / 7)
    assert twice["unknown_ptr_example"] == {"param": 0, "offset": 0, "value": "0x7f0000000010"}
    assert out[3]["unknown_ptr_example"] is None  # noargs()
    copies = [(r["dir"], r["count"], r["bytes"]) for r in out[5:7]]
    assert copies == [("DtoH", 1, MIB), ("HtoD", 1, 4096)]
    assert out[-1]["points"] == [[2000, 4096], [2500, 4096 + MIB], [5000, MIB], [11000, 3 * MIB]]


def test_render_stats(stats) -> None:
    buf = io.StringIO()
    render_stats(stats, Console(file=buf, width=160, color_system=None))
    text = buf.getvalue()
    assert "gpu-trace python train.py --steps 2" in text
    assert "twice(float*)" in text
    assert "42.9%" in text  # 3 of 7 launches
    assert "shift(Vec3*, Vec3, int)" in text
    assert "param 2 +0: 0x7f0000300000" in text
    assert "param 1 +8: 0x7f00000fff00" in text
    assert "3.0 MiB in 2 allocations" in text  # live at end
    assert "19.000 µs" in text  # duration
    assert "DtoH" in text and "memset" in text
    assert "failed launches" in text and "tracer errors" in text
    assert "records may be missing" not in text


def test_render_incomplete_trace() -> None:
    buf = io.StringIO()
    stats = compute_stats([{"type": "exit", "code": 0, "signal": 9, "complete": False}])
    render_stats(stats, Console(file=buf, width=160, color_system=None))
    assert "signal 9 (tracer ended early: records may be missing)" in buf.getvalue()


def test_render_empty_trace() -> None:
    buf = io.StringIO()
    render_stats(compute_stats([]), Console(file=buf, width=100, color_system=None))
    text = buf.getvalue()
    assert "Summary" in text
    assert "Top kernels" not in text and "Allocations" not in text


def test_no_unknown_pointers_before_any_allocation() -> None:
    word = (A + 16).to_bytes(8, "little").hex()
    launch = {"type": "launch", "kernel": "k", "params": [{"offset": 0, "size": 8, "hex": word}]}
    stats = compute_stats([launch])
    assert stats.unknown_ptrs == 0


def test_address_margin_is_the_hull_plus_256_mib() -> None:
    def launch(value: int) -> dict:
        word = value.to_bytes(8, "little").hex()
        return {"type": "launch", "name": "k", "params": [{"offset": 0, "size": 8, "hex": word}]}

    alloc = {"type": "alloc", "id": 1, "addr": A, "size": 4096}
    inside = [A - ADDRESS_MARGIN, A - 1, A + 4096, A + 4096 + ADDRESS_MARGIN - 1]
    outside = [A - ADDRESS_MARGIN - 1, A + 4096 + ADDRESS_MARGIN, 0]
    stats = compute_stats([alloc, *map(launch, inside + outside)])
    assert stats.kernels["k"].unknown_ptrs == len(inside)


def test_launch_without_names() -> None:
    stats = compute_stats([{"type": "launch", "params": []}])
    assert list(stats.kernels) == ["<unknown>"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"type": "alloc", "id": 1, "size": 10}, "no field 'addr'"),
        ({"type": "alloc", "id": 1, "addr": "0x7f00", "size": 10}, "not an integer"),
        ({"type": "launch", "name": "k", "params": [{"hex": "zz"}]}, "non-hexadecimal"),
        ({"type": "memcpy", "dir": "HtoD", "bytes": None}, "not an integer"),
        ({"no": "type"}, "no field 'type'"),
        (["not", "a", "record"], "record 2"),
    ],
)
def test_bad_records(record, message: str) -> None:
    with pytest.raises(GpuosError) as err:
        compute_stats([{"type": "alloc", "id": 9, "addr": A, "size": 16}, record])
    assert err.value.code == ExitCode.BAD_INPUT
    assert "record 2" in str(err.value)
    assert message in str(err.value)


def test_timeline_downsamples_and_keeps_peak_and_end() -> None:
    t = Timeline(max_points=200)
    values = list(range(5001)) + [5000 - i for i in range(1, 5001)]  # up to 5000 at ts 5000
    for ts, v in enumerate(values):
        t.add(ts, v)
    points = t.points()
    assert len(points) <= 201
    assert len(points) >= 100
    assert (5000, 5000) in points  # the peak sample, at its own time
    assert points[-1] == (len(values) - 1, 0)  # the end state
    assert [ts for ts, _ in points] == sorted(ts for ts, _ in points)


def test_timeline_short_is_exact() -> None:
    t = Timeline(max_points=200)
    for ts in range(150):
        t.add(ts, ts * 10)
    assert t.points() == [(ts, ts * 10) for ts in range(150)]


def test_sizes_are_written_in_binary_units() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * MIB) == "3.0 MiB"
    assert format_size(80 << 30) == "80.0 GiB"
    assert format_size(3 << 40) == "3.0 TiB"


def test_human_duration() -> None:
    assert human_duration(0) == "0 ns"
    assert human_duration(999) == "999 ns"
    assert human_duration(19000) == "19.000 µs"
    assert human_duration(1_500_000) == "1.500 ms"
    assert human_duration(62_000_000_000) == "62.000 s"


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([0, 4, 8]) == "▁▄█"
    line = sparkline(list(range(1000)), width=50)
    assert len(line) == 50
    assert line[0] == "▁" and line[-1] == "█"
