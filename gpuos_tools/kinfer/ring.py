"""The shared-memory request/response ring, as include/gpuos_kinfer.h lays it out, and its Python
producer (``RingClient``).

The header file is the reference; the numpy dtypes below mirror it field by field and a test
compiles the header and compares every offset. The daemon side reads the ring through numpy
views (``Ring.state``, ``Ring.meta32`` ...) so a whole batch is gathered and answered with a
few vectorised operations.

The client has two request paths with one behaviour: by default each request is one call into
C (client_native.py, csrc/kinfer_client.c: write, publish, wait, read back), which saves the
few µs CPython spends per request; without a C compiler it writes one request with
``struct.pack_into`` and a memoryview, which is what costs least per request in CPython.
The module is over 800 lines because the layout, the mapping and that Python path are one
reading of the header, kept side by side.

Memory order: C producers use the atomics the header asks for. Python has no fences; its
stores reach memory in program order on x86-64 (TSO), which is what the READY/DONE protocol
needs. The one thing TSO does not give, a store followed by a load of another word (the
"is the other side asleep?" check), can miss a wake-up in a window of nanoseconds; every
futex wait here has a timeout (``WAIT_SLICE_S``), so such a miss costs at most that long.
The C path uses sequentially consistent atomics and misses none.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import grp
import mmap
import operator
import os
import platform
import stat
import struct
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.kinfer import client_native, guard
from gpuos_tools.procs import exists

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
#: The timeout argument of a wait that goes on (its deadline was set when it began).
_RESUME = ctypes.c_double(0.0)
#: Model ids a Python producer may send (the header's field is 32 bits; daemons serve a few dozen).
MODEL_ID_LIMIT = 1 << 31

#: Longest single futex sleep: bounds the cost of a wake-up lost to store/load reordering.
WAIT_SLICE_S = 0.002
#: The client's adaptive spin for an answer (wait.py's rule on its recent waits): at least
#: CLIENT_SPIN_MIN_S, at most CLIENT_SPIN_MAX_S, twice the recent longest wait in between, so
#: a client whose answers take a daemon's wake-up (~250 µs on a VM) spins through it instead
#: of paying a second wake-up of its own.
CLIENT_SPIN_MIN_S = 200e-6
CLIENT_SPIN_MAX_S = 2e-3

#: Bounds on a header's geometry, so that no header makes a reader compute or map absurd sizes.
MAX_SLOTS = 1 << 20
MAX_VALUES = 1 << 16  # max_inputs and max_outputs
#: Largest pid Linux hands out (PID_MAX_LIMIT); a producer_pid or daemon_pid above it is no process.
PID_LIMIT = 1 << 22
#: Permission bits of a new ring: its owner's alone unless shared on purpose (``--mode``, ``--group``).
DEFAULT_MODE = 0o600

#: control_status values: what the daemon made of the last model-load request.
CONTROL_OK, CONTROL_FAILED, CONTROL_NO_FIT, CONTROL_NOT_ALLOWED, CONTROL_TIMEOUT, CONTROL_BAD_ID = 0, 1, 2, 3, 4, 5
CONTROL_NAMES = {
    CONTROL_OK: "swapped in", CONTROL_FAILED: "not a model file the daemon could read",
    CONTROL_NO_FIT: "its inputs or outputs do not fit the ring",
    CONTROL_NOT_ALLOWED: "not a regular file inside a directory the daemon loads models from (serve --model-dir)",
    CONTROL_TIMEOUT: "the daemon gave up reading it (too slow)", CONTROL_BAD_ID: "model id out of range",
}


class RingError(GpuosError):
    """A ring that cannot be used (missing, wrong magic or version, wrong sizes, no daemon).
    ``unready``: the file is there but its daemon has not written its header yet (shorter than
    a header, or no magic: the magic goes last), which a caller waiting for a daemon waits out."""

    def __init__(self, message: str, code: ExitCode = ExitCode.FAILURE, unready: bool = False):
        super().__init__(message, code)
        self.unready = unready


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
    """True while a process (not a zombie: a dead producer not yet reaped) has this pid. Any
    value is taken (it comes from shared memory): 0, negatives and numbers above PID_LIMIT name
    no process."""
    return 0 < pid <= PID_LIMIT and exists(pid)


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


def served_by(name: str, pid: int) -> bool:
    """Whether the ring ``name`` exists and the daemon serving it is ``pid`` (a daemon just
    started: ready once its pid is in the header)."""
    try:
        r = Ring.attach(name)
    except RingError:
        return False
    try:
        return int(r.header["daemon_pid"]) == pid
    finally:
        r.close()


def ring_path(name: str) -> Path:
    """Where shm_open(name) puts the ring; a name with a slash is taken as a path."""
    return Path(name) if "/" in name else Path("/dev/shm") / name


class Ring:
    """A mapped ring file, with numpy views on each of its parts.

    Every offset and size comes from ``geometry`` (checked against the file before mapping),
    never from the live header, which any process that can write the ring may change at any time.
    """

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, geometry: Geometry):
        self.path = path
        self.fd = fd
        self.mm = mm
        self.geometry = geometry
        self.offsets = geometry.offsets()
        self.size = self.offsets["total"]
        self.buf = np.frombuffer(mm, dtype=np.uint8)
        self.header = self.buf[:HEADER_SIZE].view(HEADER_DTYPE)[0]
        n = self.geometry.nslots
        self.nslots = n
        off = self.offsets

        def part(offset: int, count: int, dtype: Any) -> np.ndarray:
            size = np.dtype(dtype).itemsize * count
            return self.buf[offset : offset + size].view(dtype)

        self.state = part(off["state"], n, np.uint32)
        self.meta = part(off["meta"], n, META_DTYPE)
        self.meta32 = part(off["meta"], n * 32, np.uint32).reshape(n, 32)
        self.meta64 = part(off["meta"], n * 16, np.uint64).reshape(n, 16)
        self.inputs = part(off["inputs"], n * self.geometry.max_inputs, np.float32).reshape(n, -1)
        self.outputs = part(off["outputs"], n * self.geometry.max_outputs, np.float32).reshape(n, -1)
        self.counters = self.buf[192 : 192 + 8 * NCOUNTERS].view(np.uint64)
        self.base = self.buf.ctypes.data
        self.state_addr = self.base + off["state"]
        self.doorbell_addr = self.base + HEADER_DTYPE.fields["doorbell"][1]

        self.guard = guard.protect(self.base, self.size, fd, self.size)
        # the guard stops watching when the mapping goes, closed or collected: another mapping
        # may take its addresses next
        self._unguard = weakref.finalize(mm, self.guard.release) if self.guard is not None else None

    # -- creation and attachment --

    @classmethod
    def create(cls, name: str, geometry: Geometry, *, mode: int = DEFAULT_MODE, group: int | None = None) -> Ring:
        """Create (or replace) the ring file with an empty ring, mode ``mode`` (0600 unless it is
        shared on purpose) and, when given, group ``group``.

        A file already there is replaced only when it is a ring of this user that no daemon serves
        (``remove_ring``), and it is unlinked, never truncated: producers that still map it keep
        valid memory (and learn from ``replaced()`` that it is gone) instead of SIGBUS.
        """
        path = ring_path(name)
        check_geometry(geometry)
        off = geometry.offsets()
        if os.path.lexists(path):
            remove_ring(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise RingError(f"{path}: created by someone else meanwhile; refusing to use it", ExitCode.FAILURE) from None
        except PermissionError as e:
            raise RingError(f"{path}: cannot create: {e.strerror}", ExitCode.PERMISSION) from None
        try:
            set_access(fd, path, mode, group)
            os.ftruncate(fd, off["total"])
            mm = mmap.mmap(fd, off["total"])
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        write_header(mm, geometry)
        return cls(path, fd, mm, geometry)

    @classmethod
    def attach(cls, name: str, *, owners: tuple[int, ...] | None = None) -> Ring:
        """Map an existing ring after checking, before anything is mapped, that it is a regular
        file (a symbolic link is not followed), owned by one of ``owners`` (default: this user
        or root: a ring another user made could give any answer it likes), with a valid header
        whose sizes fit the file."""
        path = ring_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RingError(f"{path}: no such ring (is `gpu-kinfer-bridge serve` running?)", ExitCode.NO_INPUT) from None
        except PermissionError as e:
            raise RingError(f"{path}: {e.strerror}", ExitCode.PERMISSION) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RingError(f"{path}: a symbolic link, not a ring: refusing to follow it", ExitCode.BAD_INPUT) from None
            raise RingError(f"{path}: cannot open: {e.strerror}", ExitCode.BAD_INPUT) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RingError(f"{path}: not a regular file, not a ring", ExitCode.BAD_INPUT)
            allowed = (os.geteuid(), 0) if owners is None else owners
            if st.st_uid not in allowed:
                raise RingError(f"{path}: belongs to uid {st.st_uid}, not {' or '.join(map(str, allowed))}: refusing "
                                "a ring another user made", ExitCode.PERMISSION)
            size = st.st_size
            if size < HEADER_SIZE:
                raise RingError(f"{path}: {size} bytes, too small for a ring header", ExitCode.BAD_INPUT, unready=True)
            raw = os.pread(fd, HEADER_SIZE, 0)
            problem = check_header(raw, size)
            if problem:
                unready = np.frombuffer(raw[:HEADER_SIZE], dtype=HEADER_DTYPE)[0]["magic"] == 0
                raise RingError(f"{path}: {problem}", ExitCode.BAD_INPUT, unready=bool(unready))
            geometry = header_geometry(raw)
            mm = mmap.mmap(fd, geometry.offsets()["total"])
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, geometry)

    def close(self) -> None:
        if self._unguard is not None:
            self._unguard()  # before the mapping goes
        for name in ("header", "state", "meta", "meta32", "meta64", "inputs", "outputs", "counters", "buf"):
            self.__dict__.pop(name, None)
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        os.close(self.fd)

    # -- the file under the mapping --

    def file_size(self) -> int:
        return os.fstat(self.fd).st_size

    def truncated(self) -> bool:
        """Was the file cut short under this mapping (now, or repaired since by the guard)?"""
        return self.file_size() < self.size or (self.guard is not None and (self.guard.faults > 0 or self.guard.lost))

    def restore_size(self) -> int:
        """Give a file cut short its length back (the lost part reads as zeros); returns the size
        it had. For the daemon's housekeeping: the guard does the same when a fault comes first."""
        size = self.file_size()
        if size < self.size:
            os.ftruncate(self.fd, self.size)
        return size

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
        if self.guard is not None and self.guard.lost:
            return "the ring file was cut short by another process and this mapping lost; attach again"
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


