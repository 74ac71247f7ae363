"""Scoring a prediction against what `gpu-trace run --validate` observed on the GPU.

A `validation` record (gpuos_tools/model/records.py) follows the launch it checked and gives,
in absolute addresses: the chunks the kernel changed (`written`), whether poisoning everything
outside the range prediction changed its output (`reads`), and per pointer how far the kernel
read and wrote (`extents`). Any prediction of that launch — another granularity, size templates
— is scored here against those observations:

- missed write bytes: changed chunks that no predicted write range overlaps;
- extra write bytes: predicted write bytes outside the changed chunks;
- missed read bytes: bytes of the measured read extents outside the predicted reads; a launch
  whose poison trial changed the output missed a read even where no extent says how much;
- extra read bytes: predicted read bytes outside the measured read extents; of them, those
  the launch wrote or was predicted to write (``extra_read_written_bytes``) are where the
  measurement judges least: a write of the values already there shows no change, and where the
  extents carry no ``in_place`` (traces recorded before it, or a launch that wrote more than the
  comparison keeps) the bisection compared only written chunks it did not zero, so the read of
  an operand updated in place was invisible.

A replay in the validator process that faulted (`fault`: an access outside every granule the
prediction named) missed an access without saying which: it counts as a missed read, and its
writes as unchecked.

Chunks are aligned to 128 bytes in absolute addresses (device allocations are at least
256-byte aligned), so a predicted range that ends inside a chunk covers that chunk.
"""

from __future__ import annotations

from typing import Any

from gpuos_tools.model.allocs import Allocation


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged [start, end) ranges."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _size(ranges: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in ranges)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merged ranges ``a`` less merged ranges ``b``."""
    out = []
    for s, e in a:
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
        if s < e:
            out.append((s, e))
    return out


def _expand(ranges: list[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    return _merge([(s - s % chunk, e + (-e) % chunk) for s, e in ranges])


def absolute(entries: list[dict[str, Any]], by_id: dict[int, Allocation]) -> list[tuple[int, int]]:
    """An access record's {alloc, offset, size} entries as merged absolute [start, end) ranges."""
    out = []
    for e in entries:
        a = by_id.get(e["alloc"])
        if a is not None:
            out.append((a.addr + e["offset"], a.addr + e["offset"] + e["size"]))
    return _merge(out)


def score(access: dict[str, Any], val: dict[str, Any], by_id: dict[int, Allocation]) -> dict[str, Any] | None:
    """The ``validated`` entry of an access record, or None when the launch was not checked."""
    if not val.get("checked"):
        return None
    chunk = int(val.get("chunk") or 128)
    writes = absolute(access["writes"], by_id)
    reads = absolute(access["reads"], by_id)
    written = _merge([(s, s + n) for s, n in val.get("written", ())])
    unknown = bool(access.get("unknown"))
    out: dict[str, Any] = {}
    if val.get("fault"):
        return {"fault": val["fault"], "writes": "unchecked", "missed_write_bytes": 0, "written_bytes": 0,
                "reads": "unknown" if unknown else "missed"}
    if unknown:
        # "may touch everything": nothing can be missed, and extra bytes are not meaningful
        out.update(writes="unknown", missed_write_bytes=0, written_bytes=_size(written))
    else:
        missed_w = _size(written) - _size(_intersect(written, _expand(writes, chunk)))
        out.update(
            writes="missed" if missed_w else "ok",
            missed_write_bytes=missed_w,
            extra_write_bytes=_size(writes) - _size(_intersect(writes, written)),
            written_bytes=_size(written),
        )
    status = val.get("reads", "skipped")
    extents = val.get("extents")
    if extents is not None and status in ("ok", "missed"):
        truth = _merge([(e["ptr"], e["ptr"] + e["read"]) for e in extents if e.get("read")])
        out["read_bytes"] = _size(truth)
        if not unknown:
            out["missed_read_bytes"] = _size(truth) - _size(_intersect(truth, _expand(reads, chunk)))
            out["extra_read_bytes"] = _size(reads) - _size(_intersect(reads, truth))
            out["extra_read_written_bytes"] = _size(_intersect(_subtract(reads, truth), _merge(written + writes)))
    tested = _merge([(s, s + n) for s, n in val.get("predicted", {}).get("reads", ())])
    if unknown:
        out["reads"] = "unknown"
    elif status == "missed":
        out["reads"] = "missed"
    elif status == "ok" and _size(_intersect(tested, reads)) == _size(tested):
        # the poison test covered everything outside the tested set, which this prediction holds
        out["reads"] = "missed" if out.get("missed_read_bytes") else "ok"
    elif status == "ok":
        # a tighter prediction than the one the poison test checked: only the extents judge it
        out["reads"] = "missed" if out.get("missed_read_bytes") else ("ok" if "missed_read_bytes" in out else "unchecked")
    else:
        out["reads"] = status  # nondeterministic or skipped
    return out
