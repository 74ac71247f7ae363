"""The native tracer's binary records (gpuos_tools/injection/csrc/gpuos_record.c): the handler kinds
it is told to use for each callback, and the parser that turns one frame of its records into the
same wire tuples the Python tracer sends, so decoding into stream records is shared.
"""

from __future__ import annotations

import struct

from gpuos_tools.model import wire

# handler kinds, as in the C enum
KIND_LAUNCH, KIND_LAUNCH_COOP, KIND_LAUNCH_EX, KIND_GRAPH = 1, 2, 3, 4
KIND_ALLOC, KIND_MAP = 10, 16
KIND_FREE, KIND_FREE_ASYNC, KIND_FREE_HOST, KIND_UNMAP = 20, 21, 22, 23
KIND_COPY, KIND_COPY2D, KIND_COPY2D_ASYNC = 32, 56, 57
KIND_SET, KIND_LIBRARY = 64, 80
KIND_VARIABLE, KIND_FUNCTION = 84, 85
KIND_CAPTURE_BEGIN, KIND_CAPTURE_END, KIND_INSTANTIATE = 90, 91, 92
GRAPH_OPS = ("capture_begin", "capture_end", "instantiate")

SYMBOLS = ("variable", "function")
ALLOC_KINDS = ("device", "pitch", "managed", "async", "pool", "host", "vmm")
COPY_DIRS = ("default", "HtoD", "DtoH", "DtoD", "peer", "HtoH")
_DIR_CODE = {name: i for i, name in enumerate(COPY_DIRS)}
LIBRARY_FORMATS = ("unknown", "cubin", "fatbin", "ptx")


def copy_kind(direction: str, peer: bool, with_stream: bool) -> int:
    return KIND_COPY | _DIR_CODE[direction] << 2 | int(peer) << 1 | int(with_stream)


def set_kind(elem: int, two_d: bool, with_stream: bool) -> int:
    return KIND_SET | {1: 0, 2: 1, 4: 2}[elem] << 2 | int(two_d) << 1 | int(with_stream)


_HDR = struct.Struct("<HHIQII")  # tag, pad, length, ts, tid, cbid
_LAUNCH = struct.Struct("<Q7IIQIII4x")  # func, grid+block+smem, result, stream, args_len, ndptrs, flags
_FUNC = struct.Struct("<QIII4x")
_U64 = {n: struct.Struct(f"<{n}Q") for n in (2, 3, 4, 6, 10)}
_SOURCES = ("none", "cuFuncGetParamInfo", "cuKernelGetParamInfo")
_NO_ARGS = 0xFFFFFFFF
_ALL_ONES = (1 << 64) - 1


def parse_records(data: bytes, check_pointers: bool = False) -> list[tuple]:
    """Native records (one frame's payload) -> wire tuples."""
    out: list[tuple] = []
    append = out.append
    pos, end = 0, len(data)
    hdr = _HDR.unpack_from
    while pos < end:
        tag, _, length, ts, tid, cbid = hdr(data, pos)
        if length < _HDR.size or pos + length > end:
            raise ValueError(f"native record at byte {pos} runs past its frame")
        body = pos + _HDR.size
        if tag == 1:
            func, gx, gy, gz, bx, by, bz, smem, result, stream, args_len, ndp, flags = _LAUNCH.unpack_from(data, body)
            a = body + _LAUNCH.size
            args = None if args_len == _NO_ARGS else data[a : a + args_len]
            item = (wire.LAUNCH, ts, tid, cbid, func, gx, gy, gz, bx, by, bz, smem, stream, args, result,
                    bool(flags & 1))
            if check_pointers:
                d = a + (0 if args is None else args_len)
                flat = struct.unpack_from(f"<{3 * ndp}I", data, d)
                item += (tuple(flat[i : i + 3] for i in range(0, len(flat), 3)),)
            append(item)
        elif tag == 2:
            func, source, n, name_len = _FUNC.unpack_from(data, body)
            flat = struct.unpack_from(f"<{2 * n}I", data, body + _FUNC.size)
            name_at = body + _FUNC.size + 8 * n
            name = data[name_at : name_at + name_len].decode(errors="replace")
            layout = tuple(zip(flat[0::2], flat[1::2])) if source else None
            append((wire.FUNC, func, name, _SOURCES[source], layout))
        elif tag == 3:
            addr, size, kind, stream = _U64[4].unpack_from(data, body)
            append((wire.ALLOC, ts, tid, cbid, addr, size, ALLOC_KINDS[kind], stream))
        elif tag == 4:
            addr, size, stream = _U64[3].unpack_from(data, body)
            append((wire.FREE, ts, tid, cbid, addr, -1 if size == _ALL_ONES else size, stream))
        elif tag == 5:
            d, dst, src, n, stream, is_async, w, h, sp, dp = _U64[10].unpack_from(data, body)
            shape = (w, h, sp, dp) if (w or h) else None
            payload = data[body + 80 : body + 80 + n] if length > _HDR.size + 80 else None
            append((wire.COPY, ts, tid, cbid, COPY_DIRS[d], dst, src, n, stream, bool(is_async), shape,
                    payload))
        elif tag == 6:
            dst, nbytes, value, elem, stream, is_async = _U64[6].unpack_from(data, body)
            append((wire.SET, ts, tid, cbid, dst, nbytes, value, elem, stream, bool(is_async)))
        elif tag == 7:
            module_id, size = _U64[2].unpack_from(data, body)
            append((wire.MODULE, ts, tid, module_id, data[body + 16 : body + 16 + size]))
        elif tag == 8:
            stream, event = _U64[2].unpack_from(data, body)
            append((wire.STREAM, ts, tid, stream, "destroy" if event else "create"))
        elif tag == 9:
            graph, stream = _U64[2].unpack_from(data, body)
            append((wire.GRAPH, ts, tid, cbid, graph, stream))
        elif tag == 14:
            op, a, b = _U64[3].unpack_from(data, body)
            append((wire.GRAPHOP, ts, tid, cbid, GRAPH_OPS[op], a, b))
        elif tag == 15:
            append((wire.ERROR, ts, data[body : pos + length].decode(errors="replace")))
        elif tag == 16:
            what, handle, parent, addr, size, name_len = _U64[6].unpack_from(data, body)
            name = data[body + 48 : body + 48 + name_len].decode(errors="replace")
            append((wire.SYMBOL, ts, tid, cbid, SYMBOLS[what], handle, parent, addr,
                    -1 if size == _ALL_ONES else size, name))
        elif tag == 12:
            fmt, size, ptx_len = _U64[3].unpack_from(data, body)
            ptx = data[body + 24 : body + 24 + ptx_len] if ptx_len else None
            append((wire.LIBRARY, ts, tid, cbid, LIBRARY_FORMATS[fmt], size, ptx))
        else:
            raise ValueError(f"unknown native record tag {tag} at byte {pos}")
        pos += length
    return out