def check_geometry(geometry: Geometry) -> None:
    """ValueError when a geometry is outside what a ring may hold (``MAX_SLOTS``, ``MAX_VALUES``)."""
    g = geometry
    if not (1 <= g.lanes and 1 <= g.slots_per_lane and g.nslots <= MAX_SLOTS):
        raise ValueError(f"{g.lanes} lanes x {g.slots_per_lane} slots: 1 to {MAX_SLOTS} slots in all")
    if not (1 <= g.max_inputs <= MAX_VALUES and 1 <= g.max_outputs <= MAX_VALUES):
        raise ValueError(f"{g.max_inputs} inputs, {g.max_outputs} outputs: 1 to {MAX_VALUES} each")


def check_header(raw: bytes, file_size: int) -> str | None:
    """What is wrong with a ring header (None when it is usable), in words for a message. Every
    field is range-checked before any size is computed from it."""
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
    try:
        check_geometry(header_geometry(raw))
    except ValueError as e:
        return f"geometry out of range: {e}"
    expected = header_geometry(raw).offsets()
    for part in ("state", "meta", "inputs", "outputs"):
        if int(h[f"{part}_offset"]) != expected[part]:
            return f"{part}_offset is {int(h[f'{part}_offset'])}, the layout says {expected[part]}"
    if int(h["total_size"]) != expected["total"] or file_size < expected["total"]:
        return f"file is {file_size} bytes, header says {int(h['total_size'])}, layout needs {expected['total']}"
    return None


