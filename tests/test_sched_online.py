"""The online policy (gpuos_tools/sched/online.py) against a fake residency engine: hand-made
launch sequences of record bases, checked for the rules that keep a program correct (a launch
only runs with its whole working set resident) and within its budget, and against Belady's
optimum on cyclic sequences. No CUDA."""

from __future__ import annotations

import itertools
import random

import pytest

from gpuos_tools.sched.online import MATCH_CHECK, NEVER, OCCURRENCES, OnlinePolicy, Period

MiB = 1 << 20


class FakeEngine:
    """Residency as an engine keeps it: what is mapped, what was loaded, moved and when."""

    def __init__(self, records: dict[int, int]) -> None:
        self.records = records
        self.resident = set(records)  # allocations are mapped when made
        self.loads = 0
        self.prefetched: set[int] = set()
        self.evicted: list[int] = []
        self.log: list[tuple[str, object]] = []

    def apply(self, actions, ws) -> None:
        for op, arg in actions:
            self.log.append((op, arg))
            if op == "evict":
                assert arg in self.resident, f"evicted {arg:#x}, not resident"
                assert arg not in ws, "evicted a record of the launch itself"
                self.resident.discard(arg)
                self.evicted.append(arg)
            elif op == "prefetch":
                assert arg not in self.resident
                self.resident.add(arg)
                self.loads += 1
            elif op == "require":
                need = self.records if arg is None else arg
                for b in need:
                    if b not in self.resident:
                        self.resident.add(b)
                        self.loads += 1
            else:
                raise AssertionError(op)

    @property
    def used(self) -> int:
        return sum(self.records[b] for b in self.resident)


def drive(policy: OnlinePolicy, records: dict[int, int], launches, budget: int | None = None):
    """Run ``launches`` ((kernel, bases|None), ...) through the policy and the fake engine,
    checking per launch: its working set resident; resident bytes within the budget."""
    eng = FakeEngine(records)
    for kernel, bases in launches:
        actions = policy.before(kernel, bases, records)
        ws = set(records) if bases is None else set(bases)
        eng.apply(actions, ws)
        assert ws <= eng.resident, "a launch ran with memory not resident"
        assert sorted(eng.resident) == sorted(policy.resident), "the policy's books differ from the engine"
        b = policy.budget(records) if budget is None else budget
        if sum(records[x] for x in ws) <= b:
            assert eng.used <= b, (eng.used, b)
    return eng


def stencil(n_arrays: int, reads: int, steps: int):
    """Step s reads arrays s..s+reads-1 (mod n) and writes s+reads: a cyclic scientific loop."""
    out = []
    for s in range(steps):
        ws = [(s + k) % n_arrays for k in range(reads + 1)]
        out.append(("stencil", [0x1000 * (w + 1) for w in ws]))
    return out


# -- the period ------------------------------------------------------------------------------


def test_period_is_learned_after_one_repeat_and_predicts_ahead():
    per = Period()
    seq = [7, 8, 9, 10, 1, 2, 3]  # a prologue, then 1 2 3 repeating
    for k in seq:
        per.push(k)
    assert per.known is None
    for k in [1, 2, 3]:
        per.push(k)
    assert per.known == 3
    assert per.predict(5) == [1, 2, 3, 1, 2]
    assert per.learned == 1


def test_period_with_repeated_keys_inside_finds_the_true_period():
    per = Period()
    for k in [1, 2, 1, 3] * 4:
        per.push(k)
    assert per.known == 4
    assert per.predict(4) == [1, 2, 1, 3]


def test_period_broken_by_a_different_launch_is_dropped_and_relearned():
    per = Period()
    for k in [1, 2, 3] * 3:
        per.push(k)
    assert per.known == 3
    per.push(9)
    assert per.known is None and per.broken == 1
    assert per.predict(3) == []
    for k in [4, 5] * 3:
        per.push(k)
    assert per.known == 2 and per.learned == 2


def test_period_of_one_and_no_period_in_random_keys():
    per = Period()
    for _ in range(5):
        per.push(4)
    assert per.known == 1 and per.predict(2) == [4, 4]
    rnd = random.Random(1)
    per = Period()
    for _ in range(300):
        per.push(rnd.randrange(10**6))
    assert per.known is None


