"""The UM baseline's pieces on the CPU (gpuos_tools/memory/managed.py): the software budget's LRU
bookkeeping, and the managed allocator's C library (csrc/gpuos_um.c) on the stand-in driver
(tests/fake_libcuda.c): size classes, per-stream reuse, the log of blocks handed out, the
limit against the GPU's free memory, the eviction call."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.memory import managed
from gpuos_tools import cbuild
from gpuos_tools.memory.managed import ManagedLRU

FAKE = Path(__file__).resolve().parent / "fake_libcuda.c"
MIB = 1 << 20
HAVE_CC = bool(shutil.which("cc") or shutil.which("gcc"))


# ---------------------------------------------------------------- ManagedLRU

def lru_with(fraction: float | None, sizes: dict[int, int], budget: int | None = None) -> ManagedLRU:
    lru = ManagedLRU(fraction, budget)
    for b, s in sizes.items():
        lru.add(b, s)
    return lru


def test_fraction_or_budget_and_a_sane_fraction():
    with pytest.raises(ValueError):
        ManagedLRU()
    with pytest.raises(ValueError):
        ManagedLRU(0.5, 100)
    with pytest.raises(ValueError):
        ManagedLRU(1.5)
    with pytest.raises(ValueError):
        ManagedLRU(0.0)


def test_budget_is_a_share_of_every_block_seen_so_far():
    lru = lru_with(0.5, {1: 100, 2: 300})
    assert lru.total == 400 and lru.budget() == 200
    lru.add(2, 300)  # handed out again (the cache): nothing changes
    assert lru.total == 400
    lru.add(3, 600)
    assert lru.budget() == 500
    with pytest.raises(managed.ManagedError):
        lru.add(3, 700)
    assert ManagedLRU(budget=123).budget() == 123


def test_least_recently_used_blocks_go_first_and_never_the_operations_own():
    lru = lru_with(None, {1: 10, 2: 10, 3: 10, 4: 10}, budget=30)
    assert lru.touch([1]) == [] and lru.touch([2]) == [] and lru.touch([3]) == []
    assert list(lru.resident) == [1, 2, 3] and lru.resident_bytes == 30
    assert lru.touch([1]) == []  # resident: only more recently used
    assert list(lru.resident) == [2, 3, 1]
    # 4 needs room: 2 is the least recently used
    assert lru.touch([4, 3]) == [(2, 10)]
    assert list(lru.resident) == [1, 4, 3] and lru.resident_bytes == 30
    assert lru.evicted == {2}
    # 2 comes back (faulted in); 1 is the LRU, 4 and 3 are next
    assert lru.touch([2, 1]) == [(4, 10)]
    c = lru.counts
    assert c["evictions"] == 2 and c["evicted_bytes"] == 20
    assert c["faulted_in"] == 1 and c["faulted_bytes"] == 10 and lru.evicted == {4}
    assert c["peak_resident"] == 30 and c["over_budget"] == 0


def test_as_many_victims_as_the_need_and_in_order():
    lru = lru_with(None, {1: 10, 2: 10, 3: 10, 4: 25}, budget=35)
    for b in (1, 2, 3):
        lru.touch([b])
    assert lru.touch([4]) == [(1, 10), (2, 10)]  # 30 + 25 > 35: two go, 15 + 25 <= 35... 3 stays
    assert list(lru.resident) == [3, 4] and lru.resident_bytes == 35


def test_an_operation_bigger_than_the_budget_runs_over_it_alone():
    lru = lru_with(None, {1: 10, 2: 20, 3: 20}, budget=30)
    lru.touch([1])
    assert lru.touch([2, 3]) == [(1, 10)]
    assert lru.resident_bytes == 40 and lru.counts["over_budget"] == 1 and lru.counts["peak_resident"] == 40


def test_unknown_bases_are_ignored_and_duplicates_count_once():
    lru = lru_with(None, {1: 10}, budget=10)
    assert lru.touch([1, 1, 99, 0]) == []
    assert lru.resident_bytes == 10 and list(lru.resident) == [1]


def test_fraction_one_never_evicts():
    lru = ManagedLRU(1.0)
    for i in range(1, 50):
        lru.add(i, i * 7)
        assert lru.touch([i, i // 2]) == []
    assert lru.counts["evictions"] == 0 and lru.resident_bytes == lru.total


def test_growth_under_a_fraction_evicts_as_the_blocks_come():
    lru = ManagedLRU(0.5)
    out = []
    for i in range(1, 9):  # eight blocks of 10, each used once when made (a model's weights)
        lru.add(i, 10)
        out += lru.touch([i])
    assert lru.resident_bytes <= lru.budget() == 40
    assert [b for b, _ in out] == [1, 2, 3, 4]


# ---------------------------------------------------------------- the C library

@pytest.fixture
def um(tmp_path):
    """(ManagedLibrary, fake libcuda) with private copies of both, loaded fresh."""
    if not HAVE_CC:
        pytest.skip("no C compiler")
    lib_path = managed.build(tmp_path / "cache")
    fake_path = cbuild.build_library(tmp_path / "cache", source=FAKE, stem="libfakecuda", libs=("-lpthread",))
    mine, fake = tmp_path / "libum.so", tmp_path / "libfake.so"
    shutil.copy(lib_path, mine)
    shutil.copy(fake_path, fake)
    fake_lib = ctypes.CDLL(str(fake))
    fake_lib.fake_set_free.argtypes = [ctypes.c_uint64]
    lib = managed.ManagedLibrary(mine, libcuda=str(fake), reserve=64 * MIB, refuse_exit=0)

    def counters() -> dict[str, int]:
        out = (ctypes.c_int64 * 7)()
        fake_lib.fake_managed_counters(out)
        return dict(zip(("allocs", "bytes", "prefetches", "ptr", "size", "loc", "stream"), out))

    return lib, fake_lib, counters


def test_build_is_cached_and_exports_the_torch_entry_points(tmp_path):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    first = managed.build(tmp_path)
    assert managed.build(tmp_path) == first and first.name.startswith("libgpuos_um-")
    lib = ctypes.CDLL(str(first))
    for name in ("gpuos_um_malloc", "gpuos_um_free", "gpuos_um_evict", "gpuos_um_stats", "gpuos_um_nlog"):
        assert getattr(lib, name)


def test_init_says_when_libcuda_is_missing(tmp_path):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    path = tmp_path / "l.so"
    shutil.copy(managed.build(tmp_path), path)
    with pytest.raises(managed.ManagedError, match="cannot load"):
        managed.ManagedLibrary(path, libcuda=str(tmp_path / "nope.so"))


def test_sizes_round_to_the_owned_caches_classes(um):
    lib, _, _ = um
    assert lib.round(1) == 512 and lib.round(513) == 1024 and lib.round(MIB) == MIB
    assert lib.round(MIB + 1) == 2 * MIB
    assert lib.round(5 * MIB) == 6 * MIB  # quarter steps of 4 MiB, then the 2 MiB granule
    assert lib.round(33 * MIB) == 40 * MIB


def test_both_caches_round_every_size_alike(um, tmp_path):
    """One header (agent/include/gpuos_sizeclass.h) for both: a comparison moves the same bytes."""
    from gpuos_tools.memory import owned

    lib, _, _ = um
    path = tmp_path / "alloc.so"
    shutil.copy(owned.build(tmp_path / "cache"), path)
    alloc = ctypes.CDLL(str(path))
    alloc.gpuos_torch_round.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    alloc.gpuos_torch_round.restype = ctypes.c_size_t
    sizes = [1, 511, 512, 513, 4095, 65537, MIB - 1, MIB, MIB + 1, 3 * MIB + 7, 255 * MIB, (1 << 34) + 3]
    sizes += [int(1.37 ** k) for k in range(1, 90)]
    for n in sizes:
        assert lib.round(n) == alloc.gpuos_torch_round(n, 2 * MIB), n


def test_blocks_are_managed_allocations_cached_per_size_and_stream_and_logged(um):
    lib, _, counters = um
    a = lib.malloc(3 * MIB, stream=7)
    b = lib.malloc(100, stream=7)
    assert a and b and counters()["allocs"] == 2 and counters()["bytes"] == 4 * MIB + 512
    assert lib.drain() == [(a, 4 * MIB), (b, 512)] and lib.drain() == []
    lib.free(a, 3 * MIB, stream=7)
    assert lib.malloc(4 * MIB - 5, stream=9) != a  # another stream: not reused
    assert lib.malloc(3 * MIB + 1, stream=7) == a  # same class, same stream: the same block
    assert counters()["allocs"] == 3
    log = lib.drain()
    assert log[-1] == (a, 4 * MIB) and len(log) == 2  # a hit is logged too
    st = lib.stats()
    assert st["blocks"] == 3 and st["cache_hits"] == 1 and st["cache_misses"] == 3
    assert st["managed_bytes"] == 8 * MIB + 512 and st["cached_bytes"] == 0


def test_the_limit_is_the_free_memory_at_the_first_allocation_less_the_reserve(um):
    lib, fake, counters = um
    fake.fake_set_free(200 * MIB)  # limit: 136 MiB
    assert lib.malloc(100 * MIB)  # a 112 MiB block
    fake.fake_set_free(10 << 30)  # read once: later changes do not move the limit
    assert lib.malloc(40 * MIB) == 0
    st = lib.stats()
    assert st["refused"] == 1 and st["refused_bytes"] == 40 * MIB and st["limit"] == 136 * MIB
    assert counters()["allocs"] == 1 and st["managed_bytes"] == 112 * MIB
    assert lib.malloc(30 * MIB) == 0  # a 32 MiB block: 144 MiB
    assert lib.malloc(20 * MIB)  # 132 MiB: what fits is still given


def test_a_refusal_with_an_exit_status_ends_the_process_saying_why(tmp_path):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    fake_path = cbuild.build_library(tmp_path / "cache", source=FAKE, stem="libfakecuda", libs=("-lpthread",))
    lib_path = managed.build(tmp_path / "cache")
    code = (
        "import ctypes, sys\n"
        "from gpuos_tools.memory import managed\n"
        f"fake = ctypes.CDLL({str(fake_path)!r}); fake.fake_set_free.argtypes = [ctypes.c_uint64]\n"
        "fake.fake_set_free(1 << 30)\n"
        f"lib = managed.ManagedLibrary({str(lib_path)!r}, libcuda={str(fake_path)!r}, reserve=1 << 29)\n"
        "assert lib.malloc(1 << 28)\n"
        "lib.malloc(300 << 20)\n"
        "print('not reached')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert p.returncode == 81, (p.returncode, p.stderr)
    assert "refusing" in p.stderr and "not reached" not in p.stdout


def test_evict_prefetches_the_range_to_the_host_on_the_stream(um):
    lib, _, counters = um
    a = lib.malloc(5 * MIB)
    lib.evict(a, 6 * MIB, 0x1234)
    c = counters()
    assert c["prefetches"] == 1 and (c["ptr"], c["size"], c["loc"], c["stream"]) == (a, 6 * MIB, 2, 0x1234)


def test_session_counts_are_counters_and_the_summary_adds_the_blocks_handed_out_last(um):
    lib, _, _ = um
    session = managed.Session(lib, ManagedLRU(0.5))
    a = lib.malloc(3 * MIB)
    for base, size in lib.drain():
        session.lru.add(base, size)
    session.lru.touch([a])
    c0 = session.counts()
    assert set(c0) == {*managed.COUNTERS, "hook_s"}  # differences of two make sense for all of them
    lib.malloc(1000)  # after the last operation: the summary still counts it
    s = session.summary()
    assert s["total"] == 4 * MIB + 1024 == s["allocator"]["managed_bytes"]
    assert s["budget"] == s["total"] // 2 and s["peak_resident"] == 4 * MIB and s["fraction"] == 0.5
