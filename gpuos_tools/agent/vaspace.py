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

    ``maps`` reads this process's mappings (a parameter so that tests can watch it)."""

    def __init__(self, maps: Callable[[], list[Mapping]] = mappings) -> None:
        self._maps = maps
        self.fd = os.memfd_create(CLAIM_NAME, os.MFD_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self._munmap = libc.munmap
        self._munmap.restype = ctypes.c_int
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    @staticmethod
    def ours(m: Mapping) -> bool:
        return CLAIM_NAME in m.path

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

    def close(self) -> None:
        self.release_all()
        os.close(self.fd)
