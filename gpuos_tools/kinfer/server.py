"""The daemon: takes READY requests from the ring in batches, runs the model where the policy
says, answers each request, and keeps the ring healthy (abandoned slots, bad entries, restarts,
model swaps). Over 800 lines: batching, the CPU/GPU choice, housekeeping and model swaps all
act on the one ring this daemon owns, from its one serving thread.

With the native path (the default where a C compiler is found), the ring is served by a C
thread (``native.NativeLoop``, csrc/kinfer_native.c) doing steps 1-3 below: it answers itself
the batches the policy gives to the CPU, up to ``native_max`` requests, whose entries are all
well-formed, and hands every other batch (GPU batches, larger ones, any bad entry) to this
Python loop, which runs step 4 on them, probes the GPU's speed and keeps the ring healthy.
Without it, one Python loop does everything (plus a loader thread for model swaps and NVML's
sampler):

1. find READY slots (one vectorised compare over the state words);
2. none: spin while traffic is recent (``wait.Adaptive``: a window between ``spin_min_us`` and
   ``spin_max_us`` that follows the recent gaps between requests; or a fixed ``spin_us``), then
   announce sleep, re-check, futex-wait on the doorbell;
3. some: while traffic has recently come in bursts (mean batch > 1.5), wait up to
   ``window_us`` for more, as LAKE does; a lone producer is never delayed;
4. mark them TAKEN, refuse malformed entries (each refusal counted in the header), run the
   good ones per model on CPU or GPU, write outputs and metadata, store DONE, wake sleepers.

The policy's measurements (the GPU's delay, ``policy.GpuSpeed``; the CPU's fixed and
proportional extra, ``policy.CpuSpeed``) come from the batches
this Python loop runs, timed around the model's forward pass, and from the GPU probes; the C
loop's own CPU batches are not timed.
"""

from __future__ import annotations

import math
import os
import signal
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuos_tools.errors import ExitCode
from gpuos_tools.kinfer import gpu, guard, native, ring as R
from gpuos_tools.kinfer.model import Mlp
from gpuos_tools.kinfer.policy import CpuSpeed, GpuLoad, GpuSpeed, Policy
from gpuos_tools.kinfer.wait import SPIN_MAX_US, SPIN_MIN_US, Adaptive

HOUSEKEEPING_S = 0.1
#: How long a model load may take before the daemon gives up on it (a file that never ends).
LOAD_TIMEOUT_S = 10.0
#: Model ids a ring may ask for (the native loop holds as many).
MAX_MODEL_IDS = 64
RESCAN_S = 50e-6
#: A gap this long between two turns of the spin: the loop was not spinning (descheduled, or in
#: housekeeping), and that time does not count as idle.
PREEMPTED_S = 50e-6
#: Batches up to this size take the per-slot path (struct and memoryview), larger ones numpy's.
SMALL_BATCH = 8
_READY_WORD = R.READY.to_bytes(4, "little")
_HEAD = struct.Struct("<III")  # version, model_id, n_inputs
_STATUS = struct.Struct("<I")
_DONE_NS = struct.Struct("<Q")
_DROP = {R.BAD_VERSION: "drop_bad_version", R.BAD_SIZE: "drop_bad_size", R.BAD_MODEL: "drop_bad_model", R.BAD_VALUE: "drop_bad_value"}


@dataclass
class Backend:
    """One model on the CPU and, when there is a GPU, on the GPU too."""

    model: Mlp
    gpu: Any = None  # gpu.GpuMlp (RingServer._run times it for the delay estimate)


@dataclass
class ServeOptions:
    window_us: float = 20.0
    max_batch: int = 4096
    spin_us: float | None = None  # a fixed spin; None: adaptive between spin_min_us and spin_max_us
    spin_min_us: float = SPIN_MIN_US
    spin_max_us: float = SPIN_MAX_US
    use_gpu: str = "auto"  # auto | on | off
    device: int = 0
    gpu_mode: str = "auto"  # fused | matmul | auto
    native: str = "auto"  # auto | on | off: the C serve loop
    native_max: int = 64  # largest batch the C loop answers itself
    mode: int = R.DEFAULT_MODE  # permission bits of the ring file
    group: str | int | None = None  # the group that shares the ring, if any
    model_dirs: tuple[str, ...] = ()  # where model-load requests may read from (none: no loads)
    load_timeout_s: float = LOAD_TIMEOUT_S

    def __post_init__(self) -> None:
        """Refuse what would make the loops misbehave (a negative max_batch once meant a lone
        request was never answered)."""
        for name, value, low in (("window_us", self.window_us, 0.0), ("spin_us", self.spin_us, 0.0),
                                 ("spin_min_us", self.spin_min_us, 0.0), ("spin_max_us", self.spin_max_us, 0.0),
                                 ("max_batch", self.max_batch, 1), ("native_max", self.native_max, 0),
                                 ("load_timeout_s", self.load_timeout_s, 0.0)):
            if name == "spin_us" and value is None:  # adaptive waiting
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
                raise ValueError(f"{name} must be a finite number of at least {low}, not {value!r}")
        for name, value in (("use_gpu", self.use_gpu), ("native", self.native)):
            if value not in ("auto", "on", "off"):
                raise ValueError(f"{name} must be auto, on or off, not {value!r}")
        if not (isinstance(self.mode, int) and 0 <= self.mode <= 0o777 and self.mode & 0o600 == 0o600):
            raise ValueError(f"mode must leave the owner read and write, between 0600 and 0777, not {self.mode!r}")