class SlowPeriod:
    """The period learner by plain comparisons: candidates from the key's last OCCURRENCES
    positions (as before the search used hashes); then, if none held or only one of at most
    MATCH_CHECK that fails over MATCH_CHECK + 1 keys, the smallest period above MATCH_CHECK
    that holds over them: the reference the fast one must agree with."""

    def __init__(self, history: int) -> None:
        from collections import deque

        self.keys = deque(maxlen=history)
        self.start, self.seen, self.p, self.matched = 0, {}, None, 0

    def known(self):
        p = self.p
        return p if p is not None and self.matched >= min(p, MATCH_CHECK) else None

    def push(self, key: int) -> None:
        from collections import deque

        i, st, w = self.start + len(self.keys), self.start, MATCH_CHECK + 1
        at = lambda j: key if j == i else self.keys[j - st]  # noqa: E731
        if self.p is not None:
            j = i - self.p
            if j >= st and at(j) == key:
                self.matched += 1
            else:
                self.p = None
        if self.p is None:
            found = None
            for j in reversed(self.seen.get(key, ())):
                p = i - j
                if j < st:
                    break
                m, limit = 0, min(p - 1, MATCH_CHECK)
                while m < limit and i - 1 - m - p >= st and at(i - 1 - m) == at(i - 1 - m - p):
                    m += 1
                if m == limit:
                    found = p
                    break

            def holds(p: int) -> bool:  # the key and the MATCH_CHECK keys before it
                return i - MATCH_CHECK - p >= st and all(at(i - m) == at(i - m - p) for m in range(w))

            if found is None or found <= MATCH_CHECK:
                win = None
                for p in range(w, i + 1):
                    if i - MATCH_CHECK - p < st:
                        break
                    if holds(p):
                        win = p
                        break
                if win is not None and (found is None or not holds(found)):
                    found = win
            if found is not None:
                self.p, self.matched = found, min(found - 1, MATCH_CHECK) + 1
        self.seen.setdefault(key, deque(maxlen=OCCURRENCES)).append(i)  # at every key
        if len(self.keys) == self.keys.maxlen:
            self.start += 1
        self.keys.append(key)


def _sequences(rnd: random.Random):
    """Random keys, periodic ones with noise, runs of one key, periods past MATCH_CHECK, and
    periods whose keys come back more than OCCURRENCES times each (found by their windows)."""
    yield [rnd.randrange(4) for _ in range(600)]
    for p in (1, 3, 50, 70, 150):
        base = [rnd.randrange(40) for _ in range(p)]
        yield [base[i % p] if rnd.random() > 0.03 else 100 + rnd.randrange(5) for i in range(1200)]
    yield [k for _ in range(30) for k in [1] * rnd.randrange(1, 8) + [2, 3]]
    yield [k for _ in range(20) for k in rnd.sample(range(30), 30)]
    base = [rnd.randrange(6) for _ in range(130)]  # 6 keys, each ~20 times a period
    yield [base[i % 130] if rnd.random() > 0.01 else 50 for i in range(1500)]


@pytest.mark.parametrize("history", [64, 300, 1 << 16])
@pytest.mark.parametrize("seed", range(3))
def test_the_hashed_search_finds_what_comparing_every_key_finds(history, seed):
    """Same candidate, same moment, same prediction as the plain search, also where the
    history's bound cuts windows and the list is trimmed (history 64, 300)."""
    learned_by_window = 0
    for seq in _sequences(random.Random(seed)):
        fast, slow = Period(history), SlowPeriod(history)
        for t, k in enumerate(seq):
            fast.push(k)
            slow.push(k)
            assert (fast.p, fast.matched, fast.known) == (slow.p, slow.matched, slow.known()), t
            assert fast.start == slow.start
            if fast.known:
                p = fast.known
                assert fast.predict(p + 2) == [slow.keys[len(slow.keys) - p + (x % p)] for x in range(p + 2)]
                learned_by_window += p == 130
    if history > 300:
        assert learned_by_window  # the period of the frequent keys was found


# -- the policy ------------------------------------------------------------------------------


def test_everything_fits_moves_nothing():
    records = {0x1000 * (i + 1): 64 * MiB for i in range(4)}
    pol = OnlinePolicy(1 << 40)
    eng = drive(pol, records, stencil(4, 2, 40))
    assert eng.loads == 0 and not eng.evicted and pol.stats.evictions == 0


