"""The online policy's time plan (gpuos_tools/sched/online.py, ``plan="time"``) against its count
plan, through the CPU simulator's time model (gpuos_tools/sched/online_sim.py): on a synthetic
blocked GEMM and on a trace recorded on the device. Simulated, not measured on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuos_tools.access import Predictor
from gpuos_tools.sched.online import OnlinePolicy
from gpuos_tools.sched.online_sim import blocked_gemm, simulate_online
from gpuos_tools.sched.simulate import Config
from gpuos_tools.sched.workload import Chunks, Workload, load_job, working_footprint
from gpuos_tools.stream import open_input
from tests.helpers import REPO, child_env
from tests.test_sched_online import FakeEngine, stencil

MiB = 1 << 20
RECORDED = REPO / "tests" / "data" / "recorded"


@pytest.fixture(scope="module")
def gemm() -> Workload:
    return blocked_gemm()


@pytest.mark.parametrize("fraction", [0.66, 0.5, 0.33])
def test_time_plan_stalls_less_than_count_plan_on_the_blocked_gemm(gemm: Workload, fraction: float) -> None:
    cfg = Config(int(gemm.footprint * fraction))
    count = simulate_online(gemm, cfg, plan="count")
    time_ = simulate_online(gemm, cfg, plan="time")
    early = simulate_online(gemm, cfg, plan="time", proactive=True)
    # the same launches learned the same period: the difference is the plan once it is known
    assert count["predicted"] == time_["predicted"] > 0.8 * count["steps"]
    assert time_["stall_predicted_s"] < count["stall_predicted_s"]
    assert time_["stall_s"] < count["stall_s"]
    # further ahead only where the launches ahead are short: a few more bytes at most
    assert time_["bytes_in"] <= 1.1 * count["bytes_in"]
    assert time_["walk_max"] > 2  # past the count plan's two launches somewhere
    assert early["proactive"] > 0 and time_["proactive"] == count["proactive"] == 0
    assert early["plan"] == "time+proactive"
    for r in (count, time_, early):
        assert r["over_physical"] == 0 and r["over_budget"] == 0
        assert r["peak_mapped"] <= cfg.budget
        assert r["bytes_in"] >= r["belady_bytes_in"] * 0.99  # nothing beats the offline optimum by much


def test_count_plan_ignores_durations_and_time_plan_without_them_is_the_count_plan() -> None:
    n = 12
    records = {0x1000 * (i + 1): 64 * MiB for i in range(n)}
    budget = n * 64 * MiB * 2 // 3
    launches = stencil(n, 3, 20 * n)
    logs = []
    for plan, feed in (("count", False), ("count", True), ("time", False)):
        pol = OnlinePolicy(budget, "belady", lookahead=2, plan=plan)
        eng = FakeEngine(records)
        for k, b in launches:
            acts = pol.before(k, b, records)
            eng.apply(acts, set(b))
            if feed:
                pol.note_duration(pol.last_key, 0.01)
        logs.append(eng.log)
    assert logs[0] == logs[1] == logs[2]


@pytest.mark.parametrize("proactive", [False, True])
@pytest.mark.parametrize("compute", [1e-4, 5e-3])
def test_time_plan_keeps_working_sets_resident_and_within_budget(compute: float, proactive: bool) -> None:
    """Transfer-bound (0.1 ms a launch: the walk goes as far as room allows) and compute-bound
    (5 ms): every launch has its working set, never a record of its own evicted, never more
    than the budget resident by the policy's books."""
    n = 16
    records = {0x1000 * (i + 1): 64 * MiB for i in range(n)}
    budget = n * 64 * MiB // 2
    pol = OnlinePolicy(budget, "belady", lookahead=2, plan="time", proactive=proactive)
    eng = FakeEngine(records)
    for k, b in stencil(n, 3, 30 * n):
        acts = pol.before(k, b, records)
        eng.apply(acts, set(b))
        assert set(b) <= eng.resident
        assert eng.used <= budget
        pol.note_duration(pol.last_key, compute)
    assert pol.stats.peak_resident <= budget and pol.stats.prefetches > 0
    if compute < 1e-3:  # transfer-bound: as far as room allows
        assert pol.stats.walk_max > 4
    else:  # a launch covers a record's save and load: the lookahead, and one more at most
        assert pol.stats.walk_max <= 3