def header_geometry(raw: bytes) -> Geometry:
    """The geometry a header states (check it with ``check_header`` first)."""
    h = np.frombuffer(raw[:HEADER_SIZE], dtype=HEADER_DTYPE)[0]
    return Geometry(int(h["lanes"]), int(h["slots_per_lane"]), int(h["max_inputs"]), int(h["max_outputs"]))


def write_header(mm: mmap.mmap, geometry: Geometry) -> None:
    """Write the layout fields of a ring header (a new ring, or one whose header was lost to a
    truncation); the magic goes last, so a reader that sees it sees the rest."""
    off = geometry.offsets()
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
    h["magic"] = MAGIC


def resolve_group(group: str | int | None) -> int | None:
    """A group name or number (a ring shared with that group) to its gid; None for none."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise RingError(f"no group named {group!r}", ExitCode.USAGE) from None


def set_access(fd: int, path: Path, mode: int, group: int | None) -> None:
    """Give the ring file exactly ``mode`` (the umask does not narrow or widen a deliberate share)
    and, when given, the group ``group`` (one this user belongs to)."""
    if group is not None:
        try:
            os.fchown(fd, -1, group)
        except PermissionError:
            raise RingError(f"{path}: cannot give the ring to group {group} (not a member of it?)", ExitCode.PERMISSION) from None
    os.fchmod(fd, mode)


def remove_ring(path: Path, magic: int = MAGIC, what: str = "gpu-kinfer-bridge ring", served: bool = True) -> None:
    """Unlink an old ring so a new one can take its name, refusing anything else: a file that is
    not a regular file with the ring magic (``magic``: a feature store's, for one), one that
    belongs to another user, or (``served``) a ring a daemon still serves. The checks are made on
    the open file, and the name is removed only while it still names that file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        what = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise RingError(f"{path}: {what}: not replacing it (remove it yourself if it is not needed)",
                        ExitCode.PERMISSION if e.errno in (errno.EACCES, errno.EPERM) else ExitCode.BAD_INPUT) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RingError(f"{path}: not a regular file: not replacing it", ExitCode.BAD_INPUT)
        if st.st_uid != os.geteuid():
            raise RingError(f"{path}: belongs to uid {st.st_uid}: not replacing another user's file", ExitCode.PERMISSION)
        head = os.pread(fd, 96, 0)
        if len(head) < 8 or struct.unpack_from("<Q", head)[0] != magic:
            raise RingError(f"{path}: not a {what}: not replacing it (remove it yourself if it is not needed)",
                            ExitCode.BAD_INPUT)
        if served:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock_struct(fcntl.F_WRLCK, LOCK_DAEMON))
            except OSError:
                pid = struct.unpack_from("<I", head, 80)[0] if len(head) >= 84 else 0
                raise RingError(f"{path}: served by pid {pid}", ExitCode.FAILURE) from None
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)
        except FileNotFoundError:
            pass
    finally:
        os.close(fd)


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


