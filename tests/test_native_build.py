"""The native tracer's library builds with the system compiler, and its records parse."""

from __future__ import annotations

import ctypes
import shutil
import struct

import pytest

from gpuos_tools import cbuild
from gpuos_tools.injection import tracelib
from gpuos_tools.model import binary, wire


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_library_builds_once_and_exports_the_entry_points(tmp_path):
    first = tracelib.tracer_library(tmp_path)
    assert first.is_file()
    mtime = first.stat().st_mtime_ns
    assert tracelib.tracer_library(tmp_path) == first and first.stat().st_mtime_ns == mtime
    lib = ctypes.CDLL(str(first))
    assert lib.gpuos_trace_start and lib.gpuos_trace_stop


def _record(tag: int, cbid: int, body: bytes) -> bytes:
    return struct.pack("<HHIQII", tag, 0, 24 + len(body), 1000, 77, cbid) + body


def test_launch_and_function_records_parse():
    layout = [(0, 8), (8, 4)]
    func = struct.pack("<QIII4x", 0xF00, 1, 2, 5) + b"".join(struct.pack("<II", o, s) for o, s in layout) + b"_Z1kv"
    args = (0x7F0000001000).to_bytes(8, "little") + (3).to_bytes(4, "little")
    launch = struct.pack("<Q7IIQIII4x", 0xF00, 2, 1, 1, 64, 1, 1, 0, 0, 0x10, len(args), 1, 1) + args
    launch += struct.pack("<III", 0, 0, 2)
    data = _record(2, 0, func) + _record(1, 307, launch)
    f, l = binary.parse_records(data, check_pointers=True)
    assert f == (wire.FUNC, 0xF00, "_Z1kv", "cuFuncGetParamInfo", ((0, 8), (8, 4)))
    assert l[:4] == (wire.LAUNCH, 1000, 77, 307)
    assert l[13] == args and l[15] is True and l[16] == ((0, 0, 2),)


def test_a_record_running_past_its_frame_is_an_error():
    data = _record(3, 5, struct.pack("<4Q", 1, 2, 0, 0))
    with pytest.raises(ValueError):
        binary.parse_records(data[:-8])


def test_kind_codes_match_the_c_enum():
    src = tracelib.RECORDER.read_text()
    for name, value in [("K_COPY", binary.KIND_COPY), ("K_SET", binary.KIND_SET),
                        ("K_LIBRARY", binary.KIND_LIBRARY), ("K_COPY2D", binary.KIND_COPY2D)]:
        assert f"{name} = {value}" in src
    assert binary.copy_kind("DtoH", False, True) == 32 | 2 << 2 | 1
    assert binary.set_kind(4, True, False) == 64 | 2 << 2 | 2


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_code_is_not_loaded_from_a_cache_others_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(cbuild.BuildError, match="writable by group or others"):
        tracelib.tracer_library(shared)
    own = tmp_path / "own"
    lib = tracelib.tracer_library(own)
    lib.chmod(0o666)  # a library someone else could have rewritten
    with pytest.raises(cbuild.BuildError, match="writable by group or others"):
        tracelib.tracer_library(own)
    lib.chmod(0o755)
    assert tracelib.tracer_library(own) == lib
