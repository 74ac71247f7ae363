"""CUDA module images: tell their format, take cubins out of fatbins, read kernels and parameters.

A module image is what a program hands to ``cuModuleLoadData``/``cuLibraryLoadData``: a cubin (an
ELF file for ``EM_CUDA``), a fatbin (a container of cubins and PTX for several architectures) or
PTX text. The tracer records each image once and needs, from it, the kernel names and every
kernel's parameter layout, so that a launch's argument bytes can be cut into parameters even when
the driver's ``cuFuncGetParamInfo`` is not available.

ELF headers, sections and symbols are read with pyelftools. What pyelftools does not know is
NVIDIA's: the fatbin container, the ``.nv.info`` attribute records and one symbol flag. Their
layouts below were checked against cubins and fatbins built with nvcc 13.0 for sm_75 to sm_120
and against ``cuobjdump -elf`` / ``-lelf`` (13.5); ``scripts/make-test-cubins`` rebuilds the
fixtures that the tests hold these layouts to.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import io
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import zstandard
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from gpuos_tools.errors import ExitCode, GpuosError

# --- formats -------------------------------------------------------------------------------------

ELF_MAGIC = b"\x7fELF"
FATBIN_MAGIC = 0xBA55ED50
#: ``__fatBinC_Wrapper_t`` (host objects' ``.nvFatBinSegment``): u32 magic, u32 version, a pointer
#: to the fatbin (filled by relocation) and a second pointer. It holds addresses, not the image.
FATBIN_WRAPPER_MAGIC = 0x466243B1


def image_format(data: bytes) -> str:
    """Return "cubin", "fatbin", "ptx" or "unknown" for a module image.

    A cubin is an ELF file for EM_CUDA (190); a fatbin starts with the fatbin magic or with the
    magic of the wrapper that points to one (see `FATBIN_WRAPPER_MAGIC`).

    PTX that nvcc embeds in a fatbin begins with blank lines before ``.version``, and PTX handed
    to the driver may be NUL-terminated, so leading whitespace is skipped.
    """
    if data[:4] == ELF_MAGIC:
        return "cubin" if _is_cuda_elf(data) else "unknown"
    if len(data) >= 4 and struct.unpack_from("<I", data)[0] in (FATBIN_MAGIC, FATBIN_WRAPPER_MAGIC):
        return "fatbin"
    text = data.lstrip()
    if text.startswith((b"//", b".version")):
        return "ptx"
    return "unknown"


def _is_cuda_elf(data: bytes) -> bool:
    try:
        return ELFFile(io.BytesIO(data)).header["e_machine"] == "EM_CUDA"
    except ELFError:
        return False


# --- fatbin --------------------------------------------------------------------------------------

_FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
# Entry header, first 64 bytes (PTX entries have 80; the header size field says so). Fields marked
# "-" are not needed here and their meaning was not verified:
#   0 u16 kind (1 PTX, 2 ELF)     2 u16 version (0x101)    4 u32 header size
#   8 u64 payload size (padded)  16 u32 compressed size (0 when stored plain)
#  20 u32 -                      24 u32 - (PTX: ISA version, 0x90000 for 9.0)
#  28 u32 sm arch (80, 90, 100)  32 u32 -                 36 u32 -
#  40 u64 flags (0x11 in every entry seen, plus a compression bit below)
#  48 u64 -                      56 u64 uncompressed size (0 when stored plain)
_FATBIN_ENTRY = struct.Struct("<HHIQIIIIIIQQQ")
KIND_PTX = 1
KIND_ELF = 2
FLAG_COMPRESSED_LZ = 0x2000  #: NVIDIA's own LZ4-like format (``-compress-mode=speed``)
FLAG_COMPRESSED_ZSTD = 0x8000  #: a zstd frame (CUDA 13's default when it compresses)


@dataclass(frozen=True, slots=True)
class FatbinEntry:
    """One image inside a fatbin.

    ``compression`` is "none", "zstd" or "lz". ``payload`` is the image itself for "none" (with
    the zero padding that rounds it up to 8 bytes) and "zstd" (decompressed, exact), and the
    stored compressed bytes for "lz".
    """

    kind: int
    arch: int
    compression: str
    payload: bytes


def fatbin_entries(data: bytes) -> list[FatbinEntry]:
    """Walk every entry of a fatbin, or of several fatbins laid end to end.

    Several back to back is what a host object's ``.nv_fatbin`` section holds after linking more
    than one translation unit; zero padding between them is skipped. zstd payloads are
    decompressed. Payloads in NVIDIA's LZ-style compression are returned as stored, marked "lz":
    its format is not published and this module does not guess at a decompressor.
    """
    if len(data) >= 4 and struct.unpack_from("<I", data)[0] == FATBIN_WRAPPER_MAGIC:
        raise GpuosError(
            "fatbin wrapper (__fatBinC_Wrapper_t) holds a pointer to the fatbin, not the fatbin",
            ExitCode.BAD_INPUT,
        )
    entries: list[FatbinEntry] = []
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            pos = len(data) - len(data[pos:].lstrip(b"\0"))
            continue
        magic, _version, header_size, fat_size = _unpack(_FATBIN_HEADER, data, pos, "fatbin header")
        if magic != FATBIN_MAGIC:
            raise GpuosError(f"fatbin: bad magic {magic:#010x} at offset {pos}", ExitCode.BAD_INPUT)
        if header_size < _FATBIN_HEADER.size:
            raise GpuosError(
                f"fatbin: header size {header_size} at offset {pos}", ExitCode.BAD_INPUT
            )
        start, end = pos + header_size, pos + header_size + fat_size
        if end > len(data):
            raise GpuosError(
                f"fatbin at offset {pos} claims {fat_size} bytes of entries, "
                f"{len(data) - start} present",
                ExitCode.TRUNCATED,
            )
        entries.extend(_entries(data, start, end))
        pos = end
    return entries


def _entries(data: bytes, pos: int, end: int) -> Iterator[FatbinEntry]:
    while pos < end:
        (kind, _, header_size, size, compressed_size, _, _, arch,
         _, _, flags, _, uncompressed_size) = _unpack(
            _FATBIN_ENTRY, data, pos, "fatbin entry header")  # fmt: skip
        if header_size < _FATBIN_ENTRY.size:
            raise GpuosError(
                f"fatbin entry at offset {pos}: header size {header_size}", ExitCode.BAD_INPUT
            )
        body = pos + header_size
        if body + size > end:
            raise GpuosError(
                f"fatbin entry at offset {pos} claims {size} bytes, {end - body} left",
                ExitCode.TRUNCATED,
            )
        payload = data[body : body + size]
        if flags & FLAG_COMPRESSED_ZSTD:
            compression = "zstd"
            payload = _unzstd(payload[:compressed_size], uncompressed_size, pos)
        elif flags & FLAG_COMPRESSED_LZ:
            compression = "lz"
        else:
            compression = "none"
        yield FatbinEntry(kind, arch, compression, payload)
        pos = body + size


def _unzstd(frame: bytes, size: int, where: int) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as e:
        raise GpuosError(
            f"fatbin entry at offset {where}: bad zstd payload: {e}", ExitCode.BAD_INPUT
        ) from e
    if len(out) != size:
        raise GpuosError(
            f"fatbin entry at offset {where}: {len(out)} bytes decompressed, header says {size}",
            ExitCode.BAD_INPUT,
        )
    return out


def _unpack(layout: struct.Struct, data: bytes, pos: int, what: str) -> tuple:
    if pos + layout.size > len(data):
        raise GpuosError(f"{what} at offset {pos} cut short", ExitCode.TRUNCATED)
    return layout.unpack_from(data, pos)


def extract_cubins(data: bytes) -> list[tuple[int, bytes]]:
    """(sm arch, cubin) for every ELF entry of a fatbin that can be read, in stored order.

    Entries compressed with NVIDIA's LZ-style format are skipped; `fatbin_entries` lists them
    with ``compression == "lz"`` for a caller that must report them.
    """
    return [
        (e.arch, e.payload)
        for e in fatbin_entries(data)
        if e.kind == KIND_ELF and e.compression != "lz"
    ]


# --- cubin: kernels and parameters ---------------------------------------------------------------

#: ``st_other`` bit that marks a kernel entry point (cuobjdump prints it as "ENTRY"). pyelftools
#: decodes ``st_other`` as visibility and PowerPC's "local" bits and drops this one.
STO_CUDA_ENTRY = 0x10
# Byte offset of st_other in Elf32_Sym / Elf64_Sym.
_ST_OTHER_OFFSET = {32: 13, 64: 5}

# .nv.info records: u8 format, u8 attribute, then a u16 value, or for EIFMT_SVAL a u16 length
# and that many bytes. EIFMT_BVAL records take 4 bytes in all too (seen in .nv.compat, whose
# size adds up only so); EIFMT_NVAL was not seen and is read the same way.
EIFMT_NVAL = 0x01
EIFMT_BVAL = 0x02
EIFMT_HVAL = 0x03
EIFMT_SVAL = 0x04
EIATTR_KPARAM_INFO = 0x17  #: SVAL, one per parameter, see `param_layout`
EIATTR_CBANK_PARAM_SIZE = 0x19  #: HVAL: bytes of parameters
_KPARAM_INFO = struct.Struct("<IHHI")  # index, ordinal, offset, packed bits


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _elf_errors(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Report a damaged ELF image as bad input: pyelftools reads lazily, so any access can fail."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(*args, **kwargs)
        except ELFError as e:
            raise GpuosError(f"bad cubin: {e}", ExitCode.BAD_INPUT) from e

    return wrapper


def _elf(cubin: bytes) -> ELFFile:
    elf = ELFFile(io.BytesIO(cubin))
    if elf.header["e_machine"] != "EM_CUDA":
        raise GpuosError(f"not a cubin: ELF machine {elf.header['e_machine']}", ExitCode.BAD_INPUT)
    return elf


@_elf_errors
def kernels(cubin: bytes) -> list[str]:
    """Mangled names of the kernel entry functions, in symbol-table order.

    The entry flag in ``st_other`` decides. The other rule one might use, "a FUNC symbol with
    ``.text.<name>`` and ``.nv.info.<name>`` sections", also accepts non-inlined device functions
    in relocatable (``-rdc``) cubins, which get both sections without being launchable.
    """
    return _kernels(_elf(cubin))


def _kernels(elf: ELFFile) -> list[str]:
    symtab = elf.get_section_by_name(".symtab")
    if not isinstance(symtab, SymbolTableSection):
        return []
    raw = symtab.data()
    entsize = symtab["sh_entsize"]
    other_at = _ST_OTHER_OFFSET[elf.elfclass]
    return [
        sym.name
        for i, sym in enumerate(symtab.iter_symbols())
        if sym["st_info"]["type"] == "STT_FUNC" and raw[i * entsize + other_at] & STO_CUDA_ENTRY
    ]


def nv_info_records(section: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(format, attribute, value bytes) for each record of an ``.nv.info`` section."""
    pos = 0
    while pos < len(section):
        if pos + 4 > len(section):
            raise GpuosError(f".nv.info: record at offset {pos} cut short", ExitCode.BAD_INPUT)
        fmt, attr, value = struct.unpack_from("<BBH", section, pos)
        if fmt == EIFMT_SVAL:
            if pos + 4 + value > len(section):
                raise GpuosError(f".nv.info: value at offset {pos} cut short", ExitCode.BAD_INPUT)
            yield fmt, attr, section[pos + 4 : pos + 4 + value]
            pos += 4 + value
        elif fmt in (EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL):
            yield fmt, attr, section[pos + 2 : pos + 4]
            pos += 4
        else:
            raise GpuosError(
                f".nv.info: unknown format {fmt:#x} at offset {pos}", ExitCode.BAD_INPUT
            )


