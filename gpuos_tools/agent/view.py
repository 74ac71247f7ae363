"""What the in-process helpers (the validator, the agent) know of the traced program: its live
allocations, the pointer arrays it copied to the GPU, and the streams it used — kept from the
same records the tracer ships, so that their predictions are gpu-predict-access's own."""

from __future__ import annotations

from typing import Any

from gpuos_tools.access.predict import Predictor
from gpuos_tools.model import wire
from gpuos_tools.model.records import symbol_record
from gpuos_tools.model.allocs import Allocation

#: allocation kinds whose memory lives on the GPU (host allocations are pinned host memory)
DEVICE_KINDS = ("device", "pitch", "managed", "async", "pool", "vmm")


def launch_record(kernel: str, sizes: tuple | None, args: bytes | None, func: int | None = None) -> dict[str, Any]:
    """A launch as gpu-predict-access reads it, from the tracer's parameter sizes and argument
    bytes (layout none when either is unknown), and the function handle (which module's
    variables it reads) when given."""
    rec: dict[str, Any] = {"kernel": kernel, "params": []}
    if func is not None:
        rec["func"] = func
    if sizes is None or args is None:
        rec["layout"] = "none"
        return rec
    pos = 0
    for size in sizes:
        rec["params"].append({"size": size, "hex": args[pos : pos + size].hex()})
        pos += size
    return rec


class ProcessView:
    """The program's allocations and streams, replayed from the tracer's wire tuples."""

    def __init__(self) -> None:
        self.pred = Predictor("range")
        self.by_id: dict[int, Allocation] = {}
        self.next_id = 1
        self.streams: set[int] = {0}
        self.apis: dict[int, str] = {}  #: call id -> driver API name (the tracer's HELLO)

    def observe(self, item: tuple) -> None:
        """Apply one wire tuple (gpuos_tools/model/wire.py) the tracer is about to ship."""
        tag = item[0]
        if tag == wire.ALLOC:
            self.on_alloc(item[4], item[5], item[6])
        elif tag == wire.FREE:
            a = self.pred.allocs.remove({"addr": item[4]})
            if a is not None:
                self.by_id.pop(a.id, None)
                self.pred.contents.pop(a.id, None)
                self.pred.invalidate()
        elif tag == wire.COPY:
            _, _, _, _, direction, dst, _, nbytes, stream, _, shape, data = item
            rec: dict[str, Any] = {"type": "memcpy", "dir": direction, "dst": dst, "src": 0, "bytes": nbytes}
            if shape is not None:
                rec["width"], rec["height"], rec["src_pitch"], rec["dst_pitch"] = shape
            if data is not None:
                rec["data"] = data.hex()
            self.pred.feed(rec)
            self.streams.add(stream)
        elif tag == wire.SET:
            self.pred.feed({"type": "memset", "dst": item[4], "bytes": item[5]})
            self.streams.add(item[8])
        elif tag == wire.STREAM:
            (self.streams.add if item[4] == "create" else self.streams.discard)(item[3])
        elif tag == wire.SYMBOL:
            self.pred.feed(symbol_record(item, self.apis))
        elif tag == wire.HELLO:
            self.apis = dict(item[4])

    def on_alloc(self, addr: int, size: int, kind: str) -> None:
        a = self.pred.allocs.add({"id": self.next_id, "addr": addr, "size": size, "kind": kind})
        self.by_id[a.id] = a
        self.next_id += 1
        self.pred.invalidate()

    def device_allocations(self) -> list[Allocation]:
        """Live allocations of device memory, by address."""
        allocs = self.pred.allocs
        return [allocs._live[s] for s in allocs._starts if allocs._live[s].kind in DEVICE_KINDS]
