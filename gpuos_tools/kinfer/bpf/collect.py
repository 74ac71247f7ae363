"""Kernel-side block-I/O traces and live LinnOS decisions, from the loader's joined records.

- ``resolve_disk``: a disk named as the user would (``vda``, ``/dev/vda``, ``254:0``, or any
  path on a filesystem: the disk under it) to the kernel's number the program filters on;
- ``Converter``: joined records to ``io`` records (traces.py's format, plus what only the
  kernel knows: the 31 inputs as the kernel built them, ``x``; the hardware queue; the task;
  and, when a daemon was asked, its decision, how long after the issue the daemon had written
  it, ``decided_us``, and the loader had seen it, ``added_us``);
- ``WatchStats``: per-disk accuracy and added latency of the live decisions;
- ``capture``: the loop that drives a ``loader.Loader`` until a program exits, a duration or a
  read count is reached, or ``stop`` is set.

A read cannot be redirected from here: the decision is known only once the request is already
on its way to the disk (changing where it goes would take a kernel change). So hedging stays
a replay of the recorded decisions (``gpu-kinfer-bridge replay`` on a collected trace), and
``added`` latency is what a kernel waiting for the answer before sending the read would pay.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuos_tools.kinfer.bpf.loader import PREDICTED

SYS_BLOCK = Path("/sys/dev/block")


def make_dev(major: int, minor: int) -> int:
    """The kernel's dev_t (major << 20 | minor), as the program reports disks."""
    return (major << 20) | minor


def split_dev(dev: int) -> tuple[int, int]:
    return dev >> 20, dev & ((1 << 20) - 1)


def disk_name(dev: int, sys_block: Path = SYS_BLOCK) -> str:
    """``vda`` for 254:0; ``MAJ:MIN`` when sysfs does not know it (a disk gone meanwhile)."""
    major, minor = split_dev(dev)
    try:
        return os.path.basename(os.readlink(sys_block / f"{major}:{minor}"))
    except OSError:
        return f"{major}:{minor}"


def _whole_disk(major: int, minor: int, sys_block: Path = SYS_BLOCK) -> int | None:
    """The whole disk of a block device number (a partition's parent), None when not a block device."""
    node = sys_block / f"{major}:{minor}"
    if not node.exists():
        return None
    if (node / "partition").exists():
        parent = (node.resolve().parent / "dev").read_text().strip()
        major, minor = (int(v) for v in parent.split(":"))
    return make_dev(major, minor)


def resolve_disk(spec: str, sys_block: Path = SYS_BLOCK) -> int:
    """The disk ``spec`` names: ``vda``, ``/dev/vda``, ``MAJ:MIN``, or a path on a filesystem.

    ValueError says why a spec names no disk (a tmpfs path, an unknown name...).
    """
    if ":" in spec and all(part.isdigit() for part in spec.split(":", 1)):
        major, minor = (int(v) for v in spec.split(":", 1))
        dev = _whole_disk(major, minor, sys_block)
        if dev is None:
            raise ValueError(f"{spec}: no such block device")
        return dev
    if "/" not in spec:
        block = Path("/sys/class/block") / spec
        if not (block / "dev").exists():
            raise ValueError(f"{spec}: no such disk (see lsblk)")
        major, minor = (int(v) for v in (block / "dev").read_text().split(":"))
        dev = _whole_disk(major, minor, sys_block)
        assert dev is not None
        return dev
    try:
        st = os.stat(spec)
    except OSError as e:
        raise ValueError(f"{spec}: {e.strerror}") from None
    number = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
    dev = _whole_disk(os.major(number), os.minor(number), sys_block)
    if dev is None:
        raise ValueError(f"{spec}: not on a block device (device {os.major(number)}:{os.minor(number)}: tmpfs, overlay or a network filesystem?)")
    return dev


