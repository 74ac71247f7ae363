"""The owned allocator's C library (gpuos_alloc.c) on a stand-in driver (tests/fake_libcuda.c):
its table, size classes, residency transitions, thread safety, build caching, the option."""

from __future__ import annotations

import ctypes
import random
import shutil
import threading
from pathlib import Path

import pytest

from gpuos_tools.memory import owned

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

FAKE = Path(__file__).resolve().parent / "fake_libcuda.c"
G = 2 << 20


@pytest.fixture
def env(tmp_path):
    """(OwnedLibrary, counters()) with private copies of both libraries, so that each test
    starts from empty tables (the state of a shared object is per load)."""
    from gpuos_tools import cbuild

    lib_path = owned.build(tmp_path / "cache")
    fake_path = cbuild.build_library(tmp_path / "cache", source=FAKE, stem="libfakecuda", libs=("-lpthread",))
    mine, fake = tmp_path / "liballoc.so", tmp_path / "libfake.so"
    shutil.copy(lib_path, mine)
    shutil.copy(fake_path, fake)
    fake_lib = ctypes.CDLL(str(fake))
    lib = owned.OwnedLibrary(mine, libcuda=str(fake))

    def counters() -> dict[str, int]:
        out = (ctypes.c_int64 * 4)()
        fake_lib.fake_counters(out)
        return dict(zip(("handles", "mapped", "reserved", "syncs"), out))

    counters.limit = lambda n: fake_lib.fake_set_physical_limit(ctypes.c_int64(n))  # type: ignore[attr-defined]
    counters.fake = fake_lib  # type: ignore[attr-defined]
    return lib, counters


def test_build_is_cached_per_source_version(tmp_path):
    first = owned.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert owned.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert first.name.startswith("libgpuos_alloc-")
    lib = ctypes.CDLL(str(first))
    for name in ("gpuos_cupy_malloc", "gpuos_cupy_free", "gpuos_torch_malloc", "gpuos_torch_free",
                 "gpuos_alloc_release", "gpuos_alloc_make_resident", "gpuos_alloc_table"):
        assert getattr(lib, name)


def test_init_says_when_libcuda_is_missing(tmp_path):
    path = tmp_path / "l.so"
    shutil.copy(owned.build(tmp_path), path)
    with pytest.raises(owned.OwnedError, match="cannot load"):
        owned.OwnedLibrary(path, libcuda=str(tmp_path / "nope.so"))


def test_large_buffers_get_ranges_of_their_own_rounded_to_the_granule(env):
    lib, counters = env
    a = lib.malloc(3 * G + 1)
    b = lib.malloc(G)
    assert a and b and a % G == 0 and b % G == 0
    t = {r.base: r for r in lib.table()}
    assert t[a].size == 4 * G and t[a].requested == 3 * G + 1 and t[a].resident and not t[a].small
    assert t[b].size == G
    assert counters()["mapped"] == 5 * G and counters()["handles"] == 2
    lib.free(a)
    assert lib.lookup(a) is None and counters()["mapped"] == G and counters()["reserved"] == G
    assert counters()["syncs"] >= 1  # like cudaFree: the device is waited for before unmapping
    lib.free(b)
    assert counters() == dict(counters(), handles=0, mapped=0, reserved=0)
    with pytest.raises(owned.OwnedError):
        lib.free(b)


def test_small_requests_share_segments_by_size_class(env):
    lib, counters = env
    ptrs = [lib.malloc(700) for _ in range(10)]  # class 1 KiB
    segs = {lib.lookup(p).base for p in ptrs}
    assert len(segs) == 1
    seg = lib.lookup(ptrs[0])
    assert seg.small and seg.block == 1024 and seg.live == 10 and seg.requested == 10 * 1024
    assert sorted(p - seg.base for p in ptrs) == [i * 1024 for i in range(10)]
    other = lib.malloc(512)
    assert lib.lookup(other).base != seg.base  # another class, another segment
    for p in ptrs:
        lib.free(p)
    assert lib.lookup(ptrs[0]).live == 0  # the empty segment stays, cached
    with pytest.raises(owned.OwnedError):
        lib.free(ptrs[0])  # not live any more
    with pytest.raises(owned.OwnedError):
        lib.free(seg.base + 100)  # not a block's start
    assert lib.trim() == 1
    assert lib.lookup(ptrs[0]) is None and counters()["handles"] == 1
    # a full segment spills into a new one
    big = [lib.malloc(1 << 20) for _ in range(3)]
    assert len({lib.lookup(p).base for p in big}) == 2


