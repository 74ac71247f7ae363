"""The native launch path of the tracer (gpuos_tools/injection/csrc/gpuos_trace.c): build it, start
it, decode its records.

`gpu-trace run` builds the library once per source version with the system C compiler into the
user's cache (no CUDA headers needed) and hands its path to the program; the program's tracer
loads it with ctypes. The records it ships are parsed here, in `gpu-trace`, into the same wire
tuples the Python path sends, so decoding into stream records is shared.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path

from gpuos_tools.agent import wire

SOURCE = Path(__file__).resolve().parent.parent / "injection" / "csrc" / "gpuos_trace.c"

# handler kinds, as in the C enum
KIND_LAUNCH, KIND_LAUNCH_COOP, KIND_LAUNCH_EX, KIND_GRAPH = 1, 2, 3, 4
KIND_ALLOC, KIND_MAP = 10, 16
KIND_FREE, KIND_FREE_ASYNC, KIND_FREE_HOST, KIND_UNMAP = 20, 21, 22, 23
KIND_COPY, KIND_COPY2D, KIND_COPY2D_ASYNC = 32, 56, 57
KIND_SET, KIND_LIBRARY = 64, 80
KIND_CAPTURE_BEGIN, KIND_CAPTURE_END, KIND_INSTANTIATE = 90, 91, 92
GRAPH_OPS = ("capture_begin", "capture_end", "instantiate")

ALLOC_KINDS = ("device", "pitch", "managed", "async", "pool", "host", "vmm")
COPY_DIRS = ("default", "HtoD", "DtoH", "DtoD", "peer", "HtoH")
_DIR_CODE = {name: i for i, name in enumerate(COPY_DIRS)}
LIBRARY_FORMATS = ("unknown", "cubin", "fatbin", "ptx")


def copy_kind(direction: str, peer: bool, with_stream: bool) -> int:
    return KIND_COPY | _DIR_CODE[direction] << 2 | int(peer) << 1 | int(with_stream)


def set_kind(elem: int, two_d: bool, with_stream: bool) -> int:
    return KIND_SET | {1: 0, 2: 1, 4: 2}[elem] << 2 | int(two_d) << 1 | int(with_stream)


class BuildError(Exception):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpuos-tools"


def build_library(
    cache: Path | None = None,
    *,
    source: Path = SOURCE,
    stem: str = "libgpuos_trace",
    flags: tuple[str, ...] = ("-O2",),
    libs: tuple[str, ...] = ("-ldl", "-lpthread"),
    includes: tuple[Path, ...] = (),
    sources: tuple[Path, ...] = (),
) -> Path:
    """Compile a native library (once per version of its source and headers) and return its path.

    The tracer's by default; gpu-kinfer-bridge's serve loop passes its own source, include
    directory and flags, the agent's core its extra ``sources``. The file name carries a hash
    of the sources, every header of ``includes`` and the flags, so an edit rebuilds and two
    versions never share a file.
    BuildError says why when there is no compiler or it fails.
    """
    digest = hashlib.sha256(source.read_bytes())
    for extra in sources:
        digest.update(extra.read_bytes())
    for directory in includes:
        for header in sorted(Path(directory).glob("*.h")):
            digest.update(header.read_bytes())
    digest.update(" ".join((*flags, *libs)).encode())
    tag = digest.hexdigest()[:16]
    target = (cache or cache_dir()) / f"{stem}-{tag}.so"
    if target.exists():
        _trusted(target.parent, directory=True)
        _trusted(target, directory=False)
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise BuildError("no C compiler (cc, gcc or clang) on PATH")
    if not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.parent.chmod(0o700)  # whatever the umask: only this user may put code here
    _trusted(target.parent, directory=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [compiler, *flags, "-shared", "-fPIC", *(f"-I{d}" for d in includes), "-o", str(tmp), str(source),
           *(str(x) for x in sources), *libs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # CC names a program that is not there
        raise BuildError(f"{compiler}: {e.strerror or e}") from None
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def _trusted(path: Path, directory: bool) -> None:
    """Refuse to load code from ``path`` unless only this user (or root) could have put it there:
    it is what it claims to be (not a symbolic link), owned by this user or root, and not
    writable by group or others (a shared XDG_CACHE_HOME would otherwise let another user plant a
    library that every traced program loads)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise BuildError(f"{path}: {e.strerror}") from None
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise BuildError(f"{path}: not a {'directory' if directory else 'regular file'} (a link is not followed)")
    if st.st_uid not in (os.geteuid(), 0):
        raise BuildError(f"{path} belongs to uid {st.st_uid}: refusing to load code from it")
    if st.st_mode & 0o022:
        raise BuildError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                         "refusing to load code from it; set XDG_CACHE_HOME to a directory of your own")


def loaded_library_path(fragment: str) -> str | None:
    """The file of a shared library this process has mapped (e.g. the libcupti cupti-python loaded)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


class NativeSession:
    """The native callback inside the traced program (used by tracer.start)."""

    def __init__(self, library: str, fd: int, kinds: dict[int, int], flush_ms: float, check: bool):
        from cupti import cupti

        cupti.get_timestamp()  # makes cupti-python load libcupti (lazily, the way it finds it)
        path = loaded_library_path("libcupti.so")
        if path is None:
            raise RuntimeError("cupti-python is imported but no libcupti.so is mapped")
        self.lib = ctypes.CDLL(library)
        self.lib.gpuos_trace_start.argtypes = [
            ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]
        self.lib.gpuos_trace_stop.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        pairs = [v for cbid, kind in sorted(kinds.items()) for v in (cbid, kind)]
        self.kinds = (ctypes.c_uint32 * len(pairs))(*pairs)
        self.args = (fd, path.encode(), self.kinds, len(kinds), max(1, int(flush_ms)), int(check))

    def start(self) -> None:
        rc = self.lib.gpuos_trace_start(*self.args)
        if rc != 0:
            steps = {-1: "dlopen libcupti", -2: "dlopen libcuda.so.1", -3: "find CUPTI functions",
                     -4: "cuptiSubscribe (is another CUPTI tool attached?)", -5: "enable driver callbacks",
                     -6: "enable resource callbacks", -7: "start the writer thread"}
            raise RuntimeError(f"native tracer: {steps.get(rc, rc)} failed")

    def stop(self) -> dict[str, int]:
        counters = (ctypes.c_uint64 * 4)()
        self.lib.gpuos_trace_stop(counters)
        return {"callbacks": counters[0], "errors": counters[1], "functions": counters[2],
                "callback_ns": counters[3]}


# ---------------------------------------------------------------- parsing (in gpu-trace)

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
        elif tag == 12:
            fmt, size, ptx_len = _U64[3].unpack_from(data, body)
            ptx = data[body + 24 : body + 24 + ptx_len] if ptx_len else None
            append((wire.LIBRARY, ts, tid, cbid, LIBRARY_FORMATS[fmt], size, ptx))
        else:
            raise ValueError(f"unknown native record tag {tag} at byte {pos}")
        pos += length
    return out