def test_durations_average_per_key_and_unmeasured_keys_take_the_mean() -> None:
    pol = OnlinePolicy(1 << 30, plan="time")
    pol.before("a", [1], {1: 10, 2: 10})
    a = pol.last_key
    pol.before("b", [2], {1: 10, 2: 10})
    b = pol.last_key
    assert pol.duration(a) == 0.0  # nothing measured
    pol.note_duration(a, 0.004)
    assert pol.duration(a) == pytest.approx(0.004) and pol.duration(b) == pytest.approx(0.004)
    pol.note_duration(a, 0.008)
    assert pol.duration(a) == pytest.approx(0.005)  # 0.004 + 0.25 * (0.008 - 0.004)
    pol.note_duration(b, 0.001)
    assert pol.duration(b) == pytest.approx(0.001)
    pol.note_bandwidth(40e9, None)
    assert pol.h2d_bw == 40e9 and pol.d2h_bw == 50.5e9
    with pytest.raises(ValueError):
        OnlinePolicy(1, plan="steps")


def _recorded(name: str, copies: int) -> Workload:
    with open_input(RECORDED / f"{name}.ndjson.zst") as reader:
        access = list(Predictor("range").annotate(list(reader)))
    chunks = Chunks(2 << 20)
    job = load_job(access, chunks, 0, name)
    job.steps = job.steps * copies
    return Workload(chunks, [job], job.steps, [], working_footprint(job.steps, chunks.sizes))


def test_both_plans_on_the_recorded_torch_step_load_within_the_budget() -> None:
    w = _recorded("torch", 6)
    for fraction in (0.66, 0.33):
        cfg = Config(int(w.footprint * fraction))
        rows = {p: simulate_online(w, cfg, plan=p) for p in ("count", "time")}
        for r in rows.values():
            assert r["over_physical"] == 0
            assert r["predicted"] > r["steps"] // 2  # the step's period is learned
            assert r["prefetches"] > 0 and r["bytes_in"] > 0
            assert r["peak_mapped"] <= cfg.budget
        # a step's launches are short (gaps of at most 1 ms) and its records 2 MiB: the time
        # plan walks about as far as the count plan and moves about the same bytes
        assert rows["time"]["bytes_in"] <= 1.1 * rows["count"]["bytes_in"]


def test_the_walk_reads_the_period_as_it_goes_and_decides_as_the_whole_list_did(monkeypatch, gemm: Workload) -> None:
    """The time plan's walk reads the predicted keys lazily (``Period.ahead``): the keys are
    ``predict``'s, and on the recorded CNN step and the blocked GEMM every decision is the one
    the walk over the whole predicted list made (the same summaries, moves included)."""
    from gpuos_tools.sched.online import Period

    per = Period()
    for k in [1, 2, 3, 4, 5] * 8:
        per.push(k)
    assert per.known == 5
    for k in (0, 1, 3, 7, 12):
        view = per.ahead(k)
        assert list(view) == per.predict(k) and len(view) == k and [view[i] for i in range(k)] == per.predict(k)
    with pytest.raises(IndexError):
        per.ahead(3)[3]
    assert list(Period().ahead(4)) == []

    def runs() -> list[dict]:
        out = []
        for w, fractions in ((_recorded("suite-torch_cnn.s2", 4), (0.66, 0.5)), (gemm, (0.66,))):
            for fraction in fractions:
                for proactive in (False, True):
                    r = simulate_online(w, Config(int(w.footprint * fraction)), plan="time", proactive=proactive)
                    out.append({k: v for k, v in r.items() if k != "cpu_s"})
        return out

    lazy = runs()
    monkeypatch.setattr(Period, "ahead", lambda self, k: self.predict(k))  # the whole list, as before
    assert runs() == lazy
    assert any(r["walk_max"] > 2 for r in lazy) and any(r["prefetches"] for r in lazy)


def test_bench_sched_plan_script_writes_both_plans() -> None:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sched_plan.py"), "--workloads", "gemm",
                          "--budgets", "66%", "--json", "/dev/stdout"], capture_output=True, text=True,
                         env=child_env(), timeout=120, check=True)
    data = json.loads(out.stdout)
    assert data["simulated"] is True
    plans = {r["plan"]: r for r in data["rows"]}
    assert set(plans) == {"count", "time", "time+proactive", "fixed", "fixed-lead"}
    assert plans["time"]["stall_s"] < plans["count"]["stall_s"]