def test_stencil_at_150_percent_stays_in_budget_and_prefetches_once_the_period_is_known():
    n = 12
    records = {0x1000 * (i + 1): 64 * MiB for i in range(n)}
    budget = n * 64 * MiB * 2 // 3
    pol = OnlinePolicy(budget, "belady", lookahead=2)
    launches = stencil(n, 3, 20 * n)
    eng = drive(pol, records, launches, budget)
    st = pol.stats
    assert st.periods and st.periods[0] == n
    assert st.over_budget == 0 and st.unknown == 0
    assert st.peak_resident <= budget
    # once the period is known, the launches find their working sets prefetched: no demand
    # loads after the first periods
    late = OnlinePolicy(budget, "belady", lookahead=2)
    eng2 = FakeEngine(records)
    demand = []
    for k, b in launches:
        acts = late.before(k, b, records)
        eng2.apply(acts, set(b))
        demand.append(late.stats.demand_loads)
    assert demand[-1] == demand[3 * n] and demand[3 * n] > 0
    assert eng.loads > 0 and st.prefetches > 0


def test_belady_loads_no_more_than_lru_and_matches_the_optimum_on_small_cycles():
    for n, reads, frac in [(6, 1, 0.5), (8, 2, 0.66), (10, 3, 0.75)]:
        records = {0x1000 * (i + 1): MiB for i in range(n)}
        budget = int(n * MiB * frac)
        launches = stencil(n, reads, 30 * n)
        loads = {}
        for policy in ("belady", "lru"):
            pol = OnlinePolicy(budget, policy, lookahead=0)
            loads[policy] = drive(pol, records, launches, budget).loads
        assert loads["belady"] <= loads["lru"]
        # the optimum (offline Belady over the whole sequence, equal sizes) after warm-up:
        # per period, the online policy loads at most what MIN loads plus the learning period
        assert loads["belady"] <= _min_loads(launches, budget // MiB) + 3 * n * (reads + 1)


def test_without_prefetch_the_learned_period_gives_belady_min_loads():
    """lookahead 0: after the period is learned, the victims are MIN's, so the loads of the
    whole run exceed the offline optimum only by what the first two periods cost (LRU)."""
    n = 12
    launches = stencil(n, 3, 100 * n)
    records = {0x1000 * (i + 1): MiB for i in range(n)}
    for slots in (7, 6):
        best = _min_loads(launches, slots)
        got = drive(OnlinePolicy(slots * MiB, lookahead=0), records, launches, slots * MiB).loads
        assert best <= got <= best + 2 * n, (slots, got, best)
        lru = drive(OnlinePolicy(slots * MiB, "lru", lookahead=0), records, launches, slots * MiB).loads
        assert lru > got + 10 * n


def _min_loads(launches, slots: int) -> int:
    """Belady's MIN loads for equal-size records (demand, no prefetch), by brute force on the
    known sequence: evict the resident one used furthest ahead."""
    seq = [tuple(b) for _, b in launches]
    resident: set[int] = set()
    loads = 0
    for i, ws in enumerate(seq):
        for b in ws:
            if b in resident:
                continue
            if len(resident) >= slots:
                def nxt(x):
                    for j in range(i, len(seq)):
                        if x in seq[j]:
                            return j
                    return NEVER
                victim = max((x for x in resident if x not in ws), key=nxt)
                resident.discard(victim)
            resident.add(b)
            loads += 1
    return loads


def test_unknown_launch_requires_everything_and_counts_over_budget():
    records = {0x1000 * (i + 1): 64 * MiB for i in range(6)}
    budget = 4 * 64 * MiB
    pol = OnlinePolicy(budget)
    launches = stencil(6, 1, 12) + [("mystery", None)] + stencil(6, 1, 6)
    eng = drive(pol, records, launches, budget)
    assert pol.stats.unknown == 1 and pol.stats.over_budget == 1
    assert pol.stats.over_budget_bytes == 2 * 64 * MiB
    assert ("require", None) in eng.log
    # after it, the budget holds again
    assert eng.used <= budget


def test_working_set_larger_than_budget_runs_over_budget_after_evicting_the_rest():
    records = {0x10: 100, 0x20: 100, 0x30: 100}
    pol = OnlinePolicy(150)
    acts = pol.before("k", [0x10, 0x20], records)
    assert pol.stats.over_budget == 1
    assert ("evict", 0x30) in acts and acts[-1] == ("require", [0x10, 0x20])


def test_new_records_are_resident_and_freed_ones_leave():
    pol = OnlinePolicy(300)
    records = {0x10: 100}
    pol.before("k", [0x10], records)
    records = {0x10: 100, 0x20: 100, 0x30: 100, 0x40: 100}  # three allocations: 400 > 300
    acts = pol.before("k", [0x40], records)
    assert [a for a in acts if a[0] == "evict"] and pol.used <= 300
    records = {0x40: 100}
    pol.before("k", [0x40], records)
    assert dict(pol.resident) == {0x40: 100} and pol.used == 100


def test_percentage_budget_follows_the_live_owned_bytes():
    pol = OnlinePolicy(None, fraction=0.5)
    records = {0x10: 100, 0x20: 100}
    assert pol.budget(records) == 100
    records[0x30] = 200
    assert pol.budget(records) == 200


def test_prefetch_never_evicts_what_the_next_launches_need():
    n = 5
    records = {0x1000 * (i + 1): MiB for i in range(n)}
    budget = 3 * MiB
    pol = OnlinePolicy(budget, "belady", lookahead=2)
    launches = stencil(n, 1, 10 * n)
    for i, (k, b) in enumerate(launches):
        acts = pol.before(k, b, records)
        nxt = set(launches[i + 1][1]) if i + 1 < len(launches) else set()
        for op, arg in acts:
            if op == "evict":
                assert arg not in b
                if pol.period.known:
                    assert arg not in nxt, (i, acts)


def test_lru_prefetches_only_into_free_room():
    n = 6
    records = {0x1000 * (i + 1): MiB for i in range(n)}
    pol = OnlinePolicy(4 * MiB, "lru", lookahead=3)
    drive(pol, records, stencil(n, 1, 10 * n), 4 * MiB)
    # every eviction under lru is made for the launch itself, never for a prefetch
    pol2 = OnlinePolicy(4 * MiB, "lru", lookahead=3)
    eng = FakeEngine(records)
    for k, b in stencil(n, 1, 10 * n):
        acts = pol2.before(k, b, records)
        req = acts.index(next(a for a in acts if a[0] == "require"))
        assert all(op != "evict" for op, _ in acts[req:])
        eng.apply(acts, set(b))


@pytest.mark.parametrize("seed", range(5))
def test_random_programs_never_run_a_launch_without_its_memory(seed):
    rnd = random.Random(seed)
    records = {0x100 * (i + 1): rnd.choice([1, 2, 4]) * MiB for i in range(10)}
    bases = list(records)
    body = [("k%d" % rnd.randrange(3), rnd.sample(bases, rnd.randint(1, 3))) for _ in range(rnd.randint(3, 9))]
    launches = list(itertools.chain.from_iterable([body] * 8))
    launches.insert(rnd.randrange(len(launches)), ("odd", None))
    for policy in ("belady", "lru"):
        for look in (0, 1, 4):
            pol = OnlinePolicy(12 * MiB, policy, lookahead=look)
            drive(pol, records, launches, 12 * MiB)


@pytest.mark.parametrize("seed", range(5))
def test_random_loops_under_a_fixed_plan_never_run_a_launch_without_its_memory(seed):
    """Loops long enough for a fixed plan (at least STEADY_MIN launches), with a launch of an odd
    kernel somewhere, which ends the plan; the engine's books are the policy's throughout."""
    from gpuos_tools.sched.online import STEADY_MIN

    rnd = random.Random(seed)
    records = {0x100 * (i + 1): rnd.choice([1, 2, 4]) * MiB for i in range(14)}
    bases = list(records)
    body = [("k%d" % rnd.randrange(5), rnd.sample(bases, rnd.randint(1, 3)))
            for _ in range(rnd.randint(STEADY_MIN, 2 * STEADY_MIN))]
    launches = list(itertools.chain.from_iterable([body] * 10))
    launches.insert(rnd.randrange(4 * len(body), 6 * len(body)), ("odd", bases[:2]))
    for lead in (0, 2, 8):
        pol = OnlinePolicy(12 * MiB, "belady", lookahead=lead, plan="fixed")
        drive(pol, records, launches, 12 * MiB)
        assert pol.stats.fixed_plans >= 1 and pol.stats.fixed_launches > 0


@pytest.mark.parametrize("seed", range(8))
def test_the_victim_is_the_resident_record_used_furthest_ahead_lru_first_among_equals(seed):
    """_victim's inlined scan against the definition: max of _next_use over the resident
    records outside the protected ones, the least recently used first among equals; with
    unknown launches in the period (they use every record) and records outside it."""
    rnd = random.Random(seed)
    records = {0x100 * (i + 1): MiB for i in range(12)}
    bases = list(records)
    body = [("k%d" % rnd.randrange(3), rnd.sample(bases[:8], rnd.randint(1, 3))) for _ in range(rnd.randint(4, 9))]
    if seed % 2:
        body.insert(rnd.randrange(len(body)), ("odd", None))
    pol = OnlinePolicy(1 << 40)
    checked = 0
    for kernel, bs in body * 6:
        pol.before(kernel, bs, records)
        for _ in range(3):
            protected = set(rnd.sample(bases, rnd.randint(0, 4)))
            later = rnd.choice([-1, 0, 2, 5])
            best, best_use = None, -1
            for b in pol.resident:
                if b not in protected and pol._next_use(b) > best_use:
                    best, best_use = b, pol._next_use(b)
            want = best if best is not None and best_use > later else None
            assert pol._victim(protected, later) == want
            checked += pol.period.known is not None
    assert checked > 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        OnlinePolicy(10, "fifo")
    with pytest.raises(ValueError):
        OnlinePolicy(None)
    with pytest.raises(ValueError):
        OnlinePolicy(10, lookahead=-1)


# -- the command's arguments (no program is started when they are wrong) -----------------------


def _cli(*args: str):
    import subprocess
    import sys

    from helpers import REPO, child_env

    return subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-prefetch-sched"), *args], capture_output=True,
                          text=True, timeout=60, env=child_env(), check=False)