def _kernel_info(elf: ELFFile, kernel: str) -> bytes:
    section = elf.get_section_by_name(f".nv.info.{kernel}")
    if section is None:
        raise GpuosError(f"cubin has no kernel {kernel!r}", ExitCode.BAD_INPUT)
    return section.data()


def _layout(info: bytes) -> list[tuple[int, int, int]]:
    params = []
    for fmt, attr, value in nv_info_records(info):
        if attr == EIATTR_KPARAM_INFO and fmt == EIFMT_SVAL:
            _index, ordinal, offset, bits = _KPARAM_INFO.unpack_from(value)
            params.append((ordinal, offset, (bits >> 18) & 0x3FFF))
    return sorted(params)


@_elf_errors
def param_layout(cubin: bytes, kernel: str) -> list[tuple[int, int, int]]:
    """(ordinal, offset, size) of each parameter of ``kernel``, by ordinal; [] when it has none.

    From its EIATTR_KPARAM_INFO records, whose value is u32 index, u16 ordinal, u16 offset, u32
    bits. In the bits, as nvcc 13 writes them and cuobjdump reads them: 0-7 the pointee's log2
    alignment, 8-11 the space (5 for pointer parameters on sm_100 and later, 0 before),
    12-16 the constant bank (0x1f), 17 clear for "parameter lives in the constant bank",
    18-31 the size in bytes. nvcc writes the records from the last parameter to the first.
    """
    return _layout(_kernel_info(_elf(cubin), kernel))


