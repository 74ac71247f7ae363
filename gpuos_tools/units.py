"""Sizes, bandwidths and durations as people write them on a command line.

Sizes: a plain number is bytes; `B`; binary `KiB`, `MiB`, `GiB`, `TiB` (and the bare letters
`K`, `M`, `G`, `T`, which mean the same); decimal `KB`, `MB`, `GB`, `TB`; suffixes are
case-insensitive except that `b` alone is not accepted for bits. A budget may also be a
percentage (`66%`), which `parse_budget` resolves against a footprint the caller supplies.
Bandwidths are sizes per second (`55GB/s`, `50GiB/s`); durations take `ns`, `us`, `ms`, `s`.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_TIME_UNITS = {"ns": 1e9, "us": 1e6, "µs": 1e6, "ms": 1e3, "s": 1.0}  # divisors: 30/1e6 is exact, 30*1e-6 not
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?\s*([a-zA-Zµ%/]*)\s*$")

SIZE_HELP = "bytes, or with a unit: B, KiB, MiB, GiB, TiB (K, M, G, T alike), KB, MB, GB, TB"

#: The largest size any input may give (256 TiB): more memory than any one machine holds, GPU
#: or host, so a larger number is a damaged or hostile input, never a real allocation, and every
#: sum of a few thousand such sizes still fits comfortably in 64 bits.
MAX_BYTES = 1 << 48


def _split(text: str) -> tuple[float, str] | None:
    m = _NUMBER.match(text)
    if m is None:
        return None
    value = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else ""))
    return value, m.group(3)


def parse_size(text: str) -> int:
    """Bytes in ``text`` (``2MiB``, ``8GB``, ``4096``); ValueError if it is not a size."""
    parts = _split(text)
    if parts is None or parts[1].lower() not in _SIZE_UNITS or parts[1] == "b":
        raise ValueError(f"not a size: {text!r} ({SIZE_HELP})")
    value, unit = parts
    size = value * _SIZE_UNITS[unit.lower()]
    if not size <= MAX_BYTES:  # also inf, from 1e400
        raise ValueError(f"size too large: {text!r} (at most 256TiB)")
    return round(size)


def parse_budget_spec(text: str) -> tuple[int | None, float | None]:
    """A budget as written: (bytes, None) for a size, (None, N) for ``N%``."""
    stripped = text.strip()
    if stripped.endswith("%"):
        parts = _split(stripped[:-1])
        if parts is None or parts[1]:
            raise ValueError(f"not a percentage: {text!r}")
        return None, parts[0]
    return parse_size(stripped), None


def parse_budget(text: str, footprint: int | None) -> int:
    """Bytes of a budget: a size, or ``N%`` of ``footprint`` (bytes)."""
    size, percent = parse_budget_spec(text)
    if percent is None:
        return size
    if footprint is None:
        raise ValueError("a percentage budget needs a footprint to be a percentage of")
    return int(footprint * percent / 100)


def parse_bandwidth(text: str) -> float:
    """Bytes per second in ``text`` (``55GB/s``, ``50GiB/s``)."""
    stripped = text.strip()
    if not stripped.lower().endswith("/s"):
        raise ValueError(f"not a bandwidth: {text!r} (a size per second, e.g. 55GB/s)")
    bw = _size_float(stripped[:-2])
    if bw <= 0:
        raise ValueError(f"bandwidth must be positive: {text!r}")
    return bw


def _size_float(text: str) -> float:
    parts = _split(text)
    if parts is None or parts[1].lower() not in _SIZE_UNITS or parts[1] == "b":
        raise ValueError(f"not a size: {text!r} ({SIZE_HELP})")
    return parts[0] * _SIZE_UNITS[parts[1].lower()]


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (``30us``, ``1.5ms``, ``2s``); a unit is required."""
    parts = _split(text)
    if parts is None or parts[1].lower() not in _TIME_UNITS:
        raise ValueError(f"not a duration: {text!r} (a number with ns, us, ms or s)")
    return parts[0] / _TIME_UNITS[parts[1].lower()]


_AGE_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """Seconds in an age as retention settings write it (``90s``, ``30m``, ``12h``, ``7d``, ``2w``;
    a plain number is seconds)."""
    parts = _split(text)
    if parts is None or parts[1].lower() not in (*_AGE_UNITS, ""):
        raise ValueError(f"not an age: {text!r} (a number with s, m, h, d or w)")
    return parts[0] * _AGE_UNITS.get(parts[1].lower(), 1)


def format_size(n: float) -> str:
    """Bytes for people, binary units (``1.5 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(s: float) -> str:
    """Seconds for people (``12.3 ms``)."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"
