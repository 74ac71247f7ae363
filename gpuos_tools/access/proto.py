"""Kernel prototypes: the parameter types of a demangled C++ kernel name, and what they say
about the direction of the memory a pointer argument reaches.

Demangled kernel names nest deeply: template arguments hold lambdas whose own parameter lists
are in parentheses (``{lambda(float, float)#1}``), functions (``operator()(at::TensorIterator&)``)
and ``(anonymous namespace)``. `split_params` finds the parameter list as the last top-level
parenthesised group and splits it on the commas that are outside every bracket.
"""

from __future__ import annotations

import functools
import re

# Operator names whose characters would otherwise count as brackets.
_OPERATORS = re.compile(r"operator(?:<<=|>>=|<=>|->\*|<<|>>|<=|>=|->|<|>|\(\)|\[\])")
_OPEN = {"(": ")", "<": ">", "[": "]", "{": "}"}
_CLOSE = {v: k for k, v in _OPEN.items()}
#: Words of scalar types: a parameter made only of these is a value, not a pointer.
_SCALAR_WORDS = {"bool", "char", "short", "int", "long", "float", "double", "unsigned", "signed", "half",
                 "__half", "__nv_bfloat16", "wchar_t", "char16_t", "char32_t", "int8_t", "int16_t",
                 "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "size_t",
                 "ptrdiff_t", "const", "volatile"}  # fmt: skip
_CONST_END = re.compile(r"\bconst(?:\s+(?:volatile|__restrict__|__restrict|restrict))*$")
_FUNCTION_POINTER = re.compile(r"^[^<]*\(\*+\s*\w*\)\s*\(.*\)$")
_QUALIFIERS = re.compile(r"(?:\s*(?:const|volatile|__restrict__|__restrict|restrict))+\s*$")

# What a parameter type says about the memory a pointer in it reaches (the `basis`).
CONST = "const"  #: ``T const*``: read only
POINTER = "pointer"  #: ``T*``: read and write
POINTERS = "pointer-to-pointer"  #: ``T**``: the buffers it lists live in device memory, unseen
STRUCT = "struct"  #: passed by value (a class, array, lambda): direction unknown
VALUE = "value"  #: a scalar type (int, long...): not a pointer by its type
REFERENCE = "reference"  #: ``T&`` (unusual for a kernel): direction unknown


def mask_operators(text: str) -> str:
    """``text`` with operator names' bracket characters replaced by letters (same length)."""
    return _OPERATORS.sub(lambda m: "operator" + "x" * (len(m.group()) - 8), text)


def split_params(demangled: str) -> list[str] | None:
    """The parameter types of a demangled function name, or None when it has no parameter list.

    ``f()`` and ``f(void)`` give ``[]``.
    """
    masked = mask_operators(demangled.rstrip())
    # A trailing cv-qualifier belongs to member functions, not to kernels, but is harmless.
    end = len(masked)
    tail = masked.rstrip()
    while tail.endswith((" const", " volatile")):
        tail = tail.rsplit(" ", 1)[0].rstrip()
    end = len(tail)
    if not end or masked[end - 1] != ")":
        return None
    depth = 0
    start = -1
    for i in range(end - 1, -1, -1):
        c = masked[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                start = i
                break
    if start < 0:
        return None
    inner = masked[start + 1 : end - 1]
    original = demangled[start + 1 : end - 1]
    params: list[str] = []
    stack: list[str] = []
    last = 0
    for i, c in enumerate(inner):
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if stack and stack[-1] == c:
                stack.pop()
            elif c != ">":  # a stray ">" can only be an operator we did not mask; keep going
                return None
        elif c == "," and not stack:
            params.append(original[last:i].strip())
            last = i + 1
    if stack:
        return None
    rest = original[last:].strip()
    if rest or params:
        params.append(rest)
    if params == ["void"]:
        return []
    return params


def classify(param_type: str) -> str:
    """The basis (`CONST`, `POINTER`, `POINTERS`, `STRUCT`, `VALUE`, `REFERENCE`) of one type."""
    t = _QUALIFIERS.sub("", param_type.strip())
    if t.endswith("&"):
        return REFERENCE
    if t.endswith("*") and not t.endswith(")*"):
        pointee = t[:-1].strip()
        bare = _QUALIFIERS.sub("", pointee)
        if bare.endswith("*"):
            return POINTERS
        if pointee.startswith("const ") or _CONST_END.search(pointee):
            return CONST
        return POINTER
    if _FUNCTION_POINTER.search(t):  # code, not data
        return VALUE
    if set(t.replace("  ", " ").split(" ")) <= _SCALAR_WORDS:
        return VALUE
    return STRUCT


@functools.lru_cache(maxsize=16384)
def prototype(demangled: str) -> tuple[tuple[str, str], ...] | None:
    """((type, basis), ...) for each parameter of a demangled name; None when unparsable."""
    params = split_params(demangled)
    if params is None:
        return None
    return tuple((p, classify(p)) for p in params)
