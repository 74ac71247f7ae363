"""The shared-memory request/response ring, as include/gpuos_kinfer.h lays it out, and its Python
producer (``Client``).

The header file is the reference; the numpy dtypes below mirror it field by field and a test
compiles the header and compares every offset. The daemon side reads the ring through numpy
views (``Ring.state``, ``Ring.meta32`` ...) so a whole batch is gathered and answered with a
few vectorised operations; the client writes one request with ``struct.pack_into`` and a
memoryview, which is what costs least per request in CPython.

Memory order: C producers use the atomics the header asks for. Python has no fences; its
stores reach memory in program order on x86-64 (TSO), which is what the READY/DONE protocol
needs. The one thing TSO does not give, a store followed by a load of another word (the
"is the other side asleep?" check), can miss a wake-up in a window of nanoseconds; every
futex wait here has a timeout (``WAIT_SLICE_S``), so such a miss costs at most that long.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from gpuos_tools.errors import ExitCode, GpuosError

HEADER_FILE = Path(__file__).resolve().parent / "include" / "gpuos_kinfer.h"

MAGIC = 0x31524E49464B5047
VERSION = 1
ENTRY_VERSION = 1
HEADER_SIZE = 4096
META_SIZE = 128
LOCK_DAEMON = 1 << 40
LOCK_LANE0 = (1 << 40) + 1

FREE, WRITING, READY, TAKEN, DONE = 0, 1, 2, 3, 4
STATE_NAMES = {FREE: "FREE", WRITING: "WRITING", READY: "READY", TAKEN: "TAKEN", DONE: "DONE"}
OK, BAD_VERSION, BAD_SIZE, BAD_MODEL, BAD_VALUE = 0, 1, 2, 3, 4
STATUS_NAMES = {OK: "ok", BAD_VERSION: "bad_version", BAD_SIZE: "bad_size", BAD_MODEL: "bad_model", BAD_VALUE: "bad_value"}
CPU, GPU = 0, 1

COUNTERS = [
    "served", "batches", "cpu_batches", "gpu_batches", "drop_bad_version", "drop_bad_size",
    "drop_bad_model", "drop_bad_value", "drop_abandoned", "drop_bad_state", "requeued",
    "model_swaps", "sleeps",
]
C = {name: i for i, name in enumerate(COUNTERS)}
NCOUNTERS = 16

HEADER_DTYPE = np.dtype({
    "names": [
        "magic", "version", "header_size", "nslots", "lanes", "slots_per_lane", "max_inputs",
        "max_outputs", "meta_size", "total_size", "state_offset", "meta_offset", "inputs_offset",
        "outputs_offset", "daemon_pid", "daemon_epoch", "heartbeat_ns", "model_generation",
        "doorbell", "daemon_sleeping", "counters", "control_seq", "control_ack", "control_status",
        "control_model_id", "control_path",
    ],
    "formats": [
        "<u8", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "<u8", "<u8",
        "<u8", "<u4", "<u4", "<u8", "<u4", "<u4", "<u4", ("<u8", (NCOUNTERS,)), "<u4", "<u4", "<i4",
        "<u4", "S256",
    ],
    "offsets": [0, 8, 12, 16, 20, 24, 28, 32, 36, 40, 48, 56, 64, 72, 80, 84, 88, 96, 128, 132, 192, 320, 324, 328, 332, 336],
    "itemsize": HEADER_SIZE,
})

META_DTYPE = np.dtype({
    "names": [
        "version", "model_id", "n_inputs", "status", "seq", "submit_ns", "done_ns", "producer_pid",
        "waiting", "decision", "n_outputs", "batch", "where", "answer_seq",
    ],
    "formats": ["<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "<u8", "<u4", "<u4", "<i4", "<u4", "<u4", "<u4", "<u8"],
    "offsets": [0, 4, 8, 12, 16, 24, 32, 40, 44, 48, 52, 56, 60, 64],
    "itemsize": META_SIZE,
})

# Word indexes into one meta entry seen as uint32[32] / uint64[16], for the vectorised daemon.
M32 = {name: META_DTYPE.fields[name][1] // 4 for name in META_DTYPE.names}
M64 = {name: META_DTYPE.fields[name][1] // 8 for name in META_DTYPE.names if META_DTYPE.fields[name][0].itemsize == 8}
# What the producer writes in one go: version, model_id, n_inputs, status, seq, submit_ns.
_REQUEST = struct.Struct("<IIIIQQ")
_ANSWER = struct.Struct("<iIIIQ")  # decision, n_outputs, batch, where, answer_seq (at offset 48)
# The producer's whole request in one store: _REQUEST, done_ns (0), producer_pid, waiting (0).
_REQUEST_FULL = struct.Struct("<IIIIQQQII")
# What the producer reads back in one load, from offset 12: status, seq, submit_ns, done_ns,
# producer_pid, waiting, decision, n_outputs, batch, where, answer_seq.
_READ_BACK = struct.Struct("<IQQQIIiIIIQ")
_F32 = np.dtype(np.float32)
_FLOATS = {n: struct.Struct(f"<{n}f") for n in range(1, 17)}

#: Longest single futex sleep: bounds the cost of a wake-up lost to store/load reordering.
WAIT_SLICE_S = 0.002
#: The client's adaptive spin for an answer (wait.py's rule on its recent waits): at least
#: CLIENT_SPIN_MIN_S, at most CLIENT_SPIN_MAX_S, twice the recent longest wait in between, so
#: a client whose answers take a daemon's wake-up (~250 µs on a VM) spins through it instead
#: of paying a second wake-up of its own.
CLIENT_SPIN_MIN_S = 200e-6
CLIENT_SPIN_MAX_S = 2e-3


class RingError(GpuosError):
    """A ring that cannot be used (missing, wrong magic or version, wrong sizes, no daemon)."""


# -- futex ------------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared futexes: the word lives in a file mapped by several processes
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the uint32 at ``addr`` equals ``expected``, at most ``timeout_s``.

    Returns on a wake-up, a timeout, a signal or when the word already differs: the caller
    always re-checks what it waits for.
    """
    if _SYS_FUTEX is None:
        time.sleep(min(timeout_s, 0.0005))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


