"""serve's byte ledger (gpuos_tools/sched/ledger.py): bookings against the one total across the
jobs' views of the same file, the peaks taken at every increase, forced bookings, allocations,
exiting jobs and the coordinator's reap."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from gpuos_tools.sched.ledger import Ledger


def test_loads_are_booked_only_within_the_total_across_jobs(tmp_path):
    path = str(tmp_path / "l")
    coord = Ledger(path, None, total=100, jobs=2)
    a, b = Ledger(path, 0), Ledger(path, 1)
    assert a.total == b.total == 100 and a.jobs == 2
    assert a.reserve(60) and not b.reserve(50) and b.reserve(40)
    assert coord.snapshot()["held"] == [60, 40]
    a.uncharge(30)  # a release completed
    assert b.reserve(30) and not b.reserve(1)
    snap = coord.snapshot()
    assert snap["sum"] == 100 and snap["peak"] == 100 and snap["peak_loads"] == 100 and snap["forced_loads"] == 0


def test_allocations_and_forced_loads_may_pass_the_total_and_are_counted(tmp_path):
    path = str(tmp_path / "l")
    coord = Ledger(path, None, total=100, jobs=2)
    a, b = Ledger(path, 0), Ledger(path, 1)
    assert a.reserve(90)
    b.charge(30, "alloc")  # mapped already by the allocator
    snap = coord.snapshot()
    assert snap["sum"] == 120 and snap["peak"] == 120 and snap["peak_loads"] == 90 and snap["alloc_charges"] == 1
    assert not a.reserve(5)
    assert a.reserve(5, force=True)
    b.charge(7, "unreserved")
    snap = coord.snapshot()
    assert snap["forced_loads"] == 2 and snap["forced_over_max"] == 32 and snap["unreserved_maps"] == 1
    assert snap["peak_loads"] == 132 == snap["peak"]


def test_in_flight_exiting_and_reaped(tmp_path):
    path = str(tmp_path / "l")
    coord = Ledger(path, None, total=100, jobs=3)
    a, b = Ledger(path, 0), Ledger(path, 1)
    assert not coord.anything_in_flight()
    a.reserve(50)
    a.set_inflight(20)
    assert b.anything_in_flight() and coord.inflight_of_others(1) == 20 and coord.inflight_of_others(0) == 0
    a.set_inflight(0)
    assert not b.anything_in_flight()
    coord.set_exiting(0)  # its connection closed: its memory goes when its process is reaped
    assert b.anything_in_flight() and coord.inflight_of_others(1) == 0
    coord.zero(0)
    assert not b.anything_in_flight() and coord.snapshot()["held"] == [0, 0, 0]
    with pytest.raises(ValueError):
        Ledger(path, 3)


def _book(path: str, job: int, n: int, q) -> None:
    led = Ledger(path, job)
    got = 0
    for _ in range(n):
        if led.reserve(1):
            got += 1
    q.put(got)


def test_processes_booking_at_once_never_pass_the_total(tmp_path):
    path = str(tmp_path / "l")
    coord = Ledger(path, None, total=1000, jobs=4)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_book, args=(path, j, 400, q)) for j in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
    snap = coord.snapshot()
    assert sum(got) == 1000 == snap["sum"] == snap["peak"], (got, snap)
