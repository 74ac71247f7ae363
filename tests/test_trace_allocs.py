"""AllocTable: replaying alloc/free records and resolving (interior) pointers."""

from __future__ import annotations

import random

from gpuos_tools.model.allocs import Allocation, AllocTable

BASE = 0x7F00_0000_0000


def alloc(id_: int, addr: int, size: int, kind: str = "device") -> dict:
    return {"type": "alloc", "id": id_, "addr": addr, "size": size, "kind": kind}


def free(addr: int, id_: int | None = None) -> dict:
    return {"type": "free", "id": id_, "addr": addr}


def test_resolve_is_half_open_and_finds_interior_pointers() -> None:
    t = AllocTable()
    t.add(alloc(1, BASE, 4096))
    t.add(alloc(2, BASE + 0x10000, 256))
    assert t.resolve(BASE) == (1, 0)
    assert t.resolve(BASE + 100) == (1, 100)
    assert t.resolve(BASE + 4095) == (1, 4095)
    assert t.resolve(BASE + 4096) is None  # one past the end
    assert t.resolve(BASE - 1) is None
    assert t.resolve(BASE + 0x8000) is None  # in the gap
    assert t.resolve(BASE + 0x10000 + 255) == (2, 255)
    assert t.resolve(BASE + 0x10000 + 256) is None
    assert t.resolve(0) is None


def test_totals_follow_allocs_and_frees() -> None:
    t = AllocTable()
    t.add(alloc(1, BASE, 100))
    t.add(alloc(2, BASE + 1000, 300))
    assert (t.live_bytes, t.live_count, t.peak_bytes) == (400, 2, 400)
    freed = t.remove(free(BASE, 1))
    assert freed == Allocation(1, BASE, 100, "device")
    assert (t.live_bytes, t.live_count, t.peak_bytes) == (300, 1, 400)
    assert t.resolve(BASE) is None
    t.add(alloc(3, BASE, 50))
    assert (t.live_bytes, t.live_count, t.peak_bytes) == (350, 2, 400)
    assert t.resolve(BASE + 10) == (3, 10)


def test_unknown_frees_are_counted_and_null_is_not() -> None:
    t = AllocTable()
    t.add(alloc(1, BASE, 100))
    assert t.remove(free(BASE + 8)) is None  # interior address: not an allocation's start
    assert t.remove(free(BASE + 4096)) is None
    assert t.remove(free(0)) is None
    assert t.unknown_frees == 2
    assert t.live_count == 1
    assert t.remove(free(BASE, 1)) is not None
    assert t.remove(free(BASE, 1)) is None  # double free
    assert t.unknown_frees == 3


def test_overlapping_alloc_evicts_stale_entries() -> None:
    t = AllocTable()
    t.add(alloc(1, BASE, 100))
    t.add(alloc(2, BASE + 200, 100))
    t.add(alloc(3, BASE + 400, 100))
    # Covers the tail of 1 and all of 2; 3 is untouched.
    t.add(alloc(4, BASE + 50, 200))
    assert t.evicted == 2
    assert t.live_count == 2
    assert t.live_bytes == 300
    assert t.resolve(BASE + 10) is None  # 1 is gone, 4 starts at +50
    assert t.resolve(BASE + 60) == (4, 10)
    assert t.resolve(BASE + 450) == (3, 50)


def test_same_start_replaces() -> None:
    t = AllocTable()
    t.add(alloc(1, BASE, 100))
    t.add(alloc(2, BASE, 64))  # the free of 1 was not traced
    assert t.evicted == 1
    assert (t.live_count, t.live_bytes) == (1, 64)
    assert t.resolve(BASE + 63) == (2, 63)
    assert t.resolve(BASE + 64) is None


def test_zero_size_alloc_inside_a_live_range_evicts_it() -> None:
    t = AllocTable()
    t.add(alloc(1, BASE, 100))
    t.add(alloc(2, BASE + 50, 0))
    assert t.evicted == 1
    assert t.resolve(BASE + 10) is None
    assert t.resolve(BASE + 50) is None


def test_feed_dispatches_on_type() -> None:
    t = AllocTable()
    t.feed(alloc(1, BASE, 100))
    t.feed({"type": "launch", "addr": BASE + 1000, "size": 5})
    t.feed({"type": "memcpy", "dst": BASE, "bytes": 100})
    assert t.live_count == 1
    t.feed(free(BASE, 1))
    assert t.live_count == 0
    assert t.unknown_frees == 0


def test_hull_covers_every_allocation_seen() -> None:
    t = AllocTable()
    assert t.hull is None
    t.add(alloc(1, BASE + 1000, 10))
    t.add(alloc(2, BASE, 10))
    t.add(alloc(3, BASE + 5000, 100))
    t.remove(free(BASE + 5000, 3))
    assert t.hull == (BASE, BASE + 5100)  # freed allocations still count


def test_matches_brute_force_on_random_replay() -> None:
    rng = random.Random(1234)
    t = AllocTable()
    live: dict[int, tuple[int, int]] = {}  # addr -> (id, size)
    slots = [BASE + i * 0x10000 for i in range(500)]  # non-overlapping candidate ranges
    for step in range(5000):
        addr = rng.choice(slots)
        if addr in live:
            assert t.remove(free(addr)) == Allocation(live[addr][0], addr, live[addr][1], "device")
            del live[addr]
        else:
            size = rng.randrange(1, 0x10000)
            t.add(alloc(step, addr, size))
            live[addr] = (step, size)
        probe = rng.randrange(BASE - 0x1000, BASE + 501 * 0x10000)
        expected = next(((i, probe - a) for a, (i, s) in live.items() if a <= probe < a + s), None)
        assert t.resolve(probe) == expected
    assert t.live_count == len(live)
    assert t.live_bytes == sum(s for _, s in live.values())
    assert t.unknown_frees == 0
    assert t.evicted == 0
