"""Exact extents from launch arguments, for ``--granularity extent``.

Most launches come from a few frameworks whose argument structures carry shapes and strides.
A decoder is chosen once per kernel from its demangled name (a plan), then reads each launch's
argument bytes into spans: per pointer word, the bytes read and written relative to the pointer
(gpuos_tools/access/decoded.py). Every plan checks what it reads (magic numbers, products of
sizes against loop bounds, pointers where pointers belong) and gives None when anything is off:
that launch then gets the range prediction. docs/access-prediction.md describes the decoders.
"""

from __future__ import annotations

import struct
from typing import Any

from gpuos_tools.access import decode_cupy, decode_nvidia, decode_torch
from gpuos_tools.access.decoded import Decoded, Plan, Planner

PLANNERS: tuple[Planner, ...] = (*decode_torch.PLANNERS, *decode_cupy.PLANNERS, *decode_nvidia.PLANNERS)

_NONE = object()


def make_plan(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """The first planner's plan for a kernel (demangled name, parameter sizes), or None."""
    for planner in PLANNERS:
        try:
            plan = planner(name, sizes)
        except (ValueError, IndexError, KeyError):  # a name no planner was written for
            continue
        if plan is not None:
            return plan
    return None


class Decoders:
    """Plans cached per kernel; `decode` applies one to a launch record."""

    def __init__(self) -> None:
        self._plans: dict[tuple[str, tuple[int, ...]], Any] = {}

    def plan(self, kernel: str, name: str, sizes: tuple[int, ...]) -> Plan | None:
        """The plan for a kernel's launches with parameters of ``sizes`` bytes, or None."""
        key = (kernel, sizes)
        plan = self._plans.get(key, _NONE)
        if plan is _NONE:
            plan = self._plans[key] = make_plan(name, sizes)
        return plan  # type: ignore[return-value]

    def decode(self, kernel: str, name: str, rec: dict[str, Any]) -> Decoded | None:
        params = rec.get("params") or ()
        sizes = tuple(p.get("size", len(p.get("hex", "")) // 2) for p in params)
        plan = self.plan(kernel, name, sizes)
        if plan is None:
            return None
        try:
            raw = [bytes.fromhex(p.get("hex", "")) for p in params]
            if any(len(r) != s for r, s in zip(raw, sizes)):
                return None
            return _apply(plan, raw, rec)
        except ValueError:
            return None  # not hexadecimal

    def decode_raw(self, kernel: str, name: str, sizes: tuple[int, ...], args: bytes) -> Decoded | None:
        """``decode`` of a launch given as its parameters' sizes and their bytes back to back
        (the agent's form; no grid or block, so plans that check them give None)."""
        plan = self.plan(kernel, name, sizes)
        if plan is None:
            return None
        raw, pos = [], 0
        for n in sizes:
            raw.append(args[pos : pos + n])
            pos += n
        if pos != len(args):
            return None
        return _apply(plan, raw, {})


def _apply(plan: Plan, raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
    try:
        return plan(raw, rec)
    except (IndexError, ValueError, KeyError, ZeroDivisionError, struct.error):
        return None  # bytes that are not the structure the plan reads
