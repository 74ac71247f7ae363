"""The fixed plan (gpuos_tools/sched/fixed.py) and the online policy's ``plan="fixed"``."""

from __future__ import annotations

import pytest

from gpuos_tools.sched.fixed import FixedSchedule, leads_by_time
from gpuos_tools.sched.online import STEADY_MIN, OnlinePolicy
from gpuos_tools.sched.online_sim import simulate_online, training_step
from gpuos_tools.sched.simulate import Config

MIB = 1 << 20


def cycle_schedule(lead: int) -> FixedSchedule:
    """Ten records of 1 MiB used in turn, one a phase, room for six."""
    n = 10
    return FixedSchedule.make(list(range(n)), [f"k{i}" for i in range(n)], [(i,) for i in range(n)],
                              {i: MIB for i in range(n)}, 6 * MIB, lead)


def test_a_schedule_drops_after_the_use_and_loads_its_lead_before_the_next():
    s = cycle_schedule(lead=0)
    assert s.fits and s.p == 10 and len(s.gaps) == 5 and s.bytes_in == 5 * MIB
    for g in s.gaps:  # each record streamed over the one gap it has, all the way round
        assert g.steps == 10 and g.lead == 0
        assert g.record in s.drops[(g.use + 1) % 10] and g.record in s.loads[g.use]
    assert s.act == set(s.drops) | set(s.loads) and s.acting == sorted(s.act)
    streamed = {g.record for g in s.gaps}
    for t in range(10):  # what the plan has dropped: never the launch's own record, at most four others
        off = s.off(t)
        assert off <= streamed and t not in off and 4 <= len(off) <= 5
        assert 10 - len(off) <= 6
    first = s.acting[0]
    assert s.quiet(first, 100) == 0
    assert s.quiet((first + 1) % 10, 100) == (s.acting[1] - first - 1 if len(s.acting) > 1 else 9)
    assert s.quiet(first + 1, 0) == 0
    d = s.as_dict()
    assert d["streamed"] == 5 and d["pinned"] == 5 and d["moves"] == 10 and d["fits"]


def test_a_launch_alone_over_the_budget_is_a_phase_to_decide():
    s = FixedSchedule.make([0, 1, 2], ["a", "b", "c"], [(0,), (1, 2), (0,)], {0: MIB, 1: 4 * MIB, 2: 4 * MIB},
                           6 * MIB, 1)
    assert 1 in s.act  # its own 8 MiB exceed the budget: everything else must go before it


def drive(pol: OnlinePolicy, kernels: list[str], sets: list[tuple[int, ...]], records: dict[int, int],
          budget_ok: list[bool]) -> list[list[tuple]]:
    out = []
    for k, ws in zip(kernels, sets):
        actions = pol.before(k, list(ws), records, version=0)
        budget_ok.append(pol.used <= pol.last_budget)
        out.append([a for a in actions if a[0] != "require"])
    return out


def test_the_policy_makes_a_plan_once_the_loop_repeats_and_keeps_to_it():
    """A loop of 40 launches over 20 records of 1 MiB, each used twice a period, at a budget of
    12 MiB: the count plan learns the period, a fixed plan is made once it is known, and from
    then on every period makes the same moves, within the budget; a launch of a kernel the
    period does not have ends the plan, and the next period learned makes another."""
    n, p = 20, 2 * STEADY_MIN
    kernels = [f"k{t % 7}" for t in range(p)]
    sets = [((t * 3) % n, (t * 7 + 1) % n) for t in range(p)]
    records = {b: MIB for b in range(n)}
    pol = OnlinePolicy(12 * MIB, "belady", 4, plan="fixed")
    ok: list[bool] = []
    periods = [drive(pol, kernels, sets, records, ok) for _ in range(6)]
    st = pol.stats
    assert st.fixed_plans == 1 and st.fixed_ends == 0 and st.fixed["fits"]
    assert st.fixed_launches >= 3 * p
    steady = periods[4:]
    assert steady[0] == steady[1] and any(a for a in steady[0])  # the same moves, every period
    loads = sum(1 for acts in steady[0] for a in acts if a[0] == "prefetch")
    assert loads * MIB <= st.fixed["bytes_in"]
    assert all(ok[4 * p:])
    # another kernel: the plan ends, the count plan decides, the period is learned again
    pol.before("stray", [0], records, version=0)
    assert st.fixed_ends == 1 and "another kernel" in st.fixed_end
    for _ in range(3):
        drive(pol, kernels, sets, records, ok)
    # a period with the stray in it (two loops and the stray: the loop's windows that leave the
    # stray out come only a loop later) has its plan ended where the stray does not come again;
    # then the loop's own period is learned again, and its plan holds
    assert st.periods[-1] == p and pol._fixed is not None and pol._fixed.p == p
    assert st.fixed_ends == st.fixed_plans - 1
    held = st.fixed_launches
    drive(pol, kernels, sets, records, ok)
    assert st.fixed_launches == held + p and pol._fixed is not None


