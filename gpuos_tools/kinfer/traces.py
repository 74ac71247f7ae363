"""Block-I/O traces for LinnOS: collected for real on this machine, or synthesised.

Both write the same records (one per I/O, in issue order, after a gpuos header whose ``trace``
field says ``collected`` or ``synthetic``)::

    {"type": "io", "dev": 0, "t_us": 1234.5, "op": "R", "offset": 8192, "size": 4096,
     "pending": 12, "lat_us": 87.3}

``dev`` is the device (LinnOS hedges a read to another device, the replica), ``t_us`` the
issue time from the start, ``pending`` the I/Os in flight on that device when this one was
issued, in 4 KiB units, and ``lat_us`` its latency.

- ``collect``: real reads and writes with O_DIRECT (no page cache) on files, one file per
  "device", ``depth`` threads per file; the pending count and latency are measured around each
  ``preadv``/``pwritev`` call. On one disk the two files share the hardware, so their slow
  periods are correlated, which understates what hedging to a real replica gains.
- ``synthesize``: Poisson arrivals, log-normal sizes, a few parallel channels per device, and
  periodic slow phases (garbage collection) at a random phase per device; seeded.
"""

from __future__ import annotations

import heapq
import mmap
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 4096


def _sizes(rng: np.random.Generator, n: int, median: int, sigma: float, largest: int) -> np.ndarray:
    raw = rng.lognormal(np.log(median), sigma, n)
    return np.clip(np.ceil(raw / PAGE) * PAGE, PAGE, largest).astype(np.int64)


