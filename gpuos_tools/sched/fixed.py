"""A fixed plan for a cyclic program: which records stay resident and which are dropped after a
use and loaded again before the next one, at the same phases of every period.

Pure logic, no CUDA. ``choose_gaps`` makes the plan from one period's working sets;
``FixedSchedule`` reads it as actions per phase for the online policy's ``plan="fixed"``
(online.py), and moves.py's ``fixed_plan`` measures its bytes on a recorded workload.

Why a fixed plan: the online policy's Belady moves drift from period to period (its victims
depend on ties and on what came before), so every operation has to be decided. A plan that
repeats needs a decision only where it acts; the operations between go by on the native core's
fast path with nothing to replay but a check that the period holds.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: actions of a fixed plan this many phases apart or closer are taken together where the room
#: allows (the loads at the first of them, the drops at the last): on an LLM decode each layer's
#: three MLP weights were loaded and dropped at six phases within eight launches, six decisions
COALESCE = 8


#: how many phases before its next use a record dropped over a dead gap is mapped again (no
#: copy: only room is needed, which the mover waits for off the program's thread)
DEAD_LEAD = 1


@dataclass(frozen=True)
class Gap:
    """A record dropped over the gap between two of its uses in the period: ``start`` phases
    after its use at phase ``use``, until ``lead`` phases before its next use, ``steps`` phases
    after it (all modulo the period). ``dead``: its contents were seen dead inside the gap (every
    torch block freed) before its load, which copies nothing back; dropped from there (``start``
    past 1), it is not saved either."""

    record: int
    size: int
    use: int
    steps: int
    lead: int
    start: int = 1
    dead: bool = False
    want: int = -1  #: the lead it wanted (its copy's time; -1: ``lead``): a lead below it stalls the GPU


#: how many phases before a use a record is loaded: a number, or a function of (the phase of the
#: use, the record's bytes), e.g. the phases whose durations cover its copy (``leads_by_time``)
Lead = int | Callable[[int, int], int]


def choose_gaps(sets: Sequence[Iterable[int]], sizes: Mapping[int, int] | Sequence[int], budget: int, ahead: Lead,
                temporaries: Iterable[int] = (), dead: Mapping[int, Sequence[int]] | None = None,
                keep_leads: bool = True) -> tuple[list[Gap], np.ndarray, np.ndarray]:
    """The gaps a fixed plan drops its records over, for a period whose phase t uses the records
    of ``sets[t]``; with the live bytes per phase under that plan and the limit each phase had
    (the budget, or a phase's own bytes where those alone exceed it: it runs above the budget,
    as under MIN).

    Each record is pinned, or dropped over some gaps between its uses and loaded ``ahead``
    phases before the use after it (a function: of that use's phase and the record's bytes; at
    most the gap), or later where the room allows no earlier load. Greedy: at
    the phase whose live memory exceeds its limit the most, a load over it is made later if
    there is one (no bytes), else the largest record with a gap over it (the longest such gap
    first) is dropped over that gap; until every phase fits or no choice is left. Records in
    ``temporaries`` (freed inside the period) are live from their first to their last use in
    it, and may be dropped over the gaps between those; the others are live all along, and a
    gap may wrap around the period's end.

    ``dead`` gives, per record, the phases at which its contents were seen dead (before that
    phase's launch). A gap holding such a phase costs nothing from the first of them on: the
    record is dropped there and mapped again ``DEAD_LEAD`` phases before its use, with no copy
    either way, so at a phase over its limit a dead gap is taken before anything else. Where a
    phase before its first dead one needs the room too, it is dropped from the use on instead:
    saved, and still mapped back without a copy (its gap is ``dead``, its ``start`` 1).

    ``keep_leads``: at a phase over its limit, a new drop whose load still comes its wanted lead
    early is taken before a chosen load is made later: more bytes, but a load later than its
    copy takes is one the GPU waits for (and, at a lead of 0, one the program's thread loads)."""
    p = len(sets)
    dead = dead or {}
    tmp = set(temporaries)
    uses: dict[int, list[int]] = {}
    for t, st in enumerate(sets):
        for c in st:
            uses.setdefault(c, []).append(t)
    live = np.zeros(p, dtype=np.int64)
    cands: list[tuple[int, int, int, int]] = []  #: (bytes, steps between the uses, record, the use before), a gap each
    lead_of = ahead if callable(ahead) else _constant(ahead)
    for c, ts in uses.items():
        if c in tmp:  # a temporary: live between its first and last use, its gaps inside them
            live[ts[0]:ts[-1] + 1] += sizes[c]
            nxt = ts[1:]
        else:  # live all along, a gap may wrap around the period's end
            live += sizes[c]
            nxt = ts[1:] + [ts[0] + p]
        for a, b in zip(ts, nxt):
            if b - a > 1:
                cands.append((sizes[c], b - a, c, a))
    cands.sort(key=lambda x: (-x[0], -x[1]))  # the largest records first, then the longest gaps
    # each gap's wanted lead (at most the gap: loaded right after the use before it)
    want = [min(n - 1, lead_of((a + n) % p, size)) for size, n, _, a in cands]
    # a dead gap's first phase seen dead (phases after the use); 0: not dead where it helps
    dead_at = [_first_dead(dead.get(c, ()), a, n, p) for _, n, c, a in cands]
    limit = np.array([max(budget, sum(sizes[c] for c in set(st))) for st in sets], dtype=np.int64)
    chosen: dict[int, int] = {}  #: candidate -> its load's lead (phases before the use after the gap)
    dropped_dead: set[int] = set()  #: the chosen candidates dropped over their dead phases only
    later = 0.5 if keep_leads else -1  #: the class of a load made later (below: preferred)
    while p:
        t = int(np.argmax(live - limit))
        if live[t] <= limit[t]:
            break
        # at that phase, in order of preference: a drop over dead phases (no bytes either way),
        # a load there made later (no bytes), a new drop whose load still comes its wanted lead
        # early, a new drop whose load comes later or a dead drop begun at the use (saved: bytes)
        pick: tuple[int, int, int] | None = None  #: (class, candidate, its lead)
        for k, (size, n, _, a) in enumerate(cands):
            d = (t - a) % p  # phases from the use before the gap to t
            if not 0 < d < n:
                continue
            lead = chosen.get(k)
            s0 = dead_at[k]
            if lead is None:
                if s0 and s0 <= d < n - DEAD_LEAD:
                    c = (-2, k, DEAD_LEAD)
                else:
                    w = want[k]
                    c = (0 if n - 1 - w >= d else 1, k, min(w, n - 1 - d))
            elif k in dropped_dead and d < s0:
                c = (1, k, lead)  # t is before its first dead phase: dropped from the use on, saved
            elif d > n - 1 - lead:  # t is in its load's (or map's) lead
                c = (later, k, n - 1 - d)
            else:
                continue
            if pick is None or c[0] < pick[0]:
                pick = c
                if c[0] < -1:
                    break
        if pick is None:
            break  # nothing more to drop at that phase: the plan runs above the budget there
        how, k, lead = pick
        size, n, _, a = cands[k]
        old = chosen.get(k)
        if old is None:  # off from the phase after the use (a dead drop: its first dead phase) until the load
            first, last = a + (dead_at[k] if how == -2 else 1), a + n - lead
            if how == -2:
                dropped_dead.add(k)
        elif how == 1:  # a dead drop begun at the use instead: off before its dead phases too
            first, last = a + 1, a + dead_at[k]
            dropped_dead.discard(k)
        else:  # a load (or a map) made later: off from where its lead began
            first, last = a + n - old, a + n - lead
        live[np.arange(first, last) % p] -= size
        chosen[k] = lead
    # dead: its contents are dead by its load (dead from a phase before it), which copies nothing;
    # dropped over its dead phases only, it is not saved either (start: its first dead phase)
    gaps = []
    for k, lead in chosen.items():
        size, n, c, a = cands[k]
        dead_gap = 0 < dead_at[k] <= n - lead
        gaps.append(Gap(c, size, a, n, lead, dead_at[k] if k in dropped_dead else 1, dead_gap,
                        DEAD_LEAD if dead_gap else want[k]))
    return gaps, live, limit


def _first_dead(phases: Sequence[int], use: int, n: int, p: int) -> int:
    """Of the phases a record was seen dead at, the first inside the gap of ``n`` phases after
    its use at ``use``, as phases after the use; 0 when none leaves a phase to drop it over."""
    offs = [(t - use) % p for t in phases]
    inside = [d for d in offs if 0 < d < n - DEAD_LEAD]
    return min(inside) if inside else 0


def _constant(lead: int) -> Callable[[int, int], int]:
    return lambda u, size: lead


def leads_by_time(durations: Sequence[float], bandwidth: float, least: int) -> Callable[[int, int], int]:
    """A lead by time for ``choose_gaps``: for a use at phase u of a record of n bytes, the
    fewest phases before u whose ``durations`` (seconds, per phase of the period) add up to its
    copy at ``bandwidth`` bytes/s, at least ``least``; the whole period where they never do. A
    load issued at the decision of phase u - k then runs while the GPU runs those k launches:
    on a loop of short kernels over large records (a training step's activations), two
    launches of lead are microseconds, and each load a demand load."""
    p = len(durations)
    cum = [0.0]  # cum[j]: seconds of phases [0, j) of two periods laid end to end
    for d in (*durations, *durations):
        cum.append(cum[-1] + max(0.0, d))

    def lead(u: int, size: int) -> int:
        end = u + p  # phase u in the second period
        # the latest start j whose phases [j, end) take the copy's time: the fewest that cover it
        j = bisect_right(cum, cum[end] - size / bandwidth) - 1
        return max(least, min(p, end - j if j >= 0 else p))

    return lead


@dataclass
class FixedSchedule:
    """A fixed plan read as actions per phase of the period: before the launch of phase t, drop
    ``drops[t]`` (their last use before the gap was the launch before) and load ``loads[t]``
    (their next use comes ``lead`` phases on). ``kernels[t]`` is the kernel the period has
    there (``keys[t]``, the policy's launch key): a launch of another kernel ends the plan. ``uses`` gives, per record, its sorted
    phases, for the victims of a load the plan did not foresee (Belady along the period).
    ``acting`` are the phases to decide: those with a drop or a load, and those whose own
    records exceed the budget (everything else has to go before them)."""

    keys: list[int]
    kernels: list[str]
    sets: list[tuple[int, ...]]
    sizes: dict[int, int]
    budget: int
    gaps: list[Gap]
    fits: bool
    #: the plan was made at ``budget - slack``: the room evictions still in flight may hold
    #: while its loads go ahead
    slack: int = 0
    drops: dict[int, list[int]] = field(default_factory=dict)
    loads: dict[int, list[int]] = field(default_factory=dict)
    uses: dict[int, list[int]] = field(default_factory=dict)
    acting: list[int] = field(default_factory=list)  #: the phases to decide, ascending
    act: frozenset[int] = frozenset()  #: the same, as a set
    drop_at: list[int] = field(default_factory=list)  #: per gap, the phase its record is dropped before
    load_at: list[int] = field(default_factory=list)  #: per gap, the phase its record is loaded at

    @classmethod
    def make(cls, keys: Sequence[int], kernels: Sequence[str], sets: Sequence[tuple[int, ...]],
             sizes: Mapping[int, int], budget: int, lead: Lead, slack: int = 0, coalesce: int = COALESCE,
             dead: Mapping[int, Sequence[int]] | None = None, keep_leads: bool = True) -> FixedSchedule:
        """The plan of a period whose phase t is the launch of ``kernels[t]`` (the policy's key
        ``keys[t]``) touching ``sets[t]``, records of ``sizes`` bytes, loads ``lead`` launches
        ahead (``choose_gaps``; ``dead``: the phases each record was seen dead at); actions
        ``coalesce`` phases apart or closer taken together where they fit (``_coalesce``; 0:
        never). The gaps are chosen to fit ``budget - slack``; a phase is over the budget (and
        decided) when its own records exceed ``budget``."""
        gaps, live, limit = choose_gaps(sets, sizes, max(0, budget - slack), lead, dead=dead, keep_leads=keep_leads)
        s = cls(list(keys), list(kernels), list(sets), dict(sizes), budget, gaps,
                bool(len(live) == 0 or int(np.max(live - limit)) <= 0), slack)
        p = len(sets)
        s.drop_at = [(g.use + g.start) % p for g in gaps]
        s.load_at = [(g.use + g.steps - g.lead) % p for g in gaps]
        if coalesce > 0 and gaps:
            _coalesce(s.drop_at, s.load_at, gaps, live, limit, p, coalesce)
        for g, d, ld in zip(gaps, s.drop_at, s.load_at):
            s.drops.setdefault(d, []).append(g.record)
            s.loads.setdefault(ld, []).append(g.record)
        over = set()
        for t, ws in enumerate(sets):
            for b in ws:
                s.uses.setdefault(b, []).append(t)
            if sum(sizes[b] for b in set(ws)) > budget:
                over.add(t)
        s.act = frozenset(s.drops) | frozenset(s.loads) | over
        s.acting = sorted(s.act)
        return s

    @property
    def p(self) -> int:
        return len(self.sets)

    @property
    def bytes_in(self) -> int:
        """Bytes the plan loads per period (a dead gap's map copies none)."""
        return sum(g.size for g in self.gaps if not g.dead)

    def quiet(self, phase: int, most: int) -> int:
        """How many phases from ``phase`` on (modulo the period) have no action, at most ``most``."""
        acting, p = self.acting, self.p
        if not acting:
            return most
        k = bisect_left(acting, phase)
        nxt = acting[k] if k < len(acting) else acting[0] + p
        return min(most, nxt - phase)

    def off(self, t: int) -> set[int]:
        """The records the plan has dropped before the launch of phase ``t``: in a gap, after
        its drop and before its load."""
        p = self.p
        return {g.record for g, d, ld in zip(self.gaps, self.drop_at, self.load_at) if (t - d) % p < (ld - d) % p}

    def as_dict(self) -> dict[str, int | bool]:
        return {"period": self.p, "budget": self.budget, "slack": self.slack, "fits": self.fits, "bytes_in": self.bytes_in,
                "streamed": len({g.record for g in self.gaps}), "pinned": len(self.uses) - len({g.record for g in self.gaps}),
                "moves": 2 * len(self.gaps), "acting_phases": len(self.acting),
                "dead_gaps": sum(g.dead for g in self.gaps), "dead_bytes": sum(g.size for g in self.gaps if g.dead),
                "late_loads": sum(g.lead < g.want for g in self.gaps),
                "demand_loads": sum(g.lead == 0 for g in self.gaps)}


def _coalesce(drop_at: list[int], load_at: list[int], gaps: Sequence[Gap], live: np.ndarray, limit: np.ndarray,
              p: int, window: int) -> None:
    """Take actions close together at fewer phases: in each run of acting phases at most
    ``window`` apart, the loads move to its first phase and the drops to its last, where every
    phase still fits its limit with the records held longer (``live`` is updated); a run that
    would not fit stays as it was, and so does a record whose drop and load are in the same run. Each
    phase that acts is a decision on the program's thread; a load earlier and a drop later only
    hold room longer. ``drop_at`` and ``load_at`` are changed in place."""
    acting = sorted(set(drop_at) | set(load_at))
    runs: list[list[int]] = [[acting[0]]]
    for t in acting[1:]:
        if t - runs[-1][-1] <= window:
            runs[-1].append(t)
        else:
            runs.append([t])
    by_drop: dict[int, list[int]] = {}
    by_load: dict[int, list[int]] = {}
    for i, (d, ld) in enumerate(zip(drop_at, load_at)):
        by_drop.setdefault(d, []).append(i)
        by_load.setdefault(ld, []).append(i)
    for run in runs:
        if len(run) < 2:
            continue
        t0, t1, inside = run[0], run[-1], set(run)
        extra = np.zeros(p, dtype=np.int64)
        moved: list[tuple[int, int, int]] = []
        for i in {i for t in run for i in (*by_drop.get(t, ()), *by_load.get(t, ()))}:
            d, ld = drop_at[i], load_at[i]
            nd = t1 if d in inside else d
            nl = t0 if ld in inside else ld
            old, new = (ld - d) % p, (nl - nd) % p
            if new == 0 or (nd - d) % p + new + (ld - nl) % p != old:
                continue  # dropped and loaded within the run: it stays as it was
            size = gaps[i].size
            extra[np.arange(d, d + (nd - d) % p) % p] += size  # held until its later drop
            extra[np.arange(nl, nl + (ld - nl) % p) % p] += size  # and from its earlier load
            moved.append((i, nd, nl))
        if not moved or np.any(live + extra > limit):
            continue
        live += extra
        for i, nd, nl in moved:
            drop_at[i], load_at[i] = nd, nl