def planned_cycle() -> tuple[OnlinePolicy, list[str], list[tuple[int, ...]], dict[int, int]]:
    """A policy under a fixed plan of a loop of STEADY_MIN launches, each its own kernel, over
    ten records of 1 MiB in turn, room for six: (policy, kernels, sets, records)."""
    n, p = 10, STEADY_MIN
    kernels = [f"k{t}" for t in range(p)]
    sets = [(t % n,) for t in range(p)]
    records = {b: MIB for b in range(n)}
    pol = OnlinePolicy(6 * MIB, "belady", 2, plan="fixed")
    ok: list[bool] = []
    for _ in range(4):
        drive(pol, kernels, sets, records, ok)
    assert pol._fixed is not None and all(ok)
    return pol, kernels, sets, records


def test_a_record_of_the_plan_freed_ends_it_and_a_new_one_does_not():
    pol, kernels, sets, records = planned_cycle()
    more = {**records, 99: MIB}  # a new record: resident, no phase uses it, the first victim
    pol.before(kernels[pol._phase], list(sets[pol._phase]), more, version=1)
    assert pol._fixed is not None
    fewer = {b: s for b, s in more.items() if b != 3}
    pol.before(kernels[pol._phase], list(sets[pol._phase]), fewer, version=2)
    assert pol._fixed is None and "freed" in pol.stats.fixed_end


def test_the_fast_path_replay_moves_the_phase_only_where_the_plan_has_nothing():
    pol, kernels, _, _ = planned_cycle()
    p = len(kernels)
    fx = pol._fixed
    assert fx is not None and not pol._fixed_fresh
    j = pol._phase
    quiet = pol.fixed_quiet(10_000)
    assert quiet == fx.quiet(j, 10_000)
    for t in range(quiet):
        assert pol.fixed_next(kernels[(j + t) % p])
    assert not pol.fixed_next(kernels[(j + quiet) % p])  # the plan acts there: a decision
    assert pol._phase == (j + quiet) % p
    assert not pol.fixed_next("stray")


def test_a_fixed_plan_takes_belady_only():
    with pytest.raises(ValueError, match="belady"):
        OnlinePolicy(MIB, "lru", plan="fixed")
    with pytest.raises(ValueError, match="lookahead"):
        OnlinePolicy(MIB, plan="fixed", lookahead=-1)


