"""Writing a stream: one compact JSON object per line, to stdout, a file (atomically) or a .zst."""

from __future__ import annotations

import itertools
import json
import json.encoder
import math
import os
import stat
import sys
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, BinaryIO, Self

import zstandard

from gpuos_tools.errors import ExitCode
from gpuos_tools.stream import atomic
from gpuos_tools.stream.framing import STDIO, StreamError
from gpuos_tools.stream.records import check_written

#: Set to 1 (the tests do), every record written is checked as a reader would check it.
CHECK_ENV = "GPUOS_CHECK_RECORDS"

# Records are encoded one by one but written in batches of this many lines.
_BATCH = 1024


def _chunk_encoder() -> Callable[[Any, int], Iterable[str]]:
    """``f(record, 0)``: the compact JSON of ``record`` as a list of str chunks.

    Made once and called directly, the C encoder that json.dumps uses internally costs about
    half of what JSONEncoder.encode does (which rebuilds it on every call).
    """
    # allow_nan=False: NaN and infinities are not JSON, and every reader would refuse the line
    base = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False, allow_nan=False)
    c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
    if c_make_encoder is None:
        return lambda record, _level: (base.encode(record),)
    return c_make_encoder(None, base.default, json.encoder.encode_basestring, None, ":", ",", False, False, False)