class Converter:
    """Joined records (loader.RECORD_DTYPE) to ``io`` records.

    ``dev`` in the records is a small index, in the order disks first appear (replay hedges a
    read to the next one); ``disk`` names it. ``t_us`` is the issue time since ``t0_ns``
    (CLOCK_MONOTONIC). Records come in completion order.
    """

    def __init__(self, t0_ns: int):
        self.t0_ns = t0_ns
        self.index: dict[int, int] = {}
        self.names: dict[int, str] = {}

    def disk(self, dev: int) -> int:
        if dev not in self.index:
            self.index[dev] = len(self.index)
            self.names[dev] = disk_name(dev)
        return self.index[dev]

    def disks(self) -> list[dict[str, Any]]:
        return [{"dev": i, "disk": self.names[d], "devno": "%d:%d" % split_dev(d)} for d, i in self.index.items()]

    def records(self, recs: np.ndarray) -> list[dict[str, Any]]:
        out = []
        t0 = self.t0_ns
        for r in recs.tolist():  # tuples in RECORD_DTYPE's field order: fast to walk
            (issue, done, sector, seen, submit, answer, decided, dev, size, pending, pid, hwq, error, decision, batch,
             where, status, comm, op, predicted, features) = r
            rec: dict[str, Any] = {
                "type": "io", "dev": self.disk(dev), "disk": self.names[dev], "t_us": round((issue - t0) / 1e3, 3),
                "op": "R" if op == 0 else "W", "offset": sector * 512, "size": size, "pending": pending,
                "lat_us": round((done - issue) / 1e3, 3), "hwq": hwq, "pid": pid, "comm": comm.decode(errors="replace"),
            }
            if error:
                rec["error"] = error
            if op == 0:
                rec["x"] = features.tolist()
                if predicted:
                    rec["predicted"] = PREDICTED.get(predicted, str(predicted))
                if predicted == 1:
                    rec["decision"] = decision
                    rec["batch"] = batch
                    rec["where"] = "gpu" if where == 1 else "cpu"
                    rec["infer_us"] = round((answer - submit) / 1e3, 3)
                    rec["added_us"] = round((answer - issue) / 1e3, 3)
                    rec["decided_us"] = round((decided - issue) / 1e3, 3)
                elif predicted == 5:
                    rec["status"] = status
            out.append(rec)
        return out


class Reservoir:
    """A uniform sample of at most ``size`` values (percentiles of a long run in bounded memory)."""

    def __init__(self, size: int = 200_000, seed: int = 0):
        self.size, self.seen, self.values = size, 0, []  # type: ignore[var-annotated]
        self.rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            k = self.rng.randrange(self.seen)
            if k < self.size:
                self.values[k] = value

    def summary(self) -> dict[str, float] | None:
        if not self.values:
            return None
        a = np.asarray(self.values)
        return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
                "mean": round(float(a.mean()), 3)}


@dataclass
class DiskStats:
    """One disk's reads and the daemon's decisions on them."""

    reads: int = 0
    writes: int = 0
    predicted: int = 0
    predicted_slow: int = 0
    slow: int = 0  # of the predicted reads, those slower than the threshold
    right: int = 0
    false_fast: int = 0  # slow reads predicted fast
    false_slow: int = 0  # fast reads predicted slow
    unpredicted: dict[str, int] = field(default_factory=dict)
    added: Reservoir = field(default_factory=Reservoir)
    decided: Reservoir = field(default_factory=Reservoir)
    round_trip: Reservoir = field(default_factory=Reservoir)
    latency: Reservoir = field(default_factory=Reservoir)

    def add(self, rec: dict[str, Any], threshold_us: float) -> None:
        if rec["op"] != "R":
            self.writes += 1
            return
        self.reads += 1
        self.latency.add(rec["lat_us"])
        if "decision" not in rec:
            reason = rec.get("predicted", "none")
            self.unpredicted[reason] = self.unpredicted.get(reason, 0) + 1
            return
        self.predicted += 1
        slow = rec["lat_us"] > threshold_us
        said_slow = rec["decision"] == 1
        self.slow += slow
        self.predicted_slow += said_slow
        self.right += slow == said_slow
        self.false_fast += slow and not said_slow
        self.false_slow += said_slow and not slow
        self.added.add(rec["added_us"])
        self.decided.add(rec["decided_us"])
        self.round_trip.add(rec["infer_us"])

    def report(self) -> dict[str, Any]:
        n = self.predicted
        fast = n - self.slow
        return {
            "reads": self.reads, "writes": self.writes, "predicted": n, "predicted_slow": self.predicted_slow,
            "slow": self.slow,
            "accuracy": round(self.right / n, 4) if n else None,
            "always_fast_accuracy": round(fast / n, 4) if n else None,
            "false_fast": round(self.false_fast / self.slow, 4) if self.slow else None,
            "false_slow": round(self.false_slow / fast, 4) if fast else None,
            "added_us": self.added.summary(), "decided_us": self.decided.summary(), "round_trip_us": self.round_trip.summary(),
            "read_latency_us": self.latency.summary(), "unpredicted": dict(self.unpredicted),
        }


