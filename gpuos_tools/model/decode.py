"""Turn the tracer's wire tuples (gpuos_tools.model.wire) into gpuos stream records.

This runs in the `gpu-trace` process, off the traced program's path: allocation ids, parameter
slicing, hex encoding, demangling, module hashing and storage all happen here.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gpuos_tools.model import wire
from gpuos_tools.model.records import symbol_record
from gpuos_tools.cuda import elf
from gpuos_tools.stream import store_blob


class Decoder:
    """Stateful: it remembers functions, live allocations and which module holds which kernel."""

    def __init__(self, images_dir: Path | None):
        self.images_dir = images_dir
        self.apis: dict[int, str] = {}
        self.hello: tuple | None = None
        self.end: dict[str, Any] | None = None
        self.funcs: dict[int, dict[str, Any]] = {}
        self.kernel_module: dict[str, str] = {}
        self.live: dict[int, int] = {}  # address -> allocation id
        self.next_alloc = 1
        self.seq = 0
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []

    def api(self, cbid: int) -> str:
        return self.apis.get(cbid, f"cbid:{cbid}")

    def feed(self, items: Iterable[tuple]) -> Iterator[dict[str, Any]]:
        for item in items:
            handler = _HANDLERS.get(item[0])
            if handler is None:
                raise ValueError(f"unknown wire tag {item[0]!r}")
            rec = handler(self, item)
            if rec is not None:
                self.counts[rec["type"]] += 1
                yield rec

    # -- one method per tag; each returns a record or None

    def _hello(self, item: tuple) -> None:
        self.hello = item
        self.apis = dict(item[4])

    def _func(self, item: tuple) -> None:
        _, func, name, source, layout = item
        # a function is first seen at its first launch, just after its module was loaded: the
        # latest module defining its name then is its own (CuPy loads one module per array rank
        # under the same kernel names, so a later one may define the name too)
        self.funcs[func] = {"name": name, "source": source, "layout": layout,
                            "module": self.kernel_module.get(name)}

    def _launch(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, func, gx, gy, gz, bx, by, bz, smem, stream, args, result, captured = item[:16]
        info = self.funcs.get(func, {"name": "", "source": "none", "layout": None})
        name = info["name"]
        params = []
        layout = info["layout"]
        if layout is not None and args is not None:
            pos = 0
            for offset, size in layout:
                params.append({"offset": offset, "size": size, "hex": args[pos : pos + size].hex()})
                pos += size
        self.seq += 1
        rec: dict[str, Any] = {
            "type": "launch", "ts": ts, "tid": tid, "seq": self.seq, "api": self.api(cbid),
            "func": func, "kernel": name, "name": elf.demangle(name) if name else "",
            "grid": [gx, gy, gz], "block": [bx, by, bz], "smem": smem, "stream": stream,
            "layout": info["source"] if args is not None else "none", "params": params,
        }
        module = info.get("module") or self.kernel_module.get(name)
        if module:
            rec["module"] = module
        if result:
            rec["result"] = result
        if captured:
            rec["captured"] = True
        if len(item) > 16:
            rec["dptrs"] = [[i, off, _MEMTYPES.get(t, t)] for i, off, t in item[16]]
        return rec

    def _alloc(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, addr, size, kind, stream = item
        alloc_id = self.next_alloc
        self.next_alloc += 1
        self.live[addr] = alloc_id
        rec = {"type": "alloc", "ts": ts, "tid": tid, "id": alloc_id, "api": self.api(cbid),
               "addr": addr, "size": size, "kind": kind}
        if stream:
            rec["stream"] = stream
        return rec

    def _free(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, addr, size, stream = item
        rec: dict[str, Any] = {"type": "free", "ts": ts, "tid": tid, "id": self.live.pop(addr, None),
                               "api": self.api(cbid), "addr": addr}
        if size >= 0:
            rec["size"] = size
        if stream:
            rec["stream"] = stream
        return rec

    def _copy(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, direction, dst, src, nbytes, stream, is_async, shape = item[:11]
        rec = {"type": "memcpy", "ts": ts, "tid": tid, "api": self.api(cbid), "dir": direction,
               "dst": dst, "src": src, "bytes": nbytes, "stream": stream, "async": bool(is_async)}
        if shape is not None:
            rec["width"], rec["height"], rec["src_pitch"], rec["dst_pitch"] = shape
        if len(item) > 11 and item[11] is not None:
            rec["data"] = item[11].hex()
        return rec

    def _set(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, dst, nbytes, value, elem, stream, is_async = item
        return {"type": "memset", "ts": ts, "tid": tid, "api": self.api(cbid), "dst": dst,
                "bytes": nbytes, "value": value, "elem": elem, "stream": stream,
                "async": bool(is_async)}

    def _module(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, module_id, data = item
        fmt = elf.image_format(data)
        kernels: list[str] = []
        try:
            if fmt == "cubin":
                kernels = elf.kernels(data)
            elif fmt == "fatbin":
                # the interposer ships the image handed to the load call, which may be a fatbin
                # (CUPTI hands over the cubin the driver chose): its cubins' kernels, every
                # architecture's (the names are the same); LZ-compressed entries are not read
                kernels = list(dict.fromkeys(k for _, cubin in elf.extract_cubins(data) for k in elf.kernels(cubin)))
        except Exception as exc:  # keep the trace going; say what could not be read
            self.errors.append(f"module {module_id}: cannot list kernels: {exc}")
        rec: dict[str, Any] = {"type": "module", "ts": ts, "tid": tid, "id": module_id,
                               "size": len(data), "format": fmt}
        if data:
            digest = self._store(data, fmt, rec)
            for k in kernels:
                self.kernel_module[k] = digest
        rec["kernels"] = kernels
        return rec

    def _library(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, fmt, size, ptx = item
        rec: dict[str, Any] = {"type": "library", "ts": ts, "tid": tid, "api": self.api(cbid),
                               "format": fmt, "size": size}
        if ptx:
            self._store(ptx, "ptx", rec)
        return rec

    def _store(self, data: bytes, fmt: str, rec: dict[str, Any]) -> str:
        """Put hash (and file, when images are kept) into rec; return the hash."""
        if self.images_dir is None:
            rec["hash"] = "sha256:" + hashlib.sha256(data).hexdigest()
        else:
            rec["hash"], rec["file"] = store_blob(self.images_dir, data, suffix="." + fmt)
        return rec["hash"]

    def _stream(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, stream, event = item
        return {"type": "stream", "ts": ts, "tid": tid, "stream": stream, "event": event}

    def _graph(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, graph, stream = item
        return {"type": "graph_launch", "ts": ts, "tid": tid, "api": self.api(cbid),
                "graph": graph, "stream": stream}

    def _graphop(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, cbid, op, a, b = item
        rec: dict[str, Any] = {"type": "graph", "ts": ts, "tid": tid, "api": self.api(cbid), "event": op}
        if op == "instantiate":
            rec["graph"], rec["exec"] = a, b
        else:
            rec["stream"] = a
            if op == "capture_end":
                rec["graph"] = b
        return rec

    def _error(self, item: tuple) -> dict[str, Any]:
        _, ts, message = item
        self.errors.append(message)
        return {"type": "error", "ts": ts, "source": "tracer", "message": message}

    def _valid(self, item: tuple) -> dict[str, Any]:
        _, ts, tid, body = item
        return {"type": "validation", "ts": ts, "tid": tid, "seq": self.seq, **body}

    def _symbol(self, item: tuple) -> dict[str, Any]:
        return symbol_record(item, self.apis)

    def _end(self, item: tuple) -> None:
        self.end = dict(item[2])


_MEMTYPES = {1: "host", 2: "device", 3: "array", 4: "unified"}

_HANDLERS = {
    wire.HELLO: Decoder._hello,
    wire.FUNC: Decoder._func,
    wire.LAUNCH: Decoder._launch,
    wire.ALLOC: Decoder._alloc,
    wire.FREE: Decoder._free,
    wire.COPY: Decoder._copy,
    wire.SET: Decoder._set,
    wire.MODULE: Decoder._module,
    wire.LIBRARY: Decoder._library,
    wire.STREAM: Decoder._stream,
    wire.GRAPH: Decoder._graph,
    wire.ERROR: Decoder._error,
    wire.END: Decoder._end,
    wire.VALID: Decoder._valid,
    wire.GRAPHOP: Decoder._graphop,
    wire.SYMBOL: Decoder._symbol,
}