def test_actions_close_together_are_taken_at_fewer_phases_where_the_room_allows():
    """Three records of 1 MiB, each used once a period of 40 at phases 10, 12 and 14, dropped
    after the use and loaded two phases before it: six phases act within eight launches. Taken
    together, the loads come at phase 8 and the drops at phase 15, which holds all three from 8
    to 15: with 3 MiB of room that fits and two phases act; with 2 MiB it does not, and the six
    stay."""
    import numpy as np

    from gpuos_tools.sched.fixed import Gap, _coalesce

    p = 40
    gaps = [Gap(b, MIB, use, p, 2) for b, use in ((1, 10), (2, 12), (3, 14))]

    def run(room: int) -> tuple[list[int], list[int], np.ndarray]:
        drop_at = [(g.use + 1) % p for g in gaps]
        load_at = [(g.use + g.steps - g.lead) % p for g in gaps]
        live = np.zeros(p, dtype=np.int64)
        for g, d, ld in zip(gaps, drop_at, load_at):  # held from its load to its drop
            live[np.arange(ld, ld + (d - ld) % p) % p] += g.size
        _coalesce(drop_at, load_at, gaps, live, np.full(p, room, dtype=np.int64), p, 8)
        return drop_at, load_at, live

    drop_at, load_at, live = run(3 * MIB)
    assert load_at == [8, 8, 8] and drop_at == [15, 15, 15]
    assert live[8:15].tolist() == [3 * MIB] * 7 and live[15] == 0 and live[7] == 0
    drop_at, load_at, live = run(2 * MIB)
    assert load_at == [8, 10, 12] and drop_at == [11, 13, 15]
    assert live.max() == 2 * MIB


def test_a_record_dropped_and_loaded_within_a_run_keeps_its_phases():
    import numpy as np

    from gpuos_tools.sched.fixed import Gap, _coalesce

    p = 40
    gaps = [Gap(1, MIB, 10, 4, 1), Gap(2, MIB, 9, p, 2)]  # the first: off at 11 and 12 only
    drop_at, load_at = [11, 10], [13, 7]
    live = np.zeros(p, dtype=np.int64)
    _coalesce(drop_at, load_at, gaps, live, np.full(p, 4 * MIB, dtype=np.int64), p, 8)
    assert (drop_at[0], load_at[0]) == (11, 13)  # moving it would turn its gap inside out
    assert (drop_at[1], load_at[1]) == (13, 7)  # the other's drop moves to the run's last phase


def test_a_lead_by_time_covers_the_copy_with_the_launches_before_the_use():
    """leads_by_time: the fewest phases before a use whose durations add up to the copy, at least
    the least lead; the phases before phase 0 are the period's last ones; a copy longer than
    the whole period gets the whole period."""
    lead = leads_by_time([1.0] * 10, 1.0, 2)
    assert [lead(5, n) for n in (0, 1, 3, 5, 10, 11)] == [2, 2, 3, 5, 10, 10]
    lead = leads_by_time([0.0, 0.0, 5.0, 0.0], 1.0, 1)
    assert [lead(u, 4) for u in range(4)] == [2, 3, 4, 1]  # phase 2 is the one that takes time
    assert [lead(u, 6) for u in range(4)] == [4, 4, 4, 4]


def test_a_fixed_plan_loads_large_records_as_far_ahead_as_their_copy_takes():
    """SIMULATED: on a training loop of short launches over large records, the plan's loads a
    copy's time ahead (the durations known) stall the loop less than loads two launches ahead,
    for the same bytes."""
    w = training_step(steps=6)
    cfg = Config(int(w.footprint * 0.66))
    by_time = simulate_online(w, cfg, plan="fixed")
    by_count = simulate_online(w, cfg, plan="fixed", feed=False)
    assert by_time["bytes_in"] == by_count["bytes_in"]
    assert by_time["stall_s"] < 0.9 * by_count["stall_s"]


