"""gpu-prefetch-sched's core on hand-made sequences: units, Belady against a brute-force optimum,
the planner's rules and the time model's arithmetic.

Every sequence here is written by hand for the arithmetic (chunk ids, sizes, compute times);
none of it is trace data. The recorded traces are exercised in test_sched_recorded.py.
"""

from __future__ import annotations

import itertools
import random

import pytest

from gpuos_tools.sched.planner import NEVER, BeladyPlanner, LRUPlanner
from gpuos_tools.sched.simulate import Config, simulate
from gpuos_tools.units import (
    parse_bandwidth,
    parse_budget,
    parse_duration,
    parse_size,
)
from gpuos_tools.sched.workload import (
    Chunks,
    Step,
    Workload,
    interleave,
    load_job,
    working_footprint,
)

# -- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("1B", 1),
        ("2MiB", 2 << 20),
        ("2M", 2 << 20),
        ("1.5GiB", 3 << 29),
        ("8g", 8 << 30),
        ("1KB", 1000),
        ("3GB", 3 * 10**9),
        ("1TiB", 1 << 40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "1b", "1XB", "-1MiB", "1 MiB/s", "10%"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_budget_percent_and_size() -> None:
    assert parse_budget("50%", 1000) == 500
    assert parse_budget("66.5%", 1000) == 665
    assert parse_budget("1KiB", None) == 1024
    with pytest.raises(ValueError):
        parse_budget("50%", None)
    with pytest.raises(ValueError):
        parse_budget("x%", 10)


def test_parse_bandwidth_and_duration() -> None:
    assert parse_bandwidth("50.5GB/s") == 50.5e9
    assert parse_bandwidth("1GiB/s") == float(1 << 30)
    assert parse_duration("30us") == 30e-6
    assert parse_duration("1.5ms") == 1.5e-3
    assert parse_duration("2s") == 2.0
    for bad in ("55GB", "0GB/s"):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)
    with pytest.raises(ValueError):
        parse_duration("30")


# -- Belady against brute force ----------------------------------------------------------------


def _steps(seq: list[tuple[int, ...]], writes: bool = False, compute: float = 0.0) -> list[Step]:
    return [Step(0, "launch", i + 1, ws, ws if writes else (), (), compute) for i, ws in enumerate(seq)]


def _optimal_misses(seq: list[tuple[int, ...]], k: int) -> int:
    """Fewest chunk loads for unit-size chunks and room for k, over every eviction choice."""
    states: dict[frozenset[int], int] = {frozenset(): 0}
    for ws in seq:
        need = frozenset(ws)
        nxt: dict[frozenset[int], int] = {}
        for held, cost in states.items():
            pool = held | need
            extra = sorted(pool - need)
            step_cost = cost + len(need - held)
            for r in range(min(len(extra), k - len(need)) + 1):
                for keep in itertools.combinations(extra, r):
                    state = need | frozenset(keep)
                    if nxt.get(state, 1 << 30) > step_cost:
                        nxt[state] = step_cost
        states = nxt
    return min(states.values())


def _misses(planner_cls: type, seq: list[tuple[int, ...]], n: int, k: int) -> int:
    steps = _steps(seq)
    p = planner_cls([1] * n, k, steps)
    total = 0
    for i in range(len(steps)):
        d = p.plan(i)
        assert not d.overflow
        total += len(d.loads) + len(d.first)
        assert p.used <= k
    return total


def test_belady_textbook_sequence() -> None:
    # The reference string of the classic example, 3 frames: MIN takes 9 faults, LRU 12.
    seq = [(c,) for c in (7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1)]
    assert _misses(BeladyPlanner, seq, 8, 3) == 9
    assert _misses(LRUPlanner, seq, 8, 3) == 12
    assert _optimal_misses(seq, 3) == 9


@pytest.mark.parametrize("seed", range(40))
def test_belady_is_optimal_on_random_tiny_sequences(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 6)
    k = rng.randint(2, min(4, n))
    width = rng.randint(1, min(2, k))
    seq = [tuple(rng.sample(range(n), rng.randint(1, width))) for _ in range(rng.randint(4, 11))]
    best = _optimal_misses(seq, k)
    assert _misses(BeladyPlanner, seq, n, k) == best
    assert _misses(LRUPlanner, seq, n, k) >= best


# -- planner rules ----------------------------------------------------------------------------