def _non_finite(value: Any, path: str = "") -> tuple[str, float] | None:
    """Where in a record a NaN or an infinity is (``field.sub[2]``), and the number; or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(the record)", value
    if isinstance(value, dict):
        items: Iterable[tuple[str, Any]] = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        found = _non_finite(item, where)
        if found is not None:
            return found
    return None


def _is_non_finite_error(e: ValueError) -> bool:
    return str(e).startswith("Out of range float values are not JSON compliant")


def _unwritable(name: str, record: Any) -> StreamError:
    """A record JSON cannot carry (``record`` when known): the tool that made it has a bug."""
    found = _non_finite(record) if record is not None else None
    if found is not None:
        where, number = found
        kind = record.get("type", "?") if isinstance(record, dict) else type(record).__name__
        shown = "NaN" if number != number else ("Infinity" if number > 0 else "-Infinity")
        what = f"a {kind} record: field {where} is {shown}"
    else:
        what = "a record: a number in it is NaN or infinite"
    return StreamError(f"{name}: cannot write {what}, which JSON cannot carry (a bug in the tool that "
                       "made it; that record was not written)", ExitCode.SOFTWARE, path=name)


def _is_live(file: BinaryIO) -> bool:
    """True when someone may be reading as we write: a pipe, a socket or a terminal."""
    try:
        fd = file.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd)


class Writer:
    """Write records to one output; use as a context manager or call ``close()``.

    Leaving the ``with`` block through an exception aborts: a file being written atomically is
    discarded and the previous file (if any) stays as it was.
    """

    def __init__(
        self,
        name: str,
        file: BinaryIO,
        *,
        per_record: bool,
        compress: bool,
        owns_file: bool,
        rename: tuple[str, str] | None = None,
    ):
        self.name = name
        #: Flush after every record (pipes, terminals, ``unbuffered=True``).
        self.per_record = per_record
        self._file = file
        self._owns_file = owns_file
        #: (temp file, final name) when the output is written atomically
        self._rename = rename
        self._zstd = zstandard.ZstdCompressor().compressobj() if compress else None
        self._pending: list[str] = []
        self._closed = False
        #: GPUOS_CHECK_RECORDS=1: every record written is checked against its type's schema
        self._checking = os.environ.get(CHECK_ENV) == "1"
        self._written = 0
        self._chunks = _chunk_encoder()

    def write(self, record: dict[str, Any]) -> None:
        if self._closed:
            raise ValueError(f"{self.name}: write to a closed stream")
        if self._checking:
            self._check(record)
        pending = self._pending
        try:
            pending.append("".join(self._chunks(record, 0)))
        except ValueError as e:
            if not _is_non_finite_error(e):
                raise
            raise _unwritable(self.name, record) from None
        if self.per_record or len(pending) >= _BATCH:
            self._drain()

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        if self._closed:
            raise ValueError(f"{self.name}: write to a closed stream")
        if self.per_record:
            for record in records:
                self.write(record)
            return
        # Encoding happens in C as each record is pulled, so a producer that reuses one dict
        # for every record still gets each version written.
        if self._checking:
            records = map(self._checked, records)
        lines = map("".join, map(self._chunks, records, itertools.repeat(0)))
        pending = self._pending
        while True:
            # extend keeps what it got when the producer raises (a bad input line): abort()
            # then still writes those records where they can go
            before = len(pending)
            try:
                pending.extend(itertools.islice(lines, _BATCH - before))
            except ValueError as e:
                if not _is_non_finite_error(e):  # the producer's own error
                    raise
                raise _unwritable(self.name, None) from None
            if len(pending) == before:
                break
            if len(pending) >= _BATCH:
                self._drain()

    def _check(self, record: dict[str, Any]) -> None:
        """Refuse a record that readers would refuse: a tool that writes one has a bug."""
        self._written += 1
        problem = check_written(record)
        if problem is None and self._written > 1 and record.get("type") == "header":
            problem = "a second header"
        if problem is not None:
            raise StreamError(f"{self.name}: record {self._written} ({record.get('type')!r}) would not read back: "
                              f"{problem} ({CHECK_ENV}=1)", ExitCode.SOFTWARE, path=self.name)

    def _checked(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record``, after ``_check`` (one call less per record when the checks pass)."""
        self._written += 1
        if check_written(record) is None and (self._written == 1 or record.get("type") != "header"):
            return record
        self._written -= 1
        self._check(record)  # raises, saying why
        return record

    def _drain(self) -> None:
        """Write out the pending lines; in per-record mode also push them to the reader."""
        pending = self._pending
        pending.append("")
        # Lone surrogates (from "\udXXX" escapes in the input) cannot be UTF-8; "backslashreplace"
        # writes them back as the same JSON escape, since they can only occur inside strings.
        data = "\n".join(pending).encode("utf-8", "backslashreplace")
        pending.clear()
        try:
            if self._zstd is not None:
                data = self._zstd.compress(data)
                if self.per_record:
                    data += self._zstd.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
            self._file.write(data)
            if self.per_record:
                self._file.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StreamError(f"{self.name}: write failed: {e.strerror}", ExitCode.IO_ERROR, path=self.name) from e

    def close(self) -> None:
        """Finish the output: flush, end the zstd frame, rename the temp file into place."""
        if self._closed:
            return
        try:
            try:
                if self._pending:
                    self._drain()
                if self._zstd is not None:
                    self._file.write(self._zstd.flush())
                self._file.flush()
                if self._owns_file:
                    self._file.close()
                if self._rename is not None:
                    os.replace(*self._rename)
            except BrokenPipeError:
                raise
            except OSError as e:
                raise StreamError(f"{self.name}: write failed: {e.strerror}", ExitCode.IO_ERROR, path=self.name) from e
        except BaseException:
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Stop without finishing: discard a temp file. Written in place (standard output, a
        pipe, a file with --unbuffered), the records already made still go out, as they would
        have through a pipe: a command that stops at a bad or truncated input line leaves every
        record before it, wherever its output goes. A zstd frame is not ended, so the reader
        of a compressed output sees that it was cut short."""
        if self._closed:
            return
        if self._rename is None and self._pending:
            try:
                self.per_record = True  # a zstd block ends with the records, the frame does not
                self._drain()
                self._file.flush()
            except (OSError, StreamError):
                pass  # a closed pipe, a full disk: nothing more can be saved
        self._closed = True
        self._pending.clear()
        if self._owns_file:
            try:
                self._file.close()
            except OSError:
                pass
        if self._rename is not None:
            atomic.discard(self._rename[0])

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        return f"<Writer {self.name!r} per_record={self.per_record}>"


def open_output(path: str | os.PathLike[str], *, unbuffered: bool | None = None) -> Writer:
    """Open an output stream.

    ``"-"`` is stdout; a name ending in ``.zst`` is zstd-compressed; a regular file is written
    to a temp file and renamed into place on ``close()``; an existing non-regular file (a FIFO,
    a terminal, /dev/null) is written in place. ``unbuffered`` forces (True) or forbids (False)
    a flush after every record; by default it happens exactly when the output is a pipe, a
    socket or a terminal. ``unbuffered=True`` also writes a regular file in place, so that
    ``tail -f`` can follow it.
    """
    name = os.fspath(path)
    if name == STDIO:
        stdout = sys.stdout.buffer
        live = unbuffered if unbuffered is not None else _is_live(stdout)
        return Writer("<stdout>", stdout, per_record=live, compress=False, owns_file=False)

    compress = name.endswith(".zst")
    rename = None
    try:
        try:
            regular = stat.S_ISREG(os.stat(name).st_mode)
        except FileNotFoundError:
            regular = True
        # A file written with per-record flushes is meant to be followed (tail -f) while it
        # grows, so it is written in place; otherwise it appears only once complete.
        if unbuffered or not regular:
            file: BinaryIO = open(name, "wb")  # noqa: SIM115 (the Writer owns it)
        else:
            target = os.path.realpath(name)
            temp, fd = atomic.create_temp(target)
            rename = (temp, target)
            file = open(fd, "wb")  # noqa: SIM115
    except OSError as e:
        raise StreamError(
            f"{name}: cannot write: {e.strerror}",
            ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.IO_ERROR,
            path=name,
        ) from e
    live = unbuffered if unbuffered is not None else _is_live(file)
    return Writer(name, file, per_record=live, compress=compress, owns_file=True, rename=rename)
