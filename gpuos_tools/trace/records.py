"""The record types `gpu-trace` writes, and small helpers for reading them.

Every record is one JSON object with a ``type``. Addresses, handles and sizes are JSON integers
(device pointers fit in 64 bits; Python and jq read them exactly). Times are nanoseconds of
CLOCK_MONOTONIC in ``ts``; ``tid`` is the native thread id of the caller.

header       schema, tool, version, host, pid, argv, gpus [{index, uuid, name, memory}],
             driver (version string), cuda (driver API version int), python, cupti, backend
             (native|python), images (side directory of module images: relative to the trace
             file's directory, absolute when the trace went to stdout; null with --no-images),
             validate? {samples, max_bytes, extents} (with --validate)
alloc        id, api, addr, size, kind (device|pitch|managed|async|pool|host|vmm), stream?
free         id (null when the address was never seen allocated), api, addr, size?, stream?
launch       seq, api, func, kernel (mangled), name (demangled), grid [x,y,z], block [x,y,z],
             smem, stream, layout (cuFuncGetParamInfo|cuKernelGetParamInfo|nv.info|none),
             params [{offset, size, hex}], module? (content hash of the image it came from),
             result? (the CUresult, only when the launch failed), captured? (true when the
             stream was being captured into a CUDA graph: the kernel did not run then; it runs
             with each graph_launch of that graph),
             dptrs? [[param index, offset, "device"|"unified"], ...]: with --check-pointers, the
             argument words the driver itself says are device pointers (ground truth)
memcpy       api, dir (HtoD|DtoH|DtoD|HtoH|default|peer), dst, src, bytes, stream?, async,
             width?, height?, src_pitch?, dst_pitch? (2-D copies), data? (hex of the bytes of a
             copy from host memory of at most 4096 bytes: how pointer arrays are seen)
memset       api, dst, bytes (total), value, elem (1|2|4), stream?, async
module       id, hash ("sha256:<hex>"), size, file (path relative to the images directory),
             format (cubin|fatbin|ptx|unknown), kernels [mangled names, from the ELF symbols]
library      api (cuModuleLoadData, cuLibraryLoadData...), format, size; hash and file for PTX
             (cubins reach the trace as module records once the driver loads them)
stream       stream (handle), event ("create"|"destroy")
graph_launch graph (handle of the executable graph), stream
graph        event: "capture_begin" (stream), "capture_end" (stream, graph: the graph captured),
             "instantiate" (graph, exec: the executable graph that graph_launch names)
validation   (--validate) seq (of the launch it follows), kernel, checked (false: skipped,
             see why), predicted {reads, writes: [[addr, size]...], unknown} (gpu-predict-
             access's range prediction, made in the program), chunk (bytes per hashed chunk),
             checked_bytes, written [[addr, size]...] (the chunks whose contents changed),
             missed_writes [[addr, size]...] (written outside the predicted writes), reads
             ("ok"|"missed"|"nondeterministic"|"skipped"), read_effects? [[addr, size]...]
             (output that changed when memory outside the predicted reads was poisoned),
             extents? [{param, offset, ptr, limit, read, written, steps}] (bytes past each
             pointer read and written, chunk-rounded), why?, ms (time the check took)
error        source, message (a problem inside the tracer; the trace goes on)
exit         code (the program's exit status), signal?, complete (the tracer said goodbye),
             records {type: count}, wall_s, tracer? {callbacks, errors, functions, and on the
             native path callback_ns: time spent in the tracer's callbacks}

A launch's argument bytes are in ``params[i].hex``; `pointer_words` yields every 8-byte-aligned
word of them, which is where device pointers (raw or inside by-value structs such as CuPy's array
struct) are found.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

TRACE_TYPES = frozenset(
    {"alloc", "free", "launch", "memcpy", "memset", "module", "library", "stream", "graph_launch", "graph",
     "validation",
     "exit"}
)


def pointer_words(launch: dict[str, Any]) -> Iterator[tuple[int, int, int]]:
    """Yield (param index, byte offset within the param, value) for each aligned 8-byte word."""
    for i, p in enumerate(launch.get("params") or ()):
        raw = bytes.fromhex(p.get("hex", ""))
        for off in range(0, len(raw) - 7, 8):
            yield i, off, int.from_bytes(raw[off : off + 8], "little")
