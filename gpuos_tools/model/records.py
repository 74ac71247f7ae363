"""The record types `gpu-trace` writes, and small helpers for reading them.

Every record is one JSON object with a ``type``. Addresses, handles and sizes are JSON integers
(device pointers fit in 64 bits; Python and jq read them exactly). Times are nanoseconds of
CLOCK_MONOTONIC in ``ts``; ``tid`` is the native thread id of the caller.

Their fields, types and ranges are written once, as data, in gpuos_tools.stream.records
(``TRACE_TYPES``): every reader checks them, and gpu-trace(1) lists them from there.

A launch's argument bytes are in ``params[i].hex``; `pointer_words` yields every 8-byte-aligned
word of them, which is where device pointers (raw or inside by-value structs such as CuPy's array
struct) are found.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gpuos_tools.model import wire

def pointer_words(launch: dict[str, Any]) -> Iterator[tuple[int, int, int]]:
    """Yield (param index, byte offset within the param, value) for each aligned 8-byte word."""
    for i, p in enumerate(launch.get("params") or ()):
        raw = bytes.fromhex(p.get("hex", ""))
        for off in range(0, len(raw) - 7, 8):
            yield i, off, int.from_bytes(raw[off : off + 8], "little")


def symbol_record(item: tuple, apis: dict[int, str]) -> dict[str, Any]:
    """The ``symbol`` record of a SYMBOL wire tuple (``apis``: the HELLO's call names)."""
    _, ts, tid, cbid, what, handle, parent, addr, size, name = item
    api = wire.ASKED_API if cbid == wire.ASKED else apis.get(cbid, f"cbid:{cbid}")
    rec: dict[str, Any] = {"type": "symbol", "ts": ts, "tid": tid, "api": api, "of": what,
                           "name": name, "parent": parent}
    if what == "variable":
        rec["addr"] = addr
        if size >= 0:
            rec["bytes"] = size
    else:
        rec["func"] = handle
    return rec
