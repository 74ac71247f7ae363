"""Keeping the program's virtual addresses free in the validator process (standard library only).

The validator replays a launch at the program's own addresses (gpuos_tools/agent/replay.py). Under
unified addressing a device address is also a host address, and ``cuMemAddressReserve`` takes the
address it is given only as a hint: where anything of the validator already sits there (its own
driver's context memory and module code, a library, the staging file, Python's heap), the driver
hands out another address and the launch cannot be replayed. So, before the validator loads the
driver at all, it covers the program's address windows with placeholder mappings (no access, no
memory behind them, backed by a named memfd so that they are told apart from anything else in
/proc/self/maps): nothing the validator or its driver maps later can land there. A placeholder is
lifted just before the driver is asked for that range and put back where the driver gave it back.

The program's side (offload.py) says which windows to hold: each live allocation rounded out to
2 MiB, the whole mapping of its own address space around it, and room around them all (where its
driver will place the allocations still to come); placeholders cost no memory, only addresses, of
which there are 128 TiB.

A driver may honour the hint only inside the areas it reserved for itself when it started, so that
keeping the windows free is not always enough: the validator's driver must also have put its own
areas over them. How the validator goes about it is its address strategy (``STRATEGIES``, tried in
that order by the program's side until one gets the addresses):

- ``whole``: create the context first, then reserve each of the program's driver areas at its
  address, whole where it can be had, else in halves down to single granules
  (replay.Replayer.take_areas), and hold what is free of the windows; an allocation inside a part
  reserved so is mapped into that reservation, with no reservation of its own. On the H100s
  (driver 580) a hint is honoured only inside the driver's own areas, and a fresh validator's
  driver puts its areas over the program's (the same placement): the program's addresses are
  then had except where the validator's own context allocated, and taking every other part at
  once keeps the validator's later module loads off them;
- ``plain``: create the context first, then hold what is free of the windows;
- ``hold``: hold the windows from the start, lift a part only to reserve it;
- ``steer``: hold the windows from the start; just before the driver initialises, fill every free
  part of the address space but the program's driver areas (the windows when they are not known)
  with placeholders, leaving room for the stack, the heap and the driver's small mappings, and lift
  the windows' placeholders over those areas, so that the only room left for the driver's own
  areas is where the program's driver put its own; once the context exists, lift the filling and
  hold what is still free of the windows (on the H100s, driver 580, cuInit fails with so little
  room: it is tried last);
- ``bare``: create the context and hold nothing: for the validators the zygote forks from the
  program (zygote.py), whose layout is the program's already; not one of the fresh validators'.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Iterable

PAGE = mmap.PAGESIZE
#: the rounding of an allocation into a window: the largest minimum VMM granularity of our GPUs
WINDOW_ALIGN = 2 << 20
#: a mapping of the program's larger than this is not held whole (only its allocations are)
MAX_WINDOW = 64 << 30
#: the room held around the program's allocations (where its driver will place the next ones:
#: drivers grow their heap downwards from the first allocations, as mmap does), below and above
ROOM_BELOW = 64 << 30
ROOM_ABOVE = 4 << 30
#: no room is held when it would be larger than this (allocations scattered over the address space)
MAX_ROOM = 1 << 40
#: the memfd name the placeholders carry in /proc/self/maps
CLAIM_NAME = "gpuos-validator-claim"
#: the memfd name of the ``steer`` strategy's filling (told apart from the claims)
STEER_NAME = "gpuos-validator-steer"
#: the address strategies, in the order the program's side tries them (module docstring)
STRATEGIES = ("whole", "plain", "hold", "steer")
#: every strategy a validator takes: those, and ``bare`` (the zygote's validators)
KNOWN_STRATEGIES = STRATEGIES + ("bare",)
#: a driver area of the program's larger than this is not left free whole by ``steer``
MAX_AREA = 1 << 40
#: ``steer`` fills nothing below this (the executable, its heap, 32-bit addresses)
STEER_LOW = 1 << 32
#: the top of the address space a process maps by default (47 bits)
STEER_HIGH = (1 << 47) - PAGE
#: room ``steer`` leaves free below the main stack and above the heap, so that both can grow
STACK_ROOM = 256 << 20
HEAP_ROOM = 1 << 30
#: room ``steer`` leaves free at the top of the free space below the libraries, for what the
#: driver maps that is not its device address area (thread stacks, small mappings of its files)
SPARE = 1 << 30

_PROT_NONE = 0
_MAP_SHARED = 0x01
_MAP_NORESERVE = 0x4000
_MAP_FIXED_NOREPLACE = 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps: [start, end), permissions, and what is mapped (path, or '')."""

    start: int
    end: int
    perms: str
    path: str

    def __str__(self) -> str:
        return f"{self.start:#x}-{self.end:#x} {self.perms} {self.path or '(anonymous)'}"


