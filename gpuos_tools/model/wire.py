"""The private wire between the in-process tracer and `gpu-trace run`.

The tracer must do as little as possible on the program's launch path, so it appends plain tuples
to a queue and a drain thread ships them in batches as length-prefixed `marshal` frames over an
inherited pipe. The native tracer (csrc/gpuos_trace.c) ships binary records instead, in frames
whose length has bit 31 set; model/binary.py turns them into the same tuples. The parent turns them into stream records (gpuos_tools.model.decode). Both sides
come from the same installed package, so marshal's version coupling is not a concern.

Tuple layouts (first element is the tag):

HELLO   (0, pid, python, cupti_version or None, {cbid: api name}, {resource cbid: name}, backend,
        mechanism): mechanism "cupti" (callbacks) or "intercept" (the preloaded interposer, whose
        cbids are its entries' indexes)
LAUNCH  (1, ts, tid, cbid, func, gx, gy, gz, bx, by, bz, smem, stream, args, result, captured[, dptrs])
        captured: the stream was being captured into a graph, so the kernel did not run
        dptrs (only with --check-pointers): ((param index, offset, CUmemorytype), ...)
FUNC    (2, func, mangled name, layout source, ((offset, size), ...) or None)
ALLOC   (3, ts, tid, cbid, addr, size, kind, stream)
FREE    (4, ts, tid, cbid, addr, size or -1, stream)
COPY    (5, ts, tid, cbid, direction, dst, src, nbytes, stream, is_async, shape, data)
        shape: (width, height, src pitch, dst pitch) of 2-D copies, else None; data: the bytes
        of a copy from host memory of at most 4096 bytes, else None
SET     (6, ts, tid, cbid, dst, nbytes, value, elem, stream, is_async)
MODULE  (7, ts, tid, cupti module id, image bytes)
STREAM  (8, ts, tid, stream, event)
GRAPH   (9, ts, tid, cbid, graph exec, stream)
ERROR   (10, ts, message)
END     (11, ts, {counter: value})
LIBRARY (12, ts, tid, cbid, image bytes or None)
VALID   (13, ts, tid, {validation record body}) right after the LAUNCH it checked (--validate)
GRAPHOP (14, ts, tid, cbid, op, a, b): op "capture_begin" (a = stream), "capture_end" (a = stream,
        b = graph), "instantiate" (a = graph, b = executable graph)
SYMBOL  (15, ts, tid, cbid, what, handle, parent, addr, size or -1, name): a module's (or library's)
        variable (what "variable": addr, size; -1 when the caller did not ask for it) or function
        ("function": handle, what launches name) looked up by name in ``parent``; cbid ASKED: the
        tracer asked the driver which module holds a function it saw launched (cuFuncGetModule)

``args`` is every parameter's bytes concatenated in ordinal order (sizes from the FUNC layout);
``stream`` is the raw CUstream handle (0: legacy default stream, 2: per-thread default).
"""

from __future__ import annotations

import marshal
import os
import struct
from collections.abc import Iterator

HELLO, LAUNCH, FUNC, ALLOC, FREE, COPY, SET, MODULE, STREAM, GRAPH, ERROR, END, LIBRARY, VALID, GRAPHOP, SYMBOL = range(16)

#: the cbid of a record of what the tracer asked the driver itself, not a call of the program's
ASKED = 0xFFFFFFFF
ASKED_API = "cuFuncGetModule"

FRAME = struct.Struct("<I")
MAX_FRAME = 1 << 31


def encode_frame(items: list) -> bytes:
    data = marshal.dumps(items)
    if len(data) >= MAX_FRAME:
        raise ValueError("frame too large")
    return FRAME.pack(len(data)) + data


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class TruncatedWire(Exception):
    """The tracer's pipe ended in the middle of a frame (the program died while writing)."""


NATIVE_FLAG = 0x80000000  # a frame of the native tracer's binary records (model/binary.py)


def read_frames(fd: int, chunk: int = 1 << 20, native=None) -> Iterator[list]:
    """Yield each frame's list of tuples until EOF on ``fd``; ``native`` parses native frames."""
    buf = bytearray()
    while True:
        data = os.read(fd, chunk)
        if not data:
            break
        buf += data
        pos = 0
        while len(buf) - pos >= 4:
            (head,) = FRAME.unpack_from(buf, pos)
            n = head & ~NATIVE_FLAG
            if len(buf) - pos - 4 < n:
                break
            payload = bytes(buf[pos + 4 : pos + 4 + n])
            if head & NATIVE_FLAG:
                if native is None:
                    raise ValueError("a native frame arrived but no parser was given")
                yield native(payload)
            else:
                yield marshal.loads(payload)
            pos += 4 + n
        del buf[:pos]
    if buf:
        raise TruncatedWire(f"{len(buf)} bytes of an incomplete frame")
