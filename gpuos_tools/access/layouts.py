"""Reading the argument structures of framework kernels: template arguments of demangled names,
C++ scalar sizes, little-endian fields, and PyTorch's offset calculators.

The decoders (gpuos_tools/access/extents.py) build on these; docs/access-prediction.md says what
each structure holds and how its layout was established.
"""

from __future__ import annotations

import re
import struct
from functools import lru_cache

from gpuos_tools.access.proto import mask_operators

#: Bytes of the scalar types that appear as template arguments of framework kernels.
CXX_SIZES = {
    "bool": 1, "char": 1, "signed char": 1, "unsigned char": 1, "short": 2, "unsigned short": 2,
    "int": 4, "unsigned int": 4, "long": 8, "unsigned long": 8, "long long": 8,
    "unsigned long long": 8, "float": 4, "double": 8, "half": 2, "__half": 2, "__nv_bfloat16": 2,
    "c10::Half": 2, "c10::BFloat16": 2, "c10::complex<c10::Half>": 4, "c10::complex<float>": 8,
    "c10::complex<double>": 16, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
    "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1, "int8_t": 1, "uint8_t": 1, "int16_t": 2,
    "uint16_t": 2, "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8,
}  # fmt: skip

#: NumPy dtype names as CuPy writes them into its kernels' names.
NUMPY_SIZES = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
    "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
}  # fmt: skip

_OPEN = {"<": ">", "(": ")", "[": "]", "{": "}"}
_CLOSE = set(_OPEN.values())


def sizeof(cxx_type: str) -> int | None:
    """Bytes of a C++ scalar type as a demangled name writes it, or None when not known."""
    return CXX_SIZES.get(cxx_type.strip().removesuffix(" const").strip())


def template_args(text: str, start: int) -> tuple[list[str], int] | None:
    """The top-level arguments of the template argument list opening at ``text[start] == "<"``,
    and the index just past its closing ">"; None when the brackets do not balance."""
    masked = mask_operators(text)
    if start >= len(masked) or masked[start] != "<":
        return None
    stack: list[str] = []
    args: list[str] = []
    last = start + 1
    for i in range(start, len(masked)):
        c = masked[i]
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if not stack or stack[-1] != c:
                return None
            stack.pop()
            if not stack:
                args.append(text[last:i].strip())
                return args, i + 1
        elif c == "," and len(stack) == 1:
            args.append(text[last:i].strip())
            last = i + 1
    return None


@lru_cache(maxsize=4096)
def args_of(text: str, template: str) -> tuple[str, ...] | None:
    """The template arguments of the first ``template<...>`` in ``text`` (``template`` is a
    qualified name such as ``at::native::ReduceOp``), or None."""
    m = re.search(r"(?<![\w:])" + re.escape(template) + "<", text)
    if m is None:
        return None
    got = template_args(text, m.end() - 1)
    return tuple(got[0]) if got else None


def base_name(cxx_type: str) -> str:
    """``ns::Name`` of ``ns::Name<...>`` (or of a plain name)."""
    t = cxx_type.strip()
    i = mask_operators(t).find("<")
    return t if i < 0 else t[:i]


_LAMBDA = re.compile(r"\{lambda\(([^()]*)\)#\d+\}$")


def lambda_params(cxx_type: str) -> list[str] | None:
    """The parameter types of a closure type written ``...::{lambda(T1, T2)#n}``, or None."""
    m = _LAMBDA.search(cxx_type.strip())
    if m is None:
        return None
    inner = m.group(1).strip()
    return [p.strip() for p in inner.split(",")] if inner else []


# -- fields -----------------------------------------------------------------------------------

_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I64 = struct.Struct("<q").unpack_from
_U64 = struct.Struct("<Q").unpack_from


def i32(raw: bytes, off: int) -> int:
    return _I32(raw, off)[0]


def u32(raw: bytes, off: int) -> int:
    return _U32(raw, off)[0]


def i64(raw: bytes, off: int) -> int:
    return _I64(raw, off)[0]


def u64(raw: bytes, off: int) -> int:
    return _U64(raw, off)[0]


# -- PyTorch: OffsetCalculator<NARGS, uint32_t> ----------------------------------------------

#: ``MAX_DIMS`` of ATen's OffsetCalculator on CUDA.
MAX_DIMS = 25
_DIVIDER = struct.Struct("<III")  # IntDivider<uint32_t>: divisor, m1, shift


def calculator_size(nargs: int) -> int:
    """Bytes of an ``OffsetCalculator<nargs, uint32_t>``: dims, MAX_DIMS dividers, strides."""
    return 4 + _DIVIDER.size * MAX_DIMS + 4 * MAX_DIMS * max(nargs, 1)


def divider_ok(divisor: int, m1: int, shift: int) -> bool:
    """Whether (divisor, m1, shift) is what ``IntDivider<uint32_t>(divisor)`` computes: the magic
    number makes a random word pass with negligible odds."""
    if not 1 <= divisor <= 0x7FFFFFFF:
        return False
    s = (divisor - 1).bit_length()
    return shift == s and m1 == ((1 << 32) * ((1 << s) - divisor)) // divisor + 1


def offset_calculator(raw: bytes, off: int, nargs: int) -> tuple[list[int], list[list[int]]] | None:
    """(sizes, byte strides per argument) of the ``OffsetCalculator<nargs, uint32_t>`` at ``off``,
    or None when the bytes are not one. Only the first ``dims`` entries are read: the rest are
    never initialised."""
    if off + calculator_size(nargs) > len(raw):
        return None
    dims = i32(raw, off)
    if not 0 <= dims <= MAX_DIMS:
        return None
    sizes = []
    for d in range(dims):
        divisor, m1, shift = _DIVIDER.unpack_from(raw, off + 4 + 12 * d)
        if not divider_ok(divisor, m1, shift):
            return None
        sizes.append(divisor)
    base = off + 4 + 12 * MAX_DIMS
    strides = [[u32(raw, base + 4 * (d * nargs + a)) for d in range(dims)] for a in range(nargs)]
    return sizes, strides


def numel(sizes: list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def last_offset(sizes: list[int], strides: list[int]) -> int:
    """The largest offset an index over ``sizes`` reaches with non-negative ``strides``."""
    return sum((s - 1) * st for s, st in zip(sizes, strides))
