"""A run's timeline as a picture (`gpu-prefetch-sched run --plot`, `gpu-prefetch-sched plot`,
`gpu-prefetch-sched simulate --plot`).

Input: the `sched_timeline` JSON the executor writes (gpuos_tools/sched/executor.py, Timeline),
so a picture can be drawn on any machine from what a GPU run recorded; or the same form built
from a simulation (`simulated_timeline`: simulated seconds, moves at their simulated start,
the resident bytes of the planner's books after each step, stalls as waits). Three panels on
one time axis:

1. owned bytes mapped, as measured after each decision and each prefetch, against the budget
   (and the footprint, every owned byte);
2. the bytes whose moves were issued per time bin, as bandwidth: host to device above zero
   (prefetches by the mover, loads at a launch's require), device to host below (evictions,
   whose saves may be skipped for clean records: the bytes are the records evicted);
3. the program's host waits for room (a load that found no room until evictions completed).

Needs matplotlib (``pip install 'gpuos-tools[plot]'``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuos_tools import figures
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.sched.simulate import simulate

BINS = 200  #: time bins of the bandwidth panel


def simulated_timeline(work: Any, policy: str, cfg: Any, max_events: int = 200_000) -> dict[str, Any]:
    """A planned policy's simulation (gpuos_tools/sched/simulate.py) as a sched_timeline: per step,
    its evictions and its loads as one event each at their simulated start, its stall as a wait,
    and the bytes resident once its decision is carried out (loads and first touches in,
    evictions and frees out)."""
    sizes = work.chunks.sizes
    events: list[list] = [[0.0, "budget", cfg.budget]]
    dropped = 0
    resident = 0

    def add(t: float, kind: str, value: float) -> None:
        nonlocal dropped
        if len(events) >= max_events:
            dropped += 1
        else:
            events.append([round(t, 9), kind, value])

    def observe(i: int, d: Any, t: Any) -> None:
        nonlocal resident
        out = sum(sizes[c] for c in d.evicts)
        if out:
            add(min(x[0] for x in t.evict_times), "evict", out)
        into = sum(sizes[c] for c in d.loads)
        if into:
            add(t.load_start, "prefetch", into)
        resident += into + sum(sizes[c] for c in d.first) - out - sum(sizes[c] for c in d.freed)
        if t.stall > 0:
            add(t.start - t.stall, "wait", t.stall)
        add(t.start, "mapped", resident)

    summary = simulate(work, policy, cfg, observe)
    return {"type": "sched_timeline", "version": 1, "mode": "simulate", "policy": policy,
            "lookahead": summary.get("lookahead"), "footprint": work.footprint, "events": events,
            "dropped": dropped, "max_events": max_events, "time": "simulated seconds from the start",
            "summary": {k: v for k, v in summary.items() if not isinstance(v, (dict, list))}}


def load_timeline(path: str | Path) -> dict[str, Any]:
    """A `sched_timeline` JSON file (checked)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GpuosError(f"{path}: no such file", ExitCode.NO_INPUT) from None
    except IsADirectoryError:
        raise GpuosError(f"{path}: is a directory, not a timeline", ExitCode.NO_INPUT) from None
    except PermissionError:
        raise GpuosError(f"{path}: not allowed to read it", ExitCode.PERMISSION) from None
    except OSError as exc:
        raise GpuosError(f"{path}: cannot read: {exc.strerror or exc}", ExitCode.NO_INPUT) from None
    except ValueError as exc:  # JSON, or bytes that are not UTF-8
        raise GpuosError(f"{path}: not a timeline (not JSON: {exc})", ExitCode.BAD_INPUT) from None
    if not isinstance(data, dict) or data.get("type") != "sched_timeline" or not isinstance(data.get("events"), list):
        raise GpuosError(f"{path}: not a sched_timeline (gpu-prefetch-sched run --timeline)", ExitCode.BAD_INPUT)
    return data


def series(data: dict[str, Any]) -> dict[str, Any]:
    """The events sorted out: mapped and budget as (t, bytes) steps, moves as (t, bytes), waits
    as (start, seconds); and the last time."""
    out: dict[str, Any] = {"mapped": [], "budget": [], "prefetch": [], "load": [], "evict": [], "wait": []}
    end = 0.0
    for ev in data["events"]:
        t, kind, value = float(ev[0]), ev[1], float(ev[2])
        if kind in out:
            out[kind].append((t, value))
        end = max(end, t + (value if kind == "wait" else 0.0))
    for k in out:
        out[k].sort()
    out["end"] = end
    return out


