"""The owned allocator's C library (gpuos_alloc.c) on a stand-in driver (tests/fake_libcuda.c):
its table, size classes, residency transitions, thread safety, build caching, the option."""

from __future__ import annotations

import ctypes
import random
import shutil
import threading
from pathlib import Path

import pytest

from gpuos_tools.agent import owned

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

FAKE = Path(__file__).resolve().parent / "fake_libcuda.c"
G = 2 << 20


@pytest.fixture
def env(tmp_path):
    """(OwnedLibrary, counters()) with private copies of both libraries, so that each test
    starts from empty tables (the state of a shared object is per load)."""
    from gpuos_tools.agent import native

    lib_path = owned.build(tmp_path / "cache")
    fake_path = native.build_library(tmp_path / "cache", source=FAKE, stem="libfakecuda", libs=("-lpthread",))
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
    assert owned.parse_option("1") == "cupy" and owned.parse_option(" CuPy ") == "cupy"
    with pytest.raises(ValueError, match="GPUOS_AGENT_OWN"):
        owned.parse_option("torch")
    env = {"GPUOS_AGENT_OWN": "0", "OTHER": "x"}
    assert owned.boot_from_environment(env) is None and env == {"OTHER": "x"}


def test_record_layout_matches_the_c_struct(env):
    lib, _ = env
    assert lib.lib.gpuos_alloc_record_size() == ctypes.sizeof(owned.RECORD) == 48