def futex_wake(addr: int, count: int = 1) -> None:
    if _SYS_FUTEX is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, count, None, None, 0)


def pid_alive(pid: int) -> bool:
    """True while a process (not a zombie: a dead producer not yet reaped) has this pid."""
    from gpuos_tools.ckpt.procs import exists

    return exists(pid)


# -- layout -----------------------------------------------------------------------------------


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Geometry:
    lanes: int = 64
    slots_per_lane: int = 8
    max_inputs: int = 32
    max_outputs: int = 4

    @property
    def nslots(self) -> int:
        return self.lanes * self.slots_per_lane

    def offsets(self) -> dict[str, int]:
        n = self.nslots
        state = HEADER_SIZE
        meta = _align(state + 4 * n)
        inputs = _align(meta + META_SIZE * n)
        outputs = _align(inputs + 4 * self.max_inputs * n)
        total = _align(outputs + 4 * self.max_outputs * n, mmap.PAGESIZE)
        return {"state": state, "meta": meta, "inputs": inputs, "outputs": outputs, "total": total}


def ring_path(name: str) -> Path:
    """Where shm_open(name) puts the ring; a name with a slash is taken as a path."""
    return Path(name) if "/" in name else Path("/dev/shm") / name


class Ring:
    """A mapped ring file, with numpy views on each of its parts."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap):
        self.path = path
        self.fd = fd
        self.mm = mm
        self.buf = np.frombuffer(mm, dtype=np.uint8)
        self.header = self.buf[:HEADER_SIZE].view(HEADER_DTYPE)[0]
        h = self.header
        self.geometry = Geometry(int(h["lanes"]), int(h["slots_per_lane"]), int(h["max_inputs"]), int(h["max_outputs"]))
        n = self.geometry.nslots
        self.nslots = n

        def part(offset: int, count: int, dtype: Any) -> np.ndarray:
            size = np.dtype(dtype).itemsize * count
            return self.buf[offset : offset + size].view(dtype)

        self.state = part(int(h["state_offset"]), n, np.uint32)
        self.meta = part(int(h["meta_offset"]), n, META_DTYPE)
        self.meta32 = part(int(h["meta_offset"]), n * 32, np.uint32).reshape(n, 32)
        self.meta64 = part(int(h["meta_offset"]), n * 16, np.uint64).reshape(n, 16)
        self.inputs = part(int(h["inputs_offset"]), n * self.geometry.max_inputs, np.float32).reshape(n, -1)
        self.outputs = part(int(h["outputs_offset"]), n * self.geometry.max_outputs, np.float32).reshape(n, -1)
        self.counters = self.buf[192 : 192 + 8 * NCOUNTERS].view(np.uint64)
        self.base = self.buf.ctypes.data
        self.state_addr = self.base + int(h["state_offset"])
        self.doorbell_addr = self.base + HEADER_DTYPE.fields["doorbell"][1]

    # -- creation and attachment --

    @classmethod
    def create(cls, name: str, geometry: Geometry) -> Ring:
        """Create (or replace) the ring file with an empty ring.

        A file already there is unlinked, never truncated: producers that still map it keep
        valid memory (and learn from ``replaced()`` that it is gone) instead of SIGBUS.
        """
        path = ring_path(name)
        off = geometry.offsets()
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.ftruncate(fd, off["total"])
            mm = mmap.mmap(fd, off["total"])
        except OSError:
            os.close(fd)
            raise
        h = np.frombuffer(mm, dtype=np.uint8)[:HEADER_SIZE].view(HEADER_DTYPE)
        h["version"] = VERSION
        h["header_size"] = HEADER_SIZE
        h["nslots"] = geometry.nslots
        h["lanes"] = geometry.lanes
        h["slots_per_lane"] = geometry.slots_per_lane
        h["max_inputs"] = geometry.max_inputs
        h["max_outputs"] = geometry.max_outputs
        h["meta_size"] = META_SIZE
        h["total_size"] = off["total"]
        for part in ("state", "meta", "inputs", "outputs"):
            h[f"{part}_offset"] = off[part]
        h["magic"] = MAGIC  # last: a reader that sees the magic sees the rest
        del h
        return cls(path, fd, mm)

    @classmethod
    def attach(cls, name: str) -> Ring:
        """Map an existing ring, checking magic, version and every size against the file."""
        path = ring_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise RingError(f"{path}: no such ring (is `gpu-kinfer-bridge serve` running?)", ExitCode.NO_INPUT) from None
        except PermissionError as e:
            raise RingError(f"{path}: {e.strerror}", ExitCode.PERMISSION) from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise RingError(f"{path}: {size} bytes, too small for a ring header", ExitCode.BAD_INPUT)
            mm = mmap.mmap(fd, size)
            problem = check_header(bytes(mm[:HEADER_SIZE]), size)
            if problem:
                mm.close()
                raise RingError(f"{path}: {problem}", ExitCode.BAD_INPUT)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm)

    def close(self) -> None:
        for name in ("header", "state", "meta", "meta32", "meta64", "inputs", "outputs", "counters", "buf"):
            self.__dict__.pop(name, None)
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        os.close(self.fd)

    # -- locks --

    def try_lock(self, start: int) -> bool:
        """Take the write lock on byte ``start`` without waiting; False when someone holds it.

        Open-file-description locks (F_OFD_SETLK): they belong to this open file, so two clients
        of one process exclude each other and closing one does not drop the other's lock, as
        closing any descriptor does with classic POSIX locks. They conflict with the classic
        F_SETLK locks a C producer takes, so both kinds share the lanes safely.
        """
        try:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, flock_struct(fcntl.F_WRLCK, start))
        except OSError:
            return False
        return True

    def unlock(self, start: int) -> None:
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, flock_struct(fcntl.F_UNLCK, start))

    def daemon_alive(self) -> bool:
        return pid_alive(int(self.header["daemon_pid"]))

    def replaced(self) -> bool:
        """Has the file at ``path`` been replaced (``serve --recreate``) since it was mapped?"""
        try:
            return os.stat(self.path).st_ino != os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return True

    def why_silent(self) -> str:
        """Why requests on this ring may go unanswered, in words for a message."""
        if self.replaced():
            return "the ring file was replaced or removed since this producer attached; attach again"
        pid = int(self.header["daemon_pid"])
        if pid == 0:
            return "no daemon is serving this ring"
        if self.daemon_alive():
            return f"daemon pid {pid} is alive but did not answer"
        return f"daemon pid {pid} is gone"

    def counter_values(self) -> dict[str, int]:
        return {name: int(self.counters[i]) for i, name in enumerate(COUNTERS)}


def flock_struct(kind: int, start: int) -> bytes:
    """struct flock for one byte at ``start`` (l_type, l_whence, l_start, l_len, l_pid = 0)."""
    return struct.pack("hhqqi", kind, os.SEEK_SET, start, 1, 0)


def check_header(raw: bytes, file_size: int) -> str | None:
    """What is wrong with a ring header (None when it is usable), in words for a message."""
    h = np.frombuffer(raw[:HEADER_SIZE], dtype=HEADER_DTYPE)[0]
    if int(h["magic"]) != MAGIC:
        return f"not a gpu-kinfer-bridge ring (magic {int(h['magic']):#018x})"
    if int(h["version"]) != VERSION:
        return f"ring layout version {int(h['version'])}, this program speaks version {VERSION}"
    if int(h["header_size"]) != HEADER_SIZE or int(h["meta_size"]) != META_SIZE:
        return f"header/meta size {int(h['header_size'])}/{int(h['meta_size'])}, expected {HEADER_SIZE}/{META_SIZE}"
    lanes, per = int(h["lanes"]), int(h["slots_per_lane"])
    if lanes < 1 or per < 1 or lanes * per != int(h["nslots"]) or int(h["max_inputs"]) < 1 or int(h["max_outputs"]) < 1:
        return "inconsistent slot counts in the header"
    expected = Geometry(lanes, per, int(h["max_inputs"]), int(h["max_outputs"])).offsets()
    for part in ("state", "meta", "inputs", "outputs"):
        if int(h[f"{part}_offset"]) != expected[part]:
            return f"{part}_offset is {int(h[f'{part}_offset'])}, the layout says {expected[part]}"
    if int(h["total_size"]) != expected["total"] or file_size < expected["total"]:
        return f"file is {file_size} bytes, header says {int(h['total_size'])}, layout needs {expected['total']}"
    return None


# -- the Python producer ----------------------------------------------------------------------


class Answer:
    """One answer: the model's outputs, its decision (argmax), and where it ran."""

    __slots__ = ("status", "decision", "values", "batch", "where", "latency_ns")

    def __init__(self, status: int, decision: int, values: tuple[float, ...], batch: int, where: int, latency_ns: int):
        self.status = status
        self.decision = decision
        self.values = values  # the outputs as Python floats (what the ring holds, as read)
        self.batch = batch
        self.where = where
        self.latency_ns = latency_ns

    @property
    def outputs(self) -> np.ndarray:
        """The outputs as a float32 array (made on access: a numpy call costs a round trip's worth)."""
        return np.array(self.values, dtype=np.float32)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def __repr__(self) -> str:
        return (
            f"Answer({STATUS_NAMES.get(self.status, self.status)}, decision={self.decision}, "
            f"outputs={self.outputs.tolist()}, batch={self.batch}, where={'gpu' if self.where == GPU else 'cpu'})"
        )