def test_a_dead_gap_is_dropped_from_where_it_was_seen_dead_and_copies_nothing():
    """Record 0 (4 MiB) is used at phases 0 and 10 of a period of 20 and seen dead at phases 2,
    12 and 14, record 1 (6 MiB) at 5 and 15, live all along; room for one of them. Blind, each
    is streamed over both of its gaps (20 MiB a period); with what was seen, record 0 goes over
    its gaps from its first dead phase on with nothing copied, and only record 1's loads cost
    bytes."""
    p = 20
    sets = [(0,) if t in (0, 10) else (1,) if t in (5, 15) else () for t in range(p)]
    sizes = {0: 4 * MIB, 1: 6 * MIB}
    keys, kernels = list(range(p)), [f"k{t}" for t in range(p)]
    blind = FixedSchedule.make(keys, kernels, sets, sizes, 6 * MIB, 2)
    seen = FixedSchedule.make(keys, kernels, sets, sizes, 6 * MIB, 2, dead={0: [2, 12, 14]})
    p = len(sets)
    assert blind.fits and blind.bytes_in == 20 * MIB and not any(g.dead for g in blind.gaps)
    assert seen.fits and seen.bytes_in == 12 * MIB
    dead = sorted((g.record, g.use, g.start) for g in seen.gaps if g.dead)
    assert dead == [(0, 0, 2), (0, 10, 2)]  # from its first dead phase on
    for g in seen.gaps:
        if g.dead:  # mapped a phase before its use at most (or by the use's own require)
            assert g.lead <= 1 and 0 in seen.drops[g.use + 2] and 0 in seen.loads[(g.use + 10 - g.lead) % p]
    assert 0 not in seen.off(1) and all(0 in seen.off(t) for t in range(2, 9)) and 0 not in seen.off(10)
    d = seen.as_dict()
    assert d["dead_gaps"] == 2 and d["dead_bytes"] == 8 * MIB and d["bytes_in"] == 12 * MIB
    # seen dead only on the phase before its use: nothing to drop it over, as blind
    late = FixedSchedule.make(keys, kernels, sets, sizes, 6 * MIB, 2, dead={0: [9, 19]})
    assert not any(g.dead for g in late.gaps) and late.bytes_in == blind.bytes_in


def test_a_fixed_plan_asks_one_period_where_its_records_are_dead_then_is_made_again():
    """With ``sees_dead``, the first period under a fixed plan is decided at one phase in
    DEAD_EVERY (the fast path lets none of them go by), each asking which records are dead
    there; after that period the plan is made again with what was seen, and asks no more."""
    from gpuos_tools.sched.online import DEAD_EVERY

    n, p = 10, STEADY_MIN
    kernels = [f"k{t}" for t in range(p)]
    sets = [(t % n,) for t in range(p)]
    records = {b: MIB for b in range(n)}
    pol = OnlinePolicy(6 * MIB, "belady", 2, plan="fixed")
    pol.sees_dead = True
    asked: list[int] = []
    t = 0
    while pol.stats.fixed_dead_replans == 0 and t < 8 * p:
        k = t % p
        if pol.fixed_quiet(1_000) > 0 and pol.fixed_next(kernels[k]):
            t += 1
            continue  # let go by, as the fast path does
        pol.before(kernels[k], list(sets[k]), records, version=0)
        ask = pol.dead_ask()
        if ask is not None:
            phase, bases = ask
            asked.append(phase)
            assert set(bases) == set(records)
            # record r is dead at the phases after its use until two before its next one
            pol.note_dead(phase, [b for b in bases if 0 < (phase - b) % n < n - 2])
        t += 1
    st = pol.stats
    assert st.fixed_dead_replans == 1 and st.fixed_plans == 1
    assert asked and all(j % DEAD_EVERY == 0 for j in asked) and len(asked) == len(set(asked))
    assert set(asked) == set(range(0, p, DEAD_EVERY))
    fx = pol._fixed
    assert fx is not None and pol._fixed_inputs is not None and any(g.dead for g in fx.gaps)
    assert fx.bytes_in < FixedSchedule.make(*pol._fixed_inputs).bytes_in
    assert st.fixed["dead_gaps"] > 0
    # from here on nothing is asked, and quiet phases go by again
    for _ in range(2 * p):
        k = pol._phase
        if pol.fixed_next(kernels[k]):
            continue
        pol.before(kernels[k], list(sets[k]), records, version=0)
        assert pol.dead_ask() is None
    assert st.fixed_dead_replans == 1 and pol._fixed is fx


