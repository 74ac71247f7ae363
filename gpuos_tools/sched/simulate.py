"""Estimated run time of a workload under a memory budget: planned policies and demand paging.

One GPU runs the steps one after another in the workload's order. A step starts when the
previous one has ended and its working set is resident, then computes for its estimated time;
the wait before it is a stall.

Two copy engines, one per link direction, each first-in first-out at its own bandwidth
(`--bw H2D,D2H`), so evictions and loads run at the same time. The default, 50.5 GB/s each
way, is half of the 101 GB/s measured on an H200 with both directions busy.

`belady` and `lru`: the copies for step i may begin once step i-L has started (`--lookahead`
L; `all`: as early as the engines and the budget allow; 0: only when step i is reached, which
is reactive swapping). Evicting a chunk waits until the last step that used it has ended; a
dirty victim is copied out, a clean one dropped. A step's loads wait for the room its
evictions make: they start when the first victim is out and, pipelined one chunk behind the
evictions, the last chunk cannot land before the room for it exists. First-touch chunks need only the room. Working-set chunks that did not fit
(over budget) cost faults, the copy in (if they hold data) and the copy out at managed-memory
eviction bandwidth (if they hold data after the step), all stalling and all counted in the
bytes moved.

`demand`: no prefetch; each non-resident chunk a step uses faults in when the step runs:
ceil(size / `--fault-size`) faults of `--fault-cost` each, plus the copy at the H2D bandwidth
if it holds data; room is made by evicting the least recently used chunks, every one copied
out at `--um-evict-bw` (managed memory keeps one copy); all of it stalls. Defaults: 30 us per
fault (about 29 us measured for one fault on an H200; MSched reports 32 us) and 256 KiB per
fault, which puts a fault-driven first touch of 2 GiB of host data at 0.29 s against 0.318 s
measured on an H200; 12 GB/s eviction (9.8 to 13.7 GB/s measured on an H100).

The transfer-bound floor of a policy is max(compute, bytes in / H2D bandwidth, bytes out /
D2H bandwidth): its time if every copy hid behind compute or behind the other direction. The
in-memory time is the total compute: the same steps with all memory resident.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuos_tools.sched.planner import PLANNERS, Decision
from gpuos_tools.sched.workload import Workload

# The step loops below compare with `if` rather than calling max() (as linters suggest): with
# max() the planned simulation of the recorded PyTorch step ran 15% slower on CPython 3.11.

POLICIES = ("belady", "lru", "demand")

#: Both directions at once on an H200 sum to 101 GB/s (DESIGN.md §3): half each way.
DEFAULT_BW = 50.5e9
DEFAULT_FAULT_S = 30e-6
DEFAULT_FAULT_SIZE = 256 << 10
DEFAULT_UM_EVICT_BW = 12e9


@dataclass(slots=True)
class Config:
    """The machine and the budget a simulation assumes."""

    budget: int
    h2d_bw: float = DEFAULT_BW
    d2h_bw: float = DEFAULT_BW
    fault_s: float = DEFAULT_FAULT_S
    fault_size: int = DEFAULT_FAULT_SIZE
    um_evict_bw: float = DEFAULT_UM_EVICT_BW
    lookahead: int | None = None  #: steps; None: unbounded; 0: reactive


@dataclass(slots=True)
class Timing:
    """When one step's planned copies and the step itself happen (seconds from the start)."""

    load_start: float
    load_end: float
    room: float  #: when the room its evictions make exists
    evict_times: list[tuple[float, float]]  #: (start, end) per evicted chunk
    start: float
    end: float
    stall: float


#: Called once per step of a planned policy, when a schedule is being written.
Observer = Callable[[int, Decision, Timing], None]


def _summary_base(policy: str, w: Workload, cfg: Config) -> dict[str, Any]:
    return {
        "type": "sched_summary",
        "policy": policy,
        "budget": cfg.budget,
        "footprint": w.footprint,
        "chunk": w.chunks.chunk,
        "jobs": len(w.jobs),
        "steps": len(w.steps),
        "launches": sum(1 for st in w.steps if st.of in ("launch", "graph_launch")),
        "switches": len(w.switches),
        "unknown": sum(1 for st in w.steps if st.unknown),
    }