def _bandwidth(moves: list[tuple[float, float]], edges: list[float]) -> list[float]:
    """Bytes issued per bin over the bin's width, GB/s."""
    n = len(edges) - 1
    width = edges[1] - edges[0]
    acc = [0.0] * n
    for t, b in moves:
        i = min(n - 1, max(0, int((t - edges[0]) / width)))
        acc[i] += b
    return [a / width / 1e9 for a in acc]


def plot_timeline(data: dict[str, Any], path: str | Path, title: str = "") -> dict[str, Any]:
    """Draw ``data`` (a sched_timeline) into ``path`` (format from its suffix); return counts."""
    plt = figures.pyplot()
    s = series(data)
    if not s["mapped"]:
        raise GpuosError("the timeline has no measurements to plot (no owned operation was decided)", ExitCode.FAILURE)
    end = max(s["end"], 1e-6)
    gib = float(1 << 30)
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, sharex=True, figsize=(11, 6.5),
                                        gridspec_kw={"height_ratios": [3, 2, 0.7]})
    t, v = zip(*s["mapped"])
    ax0.step(t, [x / gib for x in v], where="post", color="#3b75c4", lw=1, label="resident (planned)" if data.get("mode") == "simulate" else "mapped (owned)")
    if s["budget"]:
        bt, bv = zip(*s["budget"])
        ax0.step([*bt, end], [x / gib for x in (*bv, bv[-1])], where="post", color="#d1352b", ls="--", lw=1.2,
                 label="budget")
    if data.get("footprint"):
        ax0.axhline(data["footprint"] / gib, color="#888888", ls=":", lw=1, label="footprint")
    ax0.set_ylabel("GiB")
    ax0.set_ylim(bottom=0)
    ax0.legend(loc="lower right", fontsize="small")

    edges = [end * i / BINS for i in range(BINS + 1)]
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    width = edges[1] - edges[0]
    pre = _bandwidth(s["prefetch"], edges)
    dem = _bandwidth(s["load"], edges)
    ev = _bandwidth(s["evict"], edges)
    ax1.bar(mids, pre, width=width, color="#3b75c4", label="prefetch (H2D)")
    if any(dem):
        ax1.bar(mids, dem, width=width, bottom=pre, color="#e69f00", label="load at launch (H2D)")
    ax1.bar(mids, [-x for x in ev], width=width, color="#d1352b", label="evict (D2H)")
    ax1.axhline(0, color="black", lw=0.5)
    ax1.set_ylabel("GB/s issued")
    ax1.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

    if s["wait"]:
        ax2.broken_barh(s["wait"], (0, 1), color="#7f7f7f")
    ax2.set_yticks([])
    ax2.set_ylabel("stalls" if data.get("mode") == "simulate" else "waits", rotation=0, ha="right", va="center")
    ax2.set_xlabel(data.get("time", "seconds since the executor started"))
    ax2.set_xlim(0, end)

    summ = data.get("summary") or {}
    if not title:
        title = f"{data.get('policy', '?')}, lookahead {data.get('lookahead', '?')}"
        if summ:
            title += (f" · budget {summ.get('budget', 0) / gib:.2f} GiB of {data.get('footprint', 0) / gib:.2f}"
                      f" · {summ.get('launches', 0)} {'launches' if data.get('mode') == 'simulate' else 'ops'}"
                      f" · in {summ.get('bytes_in', 0) / 1e9:.1f} GB,"
                      f" out {summ.get('bytes_out', 0) / 1e9:.1f} GB · {summ.get('stalls', 0)} stalls")
    if data.get("dropped"):
        title += f" · {data['dropped']} events not kept"
    ax0.set_title(title, fontsize="medium")
    fig.tight_layout()
    try:
        figures.save(fig, path, dpi=80)
    finally:
        plt.close(fig)
    return {"events": len(data["events"]), "mapped": len(s["mapped"]), "evictions": len(s["evict"]),
            "loads": len(s["load"]), "prefetches": len(s["prefetch"]), "waits": len(s["wait"]),
            "seconds": round(end, 6)}
