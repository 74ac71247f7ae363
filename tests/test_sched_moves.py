"""The accounting of scripts/bench_sched_moves.py (gpuos_tools/sched/moves.py) on the traces
recorded on the device: every byte the online policy moves has one class, the classes add up to
the bytes moved, Belady's MIN is a floor, and only a proven whole overwrite counts as one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, child_env

from gpuos_tools.sched.moves import LOAD_CLASSES, SAVE_CLASSES, Future, belady_min, classify
from gpuos_tools.sched.online_sim import simulate_online
from gpuos_tools.sched.simulate import Config
from gpuos_tools.sched.workload import Workload, trace_workload

RECORDED = Path(__file__).parent / "data" / "recorded"


def _recorded(name: str, copies: int, chunk: int | None) -> Workload:
    return trace_workload(RECORDED / f"{name}.ndjson.zst", name, copies, chunk)


@pytest.mark.parametrize("name", ["torch", "suite-torch_cnn.s1", "suite-cupy_suite.s2"])
@pytest.mark.parametrize("chunk", [None, 2 << 20])
def test_every_byte_moved_has_one_class_and_belady_min_is_a_floor(name, chunk):
    copies = 8
    w = _recorded(name, copies, chunk)
    period = len(w.steps) // copies
    for fraction in (0.66, 0.5):
        budget = int(w.footprint * fraction)
        events: list[tuple] = []
        r = simulate_online(w, Config(budget), events=events)
        c = classify(w, events, period)
        t = c["total"]
        assert t["bytes_in"] == r["bytes_in"] and t["bytes_out"] == r["bytes_out"]
        assert sum(t["in"][k] for k in LOAD_CLASSES) == t["bytes_in"]
        assert sum(t["out"][k] for k in SAVE_CLASSES) == t["bytes_out"]
        assert t["demand_loads"] == r["demand_loads"] and t["prefetches"] == r["prefetches"]
        m = belady_min(w, budget, period)
        skip = belady_min(w, budget, period, skip_dead=True)
        # MIN loads the fewest records: bytes too, within one record's size of mixed sizes
        biggest = max(w.chunks.sizes)
        assert m["steady"]["bytes_in"] <= c["steady"]["bytes_in"] + biggest
        assert skip["total"]["bytes_in"] <= m["total"]["bytes_in"]
        assert skip["total"]["bytes_out"] <= m["total"]["bytes_out"]


@pytest.mark.parametrize("name", ["suite-cupy_suite.s2", "suite-torch_cnn.s2", "torch"])
def test_only_a_proven_whole_overwrite_counts_and_a_record_read_first_is_loaded(name):
    """A step overwrites a record whole only where the predictor's ranges prove it: written over
    every byte and read nowhere (on the recorded traces: memsets over whole allocations; a
    launch's outputs are predicted read and written). A record whose next access reads it is
    loaded by MIN with the skip too, and its load never counts as overwritten."""
    w = _recorded(name, 4, None)
    fut = Future(w)
    for st in w.steps:
        assert set(st.covers) <= set(st.writes)
        if st.of == "launch":
            assert not st.covers
        for c in st.covers:
            assert w.chunks.offset[c] == 0  # whole allocations: the write covers it from 0
    budget = int(w.footprint * 0.5)
    events: list[tuple] = []
    simulate_online(w, Config(budget), events=events)
    c = classify(w, events)
    over = sum(e[3] for e in events if e[0] == "load" and e[3] and fut.next(e[2], e[1])[1] == 1)
    assert c["total"]["in"]["overwritten"] == over
    read_first = sum(e[3] for e in events if e[0] == "load" and e[3] and fut.next(e[2], e[1])[1] == 2)
    unused = sum(e[3] for e in events if e[0] == "load" and e[3] and fut.next(e[2], e[1])[1] == 0)
    assert c["total"]["in"]["unused"] == unused
    # every other byte loaded is read before anything overwrites it: needed, whatever its class
    assert c["total"]["bytes_in"] - over - unused == read_first > 0
    m, skip = belady_min(w, budget), belady_min(w, budget, skip_dead=True)
    if not any(st.covers for st in w.steps):
        assert skip["total"]["bytes_in"] == m["total"]["bytes_in"]


def test_bench_sched_moves_script_writes_its_figures(tmp_path):
    out = tmp_path / "m.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sched_moves.py"), "--workloads", "suite-cupy_suite.s1",
                    "--copies", "4", "--json", str(out)], capture_output=True, text=True, env=child_env(), timeout=300,
                   check=True)
    data = json.loads(out.read_text())
    assert data["simulated"] is True and data["rows"]
    row = data["rows"][0]
    assert {"online", "belady_min", "belady_min_skip", "classes_in", "classes_out"} <= set(row)


def _cycle(n: int, size: int, copies: int) -> Workload:
    """``n`` records of ``size`` bytes, one step each in order, each updating its record: a
    cyclic loop."""
    from gpuos_tools.sched.workload import Chunks, Job, Step

    chunks = Chunks(None, sizes=[size] * n, job=[0] * n, alloc=list(range(n)), offset=[0] * n)
    steps = [Step(0, "launch", i, (i % n,), (i % n,)) for i in range(n * copies)]
    return Workload(chunks, [Job(0, "cycle", steps)], steps, [], n * size)


def test_a_fixed_plan_on_a_cycle_pins_what_fits_beside_the_record_in_flight():
    """Ten records used in turn, room for six: five stay pinned and five are dropped and loaded
    every period (one streamed record live at a time), against MIN's four demand loads. Asked to
    load two steps ahead, it streams two more records so that every load comes two steps ahead;
    told to spare bytes instead, the room allows it for one of the five: the others' loads come
    later (made later costs no bytes, a sixth drop would), and the plan says how many."""
    from gpuos_tools.sched.moves import fixed_plan

    w = _cycle(10, 1 << 20, 4)
    m = belady_min(w, 6 << 20, 10)["steady"]
    assert m["bytes_in"] == m["bytes_out"] == 4 << 20
    now = fixed_plan(w, 6 << 20, 10, ahead=0)
    assert now["fits"] and now["peak"] <= 6 << 20 and now["short_leads"] == 0
    assert now["streamed"] == 5 and now["pinned"] == 5 and now["moves"] == 10
    assert now["bytes_in"] == now["bytes_out"] == 5 << 20  # each written: saved when dropped
    early = fixed_plan(w, 6 << 20, 10, ahead=2)
    assert early["fits"] and early["bytes_in"] == 7 << 20 and early["short_leads"] == 0
    late = fixed_plan(w, 6 << 20, 10, ahead=2, keep_leads=False)
    assert late["fits"] and late["bytes_in"] == 5 << 20 and late["short_leads"] == 4
    assert fixed_plan(w, 10 << 20, 10)["moves"] == 0  # room for all: nothing moves
    with pytest.raises(ValueError):
        fixed_plan(w, 6 << 20, 10, period=4)  # only four periods


def test_on_the_recorded_decode_a_fixed_plan_fits_and_moves_close_to_min():
    """The decode's token (owned records, weights read once a token): a plan that repeats moves
    within a tenth of MIN's bytes and fits the budget, with fewer moves a token than the online
    policy makes."""
    from gpuos_tools.sched.moves import fixed_plan

    w = _recorded("decode-owned", 3, None)
    period = len(w.steps) // 3
    budget = int(w.footprint * 0.66)
    f = fixed_plan(w, budget, period)
    m = belady_min(w, budget, period)
    assert f["fits"] and f["peak"] <= budget and f["short_leads"] <= 2
    assert m["steady"]["bytes_in"] <= f["bytes_in"] <= 1.1 * m["steady"]["bytes_in"]
    events: list[tuple] = []
    simulate_online(w, Config(budget), events=events)
    online_moves = sum(1 for e in events if period * 2 <= e[1] < period * 3)
    assert f["moves"] < online_moves


@pytest.mark.parametrize("name", ["torch", "suite-torch_cnn.s2", "suite-cupy_suite.s2"])
@pytest.mark.parametrize("chunk", [None, 2 << 20])
def test_on_the_recorded_steps_a_fixed_plan_fits_and_moves_no_more_than_a_tenth_over_min(name, chunk):
    """The PyTorch and CuPy steps (temporaries freed inside each step, steps whose records alone
    exceed the budget): the plan fits wherever a plan can and stays within a tenth (and a record)
    of MIN's bytes."""
    from gpuos_tools.sched.moves import fixed_plan

    w = _recorded(name, 4, chunk)
    period = len(w.steps) // 4
    for fraction in (0.66, 0.5):
        budget = int(w.footprint * fraction)
        f = fixed_plan(w, budget, period)
        m = belady_min(w, budget, period)["steady"]
        assert f["fits"], (name, fraction, f)
        assert m["bytes_in"] - max(w.chunks.sizes) <= f["bytes_in"] <= 1.1 * m["bytes_in"] + max(w.chunks.sizes)