class Client:
    """A producer: owns one lane of the ring (one client per thread) and sends requests.

    ``infer(x)`` sends one vector and waits for its answer; ``submit``/``wait`` let up to
    ``slots_per_lane`` requests be in flight at once.
    """

    def __init__(self, name: str, *, spin_s: float | None = None, lane: int | None = None):
        """``spin_s``: spin this long for an answer before sleeping; None (the default): adaptive."""
        self.ring = Ring.attach(name)
        self.spin_s = spin_s
        self._hold = CLIENT_SPIN_MIN_S if spin_s is None else spin_s
        self._gap = 0.0
        self.pid = os.getpid()
        self.lane = self._claim(lane)
        g = self.ring.geometry
        self._first = self.lane * g.slots_per_lane
        self._slots = range(self._first, self._first + g.slots_per_lane)
        self._state = memoryview(self.ring.mm).cast("B")[int(self.ring.header["state_offset"]):][: 4 * g.nslots].cast("I")
        self._meta_off = int(self.ring.header["meta_offset"])
        self._in_off = int(self.ring.header["inputs_offset"])
        self._out_off = int(self.ring.header["outputs_offset"])
        self._max_out = g.max_outputs
        self._max_in = g.max_inputs
        self._mm = self.ring.mm
        self._hdr_doorbell = HEADER_DTYPE.fields["doorbell"][1]
        self._doorbell = memoryview(self.ring.mm).cast("B")[self._hdr_doorbell : self._hdr_doorbell + 8].cast("I")
        self._seq = 0
        self._next = 0
        self._busy: set[int] = set()
        # a lane left by a dead producer: what it was writing will never be finished
        for i in self._slots:
            if self._state[i] == WRITING:
                self._state[i] = FREE

    def _claim(self, lane: int | None) -> int:
        lanes = range(self.ring.geometry.lanes) if lane is None else [lane]
        for candidate in lanes:
            if self.ring.try_lock(LOCK_LANE0 + candidate):
                return candidate
        self.ring.close()
        raise RingError(
            f"{self.ring.path}: no free lane ({self.ring.geometry.lanes} producers attached)"
            if lane is None else f"{self.ring.path}: lane {lane} is held by another producer",
            ExitCode.FAILURE,
        )

    def close(self) -> None:
        self._state.release()
        self._doorbell.release()
        self.ring.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests --

    def submit(self, x: Any, model_id: int = 0) -> int:
        """Publish one request; return its slot (the ticket for ``wait``)."""
        if type(x) is np.ndarray and x.dtype == _F32 and x.ndim == 1:
            data = x.tobytes()  # a copy in C order, strided or not
        else:
            data = np.ascontiguousarray(x, dtype=np.float32).ravel().tobytes()
        n = len(data) >> 2
        if n > self._max_in:
            raise ValueError(f"{n} inputs, the ring carries at most {self._max_in}")
        slot = self._free_slot()
        st = self._state
        st[slot] = WRITING
        mm = self._mm
        self._seq += 1
        m = self._meta_off + slot * META_SIZE
        _REQUEST_FULL.pack_into(mm, m, ENTRY_VERSION, model_id, n, 0, self._seq, time.monotonic_ns(), 0, self.pid, 0)
        o = self._in_off + slot * 4 * self._max_in
        mm[o : o + 4 * n] = data
        st[slot] = READY
        bell = self._doorbell
        bell[0] = (bell[0] + 1) & 0xFFFFFFFF
        if bell[1]:  # daemon_sleeping
            futex_wake(self.ring.doorbell_addr)
        self._busy.add(slot)
        return slot

    def _free_slot(self) -> int:
        st = self._state
        per = len(self._slots)
        for k in range(per):
            slot = self._first + (self._next + k) % per
            if slot not in self._busy and st[slot] in (FREE, DONE):
                self._next = (slot - self._first + 1) % per
                return slot
        raise RingError(f"lane {self.lane}: all {per} slots are in flight; wait for an answer first", ExitCode.FAILURE)

    def wait(self, slot: int, timeout: float = 5.0) -> Answer:
        """Wait for the answer in ``slot``: spin (adaptively, or ``spin_s``), then sleep on the slot's futex."""
        st = self._state
        if st[slot] != DONE:
            perf = time.perf_counter
            t0 = perf()
            spin_until = t0 + self._hold
            while st[slot] != DONE and perf() < spin_until:
                pass
            if st[slot] != DONE:
                self._sleep(slot, t0 + timeout)
            if self.spin_s is None:
                self._learn(perf() - t0)
        self._busy.discard(slot)
        mm = self._mm
        status, _, submit_ns, done_ns, _, _, decision, n_out, batch, where, _ = _READ_BACK.unpack_from(
            mm, self._meta_off + slot * META_SIZE + 12)
        values: tuple[float, ...] = ()
        if n_out:  # 0 for a refused request
            n_out = min(n_out, self._max_out)
            fmt = _FLOATS.get(n_out) or struct.Struct(f"<{n_out}f")
            values = fmt.unpack_from(mm, self._out_off + slot * 4 * self._max_out)
        return Answer(status, decision, values, batch, where, done_ns - submit_ns)

    def _learn(self, waited: float) -> None:
        """wait.Adaptive's rule on the recent waits for an answer: the spin for the next one."""
        waited = min(waited, 2 * CLIENT_SPIN_MAX_S)
        g = self._gap - self._gap / 8
        self._gap = g = waited if waited > g else g
        self._hold = CLIENT_SPIN_MIN_S if g > CLIENT_SPIN_MAX_S else min(CLIENT_SPIN_MAX_S, max(CLIENT_SPIN_MIN_S, 2 * g))

    def _sleep(self, slot: int, deadline: float) -> None:
        st = self._state
        mm = self._mm
        waiting_at = self._meta_off + slot * META_SIZE + 44
        addr = self.ring.state_addr + 4 * slot
        while True:
            state = st[slot]
            if state == DONE:
                break
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RingError(
                    f"{self.ring.path}: no answer in time for slot {slot} (state {STATE_NAMES.get(state, state)}); "
                    + self.ring.why_silent(),
                    ExitCode.FAILURE,
                )
            struct.pack_into("<I", mm, waiting_at, 1)
            if st[slot] == DONE:  # re-check after announcing the sleep
                break
            futex_wait(addr, state, min(left, WAIT_SLICE_S))
        struct.pack_into("<I", mm, waiting_at, 0)

    def infer(self, x: Any, model_id: int = 0, timeout: float = 5.0) -> Answer:
        return self.wait(self.submit(x, model_id), timeout)