@pytest.mark.parametrize("args", [["--budget", "lots"], ["--budget", "0"], ["--budget", "66%", "--policy", "fifo"],
                                  ["--budget", "66%", "--lookahead", "-1"], ["--budget", "66%", "--plan", "steps"],
                                  ["--budget", "66%", "--plan", "time", "--plan-bw", "fast"],
                                  ["--budget", "66%", "--plan", "time", "--plan-bw", "0GB/s"],
                                  ["--budget", "66%", "--proactive"], ["--budget", "66%", "--prefetch-batch", "0"],
                                  ["--budget", "66%", "--plan", "time", "--prefetch-batch", "4"],
                                  ["--budget", "66%", "--plan", "fixed", "--policy", "lru"],
                                  ["--budget", "66%", "--slack", "10%"],
                                  ["--budget", "66%", "--plan", "fixed", "--slack", "60%"],
                                  ["--budget", "66%", "--plan", "fixed", "--slack", "1GiB"]])
def test_run_refuses_bad_options_before_starting_anything(args, tmp_path):
    marker = tmp_path / "started"
    p = _cli("run", *args, "--", "python3", "-c", f"open({str(marker)!r}, 'w')")
    assert p.returncode == 2, p.stderr
    assert not marker.exists()


def test_simulate_is_the_default_command_and_run_is_listed():
    p = _cli("--help")
    assert p.returncode == 0 and "simulate" in p.stdout and "run" in p.stdout
    p = _cli("--budget", "1GiB", "/nonexistent.acc")  # no command named: simulate, which refuses without --simulate
    assert p.returncode == 2 and "--simulate" in p.stderr


