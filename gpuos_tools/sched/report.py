"""The policies side by side, as a table for people."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from gpuos_tools.units import format_duration, format_size


def _size(n: float) -> str:
    """Bytes in at most 6 characters, binary units (K = KiB)."""
    value = float(n)
    for unit in ("B", "K", "M", "G"):
        if value < 1000:
            return f"{value:.0f}{unit}" if unit == "B" or value >= 100 else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}T"


def _time(s: float) -> str:
    """Seconds in at most 7 characters."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale or unit == "us":
            v = s / scale
            return f"{v:.0f}{unit}" if v >= 100 else f"{v:.3g}{unit}"
    raise AssertionError("unreachable")


def _share(budget: int, footprint: int) -> str:
    """The budget against the footprint (the most memory resident at once with no budget)."""
    if footprint <= 0:
        return "nothing was resident"
    if budget >= footprint:
        return "all of it fits: nothing needs to move"
    return f"{100 * budget / footprint:.0f}% of it: {100 * footprint / budget:.0f}% oversubscribed"


def render_summaries(summaries: list[dict[str, Any]], console: Console) -> None:
    """One row per policy: bytes moved, faults, stalls, estimated time against floor and HBM."""
    if not summaries:
        return
    first = summaries[0]
    chunk = "whole allocations" if first["chunk"] is None else format_size(first["chunk"])
    title = (
        f"budget {format_size(first['budget'])} for a footprint of {format_size(first['footprint'])}"
        f" ({_share(first['budget'], first['footprint'])})"
        f" · {first['jobs']} job(s), {first['steps']} steps ({first['unknown']} unknown)"
        f" · chunks {chunk}"
    )
    title += f" · all in HBM {format_duration(first['in_memory_s'])}"
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in ("policy", "in", "out", "faults", "stalls", "stalled", "est.", "floor", "speed", "over"):
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    for s in summaries:
        table.add_row(
            s["policy"],
            _size(s["bytes_in"]),
            _size(s["bytes_out"]),
            f"{s['faults']}",
            f"{s['stalls']}",
            _time(s["stall_s"]),
            _time(s["est_s"]),
            _time(s["floor_s"]),
            f"{100 * s['speed_vs_in_memory']:.0f}%",
            f"{s['over_budget']:,}",
        )
    console.print(table)
    console.print(
        "in/out: bytes copied each way (K, M, G: binary); speed: compute time over estimated "
        "time (100% = as fast as all in HBM); over: steps whose working set exceeded the budget",
        style="dim",
        highlight=False,
    )
