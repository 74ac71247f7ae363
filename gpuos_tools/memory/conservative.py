"""The residency engine's conservative rule: a write no prediction showed, found when a clean
record's digest changed by its eviction, makes the kernels that may have done it conservative --
from then on their launches are unknown and count as writing everything resident
(docs/residency-engine.md, "Mismatches"). A part of ``ResidencyEngine`` (engine.py): its
methods use the engine's lock, ``clean``, ``digests`` and ``counts``."""

from __future__ import annotations

import sys
from typing import Any

from gpuos_tools.memory.states import Entry

READERS_MAX = 16  #: kernel names kept per clean record as predicted readers (more: every launch suspected)
LAUNCH_NAMES_MAX = 4096  #: kernel names whose last launch is kept (the least recently launched dropped beyond)
MISMATCH_LOG = 64  #: mismatches logged in ``stats()['mismatch']`` (all counted)


class Mismatches:
    """Who may have written a clean record, and what a mismatch does (mixed into
    ``ResidencyEngine``)."""

    def _start_mismatches(self) -> None:
        """The state of the rule (from the engine's ``__init__``)."""
        #: kernel names whose launches are unknown since a mismatch named them
        self.conservative: set[str] = set()
        self.conserve = self.settings.conserve
        self.mismatch_log: list[dict[str, Any]] = []
        self._digest_off_after = self.settings.digest_off_after
        self._seq = 0  #: launches seen (``launch``)
        #: kernel -> the sequence number of its last launch, least recently launched first
        self._last_launch: dict[str, int] = {}
        self._names_dropped = 0  #: the highest sequence number of a name dropped from _last_launch
        self._since: dict[int, int] = {}  #: base -> the sequence number at its load (clean records)
        self._readers: dict[int, set[str] | None] = {}  #: base -> predicted readers since its load (None: too many)

    def _launched(self, kernel: str) -> None:
        """A launch of ``kernel`` is being decided: it gets the next sequence number."""
        self._seq += 1
        last = self._last_launch
        last.pop(kernel, None)
        last[kernel] = self._seq
        if len(last) > LAUNCH_NAMES_MAX:
            for k in list(last)[: LAUNCH_NAMES_MAX // 2]:
                self._names_dropped = max(self._names_dropped, last.pop(k))

    def _read_while_clean(self, base: int, kernel: str) -> None:
        """``kernel`` is predicted to read the clean record at ``base`` (not to write it)."""
        r = self._readers.get(base, set())
        if r is not None:
            r.add(kernel)
            self._readers[base] = r if len(r) <= READERS_MAX else None

    def _suspects(self, base: int) -> tuple[list[str], str, bool]:
        """The kernels that may have written the clean record at ``base`` since its load (engine
        lock held): its predicted readers, else every kernel launched since; how they were found,
        and whether the list may be incomplete (names dropped past LAUNCH_NAMES_MAX)."""
        readers = self._readers.get(base, set())
        if readers:
            return sorted(readers), "predicted to read it", False
        since = self._since.get(base, 0)
        names = []
        for k in reversed(self._last_launch):  # most recently launched first
            if self._last_launch[k] < since:
                break
            names.append(k)
        return sorted(names), "launched since its load", since <= self._names_dropped

    def _mismatch(self, e: Entry) -> None:
        """A clean record's digest changed (engine lock held, evict thread): count and log it,
        make its suspects conservative, and take the clean mark and digest of every record one
        of them may have written already."""
        names, how, incomplete = e.suspects
        c = self.counts
        c["mismatches"] += 1
        self.clean.discard(e.base)
        self.digests.pop(e.base, None)
        new = [k for k in names if k not in self.conservative] if self.conserve else []
        if len(self.mismatch_log) < MISMATCH_LOG:
            self.mismatch_log.append({"base": hex(e.base), "bytes": e.size, "kernels": [k[:160] for k in names],
                                      "found": how, "incomplete": incomplete, "new": len(new),
                                      "evictions": c["evictions"], "launches": self._seq})
        if new:
            self.conservative.update(new)
            bump = getattr(self.agent, "predictions_changed", None)
            if bump is not None:  # the native core's memoised access sets of these are stale
                bump()
            self._busy()
            why = getattr(self.agent, "unknown_why", None)
            for k in new:
                if isinstance(why, dict):
                    why[k] = "conservative: it may have written a record its prediction did not show (a mismatch)"
            lasts = [self._last_launch.get(k, -1) for k in new]
            for b in list(self.clean):  # one launched since that record's load: maybe written already
                since = self._since.get(b, 0)
                if any(t >= since for t in lasts):
                    self.clean.discard(b)
                    self.digests.pop(b, None)
            print(f"gpuos engine: record {e.base:#x} ({e.size} bytes) changed without a predicted write; "
                  f"conservative from now on ({how}): {', '.join(k[:120] for k in new)}", file=sys.stderr, flush=True)
        elif c["mismatches"] == 1:
            print(f"gpuos engine: record {e.base:#x} ({e.size} bytes) changed without a predicted write "
                  f"({how}: {', '.join(k[:120] for k in names) or 'none'}); "
                  f"{'nothing made conservative (GPUOS_ENGINE_NO_CONSERVE=1)' if not self.conserve else 'all conservative already'}",
                  file=sys.stderr, flush=True)
        if self._digest_off_after and c["mismatches"] >= self._digest_off_after and self.digest_mode == "on":
            self.digest_mode = f"off (GPUOS_ENGINE_DIGEST_OFF_AFTER={self._digest_off_after}: after that many mismatches)"
            self.digests.clear()