def synthesize(
    n: int,
    *,
    seed: int = 0,
    devices: int = 2,
    rate_per_s: float = 8_000.0,
    read_fraction: float = 0.7,
    median_size: int = 16 * 1024,
    size_sigma: float = 0.8,
    channels: int = 4,
    gc_period_ms: float = 100.0,
    gc_duty: float = 0.1,
    gc_slowdown: float = 8.0,
    capacity: int = 1 << 34,
) -> list[dict[str, Any]]:
    """``n`` I/Os over ``devices`` devices, as records sorted by issue time.

    Each device serves its own Poisson stream (``rate_per_s`` each) on ``channels`` FIFO
    channels; a request's service time is a base (reads 60 µs, writes 20 µs) plus 2 µs per
    4 KiB, times log-normal noise, times ``gc_slowdown`` when it starts inside the device's
    slow phase (``gc_duty`` of every ``gc_period_ms``).
    """
    rng = np.random.default_rng(seed)
    per = [n // devices + (1 if d < n % devices else 0) for d in range(devices)]
    out: list[dict[str, Any]] = []
    period = gc_period_ms * 1000.0
    for dev, count in enumerate(per):
        if count == 0:
            continue
        t = np.cumsum(rng.exponential(1e6 / rate_per_s, count))
        reads = rng.random(count) < read_fraction
        size = _sizes(rng, count, median_size, size_sigma, 1 << 20)
        offset = rng.integers(0, capacity // PAGE, count) * PAGE
        noise = rng.lognormal(0.0, 0.25, count)
        phase = rng.uniform(0, period)
        free = [0.0] * channels
        inflight: list[tuple[float, int]] = []  # (finish, pages)
        pages_inflight = 0
        for i in range(count):
            ti = float(t[i])
            while inflight and inflight[0][0] <= ti:
                pages_inflight -= heapq.heappop(inflight)[1]
            ch = min(range(channels), key=free.__getitem__)
            start = max(ti, free[ch])
            service = (60.0 if reads[i] else 20.0) + 2.0 * size[i] / PAGE
            service *= noise[i]
            if (start + phase) % period < gc_duty * period:
                service *= gc_slowdown
            finish = start + service
            free[ch] = finish
            pages = int(size[i] // PAGE)
            out.append({
                "type": "io", "dev": dev, "t_us": round(ti, 3), "op": "R" if reads[i] else "W",
                "offset": int(offset[i]), "size": int(size[i]), "pending": pages_inflight,
                "lat_us": round(finish - ti, 3),
            })
            heapq.heappush(inflight, (finish, pages))
            pages_inflight += pages
    out.sort(key=lambda r: r["t_us"])
    return out


def collect(
    directory: str | os.PathLike[str],
    reads: int | None,
    *,
    devices: int = 2,
    depth: int = 4,
    file_size: int = 256 << 20,
    write_fraction: float = 0.2,
    median_size: int = 16 * 1024,
    seed: int = 0,
    keep_files: bool = False,
    stop: threading.Event | None = None,
    ready: threading.Event | None = None,
) -> list[dict[str, Any]]:
    """Real I/O with O_DIRECT: ``devices`` files of ``file_size`` bytes in ``directory``,
    ``depth`` threads each, until ``reads`` reads have completed, shared evenly among the
    devices (each stops at its share, so every device has reads to hedge to, however the
    threads were scheduled; a few more may complete while the last ones are in flight), or
    until ``stop`` is set (``reads`` None: only then). Records sorted by issue time.

    The files are filled with random bytes first (so reads hit allocated blocks; ``ready`` is
    set once they are and the I/O starts) and removed at the end unless ``keep_files``. Raises
    OSError when the filesystem refuses O_DIRECT, and ValueError when there are fewer reads
    than devices. Used as a load generator too (the eBPF collector records what the kernel saw
    of it).
    """
    if devices < 1 or depth < 1:
        raise ValueError("devices and depth must be at least 1")
    if reads is not None and reads < devices:
        raise ValueError(f"{reads} reads cannot give each of {devices} devices one")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = [directory / f"kinfer-io-{os.getpid()}-{d}.bin" for d in range(devices)]
    chunk = os.urandom(1 << 20)
    for path in paths:
        with open(path, "wb") as f:
            for _ in range(file_size >> 20):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    fds = [os.open(p, os.O_RDWR | os.O_DIRECT) for p in paths]
    lock = threading.Lock()
    pending = [0] * devices
    records: list[dict[str, Any]] = []
    # each device's share of the reads; a device's threads stop once it has done its share
    share = [reads // devices + (1 if d < reads % devices else 0) for d in range(devices)] if reads is not None else None
    done_reads = [0] * devices
    stop = stop or threading.Event()  # all of them (the caller's, or the end)
    stopped = [threading.Event() for _ in range(devices)]  # one device's share done
    t0 = time.perf_counter_ns()
    largest = 256 * 1024

    def worker(dev: int, wseed: int) -> None:
        wrng = np.random.default_rng(wseed)
        buf = mmap.mmap(-1, largest)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        fd = fds[dev]
        try:
            while not (stopped[dev].is_set() or stop.is_set()):
                size = int(_sizes(wrng, 1, median_size, 0.8, largest)[0])
                offset = int(wrng.integers(0, (file_size - size) // PAGE + 1)) * PAGE
                is_read = wrng.random() >= write_fraction
                pages = size // PAGE
                with lock:
                    ahead = pending[dev]
                    pending[dev] += pages
                start = time.perf_counter_ns()
                if is_read:
                    os.preadv(fd, [view[:size]], offset)
                else:
                    os.pwritev(fd, [view[:size]], offset)
                end = time.perf_counter_ns()
                with lock:
                    pending[dev] -= pages
                    records.append({
                        "type": "io", "dev": dev, "t_us": round((start - t0) / 1e3, 3), "op": "R" if is_read else "W",
                        "offset": offset, "size": size, "pending": ahead, "lat_us": round((end - start) / 1e3, 3),
                    })
                    if is_read:
                        done_reads[dev] += 1
                        if share is not None and done_reads[dev] >= share[dev]:
                            stopped[dev].set()
        finally:
            view.release()
            buf.close()

    threads = [
        threading.Thread(target=worker, args=(dev, int(rng.integers(1 << 31))), daemon=True)
        for dev in range(devices) for _ in range(depth)
    ]
    try:
        for th in threads:
            th.start()
        if ready is not None:
            ready.set()
        for th in threads:
            th.join()
    finally:
        stop.set()
        for fd in fds:
            os.close(fd)
        if not keep_files:
            for path in paths:
                path.unlink(missing_ok=True)
    records.sort(key=lambda r: r["t_us"])
    return records


class Load:
    """``collect``'s O_DIRECT reads and writes as a background workload (one thread per folder),
    and optionally a bursty buffered writer on the first folder (``burst_mib`` written then
    fsynced, at random pauses up to ``burst_pause_ms``): the writeback bursts stand for the slow
    periods LinnOS learns to see coming. For tracing what the kernel sees of it (``collect
    --source ebpf --dir``, scripts/linnos_ebpf.py). ``start`` returns once the test files are
    written (OSError when a folder refuses O_DIRECT); ``close`` stops it and removes them."""

    def __init__(self, dirs: list[str | os.PathLike[str]], *, devices: int = 2, depth: int = 4, file_size: int = 256 << 20,
                 write_fraction: float = 0.2, seed: int = 0, burst_mib: int = 0, burst_pause_ms: float = 400.0):
        self.stop = threading.Event()
        self.errors: list[OSError] = []
        self.ready: list[threading.Event] = []
        self.threads: list[threading.Thread] = []
        for k, d in enumerate(dirs):
            ready = threading.Event()
            self.ready.append(ready)
            kwargs = {"devices": devices, "depth": depth, "file_size": file_size, "write_fraction": write_fraction,
                      "seed": seed + k, "stop": self.stop, "ready": ready}
            self.threads.append(threading.Thread(target=self._direct, args=(Path(d), ready, kwargs), daemon=True))
        if burst_mib > 0 and dirs:
            self.threads.append(threading.Thread(target=self._bursts, args=(Path(dirs[0]), burst_mib, burst_pause_ms, seed),
                                                 daemon=True))

    def _direct(self, d: Path, ready: threading.Event, kwargs: dict[str, Any]) -> None:
        try:
            collect(d, None, **kwargs)
        except OSError as e:
            self.errors.append(e)
            ready.set()

    def _bursts(self, d: Path, mib: int, pause_ms: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        path = d / f"kinfer-burst-{os.getpid()}.bin"
        chunk = os.urandom(1 << 20)
        try:
            with open(path, "wb") as f:
                while not self.stop.is_set():
                    f.seek(0)
                    for _ in range(mib):
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                    self.stop.wait(float(rng.uniform(0, pause_ms)) / 1e3)
        except OSError as e:
            self.errors.append(e)
        finally:
            path.unlink(missing_ok=True)

    def start(self) -> None:
        for t in self.threads:
            t.start()
        for r in self.ready:
            r.wait()
        if self.errors:
            self.close()
            raise self.errors[0]

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            if t.is_alive() or t.ident is not None:
                t.join()


def io_records(records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The ``io`` records of a stream, checked: ValueError names the first bad one."""
    for n, r in enumerate(records, 1):
        if r.get("type") != "io":
            continue
        try:
            ok = r["op"] in ("R", "W") and float(r["lat_us"]) >= 0 and int(r["pending"]) >= 0 and int(r["dev"]) >= 0
            float(r["t_us"])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"record {n}: not a valid io record: {str(r)[:200]}")
        yield r


def device_reads(records: list[dict[str, Any]]) -> dict[int, dict[str, np.ndarray]]:
    """Per device, its reads as arrays in issue order: t_us, lat_us, pending, and ``x`` (n, 31)
    when every read of that device carries the inputs the kernel computed (``collect --source
    ebpf``)."""
    out: dict[int, dict[str, list[Any]]] = {}
    for r in records:
        if r["op"] != "R":
            continue
        d = out.setdefault(int(r["dev"]), {"t_us": [], "lat_us": [], "pending": [], "x": []})
        d["t_us"].append(float(r["t_us"]))
        d["lat_us"].append(float(r["lat_us"]))
        d["pending"].append(int(r["pending"]))
        d["x"].append(r.get("x"))
    arrays = {}
    for dev, d in out.items():
        t = np.asarray(d["t_us"])
        order = np.argsort(t, kind="stable")
        xs = d.pop("x")
        arrays[dev] = {k: np.asarray(v)[order] for k, v in d.items()}
        if all(isinstance(x, list) and len(x) == KERNEL_INPUTS for x in xs):
            arrays[dev]["x"] = np.asarray(xs, dtype=np.float32)[order]
    return arrays


#: LinnOS's input count, as the eBPF producer records it in ``x``.
KERNEL_INPUTS = 31