def test_dirty_chunks_are_written_back_clean_ones_dropped_fresh_ones_not_copied() -> None:
    # chunk 0 written, chunk 1 written, then only read: budget for one chunk.
    steps = [
        Step(0, "launch", 1, (0,), (0,)),
        Step(0, "launch", 2, (1,), (1,)),  # evicts 0: dirty -> write-back; 1 is fresh: first touch
        Step(0, "launch", 3, (0,), ()),  # evicts 1 (dirty); 0 copied back in
        Step(0, "launch", 4, (1,), ()),  # evicts 0, clean since its load: dropped; 1 copied in
    ]
    p = BeladyPlanner([10, 10], 10, steps)
    d = [p.plan(i) for i in range(4)]
    assert (d[0].first, d[0].loads, d[0].evicts) == ([0], [], [])
    assert (d[1].first, d[1].evicts, d[1].writeback) == ([1], [0], [True])
    assert (d[2].loads, d[2].evicts, d[2].writeback) == ([0], [1], [True])
    assert (d[3].loads, d[3].evicts, d[3].writeback) == ([1], [0], [False])


def test_a_freed_chunk_leaves_for_free_and_is_fresh_again() -> None:
    steps = [
        Step(0, "launch", 1, (0, 1), (0, 1)),
        Step(0, "launch", 2, (2,), (2,), frees=(0,)),  # room from the free: nothing evicted
    ]
    p = LRUPlanner([10, 10, 10], 20, steps)
    p.plan(0)
    d = p.plan(1)
    assert d.freed == [0] and d.evicts == [] and d.first == [2]
    assert not p.populated[0] and not p.dirty[0]


def test_working_set_over_budget_overflows_and_never_exceeds_budget() -> None:
    steps = [Step(0, "launch", 1, (0,), (0,)), Step(0, "launch", 2, (1, 2, 3), (1,))]
    p = BeladyPlanner([10, 10, 10, 10], 25, steps)
    p.plan(0)
    d = p.plan(1)
    assert d.evicts == [0]
    assert len(d.first) == 2 and len(d.overflow) == 1
    assert d.overflow_in == [False] and p.peak <= 25


def test_planning_out_of_order_is_refused() -> None:
    p = BeladyPlanner([1], 1, _steps([(0,), (0,)]))
    with pytest.raises(ValueError):
        p.plan(1)


# -- workload ---------------------------------------------------------------------------------


def _hand_stream() -> list[dict]:
    """A tiny hand-written access stream (not a recorded trace): three allocations, a host one."""
    return [
        {"type": "header", "schema": "gpuos/1", "tool": "hand-written"},
        {"type": "alloc", "id": 1, "addr": 1 << 20, "size": 300, "kind": "device"},
        {"type": "alloc", "id": 2, "addr": 2 << 20, "size": 100, "kind": "device"},
        {"type": "alloc", "id": 3, "addr": 3 << 20, "size": 100, "kind": "host"},
        {"type": "launch", "seq": 1, "ts": 1_000_000_000},
        {"type": "access", "of": "launch", "seq": 1, "kernel": "k",
         "reads": [{"alloc": 1, "offset": 150, "size": 20}, {"alloc": 3, "offset": 0, "size": 100}],
         "writes": [{"alloc": 2, "offset": 0, "size": 100}], "unknown": False},
        {"type": "launch", "seq": 2, "ts": 1_000_500_000, "captured": True},
        {"type": "access", "of": "launch", "seq": 2, "captured": True, "reads": [], "writes": [], "unknown": False},
        {"type": "free", "id": 2, "addr": 2 << 20},
        {"type": "memset", "ts": 1_010_000_000},
        {"type": "access", "of": "memset", "index": 1, "reads": [],
         "writes": [{"alloc": 1, "offset": 0, "size": 300}], "unknown": False},
        {"type": "graph_launch", "ts": 9_000_000_000},
        {"type": "access", "of": "graph_launch", "index": 1, "reads": [], "writes": [], "unknown": True},
    ]  # fmt: skip


def test_load_job_chunks_ranges_unknowns_and_gaps() -> None:
    chunks = Chunks(100)
    job = load_job(_hand_stream(), chunks, 0, "hand", "gaps", 5e-3)
    assert chunks.sizes == [100, 100, 100, 100]  # alloc 1: three chunks; alloc 2: one; host: none
    assert [(st.of, st.ref) for st in job.steps] == [("launch", 1), ("memset", 1), ("graph_launch", 1)]
    assert job.captured == 1 and job.skipped_entries == 1
    first, memset, graph = job.steps
    assert first.ws == (1, 3) and first.writes == (3,)  # bytes 150..169 lie in chunk 1 of alloc 1
    assert memset.frees == (3,) and memset.ws == (0, 1, 2)
    assert graph.unknown and graph.ws == (0, 1, 2) and graph.writes == (0, 1, 2)
    # gaps: 10 ms capped at 5 ms, 7.99 s capped; the last step gets the median of the others
    assert first.compute == pytest.approx(5e-3)
    assert memset.compute == pytest.approx(5e-3)
    assert graph.compute == pytest.approx(5e-3)
    fixed = load_job(_hand_stream(), Chunks(None), 0, "hand", 2e-6)
    assert all(st.compute == 2e-6 for st in fixed.steps)
    assert fixed.steps[0].ws == (0, 1)  # whole allocations: one chunk each