def _finish(out: dict[str, Any], cfg: Config, compute: float, end: float, job_stall: list[float], w: Workload) -> None:
    floor = max(compute, out["bytes_in"] / cfg.h2d_bw, out["bytes_out"] / cfg.d2h_bw)
    out["compute_s"] = compute
    out["est_s"] = end
    out["floor_s"] = floor
    out["in_memory_s"] = compute
    out["speed_vs_in_memory"] = compute / end if end > 0 else 1.0
    out["est_vs_floor"] = end / floor if floor > 0 else 1.0
    out["per_job"] = [
        {
            "job": j.index,
            "source": j.source,
            "steps": len(j.steps),
            "compute_s": sum(st.compute for st in j.steps),
            "stall_s": job_stall[j.index],
        }
        for j in w.jobs
    ]


def simulate_planned(w: Workload, policy: str, cfg: Config, observe: Observer | None = None) -> dict[str, Any]:
    """Run a planner (`belady` or `lru`) over the workload and estimate the time; the summary."""
    sizes = w.chunks.sizes
    steps = w.steps
    planner = PLANNERS[policy](sizes, cfg.budget, steps)
    h2d_bw, d2h_bw = cfg.h2d_bw, cfg.d2h_bw
    look = cfg.lookahead
    last_end = array("d", bytes(8 * len(sizes)))
    starts = array("d")
    h2d_free = d2h_free = 0.0
    prev_end = 0.0
    compute = 0.0
    bytes_in = bytes_out = dropped = first_bytes = over_bytes = 0
    loads = evictions = stalls = over_steps = faults = 0
    stall_s = 0.0
    job_stall = [0.0] * len(w.jobs)
    plan = planner.plan
    for i, st in enumerate(steps):
        d = plan(i)
        if look is None:
            window = 0.0
        elif look == 0:
            window = prev_end
        else:
            window = starts[i - look] if i >= look else 0.0
        room = window
        first_room = -1.0
        evict_times: list[tuple[float, float]] | None = [] if observe is not None else None
        if d.evicts:
            for v, wb in zip(d.evicts, d.writeback, strict=True):
                ready = last_end[v]
                if ready < window:
                    ready = window
                size = sizes[v]
                if wb:
                    t0 = d2h_free if d2h_free > ready else ready
                    d2h_free = t0 + size / d2h_bw
                    bytes_out += size
                    if d2h_free > room:
                        room = d2h_free
                    if first_room < 0:
                        first_room = d2h_free
                    if evict_times is not None:
                        evict_times.append((t0, d2h_free))
                else:
                    dropped += size
                    if ready > room:
                        room = ready
                    if first_room < 0:
                        first_room = ready
                    if evict_times is not None:
                        evict_times.append((ready, ready))
            evictions += len(d.evicts)
        ready_at = room
        load_start = load_end = room
        if d.loads:
            nbytes = 0
            biggest = 0
            for c in d.loads:
                s = sizes[c]
                nbytes += s
                if s > biggest:
                    biggest = s
            load_start = h2d_free if h2d_free > window else window
            if first_room > load_start:
                load_start = first_room  # nothing lands before the first victim has made room
            load_end = load_start + nbytes / h2d_bw
            behind = room + biggest / h2d_bw
            if behind > load_end:
                load_end = behind
            h2d_free = load_end
            bytes_in += nbytes
            loads += len(d.loads)
            if load_end > ready_at:
                ready_at = load_end
        if d.first:
            for c in d.first:
                first_bytes += sizes[c]
        penalty = 0.0
        if d.overflow:
            over_steps += 1
            for c, held, holds in zip(d.overflow, d.overflow_in, d.overflow_out, strict=True):
                size = sizes[c]
                over_bytes += size
                k = -(-size // cfg.fault_size)
                faults += k
                penalty += k * cfg.fault_s
                if held:
                    penalty += size / h2d_bw
                    bytes_in += size
                if holds:
                    penalty += size / cfg.um_evict_bw
                    bytes_out += size
        start = ready_at if ready_at > prev_end else prev_end
        stall = start - prev_end + penalty
        end = start + penalty + st.compute
        if stall > 0:
            stalls += 1
            stall_s += stall
            job_stall[st.job] += stall
        for c in st.ws:
            last_end[c] = end
        if look:
            starts.append(start)
        compute += st.compute
        if observe is not None:
            observe(i, d, Timing(load_start, load_end, room, evict_times or [], start + penalty, end, stall))
        prev_end = end
    out = _summary_base(policy, w, cfg)
    out.update(
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        bytes_dropped=dropped,
        first_touch_bytes=first_bytes,
        loads=loads,
        evictions=evictions,
        faults=faults,
        stalls=stalls,
        stall_s=stall_s,
        over_budget=over_steps,
        over_budget_bytes=over_bytes,
        peak_resident=planner.peak,
        lookahead="all" if look is None else look,
    )
    _finish(out, cfg, compute, prev_end, job_stall, w)
    return out


def simulate_demand(w: Workload, cfg: Config) -> dict[str, Any]:
    """Fault-driven managed memory (no prediction used): the summary."""
    sizes = w.chunks.sizes
    n = len(sizes)
    resident = bytearray(n)
    populated = bytearray(n)
    order: OrderedDict[int, None] = OrderedDict()
    budget = cfg.budget
    fault_s, fault_size = cfg.fault_s, cfg.fault_size
    h2d_bw, evict_bw = cfg.h2d_bw, cfg.um_evict_bw
    used = peak = 0
    end = compute = stall_s = 0.0
    bytes_in = bytes_out = first_bytes = over_bytes = 0
    faults = loads = evictions = stalls = over_steps = 0
    job_stall = [0.0] * len(w.jobs)
    for st in w.steps:
        for c in st.frees:
            if resident[c]:
                resident[c] = 0
                used -= sizes[c]
                del order[c]
            populated[c] = 0
        stall = 0.0
        over = False
        for c in st.ws:
            if resident[c]:
                order.move_to_end(c)
                continue
            size = sizes[c]
            while used + size > budget and order:
                v, _ = order.popitem(last=False)
                resident[v] = 0
                used -= sizes[v]
                bytes_out += sizes[v]
                evictions += 1
                stall += sizes[v] / evict_bw
            k = -(-size // fault_size)
            faults += k
            stall += k * fault_s
            if populated[c]:
                stall += size / h2d_bw
                bytes_in += size
                loads += 1
            else:
                first_bytes += size
            if used + size <= budget:
                resident[c] = 1
                used += size
                order[c] = None
                if used > peak:
                    peak = used
            else:  # one chunk larger than the whole budget: it streams through
                over = True
                over_bytes += size
                stall += size / evict_bw
        for c in st.writes:
            populated[c] = 1
        if over:
            over_steps += 1
        if stall > 0:
            stalls += 1
            stall_s += stall
            job_stall[st.job] += stall
        compute += st.compute
        end += stall + st.compute
    out = _summary_base("demand", w, cfg)
    out.update(
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        bytes_dropped=0,
        first_touch_bytes=first_bytes,
        loads=loads,
        evictions=evictions,
        faults=faults,
        stalls=stalls,
        stall_s=stall_s,
        over_budget=over_steps,
        over_budget_bytes=over_bytes,
        peak_resident=peak,
        lookahead=None,
    )
    _finish(out, cfg, compute, end, job_stall, w)
    return out


def simulate(w: Workload, policy: str, cfg: Config, observe: Observer | None = None) -> dict[str, Any]:
    """The summary of one policy (`belady`, `lru` or `demand`) on the workload."""
    if policy == "demand":
        return simulate_demand(w, cfg)
    if policy not in PLANNERS:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    return simulate_planned(w, policy, cfg, observe)
