"""CPU or GPU for one batch, and the profile (TOML) that holds the numbers the choice is made from.

The choice, per batch:

- no usable GPU: CPU;
- with a calibration (latency curves measured by ``gpu-kinfer-bridge calibrate``): the side
  whose expected latency at this batch size is lower. Each side's expectation is its calibrated
  curve, interpolated in log-log space, corrected by what the daemon measured on that side over
  the last ``window_ms`` (``Speed``, means, not medians: a producer pays every batch's latency,
  including those that waited behind another process's burst). The GPU's curve gets the mean
  *delay* added (``GpuSpeed``: measured minus calibrated latency of the daemon's own GPU
  batches and of probes; a time-sliced GPU makes every batch wait about the same whatever its
  size); the CPU's curve becomes ``a + b * curve`` (``CpuSpeed.fit``, from the CPU batches the
  daemon's Python loop runs, no probes; a = 0, b = 1 with none): a fixed extra (an isolated CPU
  batch pays tens of µs whatever its size) plus a proportional one (another process on the
  cores), fitted when the window holds several batch sizes, the fixed extra alone otherwise.
  Another process on the GPU, or on the CPU, changes the choice only as much as it actually
  slows that side down, on average;
- without one, LAKE's rule: CPU below ``cpu_below`` or while the GPU is busy, else GPU.

"Busy" is LAKE's test: NVML utilisation above ``busy_util`` percent while at least
``busy_procs`` other processes hold a context on the GPU. With a calibration NVML only decides
how often the daemon probes the GPU's speed (about every ``probe_busy_ms`` while another process
is on the GPU, about every ``probe_idle_ms`` otherwise, jittered, when none of its own GPU batches
measured it lately; never so rarely that the window holds fewer than two probes).

Profiles are read with tomllib. They are written by ``dump_profile``, which knows only what a
profile holds (tables of strings, numbers, booleans and lists of numbers) and writes them in a
fixed order with a comment saying the file is generated: comments added by hand are not kept.
"""

from __future__ import annotations

import math
import os
import random
import sys
import threading
import time
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import atomic
from gpuos_tools.tomlfile import load_toml

#: Profiles installed with the package (package data), found by name: ``--profile linnos``.
PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