def test_footprint_is_used_memory_not_allocated() -> None:
    steps = [Step(0, "launch", 1, (0,), ()), Step(0, "launch", 2, (1,), (), frees=(0,)), Step(0, "launch", 3, (2,), ())]
    assert working_footprint(steps, [5, 7, 11]) == 18  # 0 is freed before 2 arrives; 5+7 < 7+11


def test_round_robin_slices_and_switches() -> None:
    a = [Step(0, "launch", i, (0,), (), (), 1.0) for i in range(1, 5)]
    b = [Step(1, "launch", i, (1,), (), (), 1.0) for i in range(1, 3)]
    from gpuos_tools.sched.workload import Job

    w = interleave(Chunks(None, [1, 1], [0, 1], [1, 1], [0, 0]), [Job(0, "a", a), Job(1, "b", b)], 2.0)
    assert [(st.job, st.ref) for st in w.steps] == [(0, 1), (0, 2), (1, 1), (1, 2), (0, 3), (0, 4)]
    assert w.switches == [2, 4]


# -- time model -------------------------------------------------------------------------------


def _work(steps: list[Step], sizes: list[int]) -> Workload:
    return Workload(Chunks(None, sizes, [0] * len(sizes), list(range(len(sizes))), [0] * len(sizes)),
                    [], steps, [], working_footprint(steps, sizes))  # fmt: skip


def _with_jobs(w: Workload) -> Workload:
    from gpuos_tools.sched.workload import Job

    w.jobs = [Job(0, "hand", w.steps)]
    return w


def test_time_model_by_hand() -> None:
    # 100-byte chunks at 100 B/s: one second per chunk each way; room for one chunk.
    steps = [
        Step(0, "launch", 1, (0,), (0,), (), 1.0),
        Step(0, "launch", 2, (1,), (1,), (), 1.0),
        Step(0, "launch", 3, (0,), (), (), 1.0),
    ]
    w = _with_jobs(_work(steps, [100, 100]))
    cfg = Config(100, h2d_bw=100.0, d2h_bw=100.0, fault_s=0.5, fault_size=100, um_evict_bw=100.0)
    s = simulate(w, "belady", cfg)
    # step 1: c0 (dirty) out 1..2, c1 fresh: starts at 2; step 2: c1 out 3..4, c0 in 4..5: starts at 5
    assert s["est_s"] == pytest.approx(6.0)
    assert (s["stalls"], s["stall_s"]) == (2, pytest.approx(3.0))
    assert (s["bytes_in"], s["bytes_out"], s["first_touch_bytes"]) == (100, 200, 200)
    assert s["floor_s"] == pytest.approx(3.0) and s["in_memory_s"] == pytest.approx(3.0)
    d = simulate(w, "demand", cfg)
    # 0.5 (fault) + 1 + [1 (evict) + 0.5] + 1 + [1 (evict) + 0.5 + 1 (copy)] + 1
    assert d["est_s"] == pytest.approx(7.5)
    assert (d["faults"], d["bytes_in"], d["bytes_out"]) == (3, 100, 200)


def test_lookahead_hides_a_load_that_reactive_swapping_waits_for() -> None:
    # c1 is written, pushed out by c2, and needed again after a long step on c0.
    steps = [
        Step(0, "launch", 1, (1,), (1,), (), 1.0),
        Step(0, "launch", 2, (0,), (0,), (), 1.0),
        Step(0, "launch", 3, (2,), (2,), (), 1.0),
        Step(0, "launch", 4, (0,), (), (), 5.0),
        Step(0, "launch", 5, (1,), (), (), 1.0),
    ]
    w = _with_jobs(_work(steps, [100, 100, 100]))
    ahead = simulate(w, "belady", Config(200, 100.0, 100.0, lookahead=None))
    reactive = simulate(w, "belady", Config(200, 100.0, 100.0, lookahead=0))
    assert ahead["bytes_in"] == reactive["bytes_in"] == 100
    assert ahead["stall_s"] < reactive["stall_s"]
    assert ahead["est_s"] == pytest.approx(ahead["compute_s"] + ahead["stall_s"])


