"""The live allocations of a traced program, rebuilt by replaying its alloc and free records.

Kernel arguments are raw 64-bit words; to know which buffer a word points into, tools replay the
trace's ``alloc``/``free`` records in stream order and ask `AllocTable.resolve`. A launch may
pass an interior pointer (``x + offset``), so lookup is by range, not by start address: the
starts are kept sorted and searched with bisect, O(log n) per word, which matters because every
8-byte word of every launch's arguments is looked up.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Allocation:
    """One live allocation: the ``[addr, addr + size)`` range of an ``alloc`` record."""

    id: int
    addr: int
    size: int
    kind: str | None = None

    @property
    def end(self) -> int:
        return self.addr + self.size


class AllocTable:
    """Live allocations as non-overlapping ranges, with running totals.

    The trace is taken as the truth about what is live now: an ``alloc`` whose range overlaps
    live allocations (their ``free`` was not traced, e.g. memory released by a pool trim or a
    context teardown) replaces them, and `evicted` counts them. A ``free`` of an address that is
    not the start of a live allocation counts in `unknown_frees`; a free of address 0 is the C
    no-op and is not counted.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted start addresses of live allocations
        self._live: dict[int, Allocation] = {}  # start address -> allocation
        self.live_bytes = 0
        self.peak_bytes = 0
        self.unknown_frees = 0
        self.evicted = 0
        self._low: int | None = None
        self._high: int | None = None

    @property
    def live_count(self) -> int:
        return len(self._starts)

    @property
    def hull(self) -> tuple[int, int] | None:
        """(lowest start, highest end) over every allocation seen so far, live or freed."""
        if self._low is None or self._high is None:
            return None
        return self._low, self._high

    def add(self, rec: dict[str, Any]) -> Allocation:
        """Record an ``alloc`` record's allocation as live and return it."""
        new = Allocation(rec["id"], rec["addr"], rec["size"], rec.get("kind"))
        i = bisect_left(self._starts, new.addr)
        if i > 0 and self._live[self._starts[i - 1]].end > new.addr:
            i -= 1
            self._evict(i)
        while i < len(self._starts) and (self._starts[i] < new.end or self._starts[i] == new.addr):
            self._evict(i)
        self._starts.insert(i, new.addr)
        self._live[new.addr] = new
        self.live_bytes += new.size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._low = new.addr if self._low is None else min(self._low, new.addr)
        self._high = new.end if self._high is None else max(self._high, new.end)
        return new

    def _evict(self, i: int) -> None:
        old = self._live.pop(self._starts.pop(i))
        self.live_bytes -= old.size
        self.evicted += 1

    def remove(self, rec: dict[str, Any]) -> Allocation | None:
        """Apply a ``free`` record; return the allocation it freed, None if none was live there."""
        addr = rec["addr"]
        if addr == 0:
            return None
        old = self._live.pop(addr, None)
        if old is None:
            self.unknown_frees += 1
            return None
        del self._starts[bisect_left(self._starts, addr)]
        self.live_bytes -= old.size
        return old

    def feed(self, rec: dict[str, Any]) -> None:
        """Apply an ``alloc`` or ``free`` record; other records change nothing."""
        kind = rec.get("type")
        if kind == "alloc":
            self.add(rec)
        elif kind == "free":
            self.remove(rec)

    def find(self, addr: int) -> Allocation | None:
        """The live allocation that contains ``addr``, else None."""
        i = bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        alloc = self._live[self._starts[i]]
        return alloc if addr < alloc.end else None

    def resolve(self, addr: int) -> tuple[int, int] | None:
        """(allocation id, offset into it) for an address inside a live allocation, else None."""
        alloc = self.find(addr)
        return None if alloc is None else (alloc.id, addr - alloc.addr)