class WatchStats:
    """Per-disk statistics, for an interval and for the whole run."""

    def __init__(self, threshold_us: float):
        self.threshold_us = threshold_us
        self.total: dict[str, DiskStats] = {}
        self.interval: dict[str, DiskStats] = {}

    def add(self, records: Sequence[dict[str, Any]]) -> None:
        for rec in records:
            for table in (self.total, self.interval):
                table.setdefault(rec["disk"], DiskStats()).add(rec, self.threshold_us)

    def reports(self, scope: str, seconds: float) -> list[dict[str, Any]]:
        table = self.total if scope == "total" else self.interval
        out = [{"type": "kinfer_watch", "scope": scope, "disk": disk, "seconds": round(seconds, 3),
                "threshold_us": self.threshold_us, **stats.report()} for disk, stats in sorted(table.items())]
        if scope == "interval":
            self.interval = {}
        return out


@dataclass
class Capture:
    """What ``capture`` did: why it stopped, how long, the program's exit status."""

    reason: str
    seconds: float
    reads: int
    records: int
    returncode: int | None = None


def capture(
    loader: Any,
    sink: Callable[[np.ndarray], None],
    *,
    seconds: float | None = None,
    reads: int | None = None,
    program: Sequence[str] | None = None,
    stop: threading.Event | None = None,
    tick: Callable[[float], None] | None = None,
    tick_s: float = 1.0,
    program_stdout: Any = None,
) -> Capture:
    """Start ``loader`` (already loaded) and hand every batch of joined records to ``sink``
    until ``program`` (started here, after the tracepoints are attached) exits, ``seconds``
    pass, ``reads`` reads are recorded or ``stop`` is set; ``tick(elapsed)`` every ``tick_s``.

    The program's standard output goes to ``program_stdout`` (default: this process's stderr,
    so that a data stream on stdout stays clean). The loader is stopped, and what it still
    held handed to ``sink``, before this returns; if the program is still running then (a
    duration or read count was reached first), it is terminated.
    """
    stop = stop or threading.Event()
    loader.start()
    t0 = time.monotonic()
    proc = None
    reason = "stopped"
    n_reads = n_records = 0
    next_tick = t0 + tick_s
    try:
        if program:
            try:
                proc = subprocess.Popen(list(program), stdin=subprocess.DEVNULL,
                                        stdout=program_stdout if program_stdout is not None else 2)
            except OSError as e:
                raise FileNotFoundError(e.errno, f"{program[0]}: {e.strerror}") from None
        while True:
            recs = loader.take(0.05)
            if len(recs):
                n_records += len(recs)
                n_reads += int((recs["op"] == 0).sum())
                sink(recs)
            now = time.monotonic()
            if tick is not None and now >= next_tick:
                tick(now - t0)
                next_tick = now + tick_s
            if stop.is_set():
                break
            if proc is not None and proc.poll() is not None:
                reason = "program exited"
                break
            if seconds is not None and now - t0 >= seconds:
                reason = "duration reached"
                break
            if reads is not None and n_reads >= reads:
                reason = "read count reached"
                break
    finally:
        loader.stop()
        rest = loader.take(0.0)
        while len(rest):
            n_records += len(rest)
            n_reads += int((rest["op"] == 0).sum())
            sink(rest)
            rest = loader.take(0.0)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return Capture(reason, time.monotonic() - t0, n_reads, n_records, proc.returncode if proc is not None else None)
