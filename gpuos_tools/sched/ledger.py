"""The byte ledger of `gpu-prefetch-sched serve`: one small file in the serve's work folder,
mapped by the coordinator and every job, that books each job's owned bytes that are (or may
be) mapped on the GPU, so that a load of any job is allowed only while everybody's bytes
together stay within the one budget (docs/scheduler.md, "The budget invariant").

Layout: int64 words. A header (magic, total, jobs, peak, peak_loads, forced_loads,
forced_over_max, unreserved_maps, alloc_charges), then per job (held, inflight, exiting,
spare). ``held`` is written by the job only (under the lock); ``exiting`` by the coordinator
only. Every read-modify-write takes the lock: a thread lock (the threads of one process share
one open file, which ``flock`` does not tell apart) and then ``flock`` on the file (the other
processes).

- ``held[j]``: bytes job j has mapped, or is about to map: a load's bytes are booked BEFORE
  its ``make_resident`` (``reserve``: only if all jobs' held bytes and these fit in ``total``),
  a release's bytes are taken off AFTER its unmap, an allocation's bytes when the job first
  sees the record (``charge``: it is mapped already, by the allocator; the ledger may then pass
  ``total``). So held[j] >= what job j has mapped, at every instant, except between an
  allocation and the job's next look at its records.
- ``inflight[j]``: bytes of job j's evictions issued and not released yet (they will leave
  ``held`` without anyone's turn): a load that does not fit waits only while some job has
  bytes in flight or is exiting; when nothing is in flight, nothing but the holder's own
  evictions can make room.
- ``exiting[j]``: set by the coordinator once job j's connection closed; its held bytes go
  when its process has been reaped (``zero``).

Figures, kept under the lock at every increase of the sum (so they are maxima of the true
instantaneous sum of ``held``, not of samples): ``peak`` (any increase: loads and
allocations), ``peak_loads`` (increases by loads: reserved ones never take it past ``total``),
``forced_loads`` and ``forced_over_max`` (loads booked past ``total``: a working set larger than
the room, a wait that timed out, or nothing in flight to wait for), ``unreserved_maps`` (a
``make_resident`` the executor had not reserved: the engine's own hook loading something the
policy did not require), ``alloc_charges``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from contextlib import contextmanager
from typing import Any, Iterator

MAGIC = 0x6770756F736C6467  # "gpuosldg"
HEADER = ("magic", "total", "jobs", "peak", "peak_loads", "forced_loads", "forced_over_max",
          "unreserved_maps", "alloc_charges")
H = 16  #: header words (room for more figures)
SLOT = ("held", "inflight", "exiting", "spare")
W = 8


class Ledger:
    """One process's view of the ledger file (module docstring). ``job`` None: the coordinator."""

    def __init__(self, path: str, job: int | None = None, total: int | None = None, jobs: int | None = None) -> None:
        self.path = path
        self.job = job
        create = total is not None
        if create:
            assert jobs is not None and total > 0
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, W * (H + len(SLOT) * jobs))
        else:
            fd = os.open(path, os.O_RDWR)
        self.fd = fd
        self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        self._tlock = threading.Lock()
        if create:
            with self.locked():
                self._put(0, MAGIC)
                self._put(1, int(total))
                self._put(2, int(jobs))
        if self._get(0) != MAGIC:
            raise ValueError(f"{path}: not a serve ledger")
        self.total = self._get(1)
        self.jobs = self._get(2)
        if job is not None and not 0 <= job < self.jobs:
            raise ValueError(f"job {job} not in the ledger ({self.jobs} jobs)")

    # -- words --------------------------------------------------------------------------------

    def _get(self, i: int) -> int:
        return struct.unpack_from("<q", self.mm, W * i)[0]

    def _put(self, i: int, v: int) -> None:
        struct.pack_into("<q", self.mm, W * i, int(v))

    def _slot(self, j: int, field: str) -> int:
        return H + len(SLOT) * j + SLOT.index(field)

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._tlock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _sum(self) -> int:
        return sum(self._get(self._slot(j, "held")) for j in range(self.jobs))

    def _raised(self, s: int, load: bool) -> None:
        """The sum rose to ``s`` (lock held): the peaks."""
        if s > self._get(3):
            self._put(3, s)
        if load and s > self._get(4):
            self._put(4, s)

    # -- the job's side ------------------------------------------------------------------------

    def reserve(self, n: int, force: bool = False) -> bool:
        """Book ``n`` bytes about to be loaded by this job, if everybody's together fit in
        ``total`` (or ``force``: booked anyway, counted). True when booked."""
        if n <= 0:
            return True
        i = self._slot(self.job, "held")
        with self.locked():
            s = self._sum() + n
            if s > self.total:
                if not force:
                    return False
                self._put(5, self._get(5) + 1)
                self._put(6, max(self._get(6), s - self.total))
            self._put(i, self._get(i) + n)
            self._raised(s, True)
        return True

    def charge(self, n: int, what: str = "alloc") -> None:
        """Book ``n`` bytes mapped already (``alloc``: an allocation seen; ``unreserved``: a map
        the executor had not reserved), whatever the sum becomes."""
        if n <= 0:
            return
        i = self._slot(self.job, "held")
        with self.locked():
            self._put(i, self._get(i) + n)
            s = self._sum()
            if what == "unreserved":
                self._put(7, self._get(7) + 1)
                if s > self.total:
                    self._put(5, self._get(5) + 1)
                    self._put(6, max(self._get(6), s - self.total))
            else:
                self._put(8, self._get(8) + 1)
            self._raised(s, what == "unreserved")

    def uncharge(self, n: int) -> None:
        """``n`` bytes of this job unmapped (a release completed, a record freed)."""
        if n <= 0:
            return
        i = self._slot(self.job, "held")
        with self.locked():
            self._put(i, max(0, self._get(i) - n))

    def set_inflight(self, n: int) -> None:
        with self.locked():
            self._put(self._slot(self.job, "inflight"), max(0, int(n)))

    def anything_in_flight(self) -> bool:
        """Whether some job's held bytes are about to go without anyone's turn: evictions in
        flight, or a job exiting."""
        with self.locked():
            for j in range(self.jobs):
                if self._get(self._slot(j, "inflight")) > 0:
                    return True
                if self._get(self._slot(j, "exiting")) and self._get(self._slot(j, "held")) > 0:
                    return True
        return False

    # -- the coordinator's side ----------------------------------------------------------------

    def set_exiting(self, j: int) -> None:
        with self.locked():
            self._put(self._slot(j, "exiting"), 1)

    def zero(self, j: int) -> None:
        """Job ``j``'s process has been reaped: its memory is gone."""
        with self.locked():
            for f in ("held", "inflight"):
                self._put(self._slot(j, f), 0)
            self._put(self._slot(j, "exiting"), 1)

    def inflight_of_others(self, j: int) -> int:
        """Bytes in flight in the live jobs other than ``j`` (an early grant's measure)."""
        with self.locked():
            return sum(self._get(self._slot(k, "inflight")) for k in range(self.jobs)
                       if k != j and not self._get(self._slot(k, "exiting")))

    def snapshot(self) -> dict[str, Any]:
        with self.locked():
            out: dict[str, Any] = {k: self._get(i) for i, k in enumerate(HEADER) if k != "magic"}
            out["sum"] = self._sum()
            out["held"] = [self._get(self._slot(j, "held")) for j in range(self.jobs)]
            out["inflight"] = [self._get(self._slot(j, "inflight")) for j in range(self.jobs)]
        return out

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            os.close(self.fd)
