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
from gpuos_tools.stream.framing import STDIO, ZSTD_MAGIC, StreamError

_CHUNK = 1 << 20
_ZSTD_STEP = 1 << 16

# The C scanner behind json.loads, called directly: it skips loads' two whitespace regex
# matches per call. Anything it does not accept whole goes to the slow path, which uses
# json.loads for the real error message.
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]

OnError = Literal["raise", "emit"]


class Reader:
    """Iterate the records of one input, header included; ``.header`` peeks at it.

    With ``on_error="emit"`` a bad line becomes ``{"type": "error", "line", "message",
    "source"}`` in the iteration instead of an exception. Truncation always raises, after
    every complete record has been yielded.
    """

    def __init__(
        self,
        name: str,
        read: Callable[[int], bytes],
        close: Callable[[], None] | None,
        *,
        compressed_by_name: bool,
        on_error: OnError,
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
        lineno = 0
        partial: list[bytes] = []
        for chunk in self._chunks():
            cut = chunk.rfind(b"\n") + 1
            if not cut:
                partial.append(chunk)
                continue
            if partial:
                partial.append(chunk[:cut])
                body = b"".join(partial)
                partial.clear()
            else:
                body = chunk[:cut]
            if cut < len(chunk):
                partial.append(chunk[cut:])
            lines = self._decode(body, lineno)
            for line in lines:
                lineno += 1
                try:
                    record, end = scan(line, 0)
                except (StopIteration, ValueError, RecursionError):
                    end = -1
                if end == len(line) and record.__class__ is dict and "type" in record:
                    yield record
                    continue
                record = slow(line, lineno)
                if record is not None:
                    yield record
        if self._frame_open:
            raise StreamError(
                f"{self.name}: truncated after line {lineno} (the zstd stream ends inside a frame)",
                ExitCode.TRUNCATED,
                path=self.name,
                line=lineno,
            )
        if partial:
            raise StreamError(
                f"{self.name}: truncated after line {lineno} (last line has no newline)",
                ExitCode.TRUNCATED,
                path=self.name,
                line=lineno,
            )

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

    def _slow(self, line: str, lineno: int) -> dict[str, Any] | None:
        """A line the fast path did not accept: a blank line (skipped), an error, or odd spacing."""
        if lineno in self._undecodable:
            return self._bad(lineno, self._undecodable.pop(lineno))
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            return self._bad(lineno, f"not valid JSON: {e.msg} (column {e.colno})")
        except RecursionError:
            return self._bad(lineno, "not valid JSON: nested too deeply")
        if not isinstance(record, dict):
            return self._bad(lineno, f"not a JSON object (a {type(record).__name__})")
        if "type" not in record:
            return self._bad(lineno, 'record has no "type"')
        return record

    def _bad(self, lineno: int, message: str) -> dict[str, Any]:
        if self.on_error == "emit":
            return {"type": "error", "line": lineno, "message": message, "source": self.name}
        raise StreamError(f"{self.name}:{lineno}: {message}", ExitCode.BAD_INPUT, path=self.name, line=lineno)


def open_input(path: str | os.PathLike[str], *, on_error: OnError = "raise") -> Reader:
    """Open an input stream: ``"-"`` is stdin; zstd is recognised by a .zst name or its magic."""
    name = os.fspath(path)
    if name == STDIO:
        stdin = sys.stdin.buffer
        # read1: whatever has arrived, so records flow as a pipe delivers them.
        read = getattr(stdin, "read1", stdin.read)
        return Reader("<stdin>", read, None, compressed_by_name=False, on_error=on_error)
    try:
        file = open(name, "rb", buffering=0)  # noqa: SIM115 (the Reader owns it)
    except FileNotFoundError as e:
        raise StreamError(f"{name}: no such file", ExitCode.NO_INPUT, path=name) from e
    except PermissionError as e:
        raise StreamError(f"{name}: permission denied", ExitCode.PERMISSION, path=name) from e
    except OSError as e:
        raise StreamError(f"{name}: cannot read: {e.strerror}", ExitCode.NO_INPUT, path=name) from e
    return Reader(name, file.read, file.close, compressed_by_name=name.endswith(".zst"), on_error=on_error)