@dataclass
class RingServer:
    ring: R.Ring
    models: dict[int, Backend]
    policy: Policy
    options: ServeOptions = field(default_factory=ServeOptions)
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True)
    gpu_load: GpuLoad | None = None
    gpu_ready: bool = False

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self._pending_swap: tuple[int, int, Backend | None, str] | None = None
        self._loading = False
        self._ewma = 1.0
        self._next_housekeeping = 0.0
        self.native: Any = None  # native.NativeLoop while the C loop serves
        self.speed = GpuSpeed(self.policy)
        self.cpu_speed = CpuSpeed(self.policy)
        self._gpu_delay = 0.0
        self._cpu_fit = (0.0, 1.0)
        self._table_key: tuple[Any, ...] | None = None
        self._add = self._add_py
        r = self.ring
        raw = memoryview(r.mm).cast("B")
        off = r.offsets["state"]  # the checked geometry's, never the live header's
        self._state_mv = raw[off : off + 4 * r.nslots]
        self._st = self._state_mv.cast("I")
        bell_off = R.HEADER_DTYPE.fields["doorbell"][1]
        self._bell = raw[bell_off : bell_off + 4].cast("I")
        cnt_off = R.HEADER_DTYPE.fields["counters"][1]
        self._cnt = raw[cnt_off : cnt_off + 8 * R.NCOUNTERS].cast("Q")  # cheaper per += than numpy
        self._meta_off = r.offsets["meta"]
        self._in_off = r.offsets["inputs"]
        self._out_off = r.offsets["outputs"]
        self._load_seq: int | None = None  # the control request being loaded
        self._load_deadline = 0.0
        self._abandoned: set[int | None] = set()  # loads given up on (their late result is dropped)
        self._lost_said = False
        self._faults_seen = r.guard.faults if r.guard is not None else 0
        self.failure: str | None = None  # why serving stopped, when it stopped on its own
        self.repairs = 0  # times the ring file was found cut short and given its length back

    # -- setup --

    @classmethod
    def open(
        cls,
        name: str,
        geometry: R.Geometry,
        model: Mlp,
        policy: Policy,
        options: ServeOptions,
        *,
        recreate: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> RingServer:
        """Attach to the ring ``name`` (restart: producers stay attached) or create it.

        An existing ring is adopted only when it is this user's (``Ring.attach`` checks type, owner
        and header); it then gets ``options.mode`` and ``options.group`` like a new one. With
        ``recreate`` an existing ring of this user that no daemon serves is replaced; any other
        file is left alone and refused.
        """
        say = log or (lambda m: print(m, file=sys.stderr, flush=True))
        path = R.ring_path(name)
        gid = R.resolve_group(options.group)
        ring = None
        if os.path.lexists(path) and not recreate:
            ring = R.Ring.attach(name, owners=(os.geteuid(),))
            if ring.geometry != geometry:
                have = ring.geometry
                ring.close()
                raise R.RingError(
                    f"{path}: existing ring has {have.lanes}x{have.slots_per_lane} slots, "
                    f"{have.max_inputs} inputs, {have.max_outputs} outputs; asked for {geometry.lanes}x"
                    f"{geometry.slots_per_lane}, {geometry.max_inputs}, {geometry.max_outputs} "
                    "(--recreate replaces it; attached producers must then reattach)",
                    ExitCode.BAD_INPUT,
                )
        if ring is None:
            ring = R.Ring.create(name, geometry, mode=options.mode, group=gid)  # replaces only an old ring of ours
        if not ring.try_lock(R.LOCK_DAEMON):
            pid = int(ring.header["daemon_pid"])
            ring.close()
            raise R.RingError(f"{path}: already served by pid {pid}", ExitCode.FAILURE)
        try:
            R.set_access(ring.fd, path, options.mode, gid)  # an adopted ring is shared as asked now, no wider
            if ring.guard is None and options.mode & 0o022:
                raise R.RingError(
                    f"{path}: the ring is writable by others (mode {options.mode:04o}), but the guard that keeps the "
                    f"daemon alive when one of them cuts the file short cannot be built: {guard.unavailable()}",
                    ExitCode.FAILURE)
        except BaseException:
            ring.close()
            raise
        h = ring.header
        taken = np.flatnonzero(ring.state == R.TAKEN)
        if taken.size:  # the previous daemon died holding these: serve them again
            ring.state[taken] = R.READY
            ring.counters[R.C["requeued"]] += taken.size
            say(f"{path}: {taken.size} requests taken by the previous daemon are served again")
        h["daemon_pid"] = os.getpid()
        h["daemon_epoch"] = (int(h["daemon_epoch"]) + 1) & 0xFFFFFFFF
        h["control_ack"] = h["control_seq"]
        policy_gpu = options.use_gpu != "off"
        backend = Backend(model)
        server = cls(ring, {0: backend}, policy, options, say)
        try:
            if policy_gpu:
                server._start_gpu(backend)
            if options.native != "off":
                server._start_native()
        except BaseException:
            server.close()  # the lock goes; the ring stays for the next daemon
            raise
        return server

    def _start_native(self) -> None:
        """Build (once) and start the C serve loop; without a compiler, say so and stay in Python."""
        g = self.ring.geometry
        o = self.options
        try:
            loop = native.NativeLoop(self.ring.base, self.ring.size, o.spin_min_us if o.spin_us is None else o.spin_us,
                                     o.window_us, o.max_batch, g.max_inputs, g.max_outputs)
            if o.spin_us is None:
                loop.set_wait(o.spin_min_us, o.spin_max_us)
        except (native.BuildError, OSError) as e:
            if self.options.native == "on":
                raise R.RingError(f"--native on, but the native serve loop cannot run: {e}", ExitCode.FAILURE) from None
            self.log(f"native path off ({e}); the CPU path runs in Python, several times slower at batch 1")
            return
        for model_id, backend in self.models.items():
            if not loop.set_model(model_id, backend.model):
                self.log(f"model {model_id}: its shape does not fit the native path; its requests are served in Python")
        self.native = loop
        self._add = self._add_native
        self._refresh_policy(force=True)  # the thread starts with serve()

    def _add_py(self, name: str, n: int = 1) -> None:
        """Add to a ring counter (atomically while the C loop, which adds to them too, runs).
        Modulo 2^64, as the C loop's atomic add: any process that can write the ring may have
        set a counter to its largest value."""
        i = R.C[name]
        self._cnt[i] = (self._cnt[i] + n) & 0xFFFFFFFFFFFFFFFF

    def _add_native(self, name: str, n: int = 1) -> None:
        self.native.count(R.C[name], n)

    # -- the policy's inputs --

    def _refresh_policy(self, force: bool = False) -> None:
        """Recompute the GPU's measured delay and the CPU's measured fit and, for the C loop,
        which batch sizes it answers."""
        self._gpu_delay = self.speed.delay_us()
        self._cpu_fit = self.cpu_speed.fit()
        if self.native is not None:
            self._refresh_table(force)

    def _refresh_table(self, force: bool = False) -> None:
        """The C loop's table of the batch sizes it answers, from the estimates as they stand."""
        busy = self.gpu_load is not None and self.gpu_load.busy
        # the table is recomputed (tens of µs of numpy) only when the GPU's delay moved by 1 µs or 1%,
        # or the CPU's fixed extra by as much, or its slope by 1%
        key = (self.gpu_ready, busy, _bucket_us(self._gpu_delay), _bucket_us(self._cpu_fit[0]), _bucket(self._cpu_fit[1]))
        if force or key != self._table_key:
            self._table_key = key
            limit = max(0, min(self.options.native_max, self.options.max_batch))
            self.native.set_cpu_batches(self.policy.cpu_batches(limit, self.gpu_ready, busy, self._gpu_delay, self._cpu_fit))

    def _others_on_gpu(self) -> bool:
        load = self.gpu_load
        return load is not None and load.others >= max(1, self.policy.busy_procs)

    def maybe_probe(self) -> bool:
        """Time a probe batch on the GPU when the delay estimate is stale (``GpuSpeed.probe_due``)."""
        backend = self.models.get(0)
        if not self.gpu_ready or backend is None or backend.gpu is None or not self.speed.probe_due(self._others_on_gpu()):
            return False
        try:
            self.speed.probe(backend.gpu.forward)
        except Exception as e:  # a CUDA error: the next batch on the GPU will say it again
            self.log(f"GPU probe failed: {type(e).__name__}: {e}")
            self.speed.observe(1, float("inf"))
        self._refresh_policy()
        return True

    def _side(self, n: int, backend: Backend) -> str:
        busy = self.gpu_load is not None and self.gpu_load.busy
        return self.policy.choose(n, self.gpu_ready and backend.gpu is not None, busy, self._gpu_delay, self._cpu_fit)

    def _run(self, backend: Backend, x: np.ndarray, side: str) -> np.ndarray:
        """The batch on ``side``; its latency feeds that side's estimate (``GpuSpeed``, ``CpuSpeed``).

        A CPU batch is timed only while there is a choice to make (a GPU for this model): without
        one the measurement could change nothing. The CPU batches the C loop answers itself are
        not timed (kinfer_native.c keeps no clock for them): with the native path the CPU's
        estimate comes from the CPU batches handed to this loop (above ``native_max``, or with a
        bad entry), and stays at the calibration while there are none.
        """
        if side == "gpu" and backend.gpu is not None:
            t0 = time.perf_counter_ns()
            y = backend.gpu.forward(x)
            self.speed.observe(len(x), (time.perf_counter_ns() - t0) / 1e3)
            self._gpu_delay = self.speed.delay_us()
        elif self.gpu_ready and backend.gpu is not None:
            t0 = time.perf_counter_ns()
            y = backend.model.forward(x)
            self.cpu_speed.observe(len(x), (time.perf_counter_ns() - t0) / 1e3)
            self._cpu_fit = self.cpu_speed.fit()  # only the side that moved: a few µs per batch
        else:
            return backend.model.forward(x)
        if self.native is not None:
            self._refresh_table()
        return y

    def _start_gpu(self, backend: Backend) -> None:
        reason = gpu.gpu_unavailable_reason()
        if reason is not None:
            if self.options.use_gpu == "on":
                raise R.RingError(f"--gpu on, but the GPU path cannot run: {reason}", ExitCode.NO_DRIVER)
            self.log(f"GPU path off: {reason}; every batch runs on the CPU")
            return
        try:
            backend.gpu = gpu.GpuMlp(backend.model, self.options.device, self.options.gpu_mode)
        except Exception as e:  # a CUDA error, a kernel that does not build...
            if self.options.use_gpu == "on":
                raise R.RingError(f"--gpu on, but the GPU path failed: {type(e).__name__}: {e}", ExitCode.CUDA_ERROR) from e
            self.log(f"GPU path off: {type(e).__name__}: {e}; every batch runs on the CPU")
            return
        if backend.gpu.note:
            self.log(backend.gpu.note)
        self.gpu_ready = True
        self.gpu_load = GpuLoad(self.policy, self.options.device)
        if not self.gpu_load.start():
            self.log(self.gpu_load.error or "NVML unavailable")

    # -- the loop --

    def _tick(self, now: float) -> None:
        """What both serve loops do each turn: housekeeping when due, a pending model swap,
        a GPU probe when one is due."""
        if now >= self._next_housekeeping:
            self.housekeeping()
            self._next_housekeeping = now + HOUSEKEEPING_S
        if self._pending_swap is not None:
            self._apply_swap()
        if self.gpu_ready:
            self.maybe_probe()

    def serve(self, max_batches: int | None = None) -> None:
        """Serve until ``stop`` is set (or ``max_batches`` batches, for tests).

        While spinning, the loop watches the doorbell word (one read) and scans the state words
        only when it changed, or every ``RESCAN_S`` in case two Python producers wrote the same
        doorbell value.
        """
        if self.native is not None:
            self._serve_native(max_batches)
            return
        ring = self.ring
        state = ring.state
        header = ring.header
        bell = self._bell
        o = self.options
        lo, hi = (o.spin_us, o.spin_us) if o.spin_us is not None else (o.spin_min_us, o.spin_max_us)
        wait = Adaptive(lo / 1e6, hi / 1e6)  # with lo == hi the hold is always lo: a fixed spin
        window = self.options.window_us / 1e6
        max_batch = self.options.max_batch
        batches = 0
        idle_since = None
        seen = -1
        next_scan = 0.0
        perf = time.perf_counter
        last_turn = perf()
        while not self.stop.is_set():
            now = perf()
            if idle_since is not None and now - last_turn > PREEMPTED_S:
                idle_since += now - last_turn  # descheduled (or busy in _tick), not idle: as the C loop
            last_turn = now
            self._tick(now)
            rung = bell[0]
            if rung == seen and now < next_scan:
                if idle_since is None:
                    idle_since = now
                elif now - idle_since > wait.hold():
                    self._sleep(header, state)
                    idle_since = None
                    next_scan = 0.0
                continue
            seen = rung
            next_scan = now + RESCAN_S
            ready = self.ready_slots()
            if not ready:
                continue
            idle_since = None
            wait.arrival(now)
            if window > 0 and self._ewma > 1.5 and len(ready) < max_batch:
                deadline = now + window
                while perf() < deadline and bell[0] == seen:
                    pass
                ready = self.ready_slots()
                seen = -1
            ready = ready[:max_batch]
            if len(ready) <= SMALL_BATCH:
                self.process_small(ready)
            else:
                self.process(np.asarray(ready, dtype=np.intp))
            self._ewma = 0.9 * self._ewma + 0.1 * len(ready)
            batches += 1
            if max_batches is not None and batches >= max_batches:
                break

    def _serve_native(self, max_batches: int | None) -> None:
        """The Python side of the native path: answer the batches the C loop hands over, probe the
        GPU, housekeeping, model swaps. The C loop is stopped on the way out."""
        import ctypes

        buf = (ctypes.c_uint32 * self.ring.nslots)()
        perf = time.perf_counter
        batches = 0
        self.native.start()
        try:
            while not self.stop.is_set():
                self._tick(perf())
                n = self.native.take(buf, min(0.02, max(0.0, self._next_housekeeping - perf())))
                if n == 0:
                    continue
                slots = sorted(buf[:n])
                if n <= SMALL_BATCH:
                    self.process_small(slots)
                else:
                    self.process(np.asarray(slots, dtype=np.intp))
                batches += 1
                if max_batches is not None and batches >= max_batches:
                    break
        finally:
            self.native.stop()
            while n := self.native.take(buf, 0.0):  # batches handed over just before the stop: answer them
                self.process(np.asarray(sorted(buf[:n]), dtype=np.intp))

    def ready_slots(self) -> list[int]:
        """Slots in READY state, in slot order (a byte search: cheaper than numpy here)."""
        raw = self._state_mv.tobytes()
        out = []
        find = raw.find
        pos = find(_READY_WORD)
        while pos >= 0:
            if pos % 4 == 0:
                out.append(pos // 4)
                pos = find(_READY_WORD, pos + 4)
            else:
                pos = find(_READY_WORD, pos + 1)
        return out

    def _sleep(self, header: Any, state: np.ndarray) -> None:
        bell = int(header["doorbell"])
        header["daemon_sleeping"] = 1
        if not (state == R.READY).any() and self._pending_swap is None and not self.stop.is_set():
            self._add("sleeps")
            R.futex_wait(self.ring.doorbell_addr, bell, HOUSEKEEPING_S)
        header["daemon_sleeping"] = 0

    def process(self, idx: np.ndarray) -> None:
        """Answer the requests in slots ``idx`` (all READY)."""
        ring = self.ring
        ring.state[idx] = R.TAKEN
        m32 = ring.meta32[idx]
        version, model_id, n_in = m32[:, R.M32["version"]], m32[:, R.M32["model_id"]], m32[:, R.M32["n_inputs"]]
        status = np.full(idx.size, R.OK, dtype=np.uint32)
        status[version != R.ENTRY_VERSION] = R.BAD_VERSION
        known = np.isin(model_id, list(self.models))
        status[(status == R.OK) & ~known] = R.BAD_MODEL
        where = np.zeros(idx.size, dtype=np.uint32)
        decision = np.full(idx.size, -1, dtype=np.int32)
        n_out = np.zeros(idx.size, dtype=np.uint32)
        for mid in np.unique(model_id[status == R.OK]):
            backend = self.models[int(mid)]  # the model this batch started with, even if a swap comes in now
            mine = (model_id == mid) & (status == R.OK)
            sizes_ok = n_in == backend.model.n_inputs
            status[mine & ~sizes_ok] = R.BAD_SIZE
            mine &= sizes_ok
            rows = np.flatnonzero(mine)
            x = ring.inputs[idx[rows], : backend.model.n_inputs]
            finite = np.isfinite(x).all(axis=1)
            if not finite.all():
                status[rows[~finite]] = R.BAD_VALUE
                rows, x = rows[finite], x[finite]
            if rows.size == 0:
                continue
            side = self._side(rows.size, backend)
            y = self._run(backend, x, side)
            ring.outputs[idx[rows], : y.shape[1]] = y
            decision[rows] = np.argmax(y, axis=1)
            n_out[rows] = y.shape[1]
            where[rows] = R.GPU if side == "gpu" else R.CPU
            self._add("gpu_batches" if side == "gpu" else "cpu_batches")
        m32[:, R.M32["status"]] = status
        m32[:, R.M32["decision"]] = decision.view(np.uint32)
        m32[:, R.M32["n_outputs"]] = n_out
        m32[:, R.M32["batch"]] = idx.size
        m32[:, R.M32["where"]] = where
        ring.meta32[idx, R.M32["status"]] = status
        ring.meta32[idx, R.M32["decision"] : R.M32["where"] + 1] = m32[:, R.M32["decision"] : R.M32["where"] + 1]
        ring.meta64[idx, R.M64["answer_seq"]] = ring.meta64[idx, R.M64["seq"]]
        ring.meta64[idx, R.M64["done_ns"]] = time.monotonic_ns()
        ring.state[idx] = R.DONE  # after every answer field: TSO keeps the order of these stores
        sleepers = idx[ring.meta32[idx, R.M32["waiting"]] != 0]
        for slot in sleepers:
            R.futex_wake(ring.state_addr + 4 * int(slot))
        self._add("batches")
        served = int((status == R.OK).sum())
        if served:
            self._add("served", served)
        for code, name in _DROP.items():
            bad = int((status == code).sum())
            if bad:
                self._add(name, bad)

    def process_small(self, slots: list[int]) -> None:
        """``process`` for a few requests: per-slot struct reads and writes, one numpy forward.

        Same answers as ``process``; it exists because each numpy call costs about a
        microsecond, and ``process`` makes dozens of them whatever the batch size.
        """
        ring = self.ring
        st = self._st
        mm = ring.mm
        add = self._add
        for slot in slots:
            st[slot] = R.TAKEN
        good: dict[int, list[int]] = {}
        bad: list[tuple[int, int]] = []
        models = self.models
        for slot in slots:
            m = self._meta_off + slot * R.META_SIZE
            version, model_id, n_in = _HEAD.unpack_from(mm, m)
            if version != R.ENTRY_VERSION:
                bad.append((slot, R.BAD_VERSION))
            elif model_id not in models:
                bad.append((slot, R.BAD_MODEL))
            elif n_in != models[model_id].model.n_inputs:
                bad.append((slot, R.BAD_SIZE))
            else:
                good.setdefault(model_id, []).append(slot)
        n = len(slots)
        max_out = ring.geometry.max_outputs
        for model_id, mine in good.items():
            backend = models[model_id]
            x = ring.inputs[mine, : backend.model.n_inputs]
            if not math.isfinite(float(x.sum(dtype=np.float64))):  # one call; the exact check only then
                finite = np.isfinite(x).all(axis=1)
                bad += [(s, R.BAD_VALUE) for s, f in zip(mine, finite) if not f]
                mine = [s for s, f in zip(mine, finite) if f]
                x = x[finite]
                if not mine:
                    continue
            side = self._side(len(mine), backend)
            y = self._run(backend, x, side)
            where = R.GPU if side == "gpu" else R.CPU
            n_out = y.shape[1]
            rows = y.tolist()
            outs = range(n_out)
            decisions = [max(outs, key=row.__getitem__) for row in rows]  # np.argmax's first-maximum rule
            done = time.monotonic_ns()
            for slot, row, decision in zip(mine, rows, decisions):
                m = self._meta_off + slot * R.META_SIZE
                o = self._out_off + slot * 4 * max_out
                struct.pack_into(f"<{n_out}f", mm, o, *row)
                _STATUS.pack_into(mm, m + 12, R.OK)
                _DONE_NS.pack_into(mm, m + 32, done)
                R._ANSWER.pack_into(mm, m + 48, decision, n_out, n, where, _DONE_NS.unpack_from(mm, m + 16)[0])
                st[slot] = R.DONE
                if _STATUS.unpack_from(mm, m + 44)[0]:
                    R.futex_wake(ring.state_addr + 4 * slot)
            add("gpu_batches" if side == "gpu" else "cpu_batches")
            add("served", len(mine))
        done = time.monotonic_ns()
        for slot, code in bad:
            m = self._meta_off + slot * R.META_SIZE
            _STATUS.pack_into(mm, m + 12, code)
            _DONE_NS.pack_into(mm, m + 32, done)
            R._ANSWER.pack_into(mm, m + 48, -1, 0, n, R.CPU, _DONE_NS.unpack_from(mm, m + 16)[0])
            st[slot] = R.DONE
            if _STATUS.unpack_from(mm, m + 44)[0]:
                R.futex_wake(ring.state_addr + 4 * slot)
            add(_DROP[code])
        add("batches")

    # -- housekeeping --

    def housekeeping(self) -> None:
        """The ring file's length and header, heartbeat, slots abandoned mid-write, impossible
        states, model-load requests. Every word read here comes from memory other processes may
        write, and is checked before it is used."""
        ring = self.ring
        if not self._check_file():
            return
        ring.header["heartbeat_ns"] = time.monotonic_ns()
        state = ring.state
        writing = np.flatnonzero(state == R.WRITING)
        for slot in writing:
            pid = int(ring.meta32[slot, R.M32["producer_pid"]])
            if not R.pid_alive(pid) and state[slot] == R.WRITING:
                state[slot] = R.FREE
                self._add("drop_abandoned")
                self.log(f"slot {int(slot)}: producer pid {pid} died while writing; request dropped")
        strange = np.flatnonzero(state > R.DONE)
        if strange.size:
            state[strange] = R.FREE
            self._add("drop_bad_state", int(strange.size))
            self.log(f"{strange.size} slots had an unknown state word; reset to FREE")
        self._refresh_policy()  # old samples age out; NVML's verdict may have changed
        if self.native is not None:
            self.native.release()
        h = ring.header
        if self._loading and time.monotonic() > self._load_deadline:
            self._abandoned.add(self._load_seq)
            self.log(f"model load gave up after {self.options.load_timeout_s:g} s; model unchanged")
            self._control_done(self._load_seq, R.CONTROL_TIMEOUT)
        if int(h["control_seq"]) != int(h["control_ack"]) and not self._loading:
            self._start_load(int(h["control_seq"]), int(h["control_model_id"]), bytes(h["control_path"]).split(b"\0")[0])

    def _check_file(self) -> bool:
        """The ring file as it must be: its length (another process may cut it short), its
        header (another process may overwrite it) and this daemon's pid in it. False, with
        ``failure`` set and the loop stopped, once the mapping is lost for good."""
        ring = self.ring
        if ring.guard is not None and ring.guard.lost:
            if not self._lost_said:
                self._lost_said = True
                self.failure = (f"{ring.path}: the ring file was cut short by another process and could not be given its "
                                "length back; stopping (start again with --recreate)")
                self.log(self.failure)
            self.stop.set()
            return False
        size = ring.restore_size()
        faults = ring.guard.faults if ring.guard is not None else 0
        if size < ring.size or faults != self._faults_seen:
            self._faults_seen = faults
            self.repairs += 1
            self.log(f"{ring.path}: the ring file was cut short by another process (to {size} bytes); its length is "
                     "restored, the requests in the lost part are dropped")
        raw = bytes(ring.mm[: R.HEADER_SIZE])
        problem = R.check_header(raw, ring.size)
        if not problem and R.header_geometry(raw) != ring.geometry:
            problem = "another geometry"
        if problem or int(ring.header["daemon_pid"]) != os.getpid():
            if problem:
                self.log(f"{ring.path}: ring header overwritten ({problem}); written again")
                R.write_header(ring.mm, ring.geometry)
            ring.header["daemon_pid"] = os.getpid()
        return True

    def _control_done(self, seq: int | None, status: int) -> None:
        """Answer a model-load request (control block) with ``status``."""
        h = self.ring.header
        h["control_status"] = status
        h["control_ack"] = (seq or 0) & 0xFFFFFFFF
        self._loading = False
        self._load_seq = None

    def _start_load(self, seq: int, model_id: int, raw_path: bytes | str) -> None:
        """Load a model in a thread; the loop swaps it in between two batches. Only a regular
        file inside one of ``options.model_dirs`` is read (any process that can write the ring
        can ask), without waiting on anything that is not one, and within ``load_timeout_s``."""
        path = os.fsdecode(raw_path)
        if model_id >= MAX_MODEL_IDS:
            self.log(f"model load refused: model id {model_id} (ids go from 0 to {MAX_MODEL_IDS - 1})")
            self._control_done(seq, R.CONTROL_BAD_ID)
            return
        try:
            real = allowed_model_file(path, self.options.model_dirs)
        except ValueError as e:
            self.log(f"model load refused, model {model_id} unchanged: {e}")
            self._control_done(seq, R.CONTROL_NOT_ALLOWED)
            return
        self._loading = True
        self._load_seq = seq
        self._load_deadline = time.monotonic() + self.options.load_timeout_s

        def load() -> None:
            try:
                model = Mlp.from_bytes(read_model_file(real), str(real))
                backend = Backend(model)
                if self.gpu_ready:
                    backend.gpu = gpu.GpuMlp(model, self.options.device, self.options.gpu_mode)
                self._pending_swap = (seq, model_id, backend, "")
            except Exception as e:  # a bad file must not take the daemon down
                self._pending_swap = (seq, model_id, None, f"{type(e).__name__}: {e}")

        threading.Thread(target=load, name="kinfer-load", daemon=True).start()

    def _apply_swap(self) -> None:
        seq, model_id, backend, error = self._pending_swap  # type: ignore[misc]
        self._pending_swap = None
        if seq in self._abandoned:  # it finished after the daemon had given up on it
            self._abandoned.discard(seq)
            return
        h = self.ring.header
        if backend is None:
            status = R.CONTROL_FAILED
            self.log(f"model load refused, model {model_id} unchanged: {error}")
        elif backend.model.n_inputs > self.ring.geometry.max_inputs or backend.model.n_outputs > self.ring.geometry.max_outputs:
            status = R.CONTROL_NO_FIT
            self.log(f"model load refused: {backend.model.n_inputs} inputs / {backend.model.n_outputs} outputs do not fit the ring")
        else:
            self.models[model_id] = backend  # one reference store: batches already running keep the old one
            if self.native is not None and not self.native.set_model(model_id, backend.model):
                self.log(f"model {model_id}: its shape does not fit the native path; its requests are served in Python")
            h["model_generation"] = (int(h["model_generation"]) + 1) & 0xFFFFFFFF
            self._add("model_swaps")
            status = R.CONTROL_OK
            self.log(f"model {model_id} swapped in ({backend.model.meta.get('name', 'model')})")
        self._control_done(seq, status)

    def close(self) -> None:
        if self.native is not None:
            self.native.close()  # joins the C thread before the ring is unmapped
            self.native = None
            self._add = self._add_py
        for view in (self._bell, self._cnt, self._st, self._state_mv):
            view.release()
        if self.gpu_load is not None:
            self.gpu_load.stop()
        try:
            self.ring.unlock(R.LOCK_DAEMON)
        finally:
            self.ring.close()

    def install_signals(self) -> None:
        """SIGTERM, SIGINT and SIGHUP end the loop between batches."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop.set())



def _bucket(slowdown: float) -> float:
    """A slowdown in steps of 1% (log scale), for telling when the C loop's table must change."""
    return round(math.log(slowdown) / math.log(1.01)) if 0 < slowdown < math.inf else slowdown


def _bucket_us(delay: float) -> float:
    """A delay in steps of 1 µs below 100 µs, of 1% (log scale) above, for the same purpose."""
    if not math.isfinite(delay) or abs(delay) < 100:
        return round(delay) if math.isfinite(delay) else delay
    return math.copysign(100 + round(math.log(abs(delay) / 100) / math.log(1.01)), delay)


#: Largest model file the daemon reads on request (LinnOS's is 33 KB).
MAX_MODEL_BYTES = 256 << 20


def allowed_model_file(path: str, dirs: tuple[str, ...] | list[str]) -> Path:
    """The real path of ``path`` when it lies inside one of ``dirs`` (symbolic links resolved:
    a link inside that points outside is outside); ValueError says why not."""
    if not dirs:
        raise ValueError(f"{path}: this daemon takes no model files on request (start it with --model-dir DIR)")
    if not os.path.isabs(path):
        raise ValueError(f"{path}: not an absolute path")
    real = os.path.realpath(path)
    for d in dirs:
        top = os.path.realpath(d)
        if real != top and os.path.commonpath([real, top]) == top:
            return Path(real)
    raise ValueError(f"{path}: outside the model directories ({', '.join(map(str, dirs))})")


def read_model_file(path: Path, limit: int = MAX_MODEL_BYTES) -> bytes:
    """The bytes of a model file: a regular file (a FIFO, a device or a link is refused before
    anything is read, never waited on), at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{path}: {st.st_size} bytes, more than a model file may be ({limit})")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise ValueError(f"{path}: more than a model file may be ({limit} bytes)")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def default_model_dirs(model_file: str | None) -> tuple[str, ...]:
    """Where a daemon takes model files from when no directory is given: the directory of the
    model it started with, if it belongs to this user or root and no one else may write it
    (a directory anyone can write, /tmp say, would let anyone plant a model)."""
    if not model_file:
        return ()
    d = os.path.dirname(os.path.realpath(model_file))
    try:
        st = os.stat(d)
    except OSError:
        return ()
    if st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022:
        return (d,)
    return ()


def request_load(name: str, path: str | Path, model_id: int = 0, timeout: float = 30.0, owner: int | None = None) -> int:
    """Ask the daemon serving ``name`` to swap in the model file ``path``; wait for its answer.

    Returns the daemon's status (``R.CONTROL_OK``: swapped; ``R.CONTROL_NAMES`` says the others).
    The daemon loads the file itself, so the path is made absolute here. ``owner``: as for
    ``R.RingClient``.
    """
    ring = R.Ring.attach(name, owners=None if owner is None else (os.geteuid(), 0, owner))
    try:
        if not ring.daemon_alive():
            raise R.RingError(f"{ring.path}: no daemon is serving this ring", ExitCode.FAILURE)
        full = os.path.abspath(os.fspath(path)).encode()
        if len(full) >= 256:
            raise R.RingError(f"{path}: path longer than 255 bytes", ExitCode.USAGE)
        h = ring.header
        h["control_path"] = full
        h["control_model_id"] = model_id
        seq = (int(h["control_seq"]) + 1) & 0xFFFFFFFF
        h["control_seq"] = seq
        deadline = time.monotonic() + timeout
        while int(h["control_ack"]) != seq:
            if time.monotonic() > deadline or not ring.daemon_alive():
                raise R.RingError(f"{ring.path}: the daemon did not take the model within {timeout:g} s", ExitCode.FAILURE)
            time.sleep(0.005)
        return int(h["control_status"])
    finally:
        ring.close()
