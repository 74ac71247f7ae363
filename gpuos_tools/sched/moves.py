"""Where the online policy's bytes go: each load and save of a simulated run (online_sim.py's
events) put in one class, beside Belady's MIN on the same access sequence.

The classes, judged with the whole future known (the steps of the workload):

- loads: ``unused`` (freed, or not used again, before any access: a prefetch along a future
  that did not come), ``overwritten`` (the record's next access writes it whole without reading
  it: the copy was not needed), ``learning`` (its last eviction was decided before a period was known: LRU),
  ``early_victim`` (its last eviction took it although records used later than it stayed
  resident, enough of them to make the same room: Belady would have kept it), ``capacity``
  (the rest: Belady evicts it too, or something as soon);
- saves: ``dead`` (the record's contents are never read again: freed, overwritten whole, or not
  used again before the end), then ``learning``, ``early_victim``, ``capacity`` as for loads.

`belady_min` is the offline reference: demand loads only, the victim the resident record used
furthest ahead (freed or never used again first), a dirty victim saved. With ``skip_dead`` it
also copies nothing for a record about to be overwritten whole and saves nothing dead: what the
access sequence allows at best when only the predictor's ranges prove it.

`fixed_plan` is what a plan made once and repeated every period would move (pinned records,
streamed ones dropped and loaded at fixed steps): the kind of plan that could be carried out with
no decision per operation.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuos_tools.sched.fixed import choose_gaps
from gpuos_tools.sched.planner import NEVER
from gpuos_tools.sched.workload import Workload

FREE, COVER, TOUCH = 0, 1, 2  #: what a record's next event is (a free comes before a step's accesses)
LOAD_CLASSES = ("unused", "overwritten", "learning", "early_victim", "capacity")
SAVE_CLASSES = ("dead", "learning", "early_victim", "capacity")


class Future:
    """Per record, its events in step order: freed before a step, overwritten whole by it, or
    otherwise touched by it (read, or written in part)."""

    def __init__(self, w: Workload) -> None:
        pos: dict[int, list[int]] = {}
        kind: dict[int, list[int]] = {}
        for i, st in enumerate(w.steps):
            for c in st.frees:
                pos.setdefault(c, []).append(2 * i)
                kind.setdefault(c, []).append(FREE)
            covers = set(st.covers)
            for c in st.ws:
                pos.setdefault(c, []).append(2 * i + 1)
                kind.setdefault(c, []).append(COVER if c in covers else TOUCH)
        self.pos, self.kind = pos, kind

    def next(self, c: int, step: int) -> tuple[int, int]:
        """(step, kind) of record ``c``'s first event from step ``step``'s accesses on (its frees
        before that step are past); (NEVER, FREE) when there is none."""
        ps = self.pos.get(c)
        if not ps:
            return NEVER, FREE
        k = bisect_left(ps, 2 * step + 1)
        if k == len(ps):
            return NEVER, FREE
        return ps[k] // 2, self.kind[c][k]

    def next_read(self, c: int, step: int) -> int:
        """The step of the next use that needs ``c``'s contents (NEVER when a free or a whole
        overwrite comes first, or nothing)."""
        t, k = self.next(c, step)
        return t if k == TOUCH else NEVER

    def next_use(self, c: int, step: int) -> int:
        """The step of the next use of ``c`` (a whole overwrite too); NEVER after a free."""
        t, k = self.next(c, step)
        return NEVER if k == FREE else t


def _early(fut: Future, sizes: Sequence[int], c: int, step: int, resident: Sequence[int], protected: set[int]) -> bool:
    """Whether records used later than ``c`` stayed resident at ``step``, enough to free its room."""
    mine = fut.next_use(c, step)
    room = 0
    for r in resident:
        if r != c and r not in protected and fut.next_use(r, step) > mine:
            room += sizes[r]
            if room >= sizes[c]:
                return True
    return False


def classify(w: Workload, events: list[tuple], period_steps: int | None = None) -> dict[str, Any]:
    """The bytes of a run's ``events`` by class (module docstring), in all and per period of
    ``period_steps`` steps (the steady state: the mean over the periods after the first two)."""
    fut = Future(w)
    sizes = w.chunks.sizes
    last_evict: dict[int, tuple[bool, bool]] = {}  #: record -> (its eviction's period known, early)
    n = len(w.steps)
    p = period_steps or n
    periods = max(1, -(-n // p))

    def blank() -> dict[str, Any]:
        return {"bytes_in": 0, "bytes_out": 0, "demand_loads": 0, "prefetches": 0,
                "in": dict.fromkeys(LOAD_CLASSES, 0), "out": dict.fromkeys(SAVE_CLASSES, 0)}

    per = [blank() for _ in range(periods)]
    for ev in events:
        if ev[0] == "evict":
            _, i, c, saved, known, resident = ev
            early = known and _early(fut, sizes, c, i, resident, set(w.steps[i].ws))
            last_evict[c] = (known, early)
            if saved:
                row = per[i // p]
                row["bytes_out"] += saved
                if fut.next_read(c, i) >= NEVER:
                    cls = "dead"
                elif not known:
                    cls = "learning"
                else:
                    cls = "early_victim" if early else "capacity"
                row["out"][cls] += saved
        else:
            _, i, c, copied, demand, _known = ev
            row = per[i // p]
            row["demand_loads" if demand else "prefetches"] += 1
            if not copied:
                continue
            row["bytes_in"] += copied
            t, kind = fut.next(c, i)
            ek, ee = last_evict.get(c, (True, False))
            if kind == FREE:
                cls = "unused"
            elif kind == COVER:
                cls = "overwritten"
            elif not ek:
                cls = "learning"
            else:
                cls = "early_victim" if ee else "capacity"
            row["in"][cls] += copied
    return {"periods": periods, "period_steps": p, "total": _sum(per, blank()),
            "steady": _mean(per[2:], blank()) if periods > 2 else None, "per_period": per}


def belady_min(w: Workload, budget: int, period_steps: int | None = None, skip_dead: bool = False) -> dict[str, Any]:
    """Belady's MIN on ``w``'s steps under ``budget`` bytes (module docstring): bytes in and out,
    in all and per period (the mean over the periods after the first two)."""
    fut = Future(w)
    sizes = w.chunks.sizes
    n = len(w.steps)
    p = period_steps or n
    periods = max(1, -(-n // p))
    per = [{"bytes_in": 0, "bytes_out": 0, "loads": 0} for _ in range(periods)]
    resident: dict[int, None] = {}
    used = 0
    dirty: set[int] = set()
    populated: set[int] = set()
    for i, st in enumerate(w.steps):
        row = per[i // p]
        for c in st.frees:
            if c in resident:
                del resident[c]
                used -= sizes[c]
            dirty.discard(c)
            populated.discard(c)
        ws = set(st.ws)
        covers = set(st.covers)
        missing = [c for c in st.ws if c not in resident]
        need = sum(sizes[c] for c in missing)
        while used + need > budget:
            best, best_use = None, -1
            for r in resident:
                if r in ws:
                    continue
                u = fut.next_use(r, i)
                if u > best_use:
                    best, best_use = r, u
            if best is None:
                break  # the step alone is larger than the budget: it runs above it
            del resident[best]
            used -= sizes[best]
            if best in dirty and not (skip_dead and fut.next_read(best, i) >= NEVER):
                row["bytes_out"] += sizes[best]
            dirty.discard(best)
        for c in missing:
            resident[c] = None
            used += sizes[c]
            if c in populated and not (skip_dead and c in covers):
                row["bytes_in"] += sizes[c]
                row["loads"] += 1
        for c in st.writes:
            dirty.add(c)
            populated.add(c)
    total = {k: sum(r[k] for r in per) for k in ("bytes_in", "bytes_out", "loads")}
    steady = ({k: sum(r[k] for r in per[2:]) / (periods - 2) for k in total} if periods > 2 else None)
    return {"budget": budget, "total": total, "steady": steady}


def _sum(rows: list[dict[str, Any]], acc: dict[str, Any]) -> dict[str, Any]:
    for r in rows:
        for k, v in r.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    acc[k][kk] += vv
            else:
                acc[k] += v
    return acc


def _mean(rows: list[dict[str, Any]], acc: dict[str, Any]) -> dict[str, Any]:
    acc = _sum(rows, acc)
    for k, v in acc.items():
        if isinstance(v, dict):
            for kk in v:
                v[kk] /= len(rows)
        else:
            acc[k] = v / len(rows)
    return acc


def fixed_plan(w: Workload, budget: int, period_steps: int, ahead: int = 2, period: int = 2,
               keep_leads: bool = True) -> dict[str, Any]:
    """What a plan repeated unchanged every period moves on a cyclic workload: fixed.py's
    ``choose_gaps`` (the online policy's ``plan="fixed"`` makes its plans with it) over the steps
    of period number ``period`` (0-based: the first periods learn), with loads ``ahead`` steps
    before their use (``short_leads``: those later; with ``keep_leads`` False, later wherever
    that spares a drop, as ``choose_gaps`` says); records freed inside
    the period are its temporaries. Returns the budget, the peak live bytes, whether the plan fits (every step
    within the budget or its own bytes; not when no choice is left), the steps above the budget
    by their own bytes, the bytes it moves in and out per period (out: the drops of records the
    period writes), the records streamed and pinned, and the loads and drops per period."""
    s0 = period * period_steps
    steps = w.steps[s0:s0 + period_steps]
    if len(steps) < period_steps:
        raise ValueError(f"the workload has fewer than {period + 1} periods of {period_steps} steps")
    sets = [list(st.ws) for st in steps]
    written = {c for st in steps for c in st.writes}
    gaps, live, limit = choose_gaps(sets, w.chunks.sizes, budget, ahead, temporaries={c for st in steps for c in st.frees},
                                    keep_leads=keep_leads)
    over = int(np.max(live - limit))
    recs = {g.record for g in gaps}
    return {"budget": budget, "peak": int(np.max(live)), "fits": over <= 0, "above_steps": int(np.sum(limit > budget)),
            "bytes_in": sum(g.size for g in gaps), "bytes_out": sum(g.size for g in gaps if g.record in written),
            "streamed": len(recs), "pinned": len({c for ws in sets for c in ws}) - len(recs), "moves": 2 * len(gaps),
            "short_leads": sum(1 for g in gaps if g.lead < ahead)}
