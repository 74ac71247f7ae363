"""Adaptive waiting: spin while traffic is recent, then sleep on the futex.

A futex wake-up of a sleeping thread is slow on a VM (about 250 µs on the 2-vCPU development
machine: the idle vCPU has to be woken by the host), so a daemon that sleeps between two
requests makes each of them pay that. Spinning forever costs a core even when nothing comes.
The rule used everywhere a thread waits for the other side (the daemon's C and Python loops,
the eBPF loader; ``RingClient`` applies the same shape to its wait for an answer):

- after the last arrival, keep spinning for ``hold = clamp(2 g, spin_min, spin_max)``, where
  ``g`` is a decaying maximum of the recent gaps between arrivals (a new gap raises it at
  once; otherwise it loses 1/8 at each arrival), so the hold covers the gaps the traffic has
  shown lately;
- a gap longer than ``spin_max`` means sparse traffic: ``g`` is then above ``spin_max`` and
  the hold falls back to ``spin_min``, so sparse traffic costs no spinning (each such request
  pays one wake-up instead). Gaps enter ``g`` capped at ``2 spin_max``, so after a long pause
  a few requests in quick succession are enough to spin again;
- with nothing arriving for ``hold``, sleep on the futex: an idle daemon uses no CPU.

So a producer sending a request every millisecond finds the daemon awake each time (it spins
between them, one core busy while that traffic lasts), one sending a request every second
finds it asleep, and an idle ring costs nothing. kinfer_native.c and bpf/loader.c carry the same
arithmetic in C (``hold_ns``, ``note_traffic``); a test checks the three agree.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Defaults of the daemon's window (profile [wait]); the client's are in ring.RingClient.
SPIN_MIN_US = 200.0
SPIN_MAX_US = 5000.0


@dataclass
class Adaptive:
    """The hold after the last arrival, in the unit the caller uses (seconds or ns)."""

    spin_min: float
    spin_max: float
    gap: float = 0.0
    last: float | None = None

    def arrival(self, now: float) -> None:
        """Note an arrival (a request, or a batch of them) at ``now``."""
        if self.last is not None:
            gap = min(now - self.last, 2 * self.spin_max)
            decayed = self.gap - self.gap / 8
            self.gap = gap if gap > decayed else decayed
        self.last = now

    def hold(self) -> float:
        g = self.gap
        if g <= 0 or g > self.spin_max:
            return self.spin_min
        return min(self.spin_max, max(self.spin_min, 2 * g))

    def idle(self, now: float) -> bool:
        """True when nothing has arrived for longer than the hold: time to sleep."""
        return self.last is None or now - self.last > self.hold()
