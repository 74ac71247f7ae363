"""Reading a stream: plain or zstd (by name or by magic bytes), with line-numbered errors."""

from __future__ import annotations

import itertools
import json
import json.scanner
import os
import sys
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Literal, Self

import zstandard

from gpuos_tools.errors import ExitCode
from gpuos_tools.stream.framing import SCHEMA, STDIO, ZSTD_MAGIC, StreamError
from gpuos_tools.stream.records import INPUT, Passed
from gpuos_tools.stream.schema import SHORT_LINE, RecordChecker, _show

_CHUNK = 1 << 20
#: The longest line read: far beyond any record (large payloads go to side files), short of
#: what would exhaust a machine's memory.
MAX_LINE = 1 << 28
#: What ``_slow`` returns for a bad line once ``_bad`` has made its error record.
_BAD: Any = object()
_ZSTD_STEP = 1 << 16

# The C scanner behind json.loads, called directly: it skips loads' two whitespace regex
# matches per call. Anything it does not accept whole goes to the slow path, which uses
# json.loads for the real error message.
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]

OnError = Literal["raise", "emit"]


class Reader:
    """Iterate the records of one input, header included; ``.header`` peeks at it.

    Every record of a type gpuos_tools.stream.records knows is checked against its schema as it
    is read (``check=False``: only the framing, for tools that look at no field). A bad line
    or record raises StreamError (BAD_INPUT) naming the line and the field; with
    ``on_error="emit"`` it becomes ``{"type": "error", "line", "message", "source"}`` in the
    iteration instead. A header is only accepted as the first record, and one whose schema this
    reader does not know is refused (always raised). Truncation always raises, after every
    complete record has been yielded.
    """

    def __init__(
        self,
        name: str,
        read: Callable[[int], bytes],
        close: Callable[[], None] | None,
        *,
        compressed_by_name: bool,
        on_error: OnError,
        check: bool = True,
    ):
        if on_error not in ("raise", "emit"):
            raise ValueError(f"on_error must be 'raise' or 'emit', not {on_error!r}")
        self.name = name
        self.on_error = on_error
        self._read = read
        self._close = close
        self._compressed_by_name = compressed_by_name
        self._frame_open = False
        self._undecodable: dict[int, str] = {}
        self._checkers = INPUT.checkers if check else {}
        self._emitted: dict[str, Any] = {}
        self._records = self._parse()
        self._first: dict[str, Any] | None = None
        self._peeked = False
        self._started = False

    @property
    def header(self) -> dict[str, Any] | None:
        """The first record if it is a header, else None (reads it if iteration has not begun)."""
        first = self._peek()
        return first if first is not None and first["type"] == "header" else None

    def _peek(self) -> dict[str, Any] | None:
        if not self._peeked:
            self._peeked = True
            self._first = next(self._records, None)
        return self._first

    def __iter__(self) -> Iterator[dict[str, Any]]:
        first = self._peek()
        if self._started or first is None:
            return self._records
        self._started = True
        return itertools.chain((first,), self._records)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Reader {self.name!r}>"

    # -- bytes ------------------------------------------------------------------------------

    def _raw(self) -> Iterator[bytes]:
        read = self._read
        try:
            while chunk := read(_CHUNK):
                yield chunk
        except OSError as e:
            code = ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.NO_INPUT
            raise StreamError(f"{self.name}: read failed: {e.strerror}", code, path=self.name) from e

    def _chunks(self) -> Iterator[bytes]:
        """The decompressed bytes of the input, in chunks."""
        raw = self._raw()
        first = b""
        for chunk in raw:
            first += chunk
            if len(first) >= len(ZSTD_MAGIC):
                break
        if not first.startswith(ZSTD_MAGIC):
            if self._compressed_by_name and first:
                raise StreamError(
                    f"{self.name}: not zstd data (no zstd magic bytes)", ExitCode.BAD_INPUT, path=self.name
                )
            if first:
                yield first
            yield from raw
            return
        dctx = zstandard.ZstdDecompressor()
        frame = dctx.decompressobj()
        for data in itertools.chain((first,), raw):
            # Fed in small steps, so that highly compressed input cannot expand into one huge chunk.
            view = memoryview(data)
            while view:
                step, view = view[:_ZSTD_STEP], view[_ZSTD_STEP:]
                self._frame_open = True
                try:
                    out = frame.decompress(step)
                except zstandard.ZstdError as e:
                    raise StreamError(f"{self.name}: bad zstd data: {e}", ExitCode.BAD_INPUT, path=self.name) from e
                if out:
                    yield out
                if frame.eof:
                    # A frame ended; concatenated frames (cat a.zst b.zst) may follow.
                    self._frame_open = False
                    if frame.unused_data:
                        view = memoryview(frame.unused_data + view.tobytes())
                    frame = dctx.decompressobj()

    # -- records ----------------------------------------------------------------------------

    def _parse(self) -> Iterator[dict[str, Any]]:
        scan = _scan
        slow = self._slow
        checkers = self._checkers
        known = INPUT.types  # a record of any other type is another tool's: marked Passed
        lineno = 0
        first = True  # the next non-blank line is the stream's first (where a header may be)
        partial: list[bytes] = []
        pending = 0  # bytes in partial
        for chunk in self._chunks():
            cut = chunk.rfind(b"\n") + 1
            if not cut:
                partial.append(chunk)
                pending += len(chunk)
                if pending > MAX_LINE:
                    self._too_long(lineno + 1)
                continue
            if partial:
                partial.append(chunk[:cut])
                body = b"".join(partial)
                partial.clear()
            else:
                body = chunk[:cut]
            if cut < len(chunk):
                partial.append(chunk[cut:])
            pending = len(chunk) - cut
            lines = self._decode(body, lineno)
            for line in lines:
                lineno += 1
                try:
                    record, end = scan(line, 0)
                except (StopIteration, ValueError, RecursionError):
                    end = -1
                if end != len(line) or record.__class__ is not dict:
                    record = slow(line, lineno)
                    if record is None:
                        continue
                    if record is _BAD:
                        first = False
                        yield self._emitted
                        continue
                kind = record.get("type")
                if kind.__class__ is str and kind and kind != "header":
                    first = False
                    checker = checkers.get(kind)
                    if checker is None:
                        yield record if kind in known else Passed(record)
                        continue
                    if (problem := checker(record, len(line) < SHORT_LINE)) is None:
                        yield record
                        continue
                    problem = f"{kind} record, {problem}"
                else:
                    problem = self._check(record, kind, checkers.get(kind) if kind.__class__ is str else None,
                                          lineno, first)
                    first = False
                if problem is None:
                    yield _passed(record, kind)
                else:
                    yield self._bad(lineno, problem)
        if self._frame_open:
            raise StreamError(
                f"{self.name}: truncated after line {lineno} (the zstd stream ends inside a frame)",
                ExitCode.TRUNCATED,
                path=self.name,
                line=lineno,
            )
        if partial:
            # A last line without its newline: cut short if it is not whole JSON; otherwise it
            # is a line like any other (a file saved without a final newline).
            try:
                line = b"".join(partial).decode().strip()
            except UnicodeDecodeError:  # cut inside a character
                line = "\0"
            if not line:
                return
            try:
                record, end = scan(line, 0)
            except (StopIteration, ValueError, RecursionError):
                end = -1
            if end != len(line):
                raise StreamError(
                    f"{self.name}: truncated after line {lineno} (last line has no newline)",
                    ExitCode.TRUNCATED,
                    path=self.name,
                    line=lineno,
                )
            lineno += 1
            if record.__class__ is not dict:
                yield self._bad(lineno, f"not a JSON object (a {_json_name(record)}): not a gpuos record")
                return
            kind = record.get("type")
            problem = self._check(record, kind, checkers.get(kind) if kind.__class__ is str else None, lineno, first)
            yield _passed(record, kind) if problem is None else self._bad(lineno, problem)

    def _check(
        self, record: dict[str, Any], kind: Any, checker: RecordChecker | None,
        lineno: int, first: bool,
    ) -> str | None:
        """What is wrong with a record (None: nothing). A bad header is fatal whatever
        ``on_error`` says: the rest of the stream cannot be read without knowing its schema."""
        if kind.__class__ is not str or not kind:
            if "type" not in record:
                return 'not a gpuos record (a JSON object without "type")'
            return f'field "type" must be a non-empty string, not {_show(kind)}'
        if kind == "header":
            if not first:
                return "a second header: only the first record of a stream may be one (two streams concatenated?)"
            schema = record.get("schema")
            if schema != SCHEMA:
                known = f"this reader knows {SCHEMA}"
                what = f"unknown schema {_show(schema)}" if schema is not None else 'no "schema"'
                raise StreamError(f"{self.name}:{lineno}: header: {what} ({known})", ExitCode.BAD_INPUT,
                                  path=self.name, line=lineno)
            problem = checker(record) if checker is not None else None
            if problem is not None:
                raise StreamError(f"{self.name}:{lineno}: header: {problem}", ExitCode.BAD_INPUT,
                                  path=self.name, line=lineno)
            return None
        if checker is None:
            return None
        problem = checker(record)
        return None if problem is None else f"{kind} record, {problem}"

    def _too_long(self, lineno: int) -> None:
        raise StreamError(f"{self.name}:{lineno}: line longer than {MAX_LINE >> 20} MiB: not a gpuos record",
                          ExitCode.BAD_INPUT, path=self.name, line=lineno)

    def _decode(self, body: bytes, lineno: int) -> list[str]:
        """Split ``body`` (whole lines) into str lines; invalid UTF-8 lines become "" and are noted."""
        try:
            lines = body.decode().split("\n")
        except UnicodeDecodeError:
            lines = []
            for i, raw in enumerate(body.split(b"\n"), lineno + 1):
                try:
                    lines.append(raw.decode())
                except UnicodeDecodeError as e:
                    self._undecodable[i] = f"not valid UTF-8 (byte {e.start + 1}: {e.reason})"
                    lines.append("")
        lines.pop()
        return lines

    def _slow(self, line: str, lineno: int) -> Any:
        """A line the fast path did not accept: None for a blank line (skipped), the record when
        only its spacing was odd, else ``_BAD`` after ``_bad`` (which raises in raise mode)."""
        if lineno in self._undecodable:
            self._emitted = self._bad(lineno, self._undecodable.pop(lineno))
            return _BAD
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            self._emitted = self._bad(lineno, f"not valid JSON: {e.msg} (column {e.colno})")
            return _BAD
        except RecursionError:
            self._emitted = self._bad(lineno, "not valid JSON: nested too deeply")
            return _BAD
        if not isinstance(record, dict):
            self._emitted = self._bad(lineno, f"not a JSON object (a {_json_name(record)}): not a gpuos record")
            return _BAD
        return record

    def _bad(self, lineno: int, message: str) -> dict[str, Any]:
        if self.on_error == "emit":
            return {"type": "error", "line": lineno, "message": message, "source": self.name}
        raise StreamError(f"{self.name}:{lineno}: {message}", ExitCode.BAD_INPUT, path=self.name, line=lineno)


