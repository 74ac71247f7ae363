"""``gpu-predict-access --plot FILE.png``: an access map, launches across, allocations down.

Each cell says what the launches in that column did to that allocation: read (blue), written
(red, also when read), nothing (white); a launch marked unknown ("may touch everything") fills
its column grey. Long traces are binned: a column then stands for several consecutive launches
and shows the strongest access among them. Needs matplotlib (``pip install 'gpuos-tools[plot]'``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from gpuos_tools import figures
from gpuos_tools.access.predict import Predictor
from gpuos_tools.errors import ExitCode, GpuosError

NONE, READ, WRITE, UNKNOWN = 0, 1, 2, 3
MAX_COLUMNS = 2000
MAX_ROWS = 400


def access_matrix(records: Iterable[dict[str, Any]], granularity: str = "alloc", templates=None):
    """(matrix [allocations x launches] of NONE/READ/WRITE/UNKNOWN, allocation ids, launch seqs)."""
    pred = Predictor(granularity, templates)
    columns: list[dict[int, int] | None] = []
    seqs: list[int] = []
    ids: dict[int, int] = {}
    for rec in records:
        acc = pred.feed(rec)
        if acc is None or acc["of"] != "launch" or acc.get("captured"):
            continue
        seqs.append(acc["seq"])
        if acc["unknown"]:
            columns.append(None)
            continue
        col: dict[int, int] = {}
        for e in acc["reads"]:
            col[e["alloc"]] = max(col.get(e["alloc"], NONE), READ)
        for e in acc["writes"]:
            col[e["alloc"]] = WRITE
        for a in col:
            ids.setdefault(a, len(ids))
        columns.append(col)
    order = sorted(ids)
    row_of = {a: i for i, a in enumerate(order)}
    m = np.zeros((len(order), len(columns)), dtype=np.uint8)
    for j, col in enumerate(columns):
        if col is None:
            m[:, j] = UNKNOWN
        else:
            for a, v in col.items():
                m[row_of[a], j] = v
    return m, order, seqs


def _bin(m: np.ndarray, axis: int, limit: int) -> tuple[np.ndarray, int]:
    n = m.shape[axis]
    if n <= limit:
        return m, 1
    step = -(-n // limit)
    pad = (-n) % step
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, pad)
    padded = np.pad(m, widths)
    shape = (padded.shape[0] // step, step, padded.shape[1]) if axis == 0 else (padded.shape[0], padded.shape[1] // step, step)
    return padded.reshape(shape).max(axis=axis + 1), step


def plot(records: Iterable[dict[str, Any]], path: Path, granularity: str = "alloc", templates=None,
         title: str = "") -> dict[str, int]:
    """Draw the access map into ``path`` (format from its suffix); return its dimensions."""
    plt = figures.pyplot()
    from matplotlib.colors import ListedColormap

    m, ids, seqs = access_matrix(records, granularity, templates)
    if not seqs:
        raise GpuosError("no kernel launches to plot", ExitCode.FAILURE)
    m, col_step = _bin(m, 1, MAX_COLUMNS)
    m, row_step = _bin(m, 0, MAX_ROWS)
    fig, ax = plt.subplots(figsize=(min(16, 4 + m.shape[1] / 40), min(12, 2 + m.shape[0] / 6)))
    cmap = ListedColormap(["#ffffff", "#3b75c4", "#d1352b", "#b0b0b0"])
    ax.imshow(m, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3)
    ax.set_xlabel(f"launch (seq {seqs[0]}..{seqs[-1]}" + (f", {col_step} per column)" if col_step > 1 else ")"))
    ax.set_ylabel("allocation id" + (f" ({row_step} per row)" if row_step > 1 else ""))
    if row_step == 1 and len(ids) <= 40:
        ax.set_yticks(range(len(ids)), [str(a) for a in ids])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#3b75c4", "#d1352b", "#b0b0b0")]
    ax.legend(handles, ["read", "written", "unknown"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_title(title or f"predicted accesses ({granularity} granularity)")
    fig.tight_layout()
    try:
        figures.save(fig, path, dpi=100)
    finally:
        plt.close(fig)
    return {"launches": len(seqs), "allocations": len(ids), "columns": m.shape[1], "rows": m.shape[0]}
