"""The online policy of `gpu-prefetch-sched run`: which owned records to evict, require and
prefetch before each launch of a running program, under a byte budget.

Pure decision logic: no CUDA here. Over 800 lines: the period learner, the count and time plans
and their shared Belady books are one policy, each part reading the others' state per launch.

The caller (gpuos_tools/sched/executor.py, inside the program under the agent) tells it, per
launch, the kernel, the record bases the launch touches (from the residency engine's mapping;
None when not trustworthy) and the live owned records with their sizes; it answers a list of
actions in the order they must be applied to the engine (gpuos_tools/memory/engine.py):
``("evict", base)``, ``("require", bases)``, ``("prefetch", base)``.

- Working set: the launch's bases; None (unknown) means every live record (conservative: a
  kernel must never touch released memory).
- The known future: iterative programs repeat their launch sequence. Each launch becomes a key
  (kernel, working set); `Period` learns the period of the key sequence as the program runs
  and predicts the next launches by repeating it. Until a period is known (and again after a
  launch contradicts it) there is no future: eviction is LRU and nothing is prefetched. The
  caller may name the records that identify a launch in its key (``key_bases``: the executor
  leaves out segments of small blocks, which a framework's cache hands out in an order that
  need not repeat from one iteration to the next: keyed on every record, a PyTorch decode
  loop's temporaries can break its one-token period); a key's predicted working set is then the
  one its last launch had.
- Before a launch its whole working set is required (made resident; the launch's stream waits
  for the loads). Room is made first by evicting, never a record of the launch itself, the
  resident record whose next use is furthest in the predicted future (Belady; never used again
  first); `lru` always takes the least recently used.
- After the require, the working sets of the next ``lookahead`` predicted launches are
  prefetched in order while room allows: into free room, or (Belady) by evicting a record used
  later than the one being prefetched; prefetching stops at the first record that cannot be
  placed. Loads and evictions run on the engine's separate streams, so they overlap the
  program's compute and each other. With ``batch`` B > 1, a decision that finds the next
  ``lookahead`` launches' records all resident does nothing, and one that does not prefetches
  up to ``lookahead`` times B launches: past the first ``lookahead`` only with victims from
  outside the batch (one inside would be loaded back a few launches on) and at most
  ``BATCH_SHARE``'s share of the budget (what is loaded early holds room Belady keeps for
  reuse). The moves come in fewer decisions, and the launches between them go by without one
  (the executor's fast path). On the recorded LLM decode token, in the CPU simulation, B = 4
  took the decisions that move something from 78 to 41 a token for 1.6 % more bytes; B = 16
  moved 7-11 % more bytes on the blocked GEMM. On an H100 the decode ran no faster with B = 4:
  a decision's cost there is mostly fixed, not its moves.
- ``plan="time"`` (opt-in; module docstring of the time plan below) replaces the fixed count of
  launches by the launches' measured durations.
- A working set larger than the budget cannot fit: everything else is evicted, the launch is
  counted in ``over_budget`` and runs anyway, above the budget.
- A record that appears (an allocation) is resident: the allocator maps it.
- A percentage budget is a share of the steady working set: the live bytes of the records the
  learned period's launches touch (every live record if one of them is unknown), taken from the
  longest period learned so far of at least 32 launches (``STEADY_MIN``); until one is learned it is a
  share of all the live owned bytes. A short repeat inside a step (a kernel launched twice in a
  row, a few layers alike: periods of 1 or 7 on a CNN) is not the loop, and a budget of its few
  records would leave no room for the step. What a program allocates and leaves (start-up buffers, a
  model built in fp32 before its cast, blocks a framework's cache keeps) is not what a user means
  by its memory: 66% of the live bytes could leave the loop's whole working set resident.

The time plan. The learned period and each launch key's measured GPU duration
(``note_duration``: the executor samples them with events; the CPU simulator gives them exactly)
make a timeline. After the require, the prefetch walks the predicted launches of one period in
order and places their records as the count plan does (free room, or a Belady victim used later),
but it stops by time, not by count: at the first launch t that a later decision can still load
in time -- the compute between the next decision's launch and t covers the copies this decision
queued (each direction on its engine) and then t's own, its saves and loads in series (loads at the host-to-device bandwidth, the victims' saves at the
device-to-host one, ``note_bandwidth``; a save is ordered after everything the program has
enqueued, so it does not overlap the launch at hand) -- and never before the count plan's
``lookahead`` launches (the copies queued by earlier decisions are not counted). A
transfer-bound loop so walks as far as room allows; a compute-bound one until the short
launches ahead add up to the copies of the next long one. Then, with ``proactive``, proactive eviction: the walk goes on, without loading, over one more launch's time
(plus the saves it orders, within PROACTIVE_MAX launches), and for each record it would load
and that does not fit it evicts now the victim Belady would take then (used later than that
launch; room is booked for the record, which a later decision loads into free room). So a save
starts right after the victim's last use, while the GPU still computes, instead of when a load
needs its room, behind everything the program has enqueued; and the victims are the ones the
count plan would take a launch or two later. Off by default: in the CPU simulation
(online_sim.py, scripts/bench_sched_plan.py) it moved 30-50% more bytes on a blocked GEMM for
the same stall, and on the recorded PyTorch step stalled 8-16% less for 6-11% more bytes (the
room it makes early lets the later walks place more, each with its own victims).
Keys with no measure yet take the mean of those measured; with none measured, the walk takes
``lookahead`` launches, as the count plan does.

Why not gpuos_tools/sched/planner.py's BeladyPlanner: it plans a committed sequence in order
and cannot take back a step once appended, while the online future is a guess (a period) that
a launch may contradict at any time; here the next use of a record is read off the current
period (per record, its phases in the period, and a bisect), which costs O(log p) per record.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuos_tools.sched.fixed import FixedSchedule, Lead, leads_by_time
from gpuos_tools.sched.planner import NEVER

POLICIES = ("belady", "lru")
PLANS = ("count", "time", "fixed")
#: Each direction's bandwidth the time plan assumes until the executor says what its copies
#: measured: half of the 101 GB/s both directions carried at once on an H200 (DESIGN.md).
DEFAULT_BW = 50.5e9
WALK_MAX = 4096  #: launches the time plan walks ahead at most (a period longer is cut there)
PROACTIVE_MAX = 256  #: launches ahead the proactive eviction looks at
#: the most a prefetch batch loads past the next ``lookahead`` launches: this share of the budget
#: (what is loaded early holds room that Belady would keep for reuse: 8 launches ahead of a
#: tight stencil took half its budget and raised its loads by a third)
BATCH_SHARE = 16
DURATION_WEIGHT = 0.25  #: weight of a new measure in a key's duration (exponential average)
MATCH_CHECK = 64  #: launches compared when a repeated key suggests a period
OCCURRENCES = 8  #: earlier positions of a key kept to try as period candidates
HISTORY = 1 << 16  #: keys kept (a period longer than half of this is never learned)
BREAKS_KEPT = 16  #: breaks of a known period described in the stats
#: launches a learned period needs before a percentage budget is taken of its working set (a
#: training step of a small MLP with a foreach optimizer is about 35)
STEADY_MIN = 32
#: while a fixed plan's first period runs, one phase in this many is decided (not let go by on the
#: fast path) so that the executor can see which records are dead there (``dead_ask``)
DEAD_EVERY = 8
#: the most of the budget a fixed plan may leave as slack (``OnlinePolicy``'s ``slack``)
SLACK_MAX = 0.5

Action = tuple[str, Any]


class Period:
    """Learns the period of a sequence of keys (small ints) as they come, and predicts ahead.

    A key seen before suggests candidate periods (the distances to its last few positions, kept
    while a period holds too);
    the smallest candidate whose last min(p, MATCH_CHECK) keys match the keys p before them is
    taken. It counts as known once a whole period has repeated (or MATCH_CHECK keys matched);
    from then on each key must equal the one a period before it, else the period is dropped
    (``broken`` counts it) and a new one is looked for.

    A key that comes back more than OCCURRENCES times within a period never suggests that
    period. So the period is also looked up by the last MATCH_CHECK + 1 keys themselves (the
    key included): the most recent earlier position where the same keys ended gives the
    smallest period above MATCH_CHECK that passes the same test. It is taken when the key
    suggests none, or only a short one (at most MATCH_CHECK) that does not hold over those
    MATCH_CHECK + 1 keys: a local repeat, such as a run of one kernel, which would otherwise be
    learned and broken over and over. Seen on a PyTorch CNN step on an H200: its fill and
    layout kernels on the same cached blocks repeat dozens of times a step, the step's period
    (542 launches) was never tested, and periods of 1 were learned and broken all along.

    Cost: while no period holds, every key is a search. A candidate is tested by comparing the
    polynomial hashes of the two windows (prefix hashes kept beside the keys: O(1) a test, not
    up to MATCH_CHECK comparisons) and, only when they are equal, the keys themselves, so the
    result is the one the plain comparison gives. The keys live in a list trimmed by halves
    (O(1) indexing; a deque's middle costs O(n / 64)); only the last ``history`` count.
    """

    def __init__(self, history: int = HISTORY) -> None:
        self.history = history
        self._keys: list[int] = []
        self._h: list[int] = [0]  #: _h[k]: hash of _keys[:k]
        self._off = 0  #: absolute index of _keys[0]
        self.seen: dict[int, deque[int]] = {}  #: key -> its last absolute positions
        #: hash of the MATCH_CHECK + 1 keys ending at a position -> the last positions (+ 1)
        self.windows: dict[int, deque[int]] = {}
        self.p: int | None = None  #: candidate period
        self.matched = 0  #: consecutive keys equal to the key p before them
        self.broken = 0  #: known periods a key contradicted
        self.learned = 0  #: periods that became known (a new one after each break too)

    @property
    def n(self) -> int:
        return self._off + len(self._keys)

    @property
    def start(self) -> int:
        """Absolute index of the oldest key kept."""
        return max(self._off, self.n - self.history)

    def _at(self, i: int) -> int:
        return self._keys[i - self._off]

    @property
    def known(self) -> int | None:
        """The period, once confirmed; None before."""
        p = self.p
        return p if p is not None and self.matched >= min(p, MATCH_CHECK) else None

    def push(self, key: int) -> None:
        # once per launch, and once per operation the native core let go by: the properties
        # (n, start, known) and the window's hash are computed inline
        keys, off, p = self._keys, self._off, self.p
        i = off + len(keys)
        was = p if p is not None and self.matched >= min(p, MATCH_CHECK) else None
        broke = False
        start = max(off, i - self.history)  # of the keys before this one
        if p is not None:
            j = i - p
            if j >= start and keys[j - off] == key:
                self.matched += 1
            else:
                if was is not None:
                    self.broken += 1
                    broke = True
                self.p = p = None
        if len(keys) >= 2 * self.history:
            self._trim()
            keys, off = self._keys, self._off
        keys.append(key)
        hs = self._h
        h = (hs[-1] * _BASE + key + 1) % _MOD
        hs.append(h)
        # the hash of the MATCH_CHECK + 1 keys up to this one (None: fewer kept)
        a = i - MATCH_CHECK
        hw = (h - hs[a - off] * _POW_W) % _MOD if a >= off else None
        if p is None:
            self._search(i, key, start, hw)
        # every position, while a period holds too: after a break (a stray launch), a key's
        # candidates are then its last positions in the loop, not those from before the period
        # was learned (which suggested the loop with the stray in it, then a multiple of it)
        occ = self.seen.get(key)
        if occ is None:
            occ = self.seen[key] = deque(maxlen=OCCURRENCES)
        occ.append(i)
        if hw is not None:
            self._note_window(i + 1, hw)
        if (was is None or broke) and self.known is not None:
            self.learned += 1

    def _trim(self) -> None:
        drop = len(self._keys) - self.history
        self._keys = self._keys[drop:]
        self._off += drop
        h, hs = 0, [0]
        for k in self._keys:
            h = (h * _BASE + k + 1) % _MOD
            hs.append(h)
        self._h = hs

    def _window(self, a: int, b: int) -> int:
        """Hash of the keys at absolute [a, b)."""
        hs, off = self._h, self._off
        return (hs[b - off] - hs[a - off] * _POW[b - a]) % _MOD

    def _matches(self, i: int, p: int, n: int, start: int) -> bool:
        """The ``n`` keys ending at ``i`` (inclusive) equal the ``n`` keys p before them, all of
        them at or after ``start``: hashes first, then the keys themselves."""
        if i + 1 - n - p < start:
            return False
        keys, off = self._keys, self._off
        if n > 1 and (keys[i - 1 - off] != keys[i - 1 - p - off]  # most candidates fail here
                      or self._window(i + 1 - n, i + 1) != self._window(i + 1 - n - p, i + 1 - p)):
            return False
        return all(keys[t - off] == keys[t - p - off] for t in range(i + 1 - n, i + 1))

    def _search(self, i: int, key: int, start: int, hw: int | None) -> None:
        """No period holds at key ``i`` (appended): the candidates of the key, then the
        windows' (class docstring)."""
        found: int | None = None
        for j in reversed(self.seen.get(key, ())):
            if j < start:
                break
            p = i - j
            # the key and the min(p - 1, MATCH_CHECK) keys before it (the key matches: j's)
            if self._matches(i, p, min(p - 1, MATCH_CHECK) + 1, start):
                found = p
                break
        w = MATCH_CHECK + 1
        if found is None or found <= MATCH_CHECK:
            by_window = None if hw is None else self._by_window(i + 1, start, hw)
            # a short candidate that does not hold over the window's keys is a local repeat
            # (a run of one kernel on one block), not the loop's period: the window's wins
            if by_window is not None and (found is None or not self._matches(i, found, w, start)):
                found = by_window
        if found is not None:
            self.p, self.matched = found, min(found - 1, MATCH_CHECK) + 1

    def _note_window(self, end: int, h: int) -> None:
        """Remember where the MATCH_CHECK + 1 keys before ``end`` (absolute; hash ``h``) ended."""
        w = MATCH_CHECK + 1
        occ = self.windows.get(h)
        if occ is None:
            if len(self.windows) >= 2 * self.history:  # forget windows that left the history
                start = self.start
                self.windows = {x: q for x, q in self.windows.items() if q[-1] - w >= start}
            # enough ends to reach one more than MATCH_CHECK back, even where the window
            # recurs at every key (a run of one key)
            occ = self.windows[h] = deque(maxlen=w + 1)
        occ.append(end)

    def _by_window(self, end: int, start: int, h: int) -> int | None:
        """The smallest period above MATCH_CHECK whose MATCH_CHECK + 1 keys up to ``end`` (hash
        ``h``) match: the most recent earlier end of the same keys, by their hash."""
        w = MATCH_CHECK + 1
        if end - w < start:
            return None
        occ = self.windows.get(h)
        if not occ:
            return None
        for j in reversed(occ):
            p = end - j
            if p <= MATCH_CHECK:
                continue
            if j - w < start:
                return None
            if self._matches(end - 1, p, w, start):
                return p
        return None

    def predict(self, k: int) -> list[int]:
        """The next ``k`` keys if the period holds (empty while none is known)."""
        p = self.known
        if p is None or k <= 0:
            return []
        keys, base = self._keys, self.n - p - self._off
        return [keys[base + (t % p)] for t in range(k)]

    def ahead(self, k: int) -> Ahead:
        """``predict(k)`` read as it is walked: the same keys, each computed when it is looked
        at, so that a walk that stops after a few launches does not pay for the whole period."""
        p = self.known
        if p is None or k <= 0:
            return Ahead(self._keys, 0, 1, 0)
        return Ahead(self._keys, self.n - p - self._off, p, k)

    def phase_uses(self) -> tuple[int, list[int]]:
        """(period, the keys of one period starting at the next launch)."""
        p = self.known
        assert p is not None
        return p, self.predict(p)


class Ahead(Sequence[int]):
    """The next keys of a known period (``Period.ahead``): valid until the next ``push``."""

    __slots__ = ("_keys", "_base", "_p", "_k")

    def __init__(self, keys: list[int], base: int, p: int, k: int) -> None:
        self._keys, self._base, self._p, self._k = keys, base, p, k

    def __len__(self) -> int:
        return self._k

    def __getitem__(self, t):  # noqa: ANN001 - an int (slices are not needed by the walks)
        if not 0 <= t < self._k:
            raise IndexError(t)
        return self._keys[self._base + t % self._p]

    def __iter__(self) -> Iterator[int]:
        keys, base, p = self._keys, self._base, self._p
        for t in range(self._k):
            yield keys[base + t % p]


_MOD = (1 << 61) - 1
_BASE = 1_000_003
_POW = [pow(_BASE, k, _MOD) for k in range(MATCH_CHECK + 2)]  #: windows are at most MATCH_CHECK + 1 keys
_POW_W = _POW[MATCH_CHECK + 1]  #: a whole window's


@dataclass
class Stats:
    launches: int = 0
    unknown: int = 0  #: launches whose working set was not known (every record required)
    over_budget: int = 0  #: launches whose working set alone exceeded the budget
    over_budget_bytes: int = 0  #: sum over them of working set - budget
    evictions: int = 0
    evicted_bytes: int = 0
    prefetches: int = 0  #: records loaded ahead of the launch that needs them
    prefetched_bytes: int = 0
    demand_loads: int = 0  #: records not resident when their launch came (loaded at require)
    demand_bytes: int = 0
    stalls: int = 0  #: launches that had to load at least one record at require
    predicted: int = 0  #: launches with a period known before them
    peak_resident: int = 0  #: the most bytes resident by the policy's books, after a decision
    budget_max: int = 0  #: the largest budget a decision used (percentage budgets grow)
    #: a percentage budget's base once a period is known: the live bytes of the records the
    #: learned period touches (0: none learned yet, or a budget in bytes)
    steady_bytes: int = 0
    proactive: int = 0  #: evictions the time plan made right after a last use (not for room now)
    walk_max: int = 0  #: the most launches one decision's prefetch walked ahead (time plan)
    periods: list[int] = field(default_factory=list)  #: each period learned, in order
    #: launches decided with each period known: what governed the run (the last periods
    #: learned may be short ones of a program's ending, after its loop)
    period_use: dict[int, int] = field(default_factory=dict)
    period_breaks: int = 0  #: known periods a launch contradicted
    #: the first BREAKS_KEPT breaks: the launch (1-based), the period, the kernel the period
    #: predicted and the one that came, and whether the kernel or only its records differed
    breaks: list[dict[str, Any]] = field(default_factory=list)
    #: the last BREAKS_KEPT breaks after those (a program's start-up breaks come first; the
    #: loop's, which decide how much of it had a future, come later)
    breaks_last: list[dict[str, Any]] = field(default_factory=list)
    #: distinct launch keys so far: about one period's worth when the program repeats, growing
    #: with every iteration when the records its launches touch do not repeat
    keys: int = 0
    #: launches taken as the one the period predicted although one key record more or fewer
    #: came (``OnlinePolicy._jitter``): the period held
    jitter: int = 0
    fixed_plans: int = 0  #: fixed plans made (``plan="fixed"``)
    fixed_launches: int = 0  #: launches decided by one
    #: of them, decisions (not replays) at a phase where the plan acts, and elsewhere (a record
    #: not ready for the launch, the core's allowance cut short): where a fixed plan's upcalls come from
    fixed_acting_decisions: int = 0
    fixed_other_decisions: int = 0
    fixed_ends: int = 0  #: fixed plans a launch ended (another kernel, an unknown launch, the records changed)
    #: fixed plans made again once a period showed where records are dead, and the phases asked
    fixed_dead_replans: int = 0
    fixed_dead_samples: int = 0
    #: the last fixed plan made (FixedSchedule.as_dict), and why the last one ended
    fixed: dict[str, Any] = field(default_factory=dict)
    fixed_end: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["periods"] = list(self.periods[-8:])
        d["period_use"] = sorted(([p, n] for p, n in self.period_use.items()), key=lambda x: -x[1])[:8]
        d["breaks"] = [dict(b) for b in self.breaks]
        d["breaks_last"] = [dict(b) for b in self.breaks_last]
        return d


class OnlinePolicy:
    """Decisions per launch (module docstring). ``budget`` is bytes, or with ``fraction`` set, a
    share of the steady working set once a period is learned, of the live owned bytes before
    (``budget`` is then ignored)."""

    def __init__(self, budget: int | None, policy: str = "belady", lookahead: int = 2,
                 fraction: float | None = None, plan: str = "count", proactive: bool = False,
                 batch: int = 1, slack: float = 0.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}")
        if budget is None and fraction is None:
            raise ValueError("a budget in bytes or a fraction")
        if lookahead < 0:
            raise ValueError("lookahead must be 0 or more")
        if batch < 1:
            raise ValueError("batch must be 1 or more")
        if plan == "fixed" and policy != "belady":
            raise ValueError("a fixed plan is made the Belady way: policy belady only")
        if not 0 <= slack <= SLACK_MAX:
            raise ValueError(f"slack must be from 0 to {SLACK_MAX}")
        self.fixed = budget
        self.fraction = fraction
        self.policy = policy
        self.lookahead = lookahead
        self.batch = batch  #: the count plan prefetches lookahead x batch launches once it must act
        self.plan = plan
        self.proactive = proactive
        #: a fixed plan is made at (1 - slack) of the budget and carried out at the budget: the
        #: room between is what evictions still in flight (a save the GPU has not finished, a
        #: release waiting for a victim's last use) may hold while the plan's loads go ahead,
        #: instead of the program's thread waiting for it
        self.slack = slack
        #: a fixed plan takes a new drop before it makes a load later than its wanted lead
        #: (fixed.py ``choose_gaps``' ``keep_leads``; the executor sets it from its settings)
        self.keep_leads = True
        #: the fixed plan in force (``plan="fixed"``), the phase of the next launch in it, the
        #: period (``Period.learned``) it was last tried for, and whether its first decision
        #: is still to come (it evicts what no phase uses)
        self._fixed: FixedSchedule | None = None
        self._phase = 0
        self._fixed_tried: int | None = None
        self._fixed_fresh = False
        #: whoever drives the policy can say which records are dead (every torch block freed:
        #: the executor over the owned library); then a fixed plan's first period asks at one
        #: phase in DEAD_EVERY (``dead_ask``/``note_dead``) and the plan is made again with
        #: what it saw: dropped where it is dead, a record moves no bytes
        self.sees_dead = False
        self._dead_seen: dict[int, list[int]] | None = None  #: record -> phases seen dead, while asking
        self._dead_left = 0  #: phases of the period still to go while asking
        self._dead_ask: int | None = None  #: the phase just decided, when its dead records are wanted
        self._fixed_inputs: tuple | None = None  #: what the plan in force was made from
        self.h2d_bw = self.d2h_bw = DEFAULT_BW
        self._dur: list[float] = []  #: key id -> its measured GPU seconds (-1.0: none yet)
        self._dur_sum = 0.0  #: of the measured ones
        self._dur_n = 0
        self.last_key = -1  #: the key id of the launch last decided (``note_duration``'s)
        self.resident: OrderedDict[int, int] = OrderedDict()  #: base -> size, least recent first
        self.used = 0
        self.period = Period()
        self._ids: dict[tuple, int] = {}
        self._sets: list[tuple[int, ...] | None] = []  #: key id -> its working set (None: all)
        self._key_of: list[tuple] = []  #: key id -> its key (kernel, key records)
        self._known: set[int] = set()  #: records seen by a decision (and not freed since)
        self._uses: dict[int, list[int]] = {}  #: base -> its phases in the period
        self._all: list[int] = []  #: phases of unknown launches (they use every record)
        self._uses_for: tuple[int, int] | None = None  #: (periods learned, p) of _uses
        self._version: Any = object()  #: the caller's version of the records last synced
        self._total = 0  #: their bytes
        self.last_budget = 0  #: the budget of the last decision
        #: the records the learned period touches (None: no period learned yet; ``_steady_all``:
        #: one of its launches is unknown, so every live record), and their live bytes (-1: to count)
        self._steady: frozenset[int] | None = None
        self._steady_all = False
        self._steady_bytes = -1
        self._steady_for: tuple[int, int] | None = None  #: (periods learned, p) of _steady
        self._steady_p = 0  #: the period _steady was taken from
        self.stats = Stats()

    # -- the budget ---------------------------------------------------------------------------

    def budget(self, records: Mapping[int, int]) -> int:
        if self.fraction is not None:
            return int(self._base(records, sum(records.values())) * self.fraction)
        assert self.fixed is not None
        return self.fixed

    def budget_of(self) -> str:
        """What the budget is: ``bytes``, or for a percentage what it is a share of so far."""
        if self.fraction is None:
            return "bytes"
        return "live owned bytes" if self._steady is None or self._steady_all else "steady working set"

    def _base(self, records: Mapping[int, int], total: int) -> int:
        """What a percentage budget is a share of (module docstring): the live bytes of the
        steady working set once a period is learned, else ``total`` (all live bytes)."""
        if self._steady is None:
            return total
        if self._steady_all:
            self.stats.steady_bytes = total
            return total
        if self._steady_bytes < 0:
            self._steady_bytes = sum(records[b] for b in self._steady if b in records)
            self.stats.steady_bytes = self._steady_bytes
        return self._steady_bytes

    def _learn_steady(self) -> None:
        """With a period known, the records its launches touch (once per period learned): the
        steady working set a percentage budget is of."""
        per = self.period
        p = per.known
        if p is None or self.fraction is None or self._steady_for == (per.learned, p):
            return
        self._steady_for = (per.learned, p)
        if p < max(STEADY_MIN, self._steady_p):  # a repeat inside the loop, not the loop
            return
        self._steady_p = p
        bases: set[int] = set()
        every = False
        for k in set(per.predict(p)):
            ws = self._sets[k]
            if ws is None:
                every = True
                break
            bases.update(ws)
        self._steady, self._steady_all, self._steady_bytes = frozenset(bases), every, -1

    # -- per launch ---------------------------------------------------------------------------

    def before(self, kernel: str, bases: Sequence[int] | None, records: Mapping[int, int],
               key_bases: Sequence[int] | None = None, version: Any = None) -> list[Action]:
        """The actions before a launch of ``kernel`` touching ``bases`` (None: unknown), with
        ``records`` the live owned records (base -> bytes). ``key_bases``: the records that
        identify the launch for learning the period (default: ``bases``). ``version``: a value
        that changes whenever ``records`` does (the executor's allocator counts); with it, the
        records are re-read only when it moved."""
        st = self.stats
        st.launches += 1
        changed = version is None or version != self._version
        if changed:
            self._sync(records)
            self._total = sum(records.values())
            self._version = version
            self._steady_bytes = -1
        if self._fixed is not None:
            end = self._fixed_holds(kernel, bases, records if changed else None)
            if end is None:
                return self._fixed_before(bases, records)
            self._end_fixed(end)
        if bases is None:
            st.unknown += 1
            ws = tuple(sorted(records))
            key_ws: tuple[int, ...] | None = None
        else:
            ws = tuple(sorted({b for b in bases if b in records}))
            key_ws = ws if key_bases is None else tuple(sorted({b for b in key_bases if b in records}))
        future = self._advance(kernel, key_ws, None if bases is None else ws)
        if self.fraction is not None:
            self._learn_steady()
            budget = int(self._base(records, self._total) * self.fraction)
        else:
            budget = self.budget(records)
        self.last_budget = budget
        st.budget_max = max(st.budget_max, budget)
        actions: list[Action] = []
        protected = set(ws)
        size, _ = self._room_for(ws, records, budget, protected, actions)
        for b in ws:
            if b in self.resident:
                self.resident.move_to_end(b)
            else:
                self.resident[b] = records[b]
                self.used += records[b]
        actions.append(("require", None if bases is None else list(ws)))
        if size <= budget:
            if self.plan == "time" and self.period.known is not None and self._dur_n:
                self._prefetch_time(records, budget, protected, actions)
            else:
                self._prefetch(future, records, budget, protected, actions)
        st.peak_resident = max(st.peak_resident, self.used)
        if self.plan == "fixed":
            self._make_fixed(records, budget)
        return actions

    def _room_for(self, ws: tuple[int, ...], records: Mapping[int, int], budget: int, protected: set[int],
                  actions: list[Action]) -> tuple[int, list[int]]:
        """Room for a launch's own records ``ws``: a working set over the budget evicts everything
        else (and is counted), one within it evicts victims until its missing records fit: (its
        bytes, the records of it not resident: demand loads, counted)."""
        st = self.stats
        size = sum(records[b] for b in ws)
        missing = [b for b in ws if b not in self.resident]
        need = sum(records[b] for b in missing)
        if size > budget:
            st.over_budget += 1
            st.over_budget_bytes += size - budget
            for b in [b for b in self.resident if b not in protected]:
                self._evict(b, actions)
        else:
            while self.used + need > budget:
                v = self._victim(protected, 0)
                if v is None:  # cannot happen: what is not ws fits with ws under the budget
                    break
                self._evict(v, actions)
        if missing:
            st.stalls += 1
            st.demand_loads += len(missing)
            st.demand_bytes += need
        return size, missing

    def _sync(self, records: Mapping[int, int]) -> None:
        """Records freed leave residency; records allocated since the last decision are
        resident (the allocator maps them), records the policy evicted are not."""
        for b in [b for b in self.resident if b not in records]:
            self.used -= self.resident.pop(b)
        known = self._known
        for b in [b for b in known if b not in records]:
            known.discard(b)
        for b, size in records.items():
            if b not in known:
                known.add(b)
                self.resident[b] = size
                self.used += size

    def _advance(self, kernel: str, key_ws: tuple[int, ...] | None,
                 ws: tuple[int, ...] | None) -> list[tuple[int, ...] | None]:
        """Push this launch's key (kernel, ``key_ws``); the predicted working sets of the next
        launches (each key's: the last ``ws`` it had)."""
        key = (kernel, key_ws)
        kid = self._ids.get(key)
        if kid is None:
            kid = self._ids[key] = len(self._sets)
            self._sets.append(ws)
            self._key_of.append(key)
            self._dur.append(-1.0)
            self.stats.keys = len(self._sets)
        else:
            self._sets[kid] = ws
        per = self.period
        before = per.known
        expected = -1
        if before is not None:
            st = self.stats
            st.predicted += 1
            st.period_use[before] = st.period_use.get(before, 0) + 1
            expected = per._keys[per.n - before - per._off]  # predict(1)[0]
            if expected != kid and self._jitter(expected, key):
                kid = expected  # the period holds: the launch it predicted, with this launch's records
                self._sets[kid] = ws
                self.stats.jitter += 1
        self.last_key = kid
        broken = per.broken
        per.push(kid)
        p = per.known
        if p is not None and p != before:
            self.stats.periods.append(p)
        self.stats.period_breaks = per.broken
        if per.broken != broken:
            self._log_break(before, expected, key)
        if p is None:
            return []
        sets = self._sets
        return [sets[k] for k in per.ahead(max(self.lookahead * self.batch, 1))]

    def _jitter(self, expected: int, key: tuple) -> bool:
        """Whether a launch whose key is not the one the period predicted is that launch all the
        same: the same kernel, and its key records differ by one record at most (one more, one
        fewer). Seen on a transformers decode on an H100: PyTorch's reduction kernel of each
        RMSNorm gained or lost one record from token to token, which broke the learned period
        (one token's launches) about a hundred times a token, and with it the future. One
        record replaced by another (a loop that moves along its arrays) is a break."""
        want = self._key_of[expected]
        if want[0] != key[0] or want[1] is None or key[1] is None:
            return False
        a, b = set(want[1]), set(key[1])
        return len(a ^ b) <= 1

    def _log_break(self, p: int | None, expected: int, key: tuple) -> None:
        """One break of a known period ``p`` in ``Stats.breaks`` (the first BREAKS_KEPT) or
        ``Stats.breaks_last`` (the last BREAKS_KEPT after them): where, and what differed from
        the launch the period predicted (``expected``'s key): the kernel, or its records."""
        first = len(self.stats.breaks) < BREAKS_KEPT
        if not 0 <= expected < len(self._key_of):
            return
        want = self._key_of[expected]
        kernel, ws = key
        same = want[0] == kernel
        entry: dict[str, Any] = {"launch": self.stats.launches, "period": p, "expected": want[0],
                                 "got": kernel, "differs": "records" if same else "kernel"}
        if same and ws is not None and want[1] is not None:
            entry["records_new"] = len(set(ws) - set(want[1]))
            entry["records_gone"] = len(set(want[1]) - set(ws))
        if first:
            self.stats.breaks.append(entry)
        else:
            self.stats.breaks_last = [*self.stats.breaks_last[-(BREAKS_KEPT - 1):], entry]

    def _table(self) -> tuple[int, int, dict[int, list[int]], int]:
        """(p, the next launch's phase, base -> its sorted phases in the period, launches to
        the next unknown launch or NEVER), with a period known. The phases table is made once
        per period learned: while the period holds, the key at phase i % p is the same for
        every i."""
        fx = self._fixed
        if fx is not None:
            return fx.p, self._phase, fx.uses, NEVER
        per = self.period
        p = per.known
        assert p is not None
        n = per.n  # the index of the next launch
        if self._uses_for != (per.learned, p):
            uses: dict[int, list[int]] = {}
            every: list[int] = []
            for i in range(n - p, n):
                ws = self._sets[per._at(i)]
                if ws is None:
                    every.append(i % p)
                else:
                    for b in ws:
                        uses.setdefault(b, []).append(i % p)
            for phases in uses.values():
                phases.sort()
            every.sort()
            self._uses, self._all, self._uses_for = uses, every, (per.learned, p)
        now = n % p
        every = self._all
        if every:  # an unknown launch uses every record
            k = bisect_left(every, now)
            nxt_all = (every[k] if k < len(every) else every[0] + p) - now + 1
        else:
            nxt_all = NEVER
        return p, now, self._uses, nxt_all

    def _next_use(self, base: int) -> int:
        """Launches from the next one to the next use of ``base`` (1 = the next launch), NEVER
        if it is not in the period, or if no period is known."""
        if self.period.known is None and self._fixed is None:
            return NEVER
        p, now, uses, best = self._table()
        phases = uses.get(base)
        if phases:
            k = bisect_left(phases, now)
            best = min(best, (phases[k] if k < len(phases) else phases[0] + p) - now + 1)
        return best

    def _victim(self, protected: set[int], later_than: int) -> int | None:
        """A resident record outside ``protected`` to evict: LRU without a future (or with the
        lru policy); else the one used furthest ahead, if that is beyond ``later_than``.

        This is the policy's hot loop (every resident record, at every eviction): the next use
        is computed inline from the period's phases table (``_next_use``'s arithmetic), and a
        record used neither in the period nor by an unknown launch ends the search (nothing
        is used later; the LRU one among those comes first)."""
        if self.policy == "lru" or (self.period.known is None and self._fixed is None):
            for b in self.resident:
                if b not in protected:
                    return b
            return None
        p, now, uses, nxt_all = self._table()
        get = uses.get
        best, best_use = None, -1
        for b in self.resident:  # least recent first: among equals, the LRU one wins
            if b in protected:
                continue
            phases = get(b)
            if phases:
                k = bisect_left(phases, now)
                u = (phases[k] if k < len(phases) else phases[0] + p) - now + 1
                if u > nxt_all:
                    u = nxt_all
            else:
                u = nxt_all
            if u > best_use:
                best, best_use = b, u
                if u >= NEVER:
                    break
        return best if best is not None and best_use > later_than else None

    def _evict(self, b: int, actions: list[Action]) -> None:
        size = self.resident.pop(b)
        self.used -= size
        self.stats.evictions += 1
        self.stats.evicted_bytes += size
        actions.append(("evict", b))

    # -- the fixed plan (plan="fixed"; gpuos_tools/sched/fixed.py) ------------------------------

    def _make_fixed(self, records: Mapping[int, int], budget: int) -> None:
        """With a period of at least STEADY_MIN launches known (the loop, not a repeat inside
        it) whose launches are all known, a fixed plan of it at ``budget``, its phase 0 the next
        launch; tried once per period learned. Made as soon as the period is known (its first
        MATCH_CHECK launches repeated the period before): a loop that breaks its period now and
        then (a ResNet step's, a decode's first tokens) would otherwise run a whole period more
        under the count plan after each break; a wrong period ends its plan at its first
        launch of another kernel."""
        per = self.period
        p = per.known
        if p is None or p < STEADY_MIN or self._fixed_tried == per.learned:
            return
        self._fixed_tried = per.learned
        keys = per.predict(p)
        sets = [self._sets[k] for k in keys]
        if any(ws is None for ws in sets):
            self.stats.fixed_end = "an unknown launch in the period: no fixed plan"
            return
        live = [tuple(b for b in ws if b in records) for ws in sets]  # type: ignore[union-attr]
        sizes = {b: records[b] for ws in live for b in ws}
        # loads as far ahead as the launches' measured durations take to copy them, once some
        # are measured (the executor samples them, the simulator gives them; all zero: a fake
        # clock, which would put every load a whole period ahead); else --lookahead
        lead: Lead = self.lookahead
        if self._dur_n and self._dur_sum > 0:
            lead = leads_by_time([self.duration(k) for k in keys], self.h2d_bw, self.lookahead)
        self._fixed_inputs = (keys, [self._key_of[k][0] for k in keys], live, sizes, budget, lead,
                              int(budget * self.slack))
        self._fixed = FixedSchedule.make(*self._fixed_inputs, keep_leads=self.keep_leads)
        self._phase = 0
        self._fixed_fresh = True
        self.stats.fixed_plans += 1
        self.stats.fixed = self._fixed.as_dict()
        if self.sees_dead:  # one period asking where records are dead, then the plan again
            self._dead_seen, self._dead_left = {}, p
        else:
            self._dead_seen = None

    def _asking_dead(self) -> bool:
        return self._dead_seen is not None and self._dead_left > 0

    def dead_ask(self) -> tuple[int, tuple[int, ...]] | None:
        """After a decision: (its phase, the plan's records) when the caller should say which of
        them are dead now (``note_dead``); else None."""
        j, self._dead_ask = self._dead_ask, None
        fx = self._fixed
        if j is None or fx is None or self._dead_seen is None:
            return None
        return j, tuple(fx.sizes)

    def note_dead(self, phase: int, dead: Iterable[int]) -> None:
        """The records (of ``dead_ask``'s) whose contents were dead before the launch of ``phase``."""
        seen = self._dead_seen
        if seen is None:
            return
        self.stats.fixed_dead_samples += 1
        for b in dead:
            seen.setdefault(b, []).append(phase)

    def _replan_dead(self) -> None:
        """The plan in force made again from the same period with the phases its records were
        seen dead at (``_make_fixed``), its phase kept; its first decision drops what the new
        plan has off there. Nothing seen dead: the plan stays."""
        seen, self._dead_seen = self._dead_seen, None
        if not seen or self._fixed_inputs is None:
            return
        self._fixed = FixedSchedule.make(*self._fixed_inputs, dead=seen, keep_leads=self.keep_leads)
        self._fixed_fresh = True
        self.stats.fixed_dead_replans += 1
        self.stats.fixed = self._fixed.as_dict()

    def _fixed_holds(self, kernel: str, bases: Sequence[int] | None, records: Mapping[int, int] | None) -> str | None:
        """None when the launch is the one the fixed plan has next; else why the plan ends.
        ``records``: the live records, when they changed since the last decision (a plan's
        record freed, or of another size, ends it; a new record does not: it is resident and
        no phase uses it, the first victim)."""
        fx = self._fixed
        assert fx is not None
        if bases is None:
            return "an unknown launch"
        if fx.kernels[self._phase] != kernel:
            return "another kernel than the period's"
        if records is not None:
            for b, size in fx.sizes.items():
                if records.get(b) != size:
                    return "a record of the plan freed or resized"
        return None

    def _end_fixed(self, why: str) -> None:
        """The fixed plan no longer holds: the count plan decides this launch, and the period
        learner (which got the plan's keys meanwhile) sees the break."""
        self._fixed = None
        self._dead_seen = None
        self.stats.fixed_ends += 1
        self.stats.fixed_end = why

    def fixed_next(self, kernel: str) -> bool:
        """A launch the executor's fast path let go by, under a fixed plan: True when it is the
        kernel of the next phase and the plan has no action there (the phase moves on, as
        ``before`` would have, with nothing to do); False: it must go through ``before``."""
        fx = self._fixed
        if fx is None:
            return False
        j = self._phase
        if fx.kernels[j] != kernel or j in fx.act or self._fixed_fresh:
            return False
        if self._asking_dead() and j % DEAD_EVERY == 0:
            return False  # decided, so that its dead records are asked for
        self.stats.launches += 1
        self._fixed_step()
        return True

    def _fixed_step(self) -> int:
        """The next phase of the fixed plan decided: the period learner gets the plan's key for
        it (it follows the launches), the phase moves on. Its phase."""
        fx = self._fixed
        assert fx is not None
        j = self._phase
        self.last_key = fx.keys[j]
        self.period.push(fx.keys[j])
        self._phase = j + 1 if j + 1 < fx.p else 0
        if self._dead_seen is not None:
            self._dead_left -= 1
        self.stats.predicted += 1
        self.stats.fixed_launches += 1
        return j

    def fixed_quiet(self, most: int) -> int:
        """Under a fixed plan, how many next launches have no action in it (at most ``most``);
        -1 without one."""
        fx = self._fixed
        if fx is None:
            return -1
        if self._fixed_fresh:
            return 0
        if self._asking_dead():
            most = min(most, -self._phase % DEAD_EVERY)
        return fx.quiet(self._phase, most)

    def _fixed_before(self, bases: Sequence[int], records: Mapping[int, int]) -> list[Action]:
        """The actions at the next phase of the fixed plan: its drops, the launch's own
        records required (a demand load makes room with Belady's victims along the plan's
        period), its loads (each where it fits, evicting only records used after it)."""
        if self._dead_seen is not None and self._dead_left <= 0:
            self._replan_dead()  # a period asked: the plan again, with where its records were dead
        fx = self._fixed
        assert fx is not None
        st = self.stats
        asking = self._asking_dead()
        j = self._fixed_step()
        if asking and j % DEAD_EVERY == 0:
            self._dead_ask = j
        if j in fx.act:
            st.fixed_acting_decisions += 1
        else:
            st.fixed_other_decisions += 1
        ws = tuple(sorted({b for b in bases if b in records}))
        protected = set(ws)
        actions: list[Action] = []
        res = self.resident
        if self._fixed_fresh:  # what no phase of the plan uses, and what it has dropped by now, go first
            self._fixed_fresh = False
            off = fx.off(j)
            for b in [b for b in res if (b not in fx.uses or b in off) and b not in protected]:
                self._evict(b, actions)
        for b in fx.drops.get(j, ()):
            if b in res and b not in protected:
                self._evict(b, actions)
        budget = self.last_budget = fx.budget
        _, missing = self._room_for(ws, records, budget, protected, actions)
        for b in missing:
            res[b] = records[b]
            self.used += records[b]
        actions.append(("require", list(ws)))
        for b in fx.loads.get(j, ()):
            if b in res or b not in records:
                continue
            size = records[b]
            nxt = self._next_use(b)
            keep = protected | {b}
            while self.used + size > budget:
                v = self._victim(keep, nxt)
                if v is None:
                    break
                self._evict(v, actions)
            if self.used + size > budget:
                continue  # no room for it now: it comes when its launch needs it
            res[b] = size
            self.used += size
            st.prefetches += 1
            st.prefetched_bytes += size
            actions.append(("prefetch", b))
        st.peak_resident = max(st.peak_resident, self.used)
        return actions

    # -- a switch between jobs (gpu-prefetch-sched serve) ------------------------------------

    def shed(self, keep: int, records: Mapping[int, int], protect: set[int] | frozenset[int] = frozenset()) -> list[Action]:
        """Evictions down to ``keep`` bytes resident, at a switch: the records used furthest
        ahead in the learned period first (Belady; LRU without a period, or with lru), so what
        the next launches need goes last; never one of ``protect`` (a launch's working set)."""
        self._sync(records)
        actions: list[Action] = []
        protected = set(protect)
        while self.used > keep:
            v = self._victim(protected, -1)
            if v is None:
                break
            self._evict(v, actions)
        return actions

    def forget(self, base: int) -> None:
        """``base`` is not resident after all (a prefetch dropped at a switch before its issue)."""
        size = self.resident.pop(base, None)
        if size is not None:
            self.used -= size

    def prepare(self, records: Mapping[int, int]) -> list[Action]:
        """At the grant of the turn: evictions down to the (new) budget, then the working sets
        of the next launches prefetched in order, along one period (at least ``lookahead``
        launches) while room allows, as ``before`` prefetches."""
        self._sync(records)
        budget = self.budget(records)
        actions = self.shed(budget, records)
        k = max(self.lookahead, self.period.known or 0)
        future = [self._sets[x] for x in self.period.predict(k)]
        if future:
            self._prefetch(future, records, budget, set(), actions, k)
        return actions

    def _prefetch(self, future: list[tuple[int, ...] | None], records: Mapping[int, int], budget: int,
                  protected: set[int], actions: list[Action], ahead: int | None = None) -> None:
        batch = ahead is None and self.batch > 1
        window = self.lookahead if ahead is None else ahead
        res = self.resident
        served = True
        for ws in future[: self.lookahead if batch else window]:
            if ws is None:
                served = not batch  # the walk stops at an unknown launch; a batch must walk on
                break
            for b in ws:
                if b not in res and b in records:
                    served = False
                    break
            if not served:
                break
        if served:
            # the next launches are served (the decisions before placed them): the walk would
            # load nothing and evict nothing
            return
        room = budget // BATCH_SHARE  # what the batch may load past the window
        for t, ws in enumerate(future[: self.lookahead * self.batch if batch else window], 1):
            if ws is None:  # an unknown launch ahead: it will need everything; no guess
                return
            if t == window + 1:  # the rest of the batch takes no victim from inside it: the walk
                for rest in future[window:]:  # would load it back a few launches on
                    if rest is None:
                        break
                    protected = protected | set(rest)
            if t > window and room <= 0:
                return
            protected, loaded, _, placed = self._load_set(ws, t, records, budget, protected, actions)
            if t > window:
                room -= loaded
            if not placed:
                return

    def _load_set(self, ws: tuple[int, ...], t: int, records: Mapping[int, int], budget: int, protected: set[int],
                  actions: list[Action]) -> tuple[set[int], int, int, bool]:
        """Prefetch the live records of ``ws``, the working set of the ``t``-th predicted launch,
        evicting (Belady) records used after it to make room: (``protected`` with those records,
        bytes loaded, bytes evicted, whether every one was placed; the walk stops when not)."""
        can_evict = self.policy == "belady"
        live = [b for b in ws if b in records]
        protected = protected | set(live)
        loaded = evicted = 0
        for b in live:
            if b in self.resident:
                continue
            size = records[b]
            if size > budget:
                return protected, loaded, evicted, False
            while self.used + size > budget:
                v = self._victim(protected, t) if can_evict else None
                if v is None:
                    return protected, loaded, evicted, False
                evicted += self.resident[v]
                self._evict(v, actions)
            self.resident[b] = size
            self.used += size
            loaded += size
            self.stats.prefetches += 1
            self.stats.prefetched_bytes += size
            actions.append(("prefetch", b))
        return protected, loaded, evicted, True

    # -- the time plan (module docstring) -------------------------------------------------------

    def note_duration(self, key: int, seconds: float) -> None:
        """A measured GPU duration of a launch of key ``key`` (``last_key`` when it was decided):
        an exponential average per key."""
        if key < 0 or key >= len(self._dur) or seconds < 0:
            return
        old = self._dur[key]
        if old < 0:
            new = seconds
            self._dur_n += 1
        else:
            new = old + DURATION_WEIGHT * (seconds - old)
        self._dur_sum += new - max(old, 0.0)
        self._dur[key] = new

    def note_bandwidth(self, h2d: float | None = None, d2h: float | None = None) -> None:
        """Bytes per second the copies achieve each way (the executor's measures)."""
        if h2d and h2d > 0:
            self.h2d_bw = float(h2d)
        if d2h and d2h > 0:
            self.d2h_bw = float(d2h)

    def duration(self, key: int) -> float:
        """A key's GPU seconds: measured, else the mean of the measured keys (0.0: none)."""
        d = self._dur[key] if 0 <= key < len(self._dur) else -1.0
        if d >= 0:
            return d
        return self._dur_sum / self._dur_n if self._dur_n else 0.0

    def _prefetch_time(self, records: Mapping[int, int], budget: int, protected: set[int],
                       actions: list[Action]) -> None:
        """The time plan's prefetch walk, then its proactive evictions (module docstring)."""
        per = self.period
        p = per.known
        assert p is not None
        kids = per.ahead(min(p, WALK_MAX))  # read as far as the walk goes (most stop after a few)
        can_evict = self.policy == "belady"
        margin = self.duration(self.last_key)  # the current launch runs before any of the walk
        ahead = margin  # compute before launch t starts
        first = self.duration(kids[0]) if kids else 0.0  # the launch before the next decision's walk
        q_in = q_out = 0.0  # seconds of copies this decision queued, each way
        floor = max(self.lookahead, 1)
        walked = 0
        stopped = False
        for t, kid in enumerate(kids, 1):
            ws = self._sets[kid]
            if t > floor and ws is not None:
                # the copies launch t needs: its missing records in, as many bytes out for room
                # beyond what is free (their saves come first); a later decision can still issue
                # them in time when the compute between it and launch t covers them and what
                # this one queued
                miss = sum(records[b] for b in ws if b in records and b not in self.resident)
                out = max(0, self.used + miss - budget)
                need = miss / self.h2d_bw + out / self.d2h_bw
                if ahead - margin - first >= max(q_in, q_out) + need:
                    break
            ws = self._sets[kid]
            if ws is None:  # an unknown launch ahead needs everything: no guess
                stopped = True
                break
            walked = t
            protected, loaded, evicted, placed = self._load_set(ws, t, records, budget, protected, actions)
            q_in += loaded / self.h2d_bw
            q_out += evicted / self.d2h_bw
            if not placed:
                stopped = True
                break
            ahead += self.duration(kid)
        self.stats.walk_max = max(self.stats.walk_max, walked)
        if can_evict and self.proactive and not stopped:
            self._proactive(kids, walked, ahead, margin, records, budget, protected, actions)

    def _proactive(self, kids: Sequence[int], walked: int, ahead: float, margin: float, records: Mapping[int, int],
                   budget: int, protected: set[int], actions: list[Action]) -> None:
        """Evict now the victims the next decisions' loads will need (module docstring): the
        walk goes on past the launches loaded, without loading, over one more launch's time
        plus the saves it orders, and each record it would load that does not fit takes the
        victim Belady would take then (used later than that launch), room booked for it."""
        stop = ahead + margin
        reserved = 0
        saves = 0.0
        for t in range(walked + 1, min(len(kids), walked + PROACTIVE_MAX) + 1):
            if ahead >= stop + saves:
                return
            ws = self._sets[kids[t - 1]]
            if ws is None:
                return
            live = [b for b in ws if b in records]
            protected = protected | set(live)
            for b in live:
                if b in self.resident:
                    continue
                size = records[b]
                while self.used + reserved + size > budget:
                    v = self._victim(protected, t)
                    if v is None:
                        return
                    saves += self.resident[v] / self.d2h_bw
                    self.stats.proactive += 1
                    self._evict(v, actions)
                reserved += size
            ahead += self.duration(kids[t - 1])