@_elf_errors
def param_layouts(cubin: bytes) -> dict[str, list[tuple[int, int, int]]]:
    """`param_layout` of every kernel, reading the ELF once (a module may hold thousands)."""
    elf = _elf(cubin)
    return {k: _layout(_kernel_info(elf, k)) for k in _kernels(elf)}


@_elf_errors
def param_bytes(cubin: bytes, kernel: str) -> int:
    """Size of ``kernel``'s parameter block (EIATTR_CBANK_PARAM_SIZE), 0 when it takes none.

    This includes the padding after the last parameter that the KPARAM_INFO records leave out
    (none in the cases seen: it equals the end of the last parameter).
    """
    for fmt, attr, value in nv_info_records(_kernel_info(_elf(cubin), kernel)):
        if attr == EIATTR_CBANK_PARAM_SIZE and fmt == EIFMT_HVAL:
            return int.from_bytes(value, "little")
    return 0


# --- names ---------------------------------------------------------------------------------------


@functools.cache
def _cxa_demangle() -> tuple[Callable[..., int | None], Callable[[int], None]] | None:
    """libstdc++'s ``__cxa_demangle`` and libc's ``free``, or None where libstdc++ is missing."""
    try:
        libstdcxx = ctypes.CDLL("libstdc++.so.6")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    demangle_fn = libstdcxx.__cxa_demangle
    demangle_fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t),
                            ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    demangle_fn.restype = ctypes.c_void_p  # a malloc'd buffer we must free, so not c_char_p
    free = libc.free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return demangle_fn, free


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """The C++ demangled form of ``name``; ``name`` itself when it is not a mangled symbol.

    Only names that start with ``_Z`` are tried: ``__cxa_demangle`` also decodes bare type
    encodings, which would turn an extern "C" kernel called ``i`` into "int".
    """
    if not name.startswith("_Z"):
        return name
    funcs = _cxa_demangle()
    if funcs is None:
        return name
    demangle_fn, free = funcs
    status = ctypes.c_int(0)
    out = demangle_fn(name.encode(), None, None, ctypes.byref(status))
    if not out:
        return name
    try:
        return ctypes.string_at(out).decode() if status.value == 0 else name
    finally:
        free(out)
