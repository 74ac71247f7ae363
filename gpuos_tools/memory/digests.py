"""The residency engine's digests of host copies: whether an evicted record's host copy is still
current, decided on the GPU, and the back-off for records that keep changing
(docs/residency-engine.md, "Digests" and "Back-off"). A part of ``ResidencyEngine``
(engine.py): its methods use the engine's ``ops``, ``counts`` and lock."""

from __future__ import annotations

import sys
from typing import Any

from gpuos_tools.memory.digest_kernel import DIGEST_SLOTS

DIGEST_MIN = 256 << 10  #: smaller records get no digest (their save is cheap)
CHECKED_SIZES = 32  #: record sizes whose check results are tallied (stats' digest_checks)
BACKOFF = (4, 32)  #: evictions saved without a check after a check found the record changed: first, most


class Digests:
    """The engine's digest bookkeeping (mixed into ``ResidencyEngine``)."""

    def _start_digests(self, owned: bool) -> None:
        """The digest state (from the engine's ``__init__``, once ``ops`` is set): off with
        GPUOS_ENGINE_NO_DIGEST=1, unavailable when the driver side has none, else the kernel's
        build starts in the background (owned memory only: a lazy rollback evicts nothing)."""
        #: digests of host copies: base -> the size of the host copy whose digest is in the
        #: base's first slot
        self.digests: dict[int, int] = {}
        self._slot_of: dict[int, int] = {}  #: base -> k: its slots are 2k (host copy), 2k+1 (at eviction)
        #: base -> [evictions left to save without a check, the last run's length] (back-off)
        self._backoff: dict[int, list[int]] = {}
        #: "on", "off (...)", "unavailable: ..."; None: not decided until the first eviction
        self.digest_mode: str | None = None
        #: record size -> [checks that found it unchanged, changed] (the first CHECKED_SIZES
        #: sizes): which kind of record keeps changing (a weight should not)
        self.checked_sizes: dict[int, list[int]] = {}
        if not self.settings.digest:
            self.digest_mode = "off (GPUOS_ENGINE_NO_DIGEST=1)"
        elif not hasattr(self.ops, "digest"):
            self.digest_mode = "unavailable: the driver side has no digest"
        elif owned:
            prepare = getattr(self.ops, "digest_prepare", None)
            if prepare is not None:
                prepare()

    def _digest_ready(self) -> bool:
        """Whether digests are taken. The first call (at the first eviction, on a thread of the
        engine's with the program's context current) loads the kernel, or says once on stderr
        why there are none."""
        if self.digest_mode is None:
            init = getattr(self.ops, "digest_init", None)
            try:
                why = init() if init is not None else None
            except Exception as exc:  # noqa: BLE001 (no digests: saves as before)
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                self.digest_mode = "on"
            else:
                self._no_digests(why)
        return self.digest_mode == "on"

    def _no_digests(self, why: str) -> None:
        self.digest_mode = f"unavailable: {why}"
        self.digests.clear()
        print(f"gpuos engine: no GPU digests ({why}); evicted records not known clean are saved",
              file=sys.stderr, flush=True)

    def _slots(self, base: int, size: int) -> int | None:
        """The base's slot pair, None when its record gets no digest (small, unaligned, or no
        slot left). A base keeps its slots: a result can only be overwritten by a digest of
        the same base, and those are ordered (a load of it after the eviction that read them)."""
        if size < DIGEST_MIN or base % 8:
            return None
        k = self._slot_of.get(base)
        if k is None:
            if len(self._slot_of) >= DIGEST_SLOTS // 2:
                return None
            k = self._slot_of[base] = len(self._slot_of)
        return k

    def _digest_host_copy(self, base: int, size: int, stream: Any) -> None:
        """After a load from the engine's own host copy (engine's lock held, own thread):
        enqueue the digest of what was loaded, i.e. of the host copy."""
        self.digests.pop(base, None)
        if self.digest_mode != "on":
            return
        b = self._backoff.get(base)
        if b is not None and b[0] > 0:  # its next eviction saves without a check
            return
        k = self._slots(base, size)
        if k is None:
            return
        try:
            self.ops.digest(base, size, 2 * k, stream)
        except Exception as exc:  # noqa: BLE001 (the load stands; no digests from now on)
            self._no_digests(f"{type(exc).__name__}: {exc}")
            return
        self.digests[base] = size
        self.counts["digests"] += 1

    def _digest_at_eviction(self, base: int, size: int, side: Any) -> bool:
        """Enqueue on ``side`` (after the program's last use) the digest to compare with the
        host copy's; False when there is nothing to compare with (then the usual rules)."""
        if self.digest_mode != "on" or self.digests.get(base) != size:
            return False
        k = self._slot_of.get(base)
        if k is None:
            return False
        try:
            self.ops.digest(base, size, 2 * k + 1, side)
        except Exception as exc:  # noqa: BLE001 (saved as before)
            self._no_digests(f"{type(exc).__name__}: {exc}")
            return False
        self.counts["digests"] += 1
        return True

    def _digests_equal(self, base: int, size: int) -> bool:
        """The host copy's digest against the one taken at eviction (both complete)."""
        k = self._slot_of[base]
        same = self.ops.digest_value(2 * k) == self.ops.digest_value(2 * k + 1)
        tally = self.checked_sizes.get(size)
        if tally is None and len(self.checked_sizes) < CHECKED_SIZES:
            tally = self.checked_sizes[size] = [0, 0]
        if tally is not None:
            tally[0 if same else 1] += 1
        return same


    # -- back-off -----------------------------------------------------------------------------

    def _backing_off(self, base: int) -> bool:
        """Whether this eviction of ``base`` saves at once, without a check: a check found it
        changed not long ago (the run is counted down)."""
        back = self._backoff.get(base)
        if back is None or back[0] <= 0:
            return False
        back[0] -= 1
        self.counts["digest_backoff_saves"] += 1
        return True

    def _found_changed(self, base: int) -> None:
        """A check found ``base`` changed (engine lock held): its digest goes (the host copy is
        saved anew). A first change only marks it: a record written once (a weight being
        initialised) is not written again, and its next eviction is checked as before. From a
        second change in a row on, its next evictions save without a check, a run that starts
        at BACKOFF[0] and doubles at each further change, up to BACKOFF[1]."""
        self.digests.pop(base, None)
        self.counts["digest_changed"] += 1
        back = self._backoff.get(base)
        if back is None:
            self._backoff[base] = [0, 0]
            return
        n = min(BACKOFF[1], max(BACKOFF[0], 2 * back[1]))
        self._backoff[base] = [n, n]