def test_release_keeps_the_range_and_make_resident_maps_it_at_the_same_address(env):
    lib, counters = env
    a = lib.malloc(5 * G + 1)
    small = lib.malloc(4096)
    seg = lib.lookup(small).base
    before = counters()
    lib.release(a + 12345)  # any address inside the record
    r = lib.lookup(a)
    assert not r.resident and r.handle == 0 and r.base == a and r.size == 6 * G
    assert counters()["mapped"] == before["mapped"] - 6 * G and counters()["reserved"] == before["reserved"]
    with pytest.raises(owned.OwnedError, match="already"):
        lib.release(a)
    lib.release(seg)
    assert counters()["handles"] == 0 and counters()["mapped"] == 0
    # no small block is handed out from a released segment
    other = lib.malloc(4096)
    assert lib.lookup(other).base != seg
    lib.make_resident(a)
    lib.make_resident(small)
    assert lib.lookup(a).resident and lib.lookup(a).base == a and lib.lookup(a).handle
    assert lib.lookup(small).live == 1
    with pytest.raises(owned.OwnedError, match="already"):
        lib.make_resident(a)
    with pytest.raises(owned.OwnedError, match="not an owned"):
        lib.release(0x1000)
    s = lib.stats()
    assert s["releases"] == 2 and s["make_residents"] == 2 and s["driver_errors"] == 0
    # a released buffer can be freed: its range goes back, nothing is unmapped twice
    lib.release(a)
    lib.free(a)
    assert lib.lookup(a) is None and lib.stats()["driver_errors"] == 0


def test_make_resident_fails_cleanly_without_physical_memory(env):
    lib, counters = env
    a = lib.malloc(4 * G)
    lib.release(a)
    counters.limit(2 * G)
    with pytest.raises(owned.OwnedError, match="CUDA error 2"):
        lib.make_resident(a)
    assert not lib.lookup(a).resident
    assert lib.malloc(3 * G) == 0  # out of memory: 0, for CuPy's pool to free and retry
    counters.limit(-1)
    lib.make_resident(a)
    assert lib.lookup(a).resident


