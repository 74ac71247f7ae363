"""LAKE's feature store: register a schema, record timestamped feature vectors from any number of
producers into a shared-memory ring, read back a time window (to train on, or to score).

The file (/dev/shm/NAME) is laid out as ``struct gpuos_kinfer_features`` in
include/gpuos_kinfer.h: a 4096-byte header (magic, version, field count, capacity, record
size, next write index, schema name, field names) then ``capacity`` records of
``{uint64 ts_ns; uint64 seq; float values[n_fields]}`` padded to 8 bytes. A writer holds the
POSIX record lock on byte GPUOS_KINFER_LOCK_DAEMON exclusively while it appends one record; a
reader holds it shared while it copies the ring, so a window never holds half a record. Python
takes open-file-description locks (F_OFD_SETLKW), so two stores open in one process exclude each
other too; C writers may use F_SETLKW. When
the ring is full the oldest records are overwritten.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpuos_tools.errors import ExitCode
from gpuos_tools.kinfer import guard
from gpuos_tools.kinfer.ring import DEFAULT_MODE, LOCK_DAEMON, RingError, flock_struct, remove_ring, ring_path

MAGIC = 0x31544145464B5047  # "GPKFEAT1"
VERSION = 1
HEADER_SIZE = 4096
MAX_FIELDS = 64
NAME_LEN = 48
#: Most records a store may hold (a header saying more is refused before anything is mapped).
MAX_CAPACITY = 1 << 28

HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "n_fields", "capacity", "record_size", "write_index", "schema", "fields"],
    "formats": ["<u8", "<u4", "<u4", "<u4", "<u4", "<u8", f"S{NAME_LEN}", (f"S{NAME_LEN}", (MAX_FIELDS,))],
    "offsets": [0, 8, 12, 16, 20, 24, 32, 80],
    "itemsize": HEADER_SIZE,
})


def _record_size(n_fields: int) -> int:
    return 16 + (4 * n_fields + 7) // 8 * 8


class FeatureStore:
    def __init__(self, path: Path, fd: int, mm: mmap.mmap, checked: bytes | None = None):
        """``checked``: the header as it was checked (the live one may change under us; the
        layout is taken from the checked copy)."""
        self.path, self.fd, self.mm = path, fd, mm
        self.header = np.frombuffer(mm, dtype=np.uint8)[:HEADER_SIZE].view(HEADER_DTYPE)[0]
        h = self.header if checked is None else np.frombuffer(checked, dtype=HEADER_DTYPE)[0]
        self.n_fields = int(h["n_fields"])
        self.capacity = int(h["capacity"])
        self.record_size = int(h["record_size"])
        self.schema = bytes(h["schema"]).decode(errors="replace")
        self.fields = [bytes(f).decode(errors="replace") for f in h["fields"][: self.n_fields]]

        size = HEADER_SIZE + self.capacity * self.record_size
        region = guard.protect(np.frombuffer(mm, dtype=np.uint8).ctypes.data, size, fd, size)  # a writer may cut it short
        self._unguard = weakref.finalize(mm, region.release) if region is not None else None

    @classmethod
    def register(cls, name: str, schema: str, fields: Sequence[str], capacity: int = 65536,
                 mode: int = DEFAULT_MODE) -> FeatureStore:
        """Create the store ``name`` for vectors of ``fields``, mode ``mode`` (this user's alone
        unless shared on purpose), replacing a feature store of this user of that name and
        nothing else."""
        if not 1 <= len(fields) <= MAX_FIELDS:
            raise ValueError(f"a schema has 1 to {MAX_FIELDS} fields, not {len(fields)}")
        if len(set(fields)) != len(fields):
            raise ValueError("field names repeat")
        for text in (schema, *fields):
            if not text or len(text.encode()) >= NAME_LEN:
                raise ValueError(f"names are 1 to {NAME_LEN - 1} bytes: {text!r}")
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be 1 to {MAX_CAPACITY}")
        path = ring_path(name)
        if os.path.lexists(path):
            remove_ring(path, MAGIC, "feature store", served=False)
        size = HEADER_SIZE + capacity * _record_size(len(fields))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise RingError(f"{path}: created by someone else meanwhile; refusing to use it", ExitCode.FAILURE) from None
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        h = np.frombuffer(mm, dtype=np.uint8)[:HEADER_SIZE].view(HEADER_DTYPE)
        h["version"] = VERSION
        h["n_fields"] = len(fields)
        h["capacity"] = capacity
        h["record_size"] = _record_size(len(fields))
        h["schema"] = schema.encode()
        h["fields"][0, : len(fields)] = [f.encode() for f in fields]
        h["magic"] = MAGIC
        del h
        return cls(path, fd, mm)

    @classmethod
    def open(cls, name: str, owners: tuple[int, ...] | None = None) -> FeatureStore:
        """Map a store after checking, before mapping, that it is a regular file (not followed
        through a link) of one of ``owners`` (default: this user or root) with a sound header."""
        path = ring_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RingError(f"{path}: no such feature store (register it first)", ExitCode.NO_INPUT) from None
        except PermissionError as e:
            raise RingError(f"{path}: {e.strerror}", ExitCode.PERMISSION) from None
        except OSError as e:
            what = "a symbolic link, not a feature store" if e.errno == errno.ELOOP else f"cannot open: {e.strerror}"
            raise RingError(f"{path}: {what}", ExitCode.BAD_INPUT) from None
        try:
            st = os.fstat(fd)
            allowed = (os.geteuid(), 0) if owners is None else owners
            if not stat.S_ISREG(st.st_mode):
                raise RingError(f"{path}: not a regular file, not a feature store", ExitCode.BAD_INPUT)
            if st.st_uid not in allowed:
                raise RingError(f"{path}: belongs to uid {st.st_uid}: refusing a feature store another user made",
                                ExitCode.PERMISSION)
            raw = os.pread(fd, HEADER_SIZE, 0)
            h = np.frombuffer(raw, dtype=HEADER_DTYPE)[0] if len(raw) == HEADER_SIZE else None
            problem = None
            if h is None or int(h["magic"]) != MAGIC:
                problem = "not a feature store"
            elif int(h["version"]) != VERSION:
                problem = f"feature store version {int(h['version'])}, this program speaks {VERSION}"
            elif not 1 <= int(h["n_fields"]) <= MAX_FIELDS or int(h["record_size"]) != _record_size(int(h["n_fields"])):
                problem = "inconsistent field count or record size"
            elif not 1 <= int(h["capacity"]) <= MAX_CAPACITY:
                problem = f"capacity {int(h['capacity'])} out of range"
            elif st.st_size < HEADER_SIZE + int(h["capacity"]) * int(h["record_size"]):
                problem = "file shorter than its header says"
            if problem:
                raise RingError(f"{path}: {problem}", ExitCode.BAD_INPUT)
            mm = mmap.mmap(fd, HEADER_SIZE + int(h["capacity"]) * int(h["record_size"]))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, raw)

    def close(self) -> None:
        if self._unguard is not None:
            self._unguard()
        del self.header
        self.mm.close()
        os.close(self.fd)

    def record(self, values: Sequence[float] | np.ndarray, ts_ns: int | None = None) -> int:
        """Append one vector (timestamp: CLOCK_MONOTONIC now unless given); return its seq."""
        vec = np.asarray(values, dtype=np.float32).ravel()
        if vec.size != self.n_fields:
            raise ValueError(f"{vec.size} values, schema {self.schema!r} has {self.n_fields} fields")
        ts = time.monotonic_ns() if ts_ns is None else int(ts_ns)
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLKW, flock_struct(fcntl.F_WRLCK, LOCK_DAEMON))
        try:
            seq = int(self.header["write_index"])
            off = HEADER_SIZE + (seq % self.capacity) * self.record_size
            self.mm[off : off + 16] = np.array([ts, seq], dtype="<u8").tobytes()
            self.mm[off + 16 : off + 16 + 4 * self.n_fields] = vec.tobytes()
            self.header["write_index"] = (seq + 1) & 0xFFFFFFFFFFFFFFFF
        finally:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, flock_struct(fcntl.F_UNLCK, LOCK_DAEMON))
        return seq

    def window(self, since_ns: int = 0, until_ns: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ts_ns, seq, values) of the records with since_ns <= ts < until_ns, oldest first."""
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLKW, flock_struct(fcntl.F_RDLCK, LOCK_DAEMON))
        try:
            count = min(int(self.header["write_index"]), self.capacity)
            raw = np.frombuffer(self.mm, dtype=np.uint8, count=count * self.record_size, offset=HEADER_SIZE).copy()
        finally:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, flock_struct(fcntl.F_UNLCK, LOCK_DAEMON))
        recs = raw.reshape(count, self.record_size)
        head = recs[:, :16].copy().view("<u8")
        ts, seq = head[:, 0], head[:, 1]
        values = recs[:, 16 : 16 + 4 * self.n_fields].copy().view("<f4")
        keep = (ts >= since_ns) & (ts < (until_ns if until_ns is not None else np.iinfo(np.uint64).max))
        order = np.argsort(seq[keep], kind="stable")
        return ts[keep][order], seq[keep][order], values[keep][order]