def test_small_segments_left_out_of_the_key_keep_a_decode_loops_period():
    """A decode loop's layers read their own weights (large records) and temporaries in small
    segments, of which the last layer's alternate between two sets every other token (the
    framework's cache). Keyed on every record, the one-token period is taken on a 64-launch
    match and breaks; keyed on the large records only
    (``key_bases``, what the executor passes), it is learned once and holds, and the segments
    a launch touches are still required whatever the key predicted."""
    layers, per_layer = 6, 20  # a period (120 launches) longer than Period's match check (64)
    weights = [0x1000_0000 * (i + 1) for i in range(layers)]
    segs = [0x9000_0000 + 0x20_0000 * i for i in range(4)]
    records = {**{w: 64 * MiB for w in weights}, **{s: 2 * MiB for s in segs}}
    small = set(segs)
    out = {}
    for keyed in ("all", "large"):
        pol = OnlinePolicy(None, "belady", 2, fraction=0.66)
        eng = FakeEngine(records)
        for token in range(12):
            for layer, w in enumerate(weights):
                # the last layer's temporaries (say the logits) alternate every other token
                tmp = segs[2:] if layer == layers - 1 and token % 2 else segs[:2]
                for k in range(per_layer):
                    ws = [w, tmp[k % 2]] if k == 2 else [tmp[0], tmp[1]]
                    key = None if keyed == "all" else [b for b in ws if b not in small]
                    actions = pol.before(f"k{k}", ws, records, key, 1)
                    eng.apply(actions, ws)
                    assert set(ws) <= eng.resident
        out[keyed] = pol.stats
    p = layers * per_layer
    assert out["large"].periods == [p] and out["large"].period_breaks == 0, out["large"]
    assert out["all"].period_breaks > 0, out["all"]
    assert out["large"].predicted > out["all"].predicted