def test_a_gap_needed_before_its_first_dead_phase_is_saved_but_mapped_back_without_a_copy():
    """Record 0 (4 MiB) is used at phases 0 and 10 and seen dead from phase 5; record 1 (6 MiB)
    is used at phases 1 to 4; room for one. Record 0 must be off from phase 1, before its dead
    phases: dropped from its use on (saved), its load still copies nothing, so only record 1's
    load is counted."""
    p = 20
    sets = [(0,) if t in (0, 10) else (1,) if 1 <= t <= 4 else () for t in range(p)]
    sizes = {0: 4 * MIB, 1: 6 * MIB}
    keys, kernels = list(range(p)), [f"k{t}" for t in range(p)]
    blind = FixedSchedule.make(keys, kernels, sets, sizes, 6 * MIB, 2)
    seen = FixedSchedule.make(keys, kernels, sets, sizes, 6 * MIB, 2, dead={0: [5, 15]})
    assert blind.fits and seen.fits and blind.bytes_in == 10 * MIB and seen.bytes_in == 6 * MIB
    (g,) = [g for g in seen.gaps if g.record == 0]
    assert g.use == 0 and g.start == 1 and g.dead and all(0 in seen.off(t) for t in range(1, 5))


def test_a_plan_with_slack_fits_the_budget_less_the_slack_and_is_carried_out_at_the_budget():
    """Ten records of 1 MiB in turn, room for six: with a slack of one record the plan keeps at
    most five mapped at every phase (it drops more), its budget stays six, and the policy
    carries it out within that budget."""
    s = FixedSchedule.make(list(range(10)), [f"k{i}" for i in range(10)], [(i,) for i in range(10)],
                           {i: MIB for i in range(10)}, 6 * MIB, 0, slack=MIB)
    blind = cycle_schedule(lead=0)
    assert s.budget == 6 * MIB and s.slack == MIB and s.as_dict()["slack"] == MIB and s.fits
    assert len(s.gaps) > len(blind.gaps) and s.bytes_in > blind.bytes_in
    for t in range(10):
        assert 10 - len(s.off(t)) <= 5
    # through the policy: a loop of STEADY_MIN launches, the plan made at 1/6 less
    n, p = 10, STEADY_MIN
    kernels = [f"k{t}" for t in range(p)]
    sets = [(t % n,) for t in range(p)]
    records = {b: MIB for b in range(n)}
    pol = OnlinePolicy(6 * MIB, "belady", 0, plan="fixed", slack=1 / 6)
    ok: list[bool] = []
    for _ in range(4):
        drive(pol, kernels, sets, records, ok)
    fx = pol._fixed
    assert fx is not None and fx.budget == 6 * MIB and fx.slack == MIB and pol.last_budget == 6 * MIB
    assert all(ok)
    used = []
    for k, ws in zip(kernels, sets):  # a period under the plan: never more than the budget less the slack
        pol.before(k, list(ws), records, version=0)
        used.append(pol.used)
    assert max(used) <= 5 * MIB
    with pytest.raises(ValueError, match="slack"):
        OnlinePolicy(MIB, plan="fixed", slack=0.6)


def test_keeping_leads_drops_more_records_rather_than_load_one_at_its_use():
    """Ten records of 1 MiB in turn, room for six, loads wanted two phases ahead: sparing bytes,
    the greedy makes four of its five loads later, down to the use itself (a load the program's
    thread makes and the GPU waits for); keeping the leads (the default) it streams two records
    more and every load comes two phases ahead, within the same budget."""
    n = 10
    args = (list(range(n)), [f"k{i}" for i in range(n)], [(i,) for i in range(n)], {i: MIB for i in range(n)},
            6 * MIB, 2)
    late = FixedSchedule.make(*args, keep_leads=False)
    kept = FixedSchedule.make(*args)
    assert late.as_dict()["late_loads"] == 4 and late.as_dict()["demand_loads"] == 4
    assert kept.fits and kept.as_dict()["late_loads"] == 0 and kept.as_dict()["demand_loads"] == 0
    assert all(g.lead == g.want == 2 for g in kept.gaps)
    assert kept.bytes_in == late.bytes_in + 2 * MIB
    for t in range(n):  # within the budget at every phase
        assert n - len(kept.off(t)) <= 6
