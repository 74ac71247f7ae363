"""The validator's hold on the program's addresses (gpuos_tools/agent/vaspace.py): real placeholder
mappings in this process, and the windows the program's side asks for."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
from helpers import REPO, child_env

from gpuos_tools.agent import vaspace
from gpuos_tools.agent.vaspace import CLAIM_NAME, AddressClaims, Mapping, parse_maps, program_windows

MiB = 1 << 20


@pytest.fixture
def free_range():
    """A 16 MiB range of this process's address space that nothing maps (mapped, then unmapped)."""
    addr = _mmap_hint(0, 16 * MiB)
    _munmap(addr, 16 * MiB)
    return addr


def _mmap_hint(addr: int, size: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc.mmap(addr, size, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, a hint only


def _munmap(addr: int, size: int) -> None:
    libc = ctypes.CDLL(None)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert libc.munmap(addr, size) == 0


def test_held_windows_keep_later_mappings_away_until_lifted(free_range):
    a = free_range
    space = AddressClaims()
    try:
        assert space.claim([(a, 16 * MiB)]) == []
        assert space.held() == [(a, a + 16 * MiB)]
        lines = [m for m in vaspace.mappings() if m.start >= a and m.end <= a + 16 * MiB]
        assert lines and all(CLAIM_NAME in m.path for m in lines)
        # anything mapped later with that address as a hint lands elsewhere
        got = _mmap_hint(a + 4 * MiB, 2 * MiB)
        assert got != a + 4 * MiB
        _munmap(got, 2 * MiB)
        # lifting a part frees exactly that part; the rest stays held
        space.release(a + 4 * MiB, 2 * MiB)
        assert space.held() == [(a, a + 4 * MiB), (a + 6 * MiB, a + 16 * MiB)]
        assert "kept it for itself" in space.holder(a + 4 * MiB, 2 * MiB)
        assert CLAIM_NAME in space.holder(a, 4096)
        # something else takes the lifted part: a new claim says so and holds the rest
        got = _mmap_hint(a + 4 * MiB, 2 * MiB)
        assert got == a + 4 * MiB
        try:
            assert space.claim([(a, 16 * MiB)]) == [(a + 4 * MiB, a + 6 * MiB)]
            assert "(anonymous)" in space.holder(a + 4 * MiB, 4096)
        finally:
            _munmap(got, 2 * MiB)
    finally:
        space.close()
    assert not [m for m in vaspace.mappings() if CLAIM_NAME in m.path]


MAPS = """\
00400000-00421000 r-xp 00000000 08:01 131 /usr/bin/python3.12
7f0000000000-7f0040000000 ---p 00000000 00:00 0
7f0040000000-7f0040200000 rw-s 00000000 00:05 17 /dev/nvidiactl
7f0100000000-7f2100000000 ---p 00000000 00:00 0
7f3000000000-7f3000100000 r-xp 00000000 08:01 999 /usr/lib/x86_64-linux-gnu/libcuda.so.1
"""


def test_the_programs_windows_are_its_allocations_and_the_mappings_around_them():
    maps = parse_maps(MAPS)
    assert maps[1] == Mapping(0x7F0000000000, 0x7F0040000000, "---p", "")
    assert maps[2].path == "/dev/nvidiactl"
    allocs = [
        (0x7F0000100000, 4096),  # in an anonymous reservation of 1 GiB: all of it
        (0x7F0040010000, 4096),  # in a mapping of the driver's: all of it
        (0x7F0100000000, 1 << 20),  # in a reservation too large to hold whole: 2 MiB around it
        (0x7F3000010000, 512),  # in a library's mapping (not the driver's room): 2 MiB around it
        (0x7F4000300000, 3 * MiB),  # in nothing: rounded out to 2 MiB
    ]
    assert program_windows(allocs, maps, room=(0, 0)) == [
        [0x7F0000000000, 0x40200000],
        [0x7F0100000000, 2 * MiB],
        [0x7F3000000000, 2 * MiB],
        [0x7F4000200000, 4 * MiB],
    ]
    assert program_windows([], maps) == []
    assert program_windows(allocs[:1], room=(0, 0)) == [[0x7F0000000000, 2 * MiB]]
    # by default, room around them all: below the lowest allocation (the driver's heap grows down
    # as mmap does) and above the highest
    lo, hi = 0x7F0000000000 - vaspace.ROOM_BELOW, 0x7F4000600000 + vaspace.ROOM_ABOVE
    assert program_windows(allocs, maps) == [[lo, hi - lo]]
    # allocations scattered too far apart for room: their own windows only
    far = [(0x100000000000, 4096), (0x7F0000000000, 4096)]
    assert program_windows(far) == [[0x100000000000, 2 * MiB], [0x7F0000000000, 2 * MiB]]


ENTRY = r"""
import json, sys, types
seen = {}
fake = types.ModuleType("gpuos_tools.agent.replay")
def main(argv, strategy):
    seen["numpy"] = "numpy" in sys.modules
    seen["held"] = strategy.space.held()
    seen["strategy"] = strategy.name
    seen["argv"] = argv
    return 0
fake.main = main
import gpuos_tools.agent
sys.modules["gpuos_tools.agent.replay"] = fake
gpuos_tools.agent.replay = fake
from gpuos_tools.agent import validator
assert validator.main(sys.argv[1:]) == 0
print(json.dumps(seen))
"""


def test_the_validator_holds_the_windows_before_numpy_or_the_driver_loads(tmp_path, free_range):
    a = free_range
    claims = tmp_path / "claims.json"
    claims.write_text(json.dumps([[a, 8 * MiB]]))
    argv = ["--device", "0000:00:00.0", "--dir", str(tmp_path), "--claims", str(claims)]
    out = subprocess.run([sys.executable, "-c", ENTRY, *argv, "--strategy", "hold"], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["numpy"] is False and seen["argv"] == [*argv, "--strategy", "hold"]
    # the child's address space is its own (a range free here may be taken there): what it holds
    # lies inside the window
    assert seen["held"] and all(a <= s < e <= a + 8 * MiB for s, e in seen["held"]), seen
    out = subprocess.run([sys.executable, "-c", ENTRY, *argv], cwd=REPO, env=child_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["strategy"] == "whole"  # the first strategy unless told
    # the claims file as the program's side writes it, and strategies that hold nothing before
    # the driver starts
    claims.write_text(json.dumps({"windows": [[a, 8 * MiB]], "areas": []}))
    for strategy, held in (("plain", False), ("whole", False), ("hold", True)):
        out = subprocess.run([sys.executable, "-c", ENTRY, *argv, "--strategy", strategy], cwd=REPO,
                             env=child_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)
        assert seen["strategy"] == strategy and bool(seen["held"]) is held, seen
    out = subprocess.run([sys.executable, "-m", "gpuos_tools.agent.validator", *argv, "--strategy", "guess"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown address strategy 'guess'" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    out = subprocess.run([sys.executable, "-c", ENTRY, "--claims", str(bad)], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "were not held" in out.stderr


def test_the_programs_driver_areas_are_the_runs_of_its_drivers_mappings_around_its_allocations():
    maps = parse_maps("""\
7f0000000000-7f0040000000 ---p 00000000 00:00 0
7f0040000000-7f0040200000 rw-s 00000000 00:05 17 /dev/nvidia-uvm
7f0040200000-7f0100000000 ---p 00000000 00:00 0
7f0100000000-7f0100100000 rw-p 00000000 00:00 0
7f0200000000-7f0200200000 ---p 00000000 00:00 0
""")
    allocs = [(0x7F0000100000, 4096), (0x7F0040300000, 4096),  # one run of three touching mappings
              (0x7F0100000000, 4096),  # in the heap of an allocator of the host (readable): none
              (0x7F0300000000, 4096)]  # in nothing: none
    assert vaspace.driver_areas(allocs, maps) == [[0x7F0000000000, 0x100000000]]
    assert vaspace.driver_areas([(0x7F0200000000, 4096)], maps) == [[0x7F0200000000, 2 * MiB]]


def test_steering_fills_everything_free_but_the_kept_areas_and_room_for_stack_heap_and_small_mappings():
    GiB = 1 << 30
    maps = parse_maps("""\
555555554000-555555600000 r-xp 00000000 08:01 131 /usr/bin/python3.12
555555600000-555555800000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000100000 r-xp 00000000 08:01 999 /usr/lib/libc.so.6
7ffff0000000-7ffff0100000 rw-p 00000000 00:00 0 [stack]
""")
    keep = [(0x7E0000000000, 4 * GiB)]
    fill = vaspace.steer_fill(keep, maps, spare=GiB)
    got = vaspace.merge([(a, a + n) for a, n in fill])
    holes = vaspace.free_gaps(vaspace.STEER_LOW, vaspace.STEER_HIGH,
                              maps + [Mapping(s, e, "", "") for s, e in got])
    assert holes == [
        (0x555555800000, 0x555555800000 + vaspace.HEAP_ROOM),  # the heap grows
        (0x7E0000000000, 0x7E0000000000 + 4 * GiB),  # kept for the validator's driver
        (0x7F0000000000 - GiB, 0x7F0000000000),  # the spare, just below the lowest library
        (0x7FFFF0000000 - vaspace.STACK_ROOM, 0x7FFFF0000000),  # the stack grows
    ]
    assert not any(s < 0x7F0000100000 and 0x7F0000000000 < s + n for s, n in fill)  # never over a mapping
    assert vaspace.free_gaps(vaspace.STEER_LOW, 1 << 40, [Mapping(s, e, "", "") for s, e in got]) == []


class WatchedClaims:
    """vaspace.AddressClaims' interface over a set of held ranges (no mappings)."""

    def __init__(self, log, name):
        self.log, self.name, self.ranges = log, name, []

    def claim(self, windows):
        self.log.append((self.name, "claim", list(windows)))
        self.ranges += list(windows)
        return []

    def release(self, addr, size):
        self.log.append((self.name, "release", (addr, size)))

    def release_all(self):
        self.log.append((self.name, "release_all"))

    def close(self):
        self.log.append((self.name, "close"))


@pytest.mark.parametrize("name, expected", [
    ("steer", [("claims", "claim", [(0x100000, 0x1000)]),  # start: the windows, before any import
               ("fill", "claim", "FILL"),  # before cuInit: everything but the program's driver areas
               ("claims", "release", (0x200000, 0x1000)),  # ... whose placeholders are lifted
               ("fill", "close"),  # after the context: the filling goes
               ("claims", "claim", [(0x100000, 0x1000)])]),  # and what is free of the windows is held
    ("hold", [("claims", "claim", [(0x100000, 0x1000)])]),
    ("plain", [("claims", "claim", [(0x100000, 0x1000)])]),  # only once the context exists
    ("bare", []),  # the zygote's validators: the program's layout already, nothing held
])
def test_each_address_strategy_holds_and_lifts_in_its_own_order(name, expected):
    log = []
    maps = lambda: parse_maps(MAPS)  # noqa: E731
    s = vaspace.AddressStrategy(name, [(0x100000, 0x1000)], [(0x200000, 0x1000)],
                                space=WatchedClaims(log, "claims"), filler=lambda: WatchedClaims(log, "fill"),
                                maps=maps)
    s.start()
    s.before_init()
    s.after_init()
    want = [("fill", "claim", vaspace.steer_fill([(0x200000, 0x1000)], maps())) if e[2:] == ("FILL",) else e
            for e in expected]
    assert log == want
    if name == "plain":
        log.clear()
        fresh = vaspace.AddressStrategy(name, [(0x100000, 0x1000)], space=WatchedClaims(log, "claims"))
        fresh.start()
        fresh.before_init()
        assert log == []  # nothing is held before the driver starts
    with pytest.raises(ValueError):
        vaspace.AddressStrategy("guess", [])