def parse_maps(text: str) -> list[Mapping]:
    out = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        out.append(Mapping(int(lo, 16), int(hi, 16), parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def mappings(pid: int | str = "self") -> list[Mapping]:
    with open(f"/proc/{pid}/maps") as f:
        return parse_maps(f.read())


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) ranges, sorted, overlapping or touching ones merged."""
    out: list[list[int]] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def round_out(start: int, end: int, align: int) -> tuple[int, int]:
    return start // align * align, -(-end // align) * align


def _windowable(m: Mapping) -> bool:
    """A mapping that may hold the program's driver's reserved room: anonymous or the driver's."""
    return (not m.path or m.path.startswith("/dev/nvidia") or m.path.startswith("[anon")) and m.end - m.start <= MAX_WINDOW


def program_windows(allocs: Iterable[tuple[int, int]], maps: list[Mapping] | None = None,
                    room: tuple[int, int] = (ROOM_BELOW, ROOM_ABOVE)) -> list[list[int]]:
    """[addr, size] of the windows a validator should hold for a program whose live allocations
    are ``allocs`` ((addr, size) pairs), given the program's own ``maps``: each allocation rounded
    out to 2 MiB, the program's mapping around it, and ``room`` (bytes below the lowest, above the
    highest) around them all, where the program's later allocations are likely to land; the
    validator holds only what is free in it, and its own mappings go elsewhere."""
    allocs = [(a, a + n) for a, n in allocs if n > 0]
    if not allocs:
        return []
    windows = [round_out(s, e, WINDOW_ALIGN) for s, e in allocs]
    lo = max(PAGE, min(s for s, _ in windows) - room[0])
    hi = max(e for _, e in windows) + room[1]
    if hi - lo <= MAX_ROOM and room != (0, 0):
        windows.append((lo, hi))
    if maps:
        starts = [m.start for m in maps]
        for s, _ in allocs:
            i = bisect.bisect_right(starts, s) - 1
            if i >= 0 and maps[i].start <= s < maps[i].end and _windowable(maps[i]):
                windows.append((maps[i].start, maps[i].end))
    return [[s, e - s] for s, e in merge(windows)]


def driver_areas(allocs: Iterable[tuple[int, int]], maps: list[Mapping]) -> list[list[int]]:
    """[addr, size] of the program's driver areas that hold its allocations: around each
    allocation, the run of touching mappings that are the driver's (of /dev/nvidia*, or anonymous
    without access: its reservations), whatever their size up to ``MAX_AREA``, merged. ``steer``
    leaves these free for the validator's driver."""
    maps = sorted(maps, key=lambda m: m.start)
    starts = [m.start for m in maps]
    out = []
    for a, n in allocs:
        i = bisect.bisect_right(starts, a) - 1
        if n <= 0 or i < 0 or not (maps[i].start <= a < maps[i].end) or not _drivers(maps[i]):
            continue
        lo, hi = i, i
        while lo > 0 and maps[lo - 1].end == maps[lo].start and _drivers(maps[lo - 1]):
            lo -= 1
        while hi + 1 < len(maps) and maps[hi + 1].start == maps[hi].end and _drivers(maps[hi + 1]):
            hi += 1
        s, e = maps[lo].start, maps[hi].end
        if e - s > MAX_AREA:  # the part around the allocation only
            s, e = round_out(max(s, a - MAX_AREA // 2), min(e, a + MAX_AREA // 2), WINDOW_ALIGN)
        out.append((s, e))
    return [[s, e - s] for s, e in merge(out)]


def _drivers(m: Mapping) -> bool:
    return m.path.startswith("/dev/nvidia") or (not m.path or m.path.startswith("[anon")) and m.perms.startswith("---")


def steer_fill(keep: Iterable[tuple[int, int]], maps: list[Mapping], spare: int = SPARE) -> list[tuple[int, int]]:
    """[addr, size] of what ``steer`` fills: every free part of [STEER_LOW, STEER_HIGH) but the
    [addr, size] ranges of ``keep``, room below the main stack and above the heap, and ``spare``
    bytes at the top of the highest free gap below the lowest shared library (where mappings
    of the driver's that are too small to be its device address areas land first)."""
    skip = [(a, a + n) for a, n in keep]
    for m in maps:
        if m.path == "[stack]":
            skip.append((m.start - STACK_ROOM, m.start))
        elif m.path == "[heap]":
            skip.append((m.end, m.end + HEAP_ROOM))
    libs = [m.start for m in maps if ".so" in m.path and m.start >= STEER_LOW]
    if spare and libs:
        below = [(s, e) for s, e in free_gaps(STEER_LOW, min(libs), maps) if e - s >= 2 * spare]
        if below:
            s, e = below[-1]
            skip.append((e - spare, e))
    fill = free_gaps(STEER_LOW, STEER_HIGH, maps + [Mapping(s, e, "", "") for s, e in merge(skip)])
    return [(s, e - s) for s, e in fill]


def free_gaps(lo: int, hi: int, maps: list[Mapping]) -> list[tuple[int, int]]:
    """The parts of [lo, hi) no mapping covers."""
    out, pos = [], lo
    for m in sorted(maps, key=lambda m: m.start):
        if m.end <= pos:
            continue
        if m.start >= hi:
            break
        if m.start > pos:
            out.append((pos, m.start))
        pos = max(pos, m.end)
    if pos < hi:
        out.append((pos, hi))
    return out


class AddressClaims:
    """Placeholder mappings over address windows of this process (see the module docstring).

    ``maps`` reads this process's mappings (a parameter so that tests can watch it); ``name`` is
    the memfd name the placeholders carry."""

    def __init__(self, maps: Callable[[], list[Mapping]] = mappings, name: str = CLAIM_NAME) -> None:
        self._maps = maps
        self.name = name
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self._munmap = libc.munmap
        self._munmap.restype = ctypes.c_int
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def ours(self, m: Mapping) -> bool:
        return self.name in m.path

    def held(self) -> list[tuple[int, int]]:
        """[start, end) of the placeholders in place now."""
        return merge((m.start, m.end) for m in self._maps() if self.ours(m))

    def claim(self, windows: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Hold every free page of the [addr, size] windows; returns the [start, end) parts that
        something else already holds (not ours)."""
        maps = self._maps()
        taken = []
        for addr, size in windows:
            lo, hi = round_out(addr, addr + size, PAGE)
            for s, e in free_gaps(lo, hi, maps):
                got = self._mmap(s, e - s, _PROT_NONE, _MAP_SHARED | _MAP_NORESERVE | _MAP_FIXED_NOREPLACE, self.fd, 0)
                if got is None or got == _MAP_FAILED:
                    taken.append((s, e))  # mapped since we read the maps: someone else's now
                elif got != s:  # a kernel without MAP_FIXED_NOREPLACE took it as a hint
                    self._munmap(got, e - s)
                    taken.append((s, e))
            taken += [(max(m.start, lo), min(m.end, hi)) for m in maps
                      if m.start < hi and lo < m.end and not self.ours(m)]
        return merge(taken)

    def release(self, addr: int, size: int) -> None:
        """Lift the placeholders over [addr, addr + size), so that the driver can have it."""
        lo, hi = round_out(addr, addr + size, PAGE)
        for s, e in self.held():
            s, e = max(s, lo), min(e, hi)
            if s < e:
                self._munmap(s, e - s)

    def release_all(self) -> None:
        for s, e in self.held():
            self._munmap(s, e - s)

    def holder(self, addr: int, size: int) -> str:
        """What sits in [addr, addr + size) in this process, in words, for a refusal."""
        found = [m for m in self._maps() if m.start < addr + size and addr < m.end]
        if not found:
            return "nothing of the validator's is mapped there: the driver kept it for itself"
        return "the validator holds " + "; ".join(str(m) for m in found[:3]) + (" ..." if len(found) > 3 else "")

    def by_driver(self, addr: int, size: int) -> bool:
        """True when nothing but the driver's own (its files, anonymous reservations without
        access) sits in [addr, addr + size): a refusal there is the driver's, not the validator's."""
        return all(_drivers(m) for m in self._maps() if m.start < addr + size and addr < m.end)

    def close(self) -> None:
        self.release_all()
        os.close(self.fd)


class AddressStrategy:
    """How a validator process gets the program's addresses (the module docstring's strategies).

    ``windows`` and ``areas`` are the program's ([addr, size]: program_windows, driver_areas);
    ``space`` holds the windows (an AddressClaims; tests pass one watching fake maps), ``filler``
    makes the placeholders of ``steer``. The validator calls ``start`` before it imports anything
    that maps memory, ``before_init`` with the driver's library loaded but not initialised, and
    ``after_init`` once its context exists."""

    def __init__(self, name: str, windows: list[tuple[int, int]], areas: list[tuple[int, int]] = (),
                 space: AddressClaims | None = None, filler: Callable[[], AddressClaims] | None = None,
                 maps: Callable[[], list[Mapping]] = mappings, spare: int = SPARE) -> None:
        if name not in KNOWN_STRATEGIES:
            raise ValueError(f"unknown address strategy {name!r} (known: {', '.join(KNOWN_STRATEGIES)})")
        self.name = name
        self.windows = [(int(a), int(n)) for a, n in windows]
        self.areas = [(int(a), int(n)) for a, n in areas]
        self._space = space
        self._filler = filler or (lambda: AddressClaims(maps, STEER_NAME))
        self._maps = maps
        self.spare = spare
        self.fill: AddressClaims | None = None
        self.notes: list[str] = []  #: what did not go as meant (for the validator's log)

    @property
    def space(self) -> AddressClaims:
        if self._space is None:
            self._space = AddressClaims(self._maps)
        return self._space

    def start(self) -> None:
        if self.name in ("steer", "hold") and self.windows:
            self.space.claim(self.windows)

    def before_init(self) -> None:
        if self.name != "steer" or not (self.windows or self.areas):
            return
        # where the program's driver put its areas (or, not knowing them, the windows): the
        # validator's driver, asking for areas of the same size, gets the same places
        keep = [(s, e - s) for s, e in merge([(a, a + n) for a, n in self.areas or self.windows])]
        self.fill = self._filler()
        self.fill.claim(steer_fill(keep, self._maps(), self.spare))
        for a, n in keep:  # the driver's areas can go nowhere else now
            self.space.release(a, n)

    def after_init(self) -> None:
        if self.fill is not None:
            self.fill.close()
            self.fill = None
        if self.name in ("steer", "plain", "whole") and self.windows:
            taken = self.space.claim(self.windows)
            if taken:
                self.notes.append(f"{len(taken)} parts of the program's windows were taken at the start")

    def abandon(self) -> None:
        """Lift every placeholder (the driver would not start with them in place)."""
        if self.fill is not None:
            self.fill.close()
            self.fill = None
        if self._space is not None:
            self._space.release_all()