def test_enough_budget_means_no_copies_and_no_stall() -> None:
    steps = [Step(0, "launch", i, (i % 3,), (i % 3,), (), 1e-3) for i in range(30)]
    w = _with_jobs(_work(steps, [10, 10, 10]))
    for policy in ("belady", "lru", "demand"):
        s = simulate(w, policy, Config(30))
        assert s["bytes_in"] == s["bytes_out"] == s["evictions"] == 0
        if policy != "demand":
            assert s["est_s"] == pytest.approx(s["compute_s"])


# -- the planner online: the future arrives in pieces ------------------------------------------


def _decisions(p) -> list[tuple]:  # type: ignore[no-untyped-def]
    return [(d.loads, d.first, d.evicts, d.writeback, d.overflow) for d in p.decisions()]


@pytest.mark.parametrize("cls", [BeladyPlanner, LRUPlanner])
@pytest.mark.parametrize("seed", range(10))
def test_extending_before_planning_equals_knowing_it_all(cls: type, seed: int) -> None:
    rng = random.Random(seed)
    seq = [tuple(rng.sample(range(8), rng.randint(1, 3))) for _ in range(60)]
    steps = [Step(0, "launch", i, ws, ws[:1]) for i, ws in enumerate(seq)]
    whole = _decisions(cls([3] * 8, 12, steps))
    sizes: list[int] = [3] * 2  # the chunk ids grow as steps arrive
    p = cls(sizes, 12, [])
    for k in range(0, 60, 7):
        part = steps[k : k + 7]
        sizes.extend([3] * (max(max(st.ws) for st in part) + 1 - len(sizes)))
        p.extend(part)
    assert _decisions(p) == whole


def test_belady_with_a_window_of_the_future_stays_safe_and_is_no_better_than_knowing_it_all() -> None:
    rng = random.Random(7)
    seq = [tuple(rng.sample(range(10), rng.randint(1, 3))) for _ in range(300)]
    steps = [Step(0, "launch", i, ws, ws[:1]) for i, ws in enumerate(seq)]
    full = sum(len(d.loads) + len(d.first) for d in BeladyPlanner([1] * 10, 5, steps).decisions())
    p = BeladyPlanner([1] * 10, 5, steps[:8])
    windowed = 0
    for i in range(300):
        if i + 8 < 300:
            p.extend([steps[i + 8]])  # always 8 steps of known future
        d = p.plan(i)
        windowed += len(d.loads) + len(d.first)
        assert all(p.resident[c] for c in steps[i].ws) and p.used <= 5
    assert windowed >= full


def test_belady_learns_a_next_use_that_arrives_after_planning() -> None:
    # Room for two chunks. Steps 0 and 1 are planned knowing nothing more, so chunks 0 and 1
    # have no next use; then steps 2 and 3 arrive, and step 3 uses chunk 0 again: making room
    # for chunk 2 must evict chunk 1, not chunk 0.
    steps = [Step(0, "launch", i, (c,), ()) for i, c in enumerate((0, 1, 2, 0))]
    p = BeladyPlanner([1, 1, 1], 2, steps[:2])
    p.plan(0)
    p.plan(1)
    assert p.next_use(0) == p.next_use(1) == NEVER
    p.extend(steps[2:])
    assert p.next_use(0) == 3
    assert p.plan(2).evicts == [1]
    d = p.plan(3)
    assert d.loads == d.first == d.evicts == []  # chunk 0 stayed


def test_demand_paging_defaults_match_the_measured_fault_driven_first_touch() -> None:
    # DESIGN.md §3: 2 GiB of host data first touched by the GPU, fault-driven: 0.318 s on an
    # H200. Here: 2 GiB written (A), pushed out by 2 GiB more (B), then A read again.
    n = 1024  # 2 MiB chunks
    a = tuple(range(n))
    b = tuple(range(n, 2 * n))
    steps = [Step(0, "launch", 1, a, a), Step(0, "launch", 2, b, b), Step(0, "launch", 3, a, ())]
    w = _with_jobs(_work(steps, [2 << 20] * (2 * n)))
    fast_evict = Config(2 << 30, um_evict_bw=1e30)  # leave eviction out: only faults and copies
    d = simulate(w, "demand", fast_evict)
    first_touch = 2 * (2 << 30) // (256 << 10) * 30e-6  # A and B: faults, nothing to copy
    refault = d["est_s"] - first_touch
    assert refault == pytest.approx((2 << 30) // (256 << 10) * 30e-6 + (2 << 30) / 50.5e9)
    assert 0.9 * 0.318 < refault < 1.1 * 0.318