def test_concurrent_mallocs_frees_and_residency_keep_the_table_sound(env):
    lib, counters = env
    errors: list[str] = []
    keep = [lib.malloc(G * (i + 1)) for i in range(4)]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            for _ in range(400):
                if mine and rng.random() < 0.45:
                    lib.free(mine.pop(rng.randrange(len(mine))))
                else:
                    p = lib.malloc(rng.choice([512, 3000, 70000, 1 << 20, G + 1, 3 * G]))
                    assert p, "malloc failed"
                    mine.append(p)
            for p in mine:
                lib.free(p)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    def flipper() -> None:
        for _ in range(200):
            for p in keep:
                try:
                    lib.release(p)
                    lib.make_resident(p)
                except owned.OwnedError as e:
                    errors.append(str(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)] + [threading.Thread(target=flipper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    table = lib.table()
    for r, nxt in zip(table, table[1:]):
        assert r.base + r.size <= nxt.base
    assert all(r.resident for r in table)
    lib.trim()
    assert sorted(r.base for r in lib.table()) == sorted(keep)
    assert counters()["handles"] == 4 and lib.stats()["driver_errors"] == 0


def test_option_parsing():
    assert owned.parse_option(None) is None
    assert owned.parse_option("0") is None and owned.parse_option("") is None
    assert owned.parse_option("1") == ("cupy", "torch") and owned.parse_option(" CuPy ") == ("cupy",)
    assert owned.parse_option("torch") == ("torch",) and owned.parse_option("torch,cupy") == ("cupy", "torch")
    with pytest.raises(ValueError, match="GPUOS_AGENT_OWN"):
        owned.parse_option("jax")
    assert owned.boot(None) is None and owned.boot(()) is None  # nothing asked: nothing owned


def test_record_layout_matches_the_c_struct(env):
    lib, _ = env
    assert lib.lib.gpuos_alloc_record_size() == ctypes.sizeof(owned.RECORD) == 48


# -- the PyTorch cache (gpuos_torch_malloc / gpuos_torch_free) -----------------------------------

S1, S2 = 0x1000, 0x2000  # two streams (opaque pointers to the library)


def events(counters) -> dict[str, int]:
    out = (ctypes.c_int64 * 3)()
    counters.fake.fake_event_counters(out)
    return dict(zip(("live", "records", "queries"), out))


def test_torch_size_classes_bound_the_rounding(env):
    lib, _ = env
    assert [lib.torch_round(n) for n in (1, 512, 513, 4096, 700_000, 1 << 20)] == [512, 512, 1024, 4096, 1 << 20, 1 << 20]
    assert lib.torch_round((1 << 20) + 1) == G
    assert lib.torch_round(5 * G + 1) == 6 * G  # quarter of 8 MiB = 2 MiB steps
    for n in (3 << 20, 17 << 20, 100_000_000, 3_000_000_000, (1 << 30) + 1):
        r = lib.torch_round(n)
        assert r >= n and r % G == 0 and r <= max(1.25 * n, n + G), (n, r)


def test_torch_free_caches_and_same_stream_reuse_needs_no_driver_call(env):
    lib, counters = env
    a = lib.torch_malloc(10 * G, 0, S1)
    b = lib.torch_malloc(3000, 0, S1)
    assert a and b and lib.lookup(a).size == 10 * G and lib.lookup(b).block == 4096
    before = counters()
    lib.torch_free(a, 10 * G, 0, S1)
    lib.torch_free(b, 3000, 0, S1)
    assert counters() == before  # no unmap, no synchronisation: the blocks wait in the cache
    st = lib.torch_stats()
    assert st["cached_bytes"] == 10 * G + 4096 and st["cached_blocks"] == 2
    assert lib.torch_malloc(9 * G + 5, 0, S1) == a  # same class (10 * G), same stream: at once
    assert lib.torch_malloc(2100, 0, S1) == b
    assert counters() == before and events(counters)["records"] == 0
    st = lib.torch_stats()
    assert st["hits"] == 2 and st["misses"] == 2 and st["cached_blocks"] == 0
    # another class is not served from a cached block, however large
    lib.torch_free(a, 10 * G, 0, S1)
    c = lib.torch_malloc(G, 0, S1)
    assert c != a and lib.torch_stats()["misses"] == 3


def test_torch_cache_hands_out_the_lowest_address_so_a_repeated_step_gets_the_same_blocks(env):
    """A training step allocates its tensors in the same order every step but frees them in
    another order; with the newest block first, which tensor got which block changed from step
    to step (gpu-prefetch-sched then learns no period). Lowest address first: the same."""
    lib, _ = env
    rnd = random.Random(3)
    sizes = [3 * G, 3 * G, 3000, 3 * G, 5 * G, 3000, 3 * G]

    def step() -> list[int]:
        ptrs = [lib.torch_malloc(n, 0, S1) for n in sizes]
        for i in rnd.sample(range(len(sizes)), len(sizes)):  # freed in a new order each step
            lib.torch_free(ptrs[i], sizes[i], 0, S1)
        return ptrs

    first = step()
    assert len(set(first)) == len(sizes) and all(first)
    for _ in range(5):
        assert step() == first
    # the lowest address of the class, whichever was freed last
    big = sorted(p for p, n in zip(first, sizes) if n == 3 * G)
    assert lib.torch_malloc(3 * G, 0, S1) == big[0]


def test_torch_cross_stream_reuse_waits_for_an_event_after_the_free(env):
    lib, counters = env
    a = lib.torch_malloc(4 * G, 0, S1)
    lib.torch_free(a, 4 * G, 0, S1)
    # S2 may not take it while S1's work (up to the free) may still run: an event is recorded
    # on S1 now, and it has not completed
    b = lib.torch_malloc(4 * G, 0, S2)
    assert b and b != a
    ev = events(counters)
    assert ev["records"] == 1 and ev["live"] == 1
    assert lib.torch_malloc(4 * G, 0, S2) not in (0, a)  # still not complete: not taken
    assert events(counters)["records"] == 1  # recorded once, queried again
    counters.fake.fake_stream_done(ctypes.c_void_p(S1))
    assert lib.torch_malloc(4 * G, 0, S2) == a
    st = lib.torch_stats()
    assert st["cross_stream_hits"] == 1 and st["events"] == 1 and st["cached_blocks"] == 0
    # the event is kept for the next block that needs one
    lib.torch_free(a, 4 * G, 0, S2)
    lib.torch_malloc(4 * G, 0, S1)
    assert events(counters)["live"] == 1 and events(counters)["records"] == 2


def test_torch_trim_synchronises_once_and_gives_everything_back(env):
    lib, counters = env
    ptrs = [(lib.torch_malloc(n, 0, S1), n) for n in (700, 700, 5000, 3 * G, 7 * G, 7 * G)]
    for p, n in ptrs:
        lib.torch_free(p, n, 0, S1)
    syncs = counters()["syncs"]
    assert counters()["handles"] == 5  # two small segments, three large ranges
    assert lib.torch_trim() == 6
    assert counters()["syncs"] == syncs + 1 + 2  # once for all; the empty segments once each (as before)
    assert counters() == dict(counters(), handles=0, mapped=0, reserved=0)
    assert lib.table() == [] and lib.torch_stats()["cached_bytes"] == 0
    assert lib.torch_trim() == 0


def test_torch_malloc_out_of_memory_trims_the_cache_and_retries(env):
    lib, counters = env
    a = lib.torch_malloc(6 * G, 0, S1)
    lib.torch_free(a, 6 * G, 0, S1)
    counters.limit(8 * G)
    b = lib.torch_malloc(4 * G, 0, S1)  # 6 G cached + 4 G > 8 G: the cache goes back first
    assert b and lib.lookup(a) is None
    assert lib.torch_stats()["oom_retries"] == 1
    assert lib.torch_malloc(6 * G, 0, S1) == 0  # really out of memory: NULL (torch raises OOM)
    counters.limit(-1)


def test_cached_torch_blocks_are_records_residency_acts_on(env):
    lib, counters = env
    a = lib.torch_malloc(3 * G, 0, S1)
    lib.torch_free(a, 3 * G, 0, S1)
    lib.release(a)  # a suspend releases cached blocks too
    assert not lib.lookup(a).resident and counters()["mapped"] == 0
    lib.make_resident(a)
    assert lib.torch_malloc(3 * G, 0, S1) == a and lib.lookup(a).resident


def test_a_record_is_dead_only_while_every_block_of_it_is_in_torchs_cache(env):
    lib, _ = env
    big = lib.torch_malloc(3 * G, 0, S1)
    assert not lib.torch_dead(big)  # a live tensor
    lib.torch_free(big, 3 * G, 0, S1)
    assert lib.torch_dead(big)
    assert lib.torch_malloc(3 * G, 0, S1) == big and not lib.torch_dead(big)  # handed out again
    # a segment of 4 KiB blocks: dead once the last of its blocks is freed, whichever stream
    a, b = lib.torch_malloc(3000, 0, S1), lib.torch_malloc(4000, 0, S2)
    seg = lib.lookup(a).base
    assert lib.lookup(b).base == seg and not lib.torch_dead(seg)
    lib.torch_free(a, 3000, 0, S1)
    assert not lib.torch_dead(seg)
    lib.torch_free(b, 4000, 0, S2)
    assert lib.torch_dead(seg)
    c = lib.torch_malloc(4096, 0, S1)  # one block handed out again: live
    assert lib.lookup(c).base == seg and not lib.torch_dead(seg)
    # another record's cached block of the same class does not count for this one
    e, f = lib.torch_malloc(3 * G, 0, S1), lib.torch_malloc(3 * G, 0, S1)
    lib.torch_free(e, 3 * G, 0, S1)
    assert lib.torch_dead(e) and not lib.torch_dead(f)
    # CuPy's pool and direct callers keep their free blocks out of sight: never dead; nor an
    # address no record starts at
    d = lib.malloc(5 * G)
    assert not lib.torch_dead(d) and not lib.torch_dead(d + 4096) and not lib.torch_dead(0x1234)
    lib.torch_free(big, 3 * G, 0, S1)
    lib.release(big)  # a released record's blocks stay torch's to hand out
    assert lib.torch_dead(big)


def test_concurrent_torch_traffic_on_several_streams_keeps_the_cache_sound(env):
    lib, counters = env
    errors: list[str] = []
    live: set[int] = set()
    guard = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        stream = [S1, S2][seed % 2]
        mine: list[tuple[int, int]] = []
        try:
            for _ in range(500):
                if mine and rng.random() < 0.5:
                    p, n = mine.pop(rng.randrange(len(mine)))
                    with guard:
                        live.discard(p)
                    lib.torch_free(p, n, 0, stream)
                else:
                    n = rng.choice([100, 4000, 70000, 1 << 20, G + 1, 3 * G])
                    p = lib.torch_malloc(n, 0, stream)
                    assert p, "malloc failed"
                    with guard:
                        assert p not in live, f"{p:#x} handed out twice"
                        live.add(p)
                    mine.append((p, n))
                if rng.random() < 0.05:
                    counters.fake.fake_stream_done(ctypes.c_void_p(stream))
            for p, n in mine:
                with guard:
                    live.discard(p)
                lib.torch_free(p, n, 0, stream)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    st = lib.torch_stats()
    assert st["hits"] > 0 and st["misses"] > 0 and st["events"] > 0
    assert lib.torch_trim() == st["cached_blocks"]
    assert counters() == dict(counters(), handles=0, mapped=0, reserved=0)
    assert events(counters)["live"] == 0 and lib.stats()["driver_errors"] == 0


FAKE_TORCH = """
import types
calls = []
_C = types.SimpleNamespace(_cuda_customAllocator=object())
class CUDAPluggableAllocator:
    def __init__(self, path, alloc, free):
        calls.append(("allocator", path, alloc, free))
def change_current_allocator(a):
    calls.append(("change", type(a).__name__))
def empty_cache():
    calls.append(("empty_cache",))
memory = types.SimpleNamespace(CUDAPluggableAllocator=CUDAPluggableAllocator,
                               change_current_allocator=change_current_allocator, empty_cache=empty_cache)
cuda = types.SimpleNamespace(memory=memory, empty_cache=empty_cache, is_initialized=lambda: True)
"""


def test_torch_is_owned_when_imported_after_boot(env, tmp_path, monkeypatch):
    """GPUOS_AGENT_OWN=torch before torch is imported: an import hook installs the allocator
    as `import torch` finishes; empty_cache then trims the library's cache."""
    import sys

    lib, _ = env
    pkg = tmp_path / "site" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_TORCH)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(owned, "_library", lib)
    monkeypatch.setattr(owned, "_torch_allocator", None)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    assert owned.boot(owned.parse_option("torch")) == ("torch",)
    assert "torch" not in sys.modules  # nothing imported for a program that may never use it
    import torch

    try:
        assert torch.calls == [("allocator", lib.path, "gpuos_torch_malloc", "gpuos_torch_free"),
                               ("change", "CUDAPluggableAllocator")]
        assert not any(isinstance(f, owned._TorchImportHook) for f in sys.meta_path)  # done, gone
        a = lib.torch_malloc(3 * G)
        lib.torch_free(a, 3 * G)
        assert lib.torch_stats()["cached_blocks"] == 1
        torch.cuda.empty_cache()
        assert lib.torch_stats()["cached_blocks"] == 0 and lib.lookup(a) is None
        assert torch.calls[-1] == ("empty_cache",)  # torch's own still runs
        assert owned.torch_allocator() is not None and owned.watch_torch() == "now"
    finally:
        sys.modules.pop("torch", None)


def test_parking_is_off_by_default_release_gives_physical_memory_back(env):
    lib, counters = env
    a = lib.malloc(4 * G)
    lib.release(a)
    assert counters()["handles"] == 0
    assert lib.park_stats()["parks"] == 0 and lib.park_stats()["park_limit"] == 0


def test_parked_memory_is_mapped_again_for_a_record_of_the_same_size(env):
    lib, counters = env
    a, b, c = lib.malloc(4 * G), lib.malloc(4 * G), lib.malloc(2 * G)
    assert lib.set_park_limit(6 * G) == 0
    lib.release(a)
    # unmapped, still held: the fake driver counts the handle live and the bytes unmapped
    assert counters()["handles"] == 3 and counters()["mapped"] == 6 * G
    assert lib.parked(4 * G) == 4 * G and lib.parked(2 * G) == 0
    assert lib.stats()["mapped_bytes"] == 6 * G
    lib.release(b)  # 8 GiB would pass the limit: released
    assert counters()["handles"] == 2 and lib.park_stats()["parked_bytes"] == 4 * G == lib.parked_bytes()
    creates = lib.park_stats()["physical_creates"]
    lib.make_resident(b)  # same size: a's old memory, no new physical allocation
    st = lib.park_stats()
    assert st["park_reuses"] == 1 and st["physical_creates"] == creates and st["parked_bytes"] == 0 == lib.parked_bytes()
    assert counters()["handles"] == 2 and lib.lookup(b).resident  # b on a's old memory, and c
    lib.release(c)
    lib.make_resident(a)  # no parked 4 GiB allocation (c's is 2 GiB): a new one
    assert lib.park_stats()["physical_creates"] == creates + 1 and lib.parked(2 * G) == 2 * G
    assert counters()["handles"] == 3  # a, b, and c's parked one
    assert lib.trim_parked(0) == 0 and counters()["handles"] == 2
    assert lib.park_stats()["parked_released"] == 1 and lib.stats()["driver_errors"] == 0


def test_lowering_the_park_limit_releases_the_oldest_parked_memory(env):
    lib, counters = env
    bufs = [lib.malloc(2 * G) for _ in range(3)]
    lib.set_park_limit(6 * G)
    for p in bufs:
        lib.release(p)
    assert counters()["handles"] == 3 and lib.park_stats()["parked_bytes"] == 6 * G
    assert lib.set_park_limit(2 * G) == 2 * G and counters()["handles"] == 1
    assert lib.set_park_limit(0) == 0 and counters()["handles"] == 0
    lib.release(lib.malloc(2 * G))  # off again: released at once
    assert counters()["handles"] == 0


def test_out_of_physical_memory_releases_parked_memory_and_retries(env):
    lib, counters = env
    a, b = lib.malloc(2 * G), lib.malloc(2 * G)
    lib.set_park_limit(8 * G)
    lib.release(a)
    lib.release(b)
    counters.limit(4 * G)  # all of it parked: only releasing parked memory makes room
    c = lib.malloc(4 * G)  # no parked 4 GiB allocation to map: a new one, after the parked go
    assert c and lib.park_stats()["parked_bytes"] == 0 and counters()["handles"] == 1
    with pytest.raises(owned.OwnedError, match="CUDA error 2"):
        lib.make_resident(a)  # nothing parked is left, and the limit is full
    counters.limit(-1)


def test_concurrent_residency_with_parking_keeps_handles_and_mappings_sound(env):
    lib, counters = env
    lib.set_park_limit(6 * G)
    keep = [lib.malloc(G * (1 + i % 3)) for i in range(9)]
    errors: list[str] = []

    def flipper(mine: list[int]) -> None:
        for _ in range(150):
            for p in mine:
                try:
                    lib.release(p)
                    lib.make_resident(p)
                except owned.OwnedError as e:
                    errors.append(str(e))

    threads = [threading.Thread(target=flipper, args=(keep[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert all(r.resident for r in lib.table()) and lib.stats()["driver_errors"] == 0
    st = lib.park_stats()
    assert st["park_reuses"] > 0 and st["parked_bytes"] <= 6 * G
    lib.trim_parked(0)
    assert counters()["handles"] == 9 and counters()["mapped"] == sum(lib.lookup(p).size for p in keep)


def test_parked_bytes_is_park_stats_first_field(env):
    lib, _ = env
    a = lib.malloc(2 * G)
    lib.set_park_limit(4 * G)
    assert lib.parked_bytes() == 0
    lib.release(a)
    assert lib.parked_bytes() == lib.park_stats()["parked_bytes"] == 2 * G


def test_torch_memory_statistics_follow_live_and_held_blocks(env):
    """What torch.cuda.memory_allocated and the like read (a pluggable allocator answers none of
    them): live blocks at their class, blocks held from the driver, peaks, and a reset."""
    lib, _ = env
    a = lib.torch_malloc(10 * G, 0, S1)
    b = lib.torch_malloc(3000, 0, S1)
    m = lib.torch_memory(0)
    assert m["allocated"] == m["reserved"] == 10 * G + 4096 and m["allocs"] == 2
    lib.torch_free(a, 10 * G, 0, S1)  # cached: no longer allocated, still held
    m = lib.torch_memory(0)
    assert m["allocated"] == 4096 and m["reserved"] == 10 * G + 4096 and m["allocated_peak"] == 10 * G + 4096
    assert m["frees"] == 1 and m["bytes_allocated"] == 10 * G + 4096 and m["bytes_freed"] == 10 * G
    assert lib.torch_malloc(10 * G, 0, S1) == a  # a cache hit counts as allocated again
    assert lib.torch_memory(0)["allocated"] == 10 * G + 4096
    lib.torch_free(a, 10 * G, 0, S1)
    lib.torch_free(b, 3000, 0, S1)
    assert lib.torch_trim() == 2  # given back: nothing held
    m = lib.torch_memory(0)
    assert m["allocated"] == 0 and m["reserved"] == 0 and m["reserved_peak"] == 10 * G + 4096
    lib.torch_reset_peaks(0)
    m = lib.torch_memory(0)
    assert m["allocated_peak"] == 0 and m["reserved_peak"] == 0
    assert lib.torch_memory(1)["allocs"] == 0 and lib.torch_memory(999)["allocs"] == 0

    from gpuos_tools.memory.owned import torch_memory_stats

    c = lib.torch_malloc(G, 0, S1)
    stats = torch_memory_stats(lib, 0)
    assert stats["allocated_bytes"]["all"]["current"] == G and stats["reserved_bytes"]["all"]["peak"] == G
    assert stats["allocation"]["all"]["current"] == 1 and stats["num_device_alloc"] == lib.torch_stats()["misses"]
    lib.torch_free(c, G, 0, S1)


def test_torch_statistics_are_installed_where_torch_reads_them(env):
    """memory_stats and friends in torch.cuda.memory look memory_stats_as_nested_dict up as a
    module global; the installed functions replace it there and in torch.cuda (a stand-in for
    torch here: the GPU test runs the real one)."""
    import types

    from gpuos_tools.memory.owned import answer_torch_memory_stats

    lib, _ = env
    raising = lambda device=None: (_ for _ in ()).throw(RuntimeError("no getDeviceStats"))  # noqa: E731
    memory = types.SimpleNamespace(memory_stats_as_nested_dict=raising, reset_peak_memory_stats=raising,
                                   reset_accumulated_memory_stats=raising)
    cuda = types.SimpleNamespace(memory=memory, memory_stats_as_nested_dict=raising, reset_peak_memory_stats=raising,
                                 _utils=types.SimpleNamespace(
                                     _get_device_index=lambda d, optional=False: 0 if d is None else int(d)))
    answer_torch_memory_stats(types.SimpleNamespace(cuda=cuda), lib)
    a = lib.torch_malloc(4 * G, 0, S1)
    assert cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"] == 4 * G
    assert memory.memory_stats_as_nested_dict(0)["reserved_bytes"]["all"]["peak"] == 4 * G
    lib.torch_free(a, 4 * G, 0, S1)
    lib.torch_trim()
    memory.reset_peak_memory_stats("0")
    assert cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["peak"] == 0
    memory.reset_accumulated_memory_stats()
    assert memory.memory_stats_as_nested_dict.__wrapped__ is raising