class RingClient:
    """A producer: owns one lane of the ring (one client per thread) and sends requests.

    ``infer(x)`` sends one vector and waits for its answer; ``submit``/``wait`` let up to
    ``slots_per_lane`` requests be in flight at once.
    """

    def __init__(self, name: str, *, spin_s: float | None = None, lane: int | None = None,
                 owner: int | None = None, native: str = "auto"):
        """``spin_s``: spin this long for an answer before sleeping; None (the default): adaptive.
        ``owner``: a uid besides this user and root whose ring to trust (a daemon of another user
        that shares its ring on purpose); a ring of any other owner is refused. ``native``: auto
        (the default: each request is one call into C, csrc/kinfer_client.c, where a C compiler
        builds it; this Python path otherwise), on (the C path or an error), off (this Python path)."""
        if native not in ("auto", "on", "off"):
            raise ValueError(f"native must be auto, on or off, not {native!r}")
        self.ring = Ring.attach(name, owners=None if owner is None else (os.geteuid(), 0, owner))
        self.spin_s = spin_s
        self._hold = CLIENT_SPIN_MIN_S if spin_s is None else spin_s
        self._gap = 0.0
        self.pid = os.getpid()
        self.lane = self._claim(lane)
        g = self.ring.geometry
        off = self.ring.offsets
        self._first = self.lane * g.slots_per_lane
        self._slots = range(self._first, self._first + g.slots_per_lane)
        self._state = memoryview(self.ring.mm).cast("B")[off["state"]:][: 4 * g.nslots].cast("I")
        self._meta_off = off["meta"]
        self._in_off = off["inputs"]
        self._out_off = off["outputs"]
        self._max_out = g.max_outputs
        self._max_in = g.max_inputs
        self._max_bytes = 4 * g.max_inputs
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
        #: the C request path (None: this Python path), and why it is not used when it is not
        self._kc: ctypes.c_void_p | None = None
        self.native_why: str | None = "native off" if native == "off" else None
        if native != "off":
            try:
                self._attach_native(spin_s)
            except client_native.BuildError as e:
                self.native_why = str(e)
                if native == "on":
                    self.close()
                    raise RingError(f"native on, but the C request path cannot run: {e}", ExitCode.FAILURE) from None

    @property
    def native(self) -> bool:
        """Whether requests go through the C path."""
        return self._kc is not None

    def _attach_native(self, spin_s: float | None) -> None:
        lib = client_native.library()
        g, off = self.ring.geometry, self.ring.offsets
        fixed = -1 if spin_s is None else max(0, int(spin_s * 1e9))
        handle = lib.kc_create(self.ring.base, self.ring.size, off["state"], off["meta"], off["inputs"], off["outputs"],
                               g.nslots, g.slots_per_lane, g.max_inputs, g.max_outputs, self.lane, self.pid, fixed,
                               int(CLIENT_SPIN_MIN_S * 1e9), int(CLIENT_SPIN_MAX_S * 1e9))
        if not handle:
            raise client_native.BuildError("the C request path refused this ring's layout")
        self._lib = lib
        self._kc = ctypes.c_void_p(handle)
        self._kc_free = weakref.finalize(self, lib.kc_destroy, handle)
        head = struct.calcsize(client_native.ANSWER_HEAD)
        self._out = (ctypes.c_char * (head + 4 * g.max_outputs)).from_address(lib.kc_out(handle))
        self._answers: dict[int, struct.Struct] = {}
        self._timeouts: dict[float, ctypes.c_double] = {}
        self._kc_infer, self._kc_submit, self._kc_wait = lib.kc_infer, lib.kc_submit, lib.kc_wait

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
        if self._kc is not None:
            self._kc = None
            self._kc_free()  # the C side holds pointers into the mapping: gone before it is
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
        if type(x) is np.ndarray and x.dtype is _F32:  # numpy's own float32 (any other dtype: converted below)
            data = x.tobytes()  # a copy in C order, strided or not, of any shape: as ravel() orders it
        else:
            data = np.ascontiguousarray(x, dtype=np.float32).ravel().tobytes()
        nbytes = len(data)
        if model_id.__class__ is not int or model_id >> 31 or nbytes > self._max_bytes:
            model_id = self._checked(model_id, nbytes)
        kc = self._kc
        if kc is not None:
            slot = self._kc_submit(kc, data, nbytes, model_id)
            if slot < 0:
                raise self._native_error(slot, nbytes, model_id)
            return slot
        n = nbytes >> 2
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
        raise self._lane_full()

    def _lane_full(self) -> RingError:
        return RingError(f"lane {self.lane}: all {len(self._slots)} slots are in flight; wait for an answer first",
                         ExitCode.FAILURE)

    def _no_answer(self, slot: int, state: int) -> RingError:
        return RingError(
            f"{self.ring.path}: no answer in time for slot {slot} (state {STATE_NAMES.get(state, state)}); "
            + self.ring.why_silent(),
            ExitCode.FAILURE,
        )

    def _check_slot(self, slot: int) -> None:
        if slot not in self._slots:
            raise ValueError(f"slot {slot} is not one of this producer's (lane {self.lane}: slots "
                             f"{self._slots.start} to {self._slots.stop - 1})")

    def wait(self, slot: int, timeout: float = 5.0) -> Answer:
        """Wait for the answer in ``slot``: spin (adaptively, or ``spin_s``), then sleep on the slot's futex."""
        if slot.__class__ is not int or slot not in self._slots:
            slot = operator.index(slot)  # a numpy integer is taken (as a Python int: ctypes takes no other)
            self._check_slot(slot)
        kc = self._kc
        if kc is not None:
            n = self._kc_wait(kc, slot, self._timeouts.get(timeout) or self._timeout_arg(timeout), 1)
            return self._native_answer(n) if n >= 0 else self._native_rest(n)
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

    # -- the C path's answers and errors --

    def _native_answer(self, n: int) -> Answer:
        fmt = self._answers.get(n)
        if fmt is None:
            fmt = self._answers[n] = struct.Struct(f"{client_native.ANSWER_HEAD}{n}f")
        t = fmt.unpack_from(self._out)
        return Answer(t[0], t[1], t[5:], t[2], t[3], t[4])

    def _native_rest(self, n: int, nbytes: int = 0, model_id: Any = 0) -> Answer:
        """After a C call that returned no answer: go on sleeping slice by slice (signals are
        handled between two slices, as on the Python path), or raise what the error says."""
        while n == client_native.AGAIN:
            n = self._kc_wait(self._kc, self._native_slot(), _RESUME, 0)
        if n >= 0:
            return self._native_answer(n)
        raise self._native_error(n, nbytes, model_id)

    def _native_slot(self) -> int:
        return struct.unpack_from("<I", self._out, 8)[0]  # struct kc_answer.batch holds the slot

    def _native_error(self, n: int, nbytes: int, model_id: Any) -> Exception:
        if n == client_native.TIMEOUT:
            return self._no_answer(self._native_slot(), struct.unpack_from("<I", self._out, 0)[0])
        if n == client_native.TOO_BIG:
            return ValueError(f"{nbytes >> 2} inputs, the ring carries at most {self._max_in}")
        if n == client_native.LANE_FULL:
            return self._lane_full()
        if n == client_native.BAD_MODEL_ID:
            return ValueError(f"model id {model_id}: 0 to {MODEL_ID_LIMIT - 1}")
        return RingError(f"the C request path returned {n}", ExitCode.FAILURE)

    def _timeout_arg(self, timeout: float) -> ctypes.c_double:
        """A timeout as the C call takes it (ctypes passes no Python float by itself), kept for
        the next request with the same timeout."""
        arg = ctypes.c_double(float(timeout))
        if len(self._timeouts) >= 16:
            self._timeouts.clear()
        self._timeouts[timeout] = arg
        return arg

    def _checked(self, model_id: Any, nbytes: int) -> int:
        """Inputs too many for the ring, or a model id that is not an int from 0 to
        MODEL_ID_LIMIT - 1: refused before anything is written (a numpy integer is taken)."""
        if nbytes > self._max_bytes:
            raise ValueError(f"{nbytes >> 2} inputs, the ring carries at most {self._max_in}")
        model_id = operator.index(model_id)
        if not 0 <= model_id < MODEL_ID_LIMIT:
            raise ValueError(f"model id {model_id}: 0 to {MODEL_ID_LIMIT - 1}")
        return model_id

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
                raise self._no_answer(slot, state)
            struct.pack_into("<I", mm, waiting_at, 1)
            if st[slot] == DONE:  # re-check after announcing the sleep
                break
            futex_wait(addr, state, min(left, WAIT_SLICE_S))
        struct.pack_into("<I", mm, waiting_at, 0)

    def infer(self, x: Any, model_id: int = 0, timeout: float = 5.0) -> Answer:
        """Send one request and wait for its answer (``submit`` then ``wait``; on the C path, one call)."""
        kc = self._kc
        if kc is None:
            return self.wait(self.submit(x, model_id), timeout)
        if type(x) is np.ndarray and x.dtype is _F32:
            data = x.tobytes()
        else:
            data = np.ascontiguousarray(x, dtype=np.float32).ravel().tobytes()
        nbytes = len(data)
        if model_id.__class__ is not int or model_id >> 31 or nbytes > self._max_bytes:
            model_id = self._checked(model_id, nbytes)
        # ctypes passes a Python int as a C int (masked to 32 bits): every int given here is in range
        n = self._kc_infer(kc, data, nbytes, model_id, self._timeouts.get(timeout) or self._timeout_arg(timeout))
        if n < 0:
            return self._native_rest(n, nbytes, model_id)
        fmt = self._answers.get(n)
        if fmt is None:
            return self._native_answer(n)
        t = fmt.unpack_from(self._out)
        return Answer(t[0], t[1], t[5:], t[2], t[3], t[4])