def _passed(record: dict[str, Any], kind: Any) -> dict[str, Any]:
    """``record``, marked as another tool's when its type has no schema here."""
    return record if kind == "header" or kind in INPUT.types else Passed(record)


def _json_name(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__)


def open_input(path: str | os.PathLike[str], *, on_error: OnError = "raise", check: bool = True) -> Reader:
    """Open an input stream: ``"-"`` is stdin; zstd is recognised by a .zst name or its magic.
    ``check``: validate the records of known types (see Reader)."""
    name = os.fspath(path)
    if name == STDIO:
        stdin = sys.stdin.buffer
        # read1: whatever has arrived, so records flow as a pipe delivers them.
        read = getattr(stdin, "read1", stdin.read)
        return Reader("<stdin>", read, None, compressed_by_name=False, on_error=on_error, check=check)
    try:
        file = open(name, "rb", buffering=0)  # noqa: SIM115 (the Reader owns it)
    except FileNotFoundError as e:
        raise StreamError(f"{name}: no such file", ExitCode.NO_INPUT, path=name) from e
    except PermissionError as e:
        raise StreamError(f"{name}: permission denied", ExitCode.PERMISSION, path=name) from e
    except OSError as e:
        raise StreamError(f"{name}: cannot read: {e.strerror}", ExitCode.NO_INPUT, path=name) from e
    return Reader(name, file.read, file.close, compressed_by_name=name.endswith(".zst"), on_error=on_error,
                  check=check)
