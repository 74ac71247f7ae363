"""scripts/bench_swap.py without a GPU: its engine trials, the same calls in the same order, on the
real residency engine and the real owned library (parking included) over the stand-in driver
(tests/fake_libcuda.c), with streams and events whose work completes at once. What is checked is
the benchmark's own logic: that every eviction it times is a save, counted as the engine counts it,
and that the records come back with what was last written. The figures come from the GPU run."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import threading
import time

import pytest
from helpers import REPO, child_env
from test_engine import FakeOps
from test_owned import env  # noqa: F401 -- the fixture: the owned library on the stand-in driver

from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.states import RELEASED, RESIDENT

spec = importlib.util.spec_from_file_location("bench_swap", REPO / "scripts" / "bench_swap.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

MIB = 1 << 20
#: the owned library and the stand-in driver are built with the C compiler
needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


class OwnedOps(FakeOps):
    """The owned library's records (lookup, release, make resident: parking happens there) and the
    fake's streams, events and copies. ``destroy_s``: how long an event's destruction takes on the
    engine's evict thread -- a driver call that lets other threads run, between the moment a record
    is marked released and the moment its eviction is counted."""

    def __init__(self, lib, destroy_s: float = 0.0) -> None:
        super().__init__([], auto=True)
        self.lib = lib
        self.destroy_s = destroy_s

    def lookup(self, addr):
        return self.lib.lookup(addr)

    def make_resident(self, base):
        self.lib.make_resident(base)
        self.log.append(("make_resident", base))

    def release(self, base):
        self.lib.release(base)
        self.log.append(("release", base))

    def copy_in(self, base, pieces, stream):
        assert self.lib.lookup(base).resident, "a load into unmapped memory"
        self.device[base] = self.hostmem[pieces[0][0]]
        self.log.append(("copy_in", base, stream))

    def destroy(self, ev):
        if self.destroy_s and threading.current_thread().name == "gpuos-engine-evict":
            time.sleep(self.destroy_s)


class BenchAgent:
    """What the engine reads of the benchmark's agent (scripts/bench_swap.py's BenchAgent)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.own: set[int] = set()
        self.streams = {0}
        self.ctx = None
        self.by_id: dict = {}
        self.snap = None


def swap_setup(lib, n: int, rec: int, destroy_s: float = 0.0):
    ops = OwnedOps(lib, destroy_s)
    eng = ResidencyEngine(BenchAgent(), ops, settings=EngineSettings(digest=False))
    sets = [[lib.malloc(rec) for _ in range(n)] for _ in range(2)]
    for s, bases in enumerate(sets):
        for i, x in enumerate(bases):
            ops.device[x] = b"fill %d %d" % (s, i)
    return ops, eng, sets


def writer(eng, ops):
    """The benchmark's ``dirty`` on the fake: each record's contents become the pattern's, and the
    engine is told of the memset as the tracer would tell it."""
    last: dict[int, bytes] = {}

    def write(bases, pattern):
        for i, x in enumerate(bases):
            ops.device[x] = last[x] = b"pattern %d %d" % (pattern, i)
            eng.access("cuMemsetD32Async", 0, x)

    return write, last


def test_help_runs_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_swap.py"), "--help"],
                          capture_output=True, text=True, timeout=60, check=False, env=child_env())
    assert done.returncode == 0, done.stderr
    assert "--park" in done.stdout and "each a save" in done.stdout


@needs_cc
def test_every_timed_eviction_saves_with_parking_off_and_on_each_trial_swapping_the_sets(env):  # noqa: F811
    lib, _ = env
    n, rec, trials = 4, 4 * MIB, 3
    ops, eng, (a, b) = swap_setup(lib, n, rec)
    write, last = writer(eng, ops)
    bench.release_set(eng, b)
    assert all(eng.state(x) == RELEASED for x in b) and eng.stats()["evict_saves"] == n
    for park in (0, n * rec):
        before = bench.save_counts(eng)
        rows, a, b = bench.engine_trials(eng, lib, a, b, park, trials, write)
        after = bench.save_counts(eng)
        assert len(rows) == trials and set(rows[0]) == {"evict_gbps", "load_gbps", "both_out_gbps", "both_in_gbps",
                                                        "both_combined_gbps"}
        # two eviction phases of n records per trial, each eviction a save of the whole record
        assert after["evictions"] - before["evictions"] == 2 * n * trials
        assert after["evict_saves"] - before["evict_saves"] == 2 * n * trials
        assert after["saved_bytes"] - before["saved_bytes"] == 2 * n * rec * trials
        assert after["unsaved_bytes"] == before["unsaved_bytes"] == 0
        assert lib.park_stats()["park_limit"] == 0  # set back after the run
    # the whole run: B's first release, then 2 x n x trials per mode
    assert eng.stats()["evict_saves"] == n + 2 * (2 * n * trials)
    st = lib.park_stats()
    assert st["parks"] > 0 and st["park_reuses"] > 0  # the "on" run did map parked memory again
    # an odd number of trials ends with the sets swapped; every record holds what was last written
    assert all(eng.state(x) == RESIDENT for x in a) and all(eng.state(x) == RELEASED for x in b)
    for x in b:
        eng.prefetch(x)
    eng.require(b, 0)
    assert {x: ops.device[x] for x in a + b} == last
    assert eng.stats().get("evict_errors", 0) == 0
    eng.close()


@needs_cc
def test_the_check_counts_an_eviction_seen_released_before_the_engine_counted_it(env):  # noqa: F811
    # the evict thread marks a record released, destroys the save's event, then counts the
    # eviction, all under the engine's lock; a reader that polls the state (no lock) and then
    # reads the counts directly can see the release without its count, and B's last eviction
    # missing from the counts taken at the start of the first run made its check fail
    lib, _ = env
    n, rec, trials = 2, 4 * MIB, 1
    ops, eng, (a, b) = swap_setup(lib, n, rec, destroy_s=0.05)
    write, _ = writer(eng, ops)
    bench.release_set(eng, b)
    rows, a, b = bench.engine_trials(eng, lib, a, b, n * rec, trials, write)
    assert len(rows) == trials and eng.stats()["evict_saves"] == n + 2 * n * trials
    eng.close()


def test_the_check_says_what_the_engine_counted_when_an_eviction_did_not_save() -> None:
    before = {"evictions": 16, "evict_saves": 16, "saved_bytes": 16 << 28, "unsaved_bytes": 0}
    good = {"evictions": 112, "evict_saves": 112, "saved_bytes": 112 << 28, "unsaved_bytes": 0}
    bench.check_saves(before, good, 96, 96 << 28, "park on")
    clean = {"evictions": 112, "evict_saves": 111, "saved_bytes": 111 << 28, "unsaved_bytes": 1 << 28}
    with pytest.raises(RuntimeError, match=r"park on: expected 96 evictions, each a save .* 95 saves, .* "
                                           r"268435456 bytes released unsaved"):
        bench.check_saves(before, clean, 96, 96 << 28, "park on")
    with pytest.raises(RuntimeError, match="counted 95 evictions, 95 saves"):
        bench.check_saves(before, {**good, "evictions": 111, "evict_saves": 111, "saved_bytes": 111 << 28},
                          96, 96 << 28, "park off")