def test_period_use_names_the_period_that_governed_the_run_not_the_last_learned():
    """A loop with a period of 4, then a short tail that repeats one launch: the last period
    learned is 1, but nearly every decision was made with 4 known."""
    pol = OnlinePolicy(None, "belady", 2, fraction=1.0)
    recs = {0x1000 * (i + 1): 1 << 20 for i in range(4)}
    bases = list(recs)
    for s in range(4 * 20):
        pol.before("k", [bases[s % 4]], recs)
    for _ in range(6):
        pol.before("tail", [bases[0]], recs)
    d = pol.stats.as_dict()
    assert d["periods"][0] == 4 and d["periods"][-1] == 1
    assert d["period_use"][0][0] == 4 and d["period_use"][0][1] >= 70
    assert sum(n for _, n in d["period_use"]) == d["predicted"]


def test_each_break_of_the_period_says_what_differed():
    """A loop of three launches learned; then the second launch comes with another record (a
    break on its records), later a kernel the period did not have (a break on the kernel)."""
    records = {0x1000 * (i + 1): MiB for i in range(5)}
    a, b, c, d, e = sorted(records)
    pol = OnlinePolicy(1 << 40)
    loop = [("k0", [a]), ("k1", [b]), ("k2", [c])]
    for _ in range(4):
        for kernel, ws in loop:
            pol.before(kernel, ws, records)
    pol.before("k0", [a], records)
    pol.before("k1", [d], records)  # the period expected k1 on b
    for _ in range(4):
        for kernel, ws in loop:
            pol.before(kernel, ws, records)
    pol.before("other", [e], records)
    st = pol.stats
    assert st.period_breaks == len(st.breaks) >= 2
    first = st.breaks[0]
    assert first["period"] == 3 and first["expected"] == first["got"] == "k1"
    assert first["differs"] == "records" and first["records_new"] == first["records_gone"] == 1
    assert first["launch"] == 14
    last = st.breaks[-1]
    assert last["differs"] == "kernel" and last["got"] == "other" and last["expected"] == "k0"
    assert st.as_dict()["breaks"] == st.breaks and st.breaks_last == []


def test_one_record_more_or_fewer_on_the_predicted_kernel_does_not_break_the_period():
    """A loop of three launches learned; then its second launch comes with one record more, and
    a period later with one fewer than at first: the same launch all the same (the period holds,
    counted as jitter), and what it predicts for that launch next is the records it last had."""
    records = {0x1000 * (i + 1): MiB for i in range(5)}
    a, b, c, d, e = sorted(records)
    pol = OnlinePolicy(1 << 40)
    loop = [("k0", [a]), ("k1", [b, c]), ("k2", [c])]
    for _ in range(4):
        for kernel, ws in loop:
            pol.before(kernel, ws, records)
    pol.before("k0", [a], records)
    pol.before("k1", [b, c, d], records)  # one record more
    pol.before("k2", [c], records)
    pol.before("k0", [a], records)
    assert pol.period.known == 3 and pol.stats.period_breaks == 0 and pol.stats.jitter == 1
    assert pol._sets[pol.period.predict(1)[0]] == (b, c, d)
    pol.before("k1", [b], records)  # one fewer than at first
    assert pol.period.known == 3 and pol.stats.period_breaks == 0 and pol.stats.jitter == 2
    pol.before("k2", [e], records)  # a record replaced by another: a break
    assert pol.stats.period_breaks == 1


