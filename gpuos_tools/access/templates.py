"""Size templates: how many bytes past each pointer argument a kernel reads and writes, as a
function of its integer arguments, learned from `validation` records (MSched's observation that
a working set is a pointer plus a size computed from the launch's integers).

`gpu-predict-access --learn` reads traces made with `gpu-trace run --validate` and writes one
``access_template`` record per (kernel, pointer position):

Its fields are written once, as data, in gpuos_tools.stream.records (ACCESS_TEMPLATE): `read` and
`write` are a size expression, or null when none fits (the range then runs to the end of the
allocation): {"const": bytes} or {"scale": k, "args": [[param, offset, width], ...]} (k times the
product of those unsigned integer words), or {"max": [expression, ...]}: the samples could not
tell these apart, so the largest value is used; {"const": 0} means the kernel was never seen
reading (or writing) there.

The observations are whole 128-byte chunks (the validator's granularity): an expression fits a
launch when rounding the pointer plus its value up to a chunk boundary (at most to the end of
the pointer's span) gives what the GPU showed. Reads are fitted to the larger of the read and
the written extent, because a kernel that updates memory in place may read what it overwrites
and the poison bisection cannot see that read. With element sizes 4, 2, 8, 1, 16 as the factor,
single integer arguments are tried first, then products of 2 to 4 scalar arguments (parameters
of at most 8 bytes); then the same with factors 32 and 64 (a wide factor on one argument is
often a product in disguise: a batch of 16 times 4-byte floats); then products of two words
anywhere; then a constant. When several
expressions fit every sample, those whose arguments changed between samples win; if none
changed, up to 32 are kept and the largest value is predicted (samples of one size cannot say
which argument is the length).

A template is a prediction, not a proof: it holds for the launches it was fitted on, and
`gpu-trace run --validate` on new runs scores it (`gpu-predict-access --report`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CHUNK = 128
MAX_ALTERNATIVES = 32  #: expressions kept when the samples cannot tell them apart
ELEMENT_SIZES = (4, 2, 8, 1, 16)
WIDE_SCALES = (32, 64)
SCALES = ELEMENT_SIZES + WIDE_SCALES
_MAX_WORD = 1 << 40


@dataclass(slots=True)
class Sample:
    ints: dict[tuple[int, int, int], int]  #: (param, offset, width) -> value
    scalar_keys: frozenset  #: the keys of parameters of at most 8 bytes (scalar arguments)
    ptr: int
    limit: int
    read: int
    written: int


@dataclass(slots=True)
class Template:
    kernel: str
    param: int
    offset: int
    read: dict[str, Any] | None
    write: dict[str, Any] | None
    samples: int = 0
    fits: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {"type": "access_template", "kernel": self.kernel, "param": self.param, "offset": self.offset,
                "read": self.read, "write": self.write, "samples": self.samples, "fits": self.fits}


def integer_words(params: list[dict[str, Any]]) -> dict[tuple[int, int, int], int]:
    """Every aligned 4- and 8-byte word of the arguments that could be a size: 1 <= v < 2**40."""
    out = {}
    for i, p in enumerate(params):
        raw = bytes.fromhex(p.get("hex", ""))
        for off in range(0, len(raw) - 3, 4):
            (v,) = struct.unpack_from("<I", raw, off)
            if 1 <= v:
                out[(i, off, 4)] = v
            if off % 8 == 0 and off + 8 <= len(raw):
                (w,) = struct.unpack_from("<Q", raw, off)
                if 1 <= w < _MAX_WORD and w != v:
                    out[(i, off, 8)] = w
    return out


def observed(ptr: int, limit: int, size: int) -> int:
    """What the validator reports for a true extent ``size``: rounded up to a chunk boundary,
    at most to the end of the pointer's span."""
    if size <= 0:
        return 0
    end = -(-(ptr + size) // CHUNK) * CHUNK
    return min(end, ptr + limit) - ptr


def evaluate(expr: dict[str, Any] | None, ints: dict[tuple[int, int, int], int]) -> int | None:
    """The size an expression gives for a launch's integer words; None when it cannot say."""
    if expr is None:
        return None
    if "max" in expr:
        values = [evaluate(e, ints) for e in expr["max"]]
        return None if None in values else max(values)
    if "const" in expr:
        return expr["const"]
    value = expr["scale"]
    for key in expr["args"]:
        v = ints.get(tuple(key))
        if v is None:
            return None
        value *= v
    return value


def _words_of(params: list[dict[str, Any]], keys) -> dict[tuple[int, int, int], int]:
    """Just the integer words a template needs (cheaper than `integer_words` on big structs)."""
    out = {}
    for p, off, width in keys:
        if p < len(params):
            raw = params[p].get("hex", "")
            piece = raw[2 * off : 2 * (off + width)]
            if len(piece) == 2 * width:
                out[(p, off, width)] = int.from_bytes(bytes.fromhex(piece), "little")
    return out


def _products(samples: list[Sample], common: list, attr: str, ok, scales=SCALES) -> list[dict[str, Any]]:
    """k times a product of 2 to 4 scalar arguments (parameters of at most 8 bytes, such as the
    N, C, H, W of a pooling kernel), found by a depth-first search bounded by the extent."""
    first = samples[0]
    e = getattr(first, attr)
    scalars = sorted((key for key in common if key[2] >= 4 and 2 <= first.ints[key] <= 1 << 24
                      and key in first.scalar_keys), key=lambda k: k)
    found: list[dict[str, Any]] = []
    for k in scales:
        if e // k < 2:
            continue

        def dfs(start: int, chosen: list, value: int) -> None:
            if len(found) >= 4 * MAX_ALTERNATIVES:
                return
            if len(chosen) >= 2 and e - CHUNK < k * value <= e:
                keys = list(chosen)
                if ok(lambda s, keys=keys, k=k: k * _prod(s.ints[x] for x in keys)):
                    found.append({"scale": k, "args": [list(x) for x in keys]})
            if len(chosen) == 4:
                return
            for i in range(start, len(scalars)):
                v = first.ints[scalars[i]]
                if k * value * v <= e:
                    dfs(i + 1, chosen + [scalars[i]], value * v)

        dfs(0, [], 1)
        if found:
            break
    return found


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def fit(samples: list[Sample], attr: str) -> tuple[dict[str, Any] | None, int]:
    """The preferred expression that reproduces every sample's observed extent, and how many fit."""

    def ok(f) -> bool:
        return all(observed(s.ptr, s.limit, f(s)) == getattr(s, attr) for s in samples)

    first = samples[0]
    e = getattr(first, attr)
    if all(getattr(s, attr) == 0 for s in samples):
        return {"const": 0}, 1
    common = [k for k in first.ints if all(k in s.ints for s in samples)]

    def singles(scales) -> list[dict[str, Any]]:
        out = []
        for k in scales:
            for key in common:
                v = first.ints[key]
                if e - CHUNK < k * v <= e or observed(first.ptr, first.limit, k * v) == e:
                    if ok(lambda s, key=key, k=k: k * s.ints[key]):
                        out.append({"scale": k, "args": [list(key)]})
        return out

    # element sizes first, single arguments then products of scalars; a wide factor (32, 64)
    # on one argument is more often a product in disguise (batch 16 x 4-byte floats = 64)
    found = (singles(ELEMENT_SIZES) or _products(samples, common, attr, ok, ELEMENT_SIZES)
             or singles(WIDE_SCALES) or _products(samples, common, attr, ok, WIDE_SCALES))
    if not found:
        by_value: dict[int, list] = {}
        for key in common:
            by_value.setdefault(first.ints[key], []).append(key)
        small = sorted(key for key in common if 2 <= first.ints[key] <= 1 << 24)
        for k in SCALES:
            for key1 in small:
                v1 = first.ints[key1]
                for v2, keys in by_value.items():
                    if not (e - CHUNK < k * v1 * v2 <= e):
                        continue
                    for key2 in keys:
                        if key2 <= key1:
                            continue
                        f = lambda s, a=key1, b=key2, k=k: k * s.ints[a] * s.ints[b]  # noqa: E731
                        if ok(f):
                            found.append({"scale": k, "args": [list(key1), list(key2)]})
                if len(found) > 64:
                    break
    if not found and all(getattr(s, attr) == e for s in samples):
        # a constant: the observed (chunk-rounded) extent, which covers the true one
        found.append({"const": e})
    if not found:
        return None, 0
    # a word whose value changed between samples is evidence, not coincidence: keep those alone
    varied = [f for f in found if "args" in f and len({tuple(s.ints.get(tuple(a)) for a in f["args"]) for s in samples}) > 1]
    alts = (varied or found)[:MAX_ALTERNATIVES]
    return (alts[0] if len(alts) == 1 else {"max": alts}), len(found)


def learn(records: Iterable[dict[str, Any]]) -> list[Template]:
    """Templates for every (kernel, pointer position) with validated extents in ``records``."""
    samples: dict[tuple[str, int, int], list[Sample]] = {}
    last: dict[str, Any] | None = None
    ints_cache: dict[int, dict] = {}
    for rec in records:
        kind = rec.get("type")
        if kind == "launch":
            last = rec
            continue
        if kind != "validation" or last is None or last.get("seq") != rec.get("seq"):
            continue
        if not rec.get("checked") or rec.get("reads") == "nondeterministic" or "extents" not in rec:
            continue
        ints = ints_cache.setdefault(id(last), integer_words(last.get("params") or []))
        params = last.get("params") or []
        scalars = frozenset(k for k in ints if params[k[0]].get("size", 0) <= 8)
        for e in rec["extents"]:
            key = (last.get("kernel") or "", e["param"], e["offset"])
            written = e.get("written", 0)
            samples.setdefault(key, []).append(
                Sample(ints, scalars, e["ptr"], e["limit"], max(e["read"], written), written)
            )
        ints_cache.clear()
    out = []
    for (kernel, param, offset), ss in samples.items():
        read, nr = fit(ss, "read")
        write, nw = fit(ss, "written")
        out.append(Template(kernel, param, offset, read, write, len(ss), {"read": nr, "write": nw}))
    return out


class Templates:
    """Loaded templates, looked up by (kernel, param, offset) at prediction time."""

    def __init__(self, records: Iterable[dict[str, Any]]):
        self.by_key: dict[tuple[str, int, int], tuple] = {}
        self.kernels: set[str] = set()
        for rec in records:
            if rec.get("type") != "access_template":
                continue
            read, write = rec.get("read"), rec.get("write")
            keys = [tuple(a) for x in (read, write) if x for e in x.get("max", [x]) for a in e.get("args", ())]
            self.by_key[(rec["kernel"], rec["param"], rec["offset"])] = (read, write, keys)
            self.kernels.add(rec["kernel"])

    def __len__(self) -> int:
        return len(self.by_key)

    def sizes(self, kernel: str, param: int, offset: int, params: list[dict[str, Any]]) -> tuple[int | None, int | None] | None:
        """(read bytes, write bytes) past the pointer at (param, offset); None: no template.
        A size of None inside the pair: that direction has no template."""
        t = self.by_key.get((kernel, param, offset))
        if t is None:
            return None
        read, write, keys = t
        ints = _words_of(params, keys)
        return evaluate(read, ints), evaluate(write, ints)