def user_profile_dir() -> Path:
    """Where a user's own profiles live, found by name before the shipped ones, and where
    ``calibrate`` writes a calibrated copy of a shipped profile:
    ``$XDG_CONFIG_HOME/gpuos-tools/profiles`` (default ``~/.config/gpuos-tools/profiles``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "gpuos-tools" / "profiles"

DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"name": "linnos", "file": "", "inputs": 31, "hidden": 256, "outputs": 2, "load_dir": ""},
    "ring": {"name": "gpuos-kinfer", "lanes": 64, "slots_per_lane": 8, "mode": "0600", "group": ""},
    "batch": {"window_us": 20.0, "max": 4096},
    "policy": {
        "cpu_below": 8, "busy_util": 70, "busy_procs": 1, "probe_batch": 64, "probe_idle_ms": 60.0,
        "probe_busy_ms": 20.0, "window_ms": 1000.0, "window_samples": 4096,
    },
    "native": {"mode": "auto", "max_batch": 64},
    "wait": {"spin_min_us": 200.0, "spin_max_us": 5000.0},
}


@dataclass(frozen=True)
class Rule:
    """What one profile key may hold. ``kind``: int, float (an integer is taken too), str, bool,
    "mode" (permission bits: an integer such as 0o660 or a string of octal digits) or list
    (of ``item``); ``low``/``high``: inclusive bounds of a number or of each list item;
    ``choices``: the strings allowed."""

    kind: Any
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    item: Any = None


#: The profile's schema, as data: every key of DEFAULTS (a key without a rule here must hold its
#: default's type) and the [calibration] table `calibrate` writes. Bounds refuse what cannot work
#: (a negative batch, a window of minus one microsecond) and what no machine could hold.
RULES: dict[str, dict[str, Rule]] = {
    "model": {"inputs": Rule(int, 1, 1 << 16), "hidden": Rule(int, 1, 1 << 16), "outputs": Rule(int, 1, 1 << 16)},
    "ring": {"lanes": Rule(int, 1, 1 << 16), "slots_per_lane": Rule(int, 1, 1 << 12), "mode": Rule("mode")},
    "batch": {"window_us": Rule(float, 0, 1e6), "max": Rule(int, 1, 1 << 20)},
    "wait": {"spin_min_us": Rule(float, 0, 1e7), "spin_max_us": Rule(float, 0, 1e7)},
    "policy": {
        "cpu_below": Rule(int, 0, 1 << 30), "busy_util": Rule(int, 0, 100), "busy_procs": Rule(int, 0, 1 << 16),
        "probe_batch": Rule(int, 1, 1 << 20), "probe_idle_ms": Rule(float, 1e-3, 1e7), "probe_busy_ms": Rule(float, 1e-3, 1e7),
        "window_ms": Rule(float, 1e-3, 1e7), "window_samples": Rule(int, 1, 1 << 24),
    },
    "native": {"mode": Rule(str, choices=("auto", "on", "off")), "max_batch": Rule(int, 0, 1 << 20)},
    "calibration": {
        "batches": Rule(list, 1, 1 << 30, item=int), "cpu_us": Rule(list, 0, 1e12, item=float),
        "gpu_us": Rule(list, 0, 1e12, item=float), "crossover": Rule(int, -1, 1 << 30), "host": Rule(str),
        "gpu": Rule(str), "date": Rule(str),
    },
}


def _rule(table: str, key: str) -> Rule | None:
    rule = RULES.get(table, {}).get(key)
    if rule is None and key in DEFAULTS.get(table, {}):
        default = DEFAULTS[table][key]
        rule = Rule(bool if isinstance(default, bool) else type(default))
    return rule


def parse_mode(value: Any) -> int:
    """Permission bits from a profile or a command line: an integer (0o660) or octal digits ("0660")."""
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text):
            raise ValueError(f"{value!r} is not an octal mode such as 0600 or 0660")
        value = int(text, 8)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        raise ValueError(f"{value!r} is not a file mode between 0000 and 0777")
    if value & 0o600 != 0o600:
        raise ValueError(f"mode {value:04o} leaves the owner without read and write")
    return value


def _check_value(rule: Rule, value: Any) -> str | None:
    """What is wrong with ``value`` under ``rule`` (None when it fits), in words."""
    if rule.kind == "mode":
        try:
            parse_mode(value)
        except ValueError as e:
            return str(e)
        return None
    if rule.kind is list:
        if not isinstance(value, list):
            return f"must be a list, not {_toml_type(value)}"
        for i, v in enumerate(value):
            problem = _check_value(Rule(rule.item, rule.low, rule.high), v)
            if problem:
                return f"item {i} {problem}"
        return None
    if rule.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, not {_toml_type(value)}"
        if not math.isfinite(value):
            return f"must be a finite number, not {value}"
    elif rule.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, not {_toml_type(value)}"
    elif not isinstance(value, rule.kind) or (rule.kind is int and isinstance(value, bool)):
        return f"must be {_toml_type(rule.kind())}, not {_toml_type(value)}"
    if rule.kind is str:
        if "\0" in value:
            return "must not contain a NUL character"
        if rule.choices and value not in rule.choices:
            return f"must be one of {', '.join(rule.choices)}, not {value!r}"
    if rule.low is not None and value < rule.low:
        return f"must be at least {_number(rule.low)}, not {value}"
    if rule.high is not None and value > rule.high:
        return f"must be at most {_number(rule.high)}, not {value}"
    return None


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _toml_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def validate_profile(data: dict[str, Any]) -> list[str]:
    """Every problem of a profile's parsed tables, each naming its [table] and key; empty when
    the profile is usable. Obsolete keys are left to the caller."""
    problems = []
    for table, keys in data.items():
        if table not in RULES and table not in DEFAULTS:
            problems.append(f"unknown table [{table}] (known: {', '.join(sorted({*DEFAULTS, *RULES}))})")
            continue
        if not isinstance(keys, dict):
            problems.append(f"{table} must be a table, not {_toml_type(keys)}")
            continue
        unknown = sorted(set(keys) - set(DEFAULTS.get(table, {})) - set(RULES.get(table, {})) - set(OBSOLETE.get(table, {})))
        if unknown:
            problems.append(f"unknown keys in [{table}]: {', '.join(unknown)}")
        for key, value in keys.items():
            rule = _rule(table, key)
            problem = None if rule is None else _check_value(rule, value)
            if problem:
                problems.append(f"[{table}] {key} {problem}")
    cal = data.get("calibration")
    if isinstance(cal, dict) and not problems:
        lengths = {k: len(cal[k]) for k in ("batches", "cpu_us", "gpu_us") if k in cal}
        if len(set(lengths.values())) > 1:
            problems.append("[calibration] batches, cpu_us and gpu_us must have one value per batch size "
                            f"({', '.join(f'{k} {n}' for k, n in lengths.items())})")
        elif list(cal.get("batches", [])) != sorted(set(cal.get("batches", []))):
            problems.append("[calibration] batches must be increasing")
    return problems


#: Keys that older profiles may still hold; read and ignored, with a message.
OBSOLETE = {"policy": {
    "busy_factor": "replaced by the measured GPU delay",
    "slowdown_samples": "replaced by window_samples: the estimate is now a mean over window_ms, not a median of a few",
    "slowdown_max_age_ms": "replaced by window_ms",
}}


@dataclass
class Policy:
    cpu_below: int = 8
    busy_util: int = 70
    busy_procs: int = 1
    probe_batch: int = 64
    probe_idle_ms: float = 60.0
    probe_busy_ms: float = 20.0
    window_ms: float = 1000.0
    window_samples: int = 4096
    batches: list[int] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    gpu_us: list[float] = field(default_factory=list)

    @property
    def calibrated(self) -> bool:
        return len(self.batches) >= 2 and len(self.cpu_us) == len(self.batches) == len(self.gpu_us)

    def estimate(self, side: str, batch: int) -> float:
        """Calibrated latency (µs) of a batch on ``side``, log-log interpolation, linear beyond."""
        return float(self.estimate_many(side, np.asarray([batch]))[0])

    def estimate_many(self, side: str, batches: np.ndarray) -> np.ndarray:
        ys = np.asarray(self.cpu_us if side == "cpu" else self.gpu_us, dtype=np.float64)
        xs = np.log(np.asarray(self.batches, dtype=np.float64))
        b = np.maximum(np.asarray(batches, dtype=np.float64), 1.0)
        inside = np.exp(np.interp(np.log(b), xs, np.log(np.maximum(ys, 1e-3))))
        # beyond the sweep: time grows at most linearly with the batch
        return np.where(b > self.batches[-1], ys[-1] * b / self.batches[-1], inside)

    def choose(self, batch: int, gpu_available: bool, busy: bool = False, gpu_delay_us: float = 0.0,
               cpu_fit: tuple[float, float] = (0.0, 1.0)) -> str:
        """CPU or GPU for one batch. ``gpu_delay_us``: the GPU's measured mean delay
        (``GpuSpeed.delay_us``), added to its curve; ``cpu_fit``: (a µs, b), the CPU's expected
        latency being a + b times its curve (``CpuSpeed.fit``); both used with a calibration.
        ``busy``: NVML's verdict, used without one (LAKE's rule)."""
        if not gpu_available:
            return "cpu"
        if self.calibrated:
            gpu = self.estimate("gpu", batch) + gpu_delay_us
            return "gpu" if gpu < cpu_fit[0] + cpu_fit[1] * self.estimate("cpu", batch) else "cpu"
        return "cpu" if batch < self.cpu_below or busy else "gpu"

    def cpu_batches(self, largest: int, gpu_available: bool, busy: bool = False, gpu_delay_us: float = 0.0,
                    cpu_fit: tuple[float, float] = (0.0, 1.0)) -> np.ndarray:
        """``choose`` for every batch size 0..largest at once: True where it says CPU."""
        b = np.arange(largest + 1)
        if not gpu_available:
            return np.ones(largest + 1, dtype=bool)
        if self.calibrated:
            return ~(self.estimate_many("gpu", b) + gpu_delay_us < cpu_fit[0] + cpu_fit[1] * self.estimate_many("cpu", b))
        return (b < self.cpu_below) | busy


class Speed:
    """How one side (``"cpu"`` or ``"gpu"``) runs now against its calibrated curve, from the
    batches measured on it in the last ``window_ms`` (at most ``window_samples`` of them): each
    sample is a measured latency beside the calibrated latency of its batch size.

    Two summaries, both of *means*, so that they follow the expected latency a producer sees:

    - ``slowdown()``: sum of measured over sum of calibrated latencies (the ratio of the means),
      for a side that runs everything proportionally slower (a CPU core shared with another
      thread);
    - ``delay_us()``: mean of measured minus calibrated, for a side that makes every batch wait
      the same extra time whatever its size (a GPU time-sliced with another process: on an
      H100 under a second process's matrix products every batch from 1 to 4096 rows took 2.41 ms,
      docs/benchmarks/gpu-kinfer-bridge.md).

    A median would not do: under a duty-cycled load most samples may see an idle GPU while the
    mean, which is what the producer pays, is set by the ones that waited. With no fresh samples
    the calibration stands (1.0, 0 µs); a sample that failed (``us`` infinite) makes both
    infinite while it is in the window. Without a calibration nothing is recorded.

    ``clock`` (seconds, monotonic) is injectable so the logic is tested without a GPU or a timer.
    Sums are kept running (a sample in, old ones out) because the daemon observes every batch.
    The calibrated latency of each batch size is computed once (numpy costs microseconds), so a
    ``Speed`` is for the curves its policy had when it first saw that size.
    """

    #: sizes whose calibrated latency is kept; past that the cache starts again
    CACHE_SIZES = 8192

    def __init__(self, policy: Policy, side: str, clock: Callable[[], float] = time.monotonic):
        if side not in ("cpu", "gpu"):
            raise ValueError(f"side must be cpu or gpu, not {side!r}")
        self.policy = policy
        self.side = side
        self.clock = clock
        self.samples: deque[tuple[float, float, float]] = deque()  # (when, measured µs, calibrated µs)
        self._sum_us = 0.0  # of the finite measured latencies in samples
        self._sum_cal = 0.0  # of their calibrated latencies
        self._sum_cal2 = 0.0  # of their squares
        self._sum_cal_us = 0.0  # of calibrated times measured
        self._failed = 0  # samples with an infinite latency
        self._calibrated_us: dict[int, float] = {}

    def observe(self, batch: int, us: float, now: float | None = None) -> None:
        """A batch of ``batch`` requests took ``us`` µs on this side."""
        if not us > 0:
            return
        cal = self._calibrated_us.get(batch)
        if cal is None:  # a size not seen yet (or a policy without curves: nothing to compare with)
            if batch < 1 or not self.policy.calibrated:
                return
            if len(self._calibrated_us) >= self.CACHE_SIZES:
                self._calibrated_us.clear()
            cal = self._calibrated_us[batch] = self.policy.estimate(self.side, batch)
        now = self.clock() if now is None else now
        self.samples.append((now, us, cal))
        if math.isfinite(us):
            self._sum_us += us
            self._sum_cal += cal
            self._sum_cal2 += cal * cal
            self._sum_cal_us += cal * us
        else:
            self._failed += 1
        while len(self.samples) > max(1, self.policy.window_samples):
            self._drop()
        self._observed(now)

    def _observed(self, now: float) -> None:
        """Called after each sample (the GPU draws its next probe interval here)."""

    def _drop(self) -> None:
        _, us, cal = self.samples.popleft()
        if math.isfinite(us):
            self._sum_us -= us
            self._sum_cal -= cal
            self._sum_cal2 -= cal * cal
            self._sum_cal_us -= cal * us
        else:
            self._failed -= 1
        if not self.samples:  # start again from exact zeros: no rounding left over
            self._sum_us = self._sum_cal = self._sum_cal2 = self._sum_cal_us = 0.0
            self._failed = 0

    def _expire(self, now: float | None) -> int:
        """Drop the samples older than the window; the number left."""
        now = self.clock() if now is None else now
        oldest = now - self.policy.window_ms / 1e3
        while self.samples and self.samples[0][0] < oldest:
            self._drop()
        return len(self.samples)

    def fresh(self, now: float | None = None) -> list[float]:
        """Measured over calibrated latency of each sample in the window, oldest first."""
        self._expire(now)
        return [us / cal for _, us, cal in self.samples]

    def slowdown(self, now: float | None = None) -> float:
        """Mean measured latency over mean calibrated latency in the window; 1.0 without samples."""
        if not self._expire(now):
            return 1.0
        if self._failed:
            return math.inf
        return self._sum_us / self._sum_cal if self._sum_cal > 0 else 1.0

    def delay_us(self, now: float | None = None) -> float:
        """Mean of measured minus calibrated latency (µs) in the window; 0 without samples."""
        n = self._expire(now)
        if not n:
            return 0.0
        if self._failed:
            return math.inf
        return (self._sum_us - self._sum_cal) / n

    def last_seen(self) -> float | None:
        return self.samples[-1][0] if self.samples else None

    def reset(self) -> None:
        """Forget every sample: the calibration stands again."""
        self.samples.clear()
        self._sum_us = self._sum_cal = self._sum_cal2 = self._sum_cal_us = 0.0
        self._failed = 0


class CpuSpeed(Speed):
    """The CPU's expected latency as ``a + b * calibrated`` (``fit()``), from the CPU batches the
    daemon times (the model's forward pass, as ``calibrate`` times it). No probes: the daemon
    runs CPU batches all the time, and when none ran lately the calibration (0, 1) stands.

    Two things slow the CPU against its curve, and they scale differently. A batch run alone, not
    back to back as ``calibrate`` runs them, pays a roughly *fixed* extra (on the H100's host: 47 µs
    at batch 1, 77 at 64, 87 at 128, 98 at 256; docs/benchmarks/gpu-kinfer-bridge.md, 2026-11-24 run
    2), so a ratio learnt at batch 64 (4.4) overstated batch 128 (3.0) and the policy sent it to the
    GPU. Another process on the cores slows every batch *in proportion*. So: when the window's
    samples span several batch sizes (coefficient of variation of their calibrated latencies at
    least ``FIT_MIN_SPREAD``, at least ``FIT_MIN_SAMPLES`` of them), a least-squares line through
    them, its slope kept between 1 (all fixed) and the ratio of the means (all proportional); a line
    between those two always passes through the means, so the fit can only move the estimate between
    the two pure forms. With one size in the window (or too few) the two cannot be told apart and
    the fixed extra is taken (b = 1): it is what an isolated small batch pays, and it errs low, not
    high, for larger batches — by as much as half at 4x the size (run 3: 190 µs extra at batch 256,
    380 at 1024, and a batch of 1024 kept on the CPU that the GPU ran faster)."""

    #: coefficient of variation of the window's calibrated latencies from which a slope is fitted
    FIT_MIN_SPREAD = 0.25
    #: samples the window must hold for a slope
    FIT_MIN_SAMPLES = 8

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic):
        super().__init__(policy, "cpu", clock)

    def fit(self, now: float | None = None) -> tuple[float, float]:
        """(a µs, b): the CPU's expected latency at a batch is a + b times its calibrated latency.
        (0, 1) without samples, (inf, 1) while a failed one is in the window."""
        total = self._expire(now)
        if not total:
            return 0.0, 1.0
        if self._failed:
            return math.inf, 1.0
        n = total
        mean_cal, mean_us = self._sum_cal / n, self._sum_us / n
        if mean_cal <= 0:
            return 0.0, 1.0
        b = 1.0
        var = max(0.0, self._sum_cal2 / n - mean_cal * mean_cal)
        if n >= self.FIT_MIN_SAMPLES and var > (self.FIT_MIN_SPREAD * mean_cal) ** 2:
            slope = (self._sum_cal_us / n - mean_cal * mean_us) / var
            ratio = mean_us / mean_cal
            b = min(max(slope, min(1.0, ratio)), max(1.0, ratio))
        return mean_us - b * mean_cal, b


class GpuSpeed(Speed):
    """The GPU's measured delay (``delay_us()``), from the daemon's own GPU batches (end to end:
    copies and sync included) and from probes, timed when no batch measured it lately
    (``probe_due``).

    A probe measures what the next request would pay: one run, timed, as a request's batch is
    run. Dense traffic keeps the window full of real batches (a warm GPU); sparse traffic fills
    it with probes and isolated batches, each paying whatever an idle GPU makes a lone batch pay
    (on an H100 ~200 µs for batches 7 ms apart, against 30 µs back to back:
    docs/benchmarks/gpu-kinfer-bridge.md, 2026-11-24). Either way the window holds the kind of
    batch the traffic sends, as the CPU's does.

    Probe intervals are drawn uniformly from ``PROBE_JITTER`` either side of the nominal period,
    afresh after every measurement, so that probes do not lock onto the phase of a periodic
    load (a second process that computes for 40 ms of every 65 would otherwise be seen always
    at the same point of its cycle). The nominal period is capped so that even the longest
    interval leaves ``MIN_PROBES_IN_WINDOW`` probes in ``window_ms``: one probe is too few for
    a mean (an idle H100 gave single probes of 41 to 248 µs for batch 64). At idle the default
    period is 60 ms (~16 probes in a 1 s window): with 3 to 5 probes the idle delay came out at
    125 to 344 µs where isolated batches paid 181 to 215 (docs/benchmarks/gpu-kinfer-bridge.md,
    2026-11-24 run 2), enough to flip picks near the crossover; an idle probe holds the Python
    loop ~200 µs, so ~0.3 % of its time. ``rng`` is injectable for tests.
    """

    #: probe interval: the nominal period times a factor uniform in [1 - PROBE_JITTER, 1 + PROBE_JITTER]
    PROBE_JITTER = 0.5
    #: probes the window holds at least, without other GPU batches (the nominal period's cap)
    MIN_PROBES_IN_WINDOW = 2

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        super().__init__(policy, "gpu", clock)
        self.rng = rng if rng is not None else random.Random()
        self.probes = 0
        self.last_probe_us: float | None = None
        self._factor = 1.0  # this interval's jitter factor
        self._last = None  # when the daemon last ran anything on the GPU (samples may have aged out)

    def _observed(self, now: float) -> None:
        self._last = now
        self._factor = 1.0 + self.PROBE_JITTER * (2.0 * self.rng.random() - 1.0)

    def period_s(self, others_on_gpu: bool) -> float:
        """The nominal probe period: ``probe_busy_ms`` while another process is on the GPU,
        ``probe_idle_ms`` otherwise, at most ``window_ms / (MIN_PROBES_IN_WINDOW * (1 +
        PROBE_JITTER))`` (333 ms with a 1 s window)."""
        nominal = self.policy.probe_busy_ms if others_on_gpu else self.policy.probe_idle_ms
        cap = self.policy.window_ms / (self.MIN_PROBES_IN_WINDOW * (1.0 + self.PROBE_JITTER))
        return min(nominal, cap) / 1e3

    def probe_due(self, others_on_gpu: bool, now: float | None = None) -> bool:
        """Should the daemon time a probe batch on the GPU now? When its last measurement is older
        than ``period_s`` (jittered)."""
        if not self.policy.calibrated:
            return False
        now = self.clock() if now is None else now
        if self._last is None:
            return True
        return now - self._last >= self.period_s(others_on_gpu) * self._factor

    def probe(self, forward: Callable[[np.ndarray], Any], inputs: np.ndarray | None = None) -> float:
        """Time one batch of ``probe_batch`` rows through ``forward`` (the GPU's) and record it.

        One run, timed, with no untimed run before it, however long the GPU was left alone: a
        request arriving then would pay the GPU's wake-up too, so the probe must. Not the best
        of several either: the estimate is a mean, and a probe that waited behind another
        process's work is exactly what a batch sent then would have paid."""
        n = max(1, self.policy.probe_batch)
        x = inputs if inputs is not None else probe_inputs(n, 31)
        t0 = time.perf_counter_ns()
        forward(x)
        us = (time.perf_counter_ns() - t0) / 1e3
        self.observe(len(x), us)
        self.probes += 1
        self.last_probe_us = us
        return us


def probe_inputs(batch: int, n_inputs: int) -> np.ndarray:
    """Digits, as LinnOS inputs are: what the probe sends through the GPU."""
    return (np.arange(batch * n_inputs, dtype=np.int64).reshape(batch, n_inputs) * 7 % 10).astype(np.float32)


def crossover(batches: list[int], cpu_us: list[float], gpu_us: list[float]) -> int | None:
    """Smallest measured batch from which the GPU is faster at every larger measured batch."""
    best = None
    for b, c, g in reversed(list(zip(batches, cpu_us, gpu_us))):
        if g < c:
            best = b
        else:
            break
    return best


# -- GPU load ---------------------------------------------------------------------------------


class GpuLoad:
    """Samples NVML in a thread (utilisation and other processes on one GPU) every ``period_s``,
    so that the daemon reads a flag instead of calling NVML per batch."""

    def __init__(self, policy: Policy, device: int = 0, period_s: float = 0.02, nvml: Any = None):
        self.policy = policy
        self.busy = False
        self.util = 0
        self.others = 0
        self.error: str | None = None
        self._device = device
        self._period = period_s
        self._nvml = nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(self._device)
        self.util = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
        me = os.getpid()
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
        except Exception:
            procs = []
        self.others = sum(1 for p in procs if int(p.pid) != me)
        self.busy = self.util > self.policy.busy_util and self.others >= self.policy.busy_procs

    def start(self) -> bool:
        """Start sampling; False (and ``error`` says why) when NVML is not there."""
        if self._nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as e:  # ImportError, NVMLError...
                self.error = f"NVML unavailable ({e}); the GPU is taken as idle"
                return False
        try:
            self.sample()
        except Exception as e:
            self.error = f"NVML failed ({e}); the GPU is taken as idle"
            return False
        self._thread = threading.Thread(target=self._run, name="kinfer-nvml", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.sample()
            except Exception as e:
                self.error = f"NVML failed ({e})"
                self.busy = False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)


# -- profiles ---------------------------------------------------------------------------------


@dataclass
class Profile:
    path: Path | None
    data: dict[str, dict[str, Any]]

    def section(self, name: str) -> dict[str, Any]:
        return {**DEFAULTS.get(name, {}), **self.data.get(name, {})}

    def policy(self) -> Policy:
        p = self.section("policy")
        cal = self.data.get("calibration", {})
        return Policy(
            cpu_below=int(p["cpu_below"]),
            busy_util=int(p["busy_util"]),
            busy_procs=int(p["busy_procs"]),
            probe_batch=int(p["probe_batch"]),
            probe_idle_ms=float(p["probe_idle_ms"]),
            probe_busy_ms=float(p["probe_busy_ms"]),
            window_ms=float(p["window_ms"]),
            window_samples=int(p["window_samples"]),
            batches=[int(b) for b in cal.get("batches", [])],
            cpu_us=[float(v) for v in cal.get("cpu_us", [])],
            gpu_us=[float(v) for v in cal.get("gpu_us", [])],
        )

    def model_file(self) -> Path | None:
        name = self.section("model")["file"]
        return self.relative(name) if name else None

    def relative(self, name: str) -> Path:
        """A path the profile names: relative ones are taken from the profile's directory."""
        path = Path(name)
        return path if path.is_absolute() or self.path is None else self.path.parent / path


def find_profile(name_or_path: str) -> Path:
    """A path as given (it ends in .toml or names a directory), or a name: the user's own
    NAME.toml (``user_profile_dir()``) if there is one, else the one shipped with the package."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or "/" in name_or_path:
        return path
    own = user_profile_dir() / f"{name_or_path}.toml"
    return own if own.is_file() else PROFILE_DIR / f"{name_or_path}.toml"


def is_shipped(path: Path | None) -> bool:
    """True for a profile installed with the package (never rewritten: calibrate writes a copy)."""
    return path is not None and path.resolve().parent == PROFILE_DIR


def load_profile(name_or_path: str | None) -> Profile:
    """Read and validate a profile: every key's type and range (``RULES``), unknown tables and
    keys refused; each problem is a BAD_INPUT error naming the file, the table and the key."""
    if name_or_path is None:
        return Profile(None, {})
    path = find_profile(name_or_path)
    data = load_toml(path)  # a regular file, bounded, UTF-8 (gpuos_tools/tomlfile.py)
    for table, keys in data.items():
        if isinstance(keys, dict):
            for key in set(keys) & set(OBSOLETE.get(table, {})):
                print(f"gpu-kinfer-bridge: {path}: [{table}] {key} is ignored ({OBSOLETE[table][key]})", file=sys.stderr)
                del keys[key]
    problems = validate_profile(data)
    if problems:
        raise GpuosError(f"{path}: " + "; ".join(problems), ExitCode.BAD_INPUT)
    return Profile(path, data)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(round(value, 3)) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to a profile")


def dump_profile(data: dict[str, dict[str, Any]], comment: str = "") -> str:
    """TOML text of a profile: one table per section, keys in insertion order."""
    lines = [f"# {line}" if line else "#" for line in comment.splitlines()]
    for table, keys in data.items():
        lines += ["", f"[{table}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in keys.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def write_profile(path: Path, data: dict[str, dict[str, Any]], comment: str = "") -> None:
    """Write atomically (temp file + rename), as sponge does."""
    text = dump_profile(data, comment)
    tomllib.loads(text)  # never write what cannot be read back
    atomic.replace(str(path), text.encode("utf-8"))


def steady_curve(run: Callable[[int], Callable[[], Any]], batches: list[int], reps: int, passes: int = 3,
                 warm_s: float = 0.3, warmup: int = 3) -> list[float]:
    """Latency (µs) per batch size for a calibration curve: ``run(batch)`` gives the function to
    time. Each of ``passes`` sweeps (alternately upwards and downwards) starts with ``warm_s``
    seconds of work at the largest batch, and each batch keeps the lowest of its per-pass
    medians. One sweep is not enough on a GPU: measured on an H100, a sweep right after idle time
    gave medians of 329 µs at batch 64 and 395 µs at 2048 where the steady figure was 45 µs, and
    a policy scaling such a curve picked the wrong side (docs/benchmarks/gpu-kinfer-bridge.md)."""
    best = [math.inf] * len(batches)
    largest = run(max(batches))
    for p in range(max(1, passes)):
        end = time.perf_counter() + warm_s
        while time.perf_counter() < end:
            largest()
        order = range(len(batches)) if p % 2 == 0 else range(len(batches) - 1, -1, -1)
        for i in order:
            best[i] = min(best[i], time_us(run(batches[i]), reps, warmup))
    return [round(v, 3) for v in best]


def time_us(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in µs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e3