def test_the_last_breaks_are_kept_apart_from_the_first():
    """A program's start-up breaks its periods first; what the loop's breaks were comes later:
    past the first BREAKS_KEPT, the last BREAKS_KEPT are kept too, the newest last."""
    from gpuos_tools.sched.online import BREAKS_KEPT

    records = {0x1000 * (i + 1): MiB for i in range(4)}
    a, b, c, d = sorted(records)
    pol = OnlinePolicy(1 << 40)
    loop = [("k0", [a]), ("k1", [b]), ("k2", [c])]
    for rnd in range(3 * BREAKS_KEPT):
        for _ in range(3):
            for kernel, ws in loop:
                pol.before(kernel, ws, records)
        pol.before(f"odd{rnd}", [d], records)  # a kernel the period did not have
    st = pol.stats
    assert st.period_breaks >= 2 * BREAKS_KEPT
    assert len(st.breaks) == len(st.breaks_last) == BREAKS_KEPT
    assert st.breaks_last[-1]["got"] == f"odd{3 * BREAKS_KEPT - 1}"
    assert st.breaks[-1]["launch"] < st.breaks_last[0]["launch"] < st.breaks_last[-1]["launch"]
    assert st.as_dict()["breaks_last"] == st.breaks_last



def test_a_percentage_is_of_the_loops_working_set_not_of_a_short_repeat_inside_it():
    """A step of 40 launches over 8 records, learned; then the tail repeats one launch (periods of
    1 learned): the budget stays a share of the step's records. A loop of 4 launches (shorter than
    STEADY_MIN) is a share of every live byte."""
    from gpuos_tools.sched.online import STEADY_MIN

    recs = {0x1000 * (i + 1): MiB for i in range(10)}  # two records the loop never touches
    bases = sorted(recs)[:8]
    pol = OnlinePolicy(None, "belady", 2, fraction=0.5)
    assert 40 >= STEADY_MIN
    for s in range(40 * 6):
        pol.before(f"k{s % 40}", [bases[s % 8]], recs)
    assert pol.budget_of() == "steady working set" and pol.last_budget == 4 * MiB
    for _ in range(20):
        pol.before("tail", [bases[0]], recs)
    assert pol.stats.as_dict()["periods"][-1] == 1
    assert pol.last_budget == 4 * MiB, pol.last_budget
    short = OnlinePolicy(None, "belady", 2, fraction=0.5)
    for s in range(4 * 30):
        short.before(f"k{s % 4}", [bases[s % 4]], recs)
    assert short.stats.as_dict()["periods"] == [4]
    assert short.budget_of() == "live owned bytes" and short.last_budget == 5 * MiB


def _acting(n: int, reads: int, batch: int) -> tuple[int, int, int]:
    """(decisions that moved something, loads, demand loads after four periods) of the stencil."""
    records = {0x1000 * (i + 1): 64 * MiB for i in range(n)}
    budget = n * 64 * MiB * 2 // 3
    pol = OnlinePolicy(budget, "belady", lookahead=2, batch=batch)
    eng = FakeEngine(records)
    acting = demand_late = 0
    for i, (k, b) in enumerate(stencil(n, reads, 20 * n)):
        before = pol.stats.demand_loads
        acts = pol.before(k, b, records)
        acting += any(op != "require" for op, _ in acts)
        eng.apply(acts, set(b))
        if i >= 4 * n:
            demand_late += pol.stats.demand_loads - before
    assert pol.stats.peak_resident <= budget
    return acting, eng.loads, demand_late


def test_a_prefetch_batch_acts_in_fewer_decisions_for_about_the_same_loads():
    """batch B: a decision whose next ``lookahead`` launches are served moves nothing; one that
    is not prefetches up to lookahead x B launches (victims from outside them, at most a
    sixteenth of the budget past the first ``lookahead``). On a long stencil the decisions that
    act nearly halve for 3 % more loads; on a tight one, where every record is inside the batch,
    nothing changes; once learned, no launch waits for a load either way."""
    one, four = _acting(48, 1, 1), _acting(48, 1, 4)
    assert four[0] < 0.6 * one[0] and four[1] <= 1.05 * one[1]
    assert one[2] == four[2] == 0
    assert _acting(12, 3, 4) == _acting(12, 3, 1)


def test_prefetch_batch_must_be_one_or_more():
    with pytest.raises(ValueError, match="batch"):
        OnlinePolicy(1 << 30, batch=0)
