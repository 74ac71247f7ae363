"""``gpu-predict-access --report`` and ``--explain SEQ``: summaries of the predictions, per
kernel, and the reasoning behind one launch's prediction."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuos_tools.access.predict import BASIS_TEXT, Predictor
from gpuos_tools.access.score import score
from gpuos_tools.names import short_names
from gpuos_tools.stream.records import COUNT, register_output
from gpuos_tools.stream.schema import Anything, Field, List, Map, Num, RecordType, Str
from gpuos_tools.units import format_size


@dataclass(slots=True)
class Row:
    """Predictions for one kernel (or for all copies, memsets or graph launches)."""

    of: str
    name: str
    kernel: str | None = None
    launches: int = 0
    captured: int = 0
    reads: int = 0  #: buffer entries over all launches
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    unknown: int = 0
    why: Counter[str] = field(default_factory=Counter)
    # from validation records (gpu-trace run --validate), scored by gpuos_tools/access/score.py
    validated: int = 0
    missed_write_launches: int = 0
    missed_write_bytes: int = 0
    extra_write_bytes: int = 0
    written_bytes: int = 0
    missed_read_launches: int = 0
    missed_read_bytes: int = 0
    extra_read_bytes: int = 0
    extra_read_written_bytes: int = 0  #: of them, on bytes the launch wrote or was predicted to write
    read_bytes: int = 0
    read_measured: int = 0  #: validated launches with read extents measured
    reads_unchecked: Counter[str] = field(default_factory=Counter)  #: nondeterministic, skipped...

    def add_score(self, v: dict[str, Any]) -> None:
        self.validated += 1
        self.missed_write_launches += v["writes"] == "missed"
        self.missed_write_bytes += v["missed_write_bytes"]
        self.extra_write_bytes += v.get("extra_write_bytes", 0)
        self.written_bytes += v["written_bytes"]
        self.missed_read_launches += v["reads"] == "missed"
        if v["reads"] not in ("ok", "missed"):
            self.reads_unchecked[v["reads"]] += 1
        if "read_bytes" in v:
            self.read_measured += 1
            self.read_bytes += v["read_bytes"]
            self.missed_read_bytes += v.get("missed_read_bytes", 0)
            self.extra_read_bytes += v.get("extra_read_bytes", 0)
            self.extra_read_written_bytes += v.get("extra_read_written_bytes", 0)


def compute_report(records: Iterable[dict[str, Any]], granularity: str = "alloc", templates=None) -> list[Row]:
    """One pass over a trace: a row per kernel, then one each for memcpy, memset, graph_launch."""
    pred = Predictor(granularity, templates)
    rows: dict[tuple[str, str], Row] = {}
    feed = pred.feed
    last: tuple[dict[str, Any], Row] | None = None
    for rec in records:
        if rec["type"] == "validation" and last is not None and last[0].get("seq") == rec.get("seq"):
            v = score(last[0], rec, pred.by_id)
            if v is not None:
                last[1].add_score(v)
            continue
        acc = feed(rec)
        if acc is None:
            continue
        of = acc["of"]
        if of == "launch":
            info = pred.info(rec)
            key = (of, info.kernel)
            row = rows.get(key)
            if row is None:
                row = rows[key] = Row(of, info.name, info.kernel)
        else:
            key = (of, of)
            row = rows.get(key)
            if row is None:
                row = rows[key] = Row(of, f"({of})")
        last = (acc, row) if of == "launch" else None
        row.launches += 1
        row.captured += bool(acc.get("captured"))
        row.reads += len(acc["reads"])
        row.writes += len(acc["writes"])
        row.bytes_read += sum(e["size"] for e in acc["reads"])
        row.bytes_written += sum(e["size"] for e in acc["writes"])
        if acc["unknown"]:
            row.unknown += 1
            row.why[acc.get("why", "")] += 1
    kernels = sorted((r for r in rows.values() if r.of == "launch"), key=lambda r: (-r.launches, r.name))
    others = [rows[(of, of)] for of in ("memcpy", "memset", "graph_launch") if (of, of) in rows]
    return kernels + others


#: The records of ``--report`` and ``--explain``, as data (gpuos_tools.stream.schema).
ACCESS_REPORT = RecordType("access_report", "(--report) one kernel's predictions summed, or all memcpys, memsets or "
                           "graph launches.", (
    Field("of", Str(("launch", "memcpy", "memset", "graph_launch")), required=True),
    Field("kernel", Str(max_len=1 << 20), "launches: the mangled name"), Field("name", Str(max_len=1 << 20)),
    Field("granularity", Str()), Field("launches", COUNT, required=True), Field("captured", COUNT),
    Field("reads_per_launch", Num(0)), Field("writes_per_launch", Num(0)),
    Field("bytes_read", Num(0, unit="bytes")), Field("bytes_written", Num(0, unit="bytes")),
    Field("unknown", COUNT, "launches that may touch any memory"), Field("why", Map(COUNT), "what made them unknown"),
    Field("validation", Map(), "on a --validate trace: missed and extra bytes against what the GPU did"),
))
ACCESS_EXPLAIN = RecordType("access_explain", "(--explain SEQ) how one launch's prediction was made, word by word.", (
    Field("seq", COUNT, null=True, required=True), Field("kernel", Str(max_len=1 << 20)),
    Field("name", Str(max_len=1 << 20)), Field("layout", Str(), null=True), Field("source", Str()),
    Field("prototype", Anything()), Field("params", List(Map())), Field("words", List(Map())),
    Field("access", Map(), "the `access` record predicted"),
))
register_output(ACCESS_REPORT, ACCESS_EXPLAIN)


def report_records(rows: list[Row], granularity: str) -> Iterable[dict[str, Any]]:
    for row in rows:
        rec: dict[str, Any] = {"type": "access_report", "of": row.of}
        if row.kernel is not None:
            rec["kernel"] = row.kernel
        rec.update(
            name=row.name, granularity=granularity, launches=row.launches, captured=row.captured,
            reads_per_launch=round(row.reads / row.launches, 3),
            writes_per_launch=round(row.writes / row.launches, 3),
            bytes_read=row.bytes_read, bytes_written=row.bytes_written,
            unknown=row.unknown, why=dict(row.why),
        )  # fmt: skip
        if row.validated:
            rec["validation"] = {
                "launches": row.validated,
                "missed_write_launches": row.missed_write_launches,
                "missed_write_bytes": row.missed_write_bytes,
                "extra_write_bytes": row.extra_write_bytes,
                "written_bytes": row.written_bytes,
                "missed_read_launches": row.missed_read_launches,
                "read_measured": row.read_measured,
                "missed_read_bytes": row.missed_read_bytes,
                "extra_read_bytes": row.extra_read_bytes,
                "extra_read_written_bytes": row.extra_read_written_bytes,
                "read_bytes": row.read_bytes,
                "reads_unchecked": dict(row.reads_unchecked),
            }
        yield rec


def render_report(rows: list[Row], console: Console, granularity: str) -> None:
    if any(r.validated for r in rows):
        render_validation(rows, console, granularity)
    table = Table(title=f"predicted accesses ({granularity} granularity)")
    table.caption = "reads, writes: buffers per launch; bytes: summed over the launches"
    for col, justify in (("kernel", "left"), ("launches", "right"), ("reads", "right"),
                         ("writes", "right"), ("bytes read", "right"), ("bytes written", "right"),
                         ("unknown", "right")):  # fmt: skip
        table.add_column(col, justify=justify, overflow="ellipsis", no_wrap=True)
    names = short_names([r.name for r in rows], max(30, min(100, console.width - 72)))
    for row, name in zip(rows, names):
        table.add_row(
            name, str(row.launches), f"{row.reads / row.launches:.2f}", f"{row.writes / row.launches:.2f}",
            format_size(row.bytes_read), format_size(row.bytes_written),
            str(row.unknown) if row.unknown else "",
        )  # fmt: skip
    console.print(table)
    for row, name in zip(rows, names):
        for why, n in row.why.items():
            console.print(f"unknown ×{n}: {name}: {why}", highlight=False)


def render_validation(rows: list[Row], console: Console, granularity: str) -> None:
    table = Table(title=f"validated on the GPU ({granularity} granularity): missed and extra bytes")
    for col in ("kernel", "checked", "missed writes", "extra write bytes", "missed reads",
                "extra read bytes", "reads not judged"):
        table.add_column(col, justify="left" if col == "kernel" else "right", overflow="ellipsis",
                         no_wrap=col == "kernel")
    checked = [r for r in rows if r.validated]
    for row, name in zip(checked, short_names([r.name for r in checked], max(30, min(80, console.width - 90)))):
        missed_w = f"{row.missed_write_launches} ({format_size(row.missed_write_bytes)})" if row.missed_write_launches else "0"
        missed_r = (f"{row.missed_read_launches} ({format_size(row.missed_read_bytes)})"
                    if row.missed_read_launches else "0")
        extra_w = f"{format_size(row.extra_write_bytes)} ({_pct(row.extra_write_bytes, row.written_bytes)})"
        extra_r = (f"{format_size(row.extra_read_bytes)} ({_pct(row.extra_read_bytes, row.read_bytes)})"
                   if row.read_measured else "-")
        unjudged = ", ".join(f"{k} {n}" for k, n in row.reads_unchecked.items())
        table.add_row(name, str(row.validated), missed_w, extra_w, missed_r, extra_r, unjudged)
    console.print(table)


def _pct(extra: int, true: int) -> str:
    return f"{100 * extra / true:.0f}%" if true else ("0%" if not extra else "∞")


# -- explain ----------------------------------------------------------------------------------


def explain(records: Iterable[dict[str, Any]], seq: int, granularity: str = "alloc",
            templates=None) -> dict[str, Any] | None:
    """The ``access_explain`` record of the launch with this ``seq`` (the first one), or None."""
    pred = Predictor(granularity, templates)
    for rec in records:
        if rec["type"] == "launch" and rec.get("seq") == seq:
            return explain_launch(pred, rec)
        pred.feed(rec)
    return None


def explain_launch(pred: Predictor, rec: dict[str, Any]) -> dict[str, Any]:
    """How each buffer of one launch was inferred, given the predictor's state just before it."""
    access, info, found = pred.launch(rec, pred.zeroed_before(rec))
    params = rec.get("params") or ()
    decoded = None
    if pred.decoders is not None and rec.get("layout") != "none":
        decoded = pred.decoders.decode(info.kernel, info.name, rec)
    words = []
    for f in found:
        basis = "stored" if f.found == "stored" else info.bases[f.param] if f.param < len(info.bases) else "untyped"
        entry: dict[str, Any] = {
            "param": f.param,
            "param_offset": params[f.param].get("offset") if f.param < len(params) else None,
            "offset": f.offset,
            "word": f.word,
            "found": f.found,
            "alloc": f.alloc.id if f.alloc else None,
            "alloc_offset": f.word - f.alloc.addr if f.alloc else None,
            "alloc_size": f.alloc.size if f.alloc else None,
            "type": info.types[f.param] if f.param < len(info.types) else None,
            "basis": basis,
        }
        if f.via is not None:
            entry["via"] = f.via  # the device address the pointer was read from
        spans = decoded.spans.get((f.param, f.offset)) if decoded is not None and f.found != "stored" else None
        if spans is not None:
            entry["decision"] = f"decoded ({decoded.via}): " + _spans_text(spans)
        elif decoded is not None and f.found != "stored" and decoded.laid_out(f.param, f.offset):
            entry["decision"] = f"not a pointer: a field of the structure decoded ({decoded.via})"
        elif f.alloc is None:
            entry["decision"] = "in no traced allocation: the launch is unknown"
        elif basis == "const":
            entry["decision"] = "read"
        else:
            entry["decision"] = "read+write: " + BASIS_TEXT.get(basis, basis)
        words.append(entry)
    return {
        "type": "access_explain",
        "seq": rec.get("seq"),
        "kernel": info.kernel,
        "name": info.name,
        "layout": rec.get("layout"),
        "source": "dptrs (driver-confirmed pointers)" if "dptrs" in rec else "scan of the argument words",
        "prototype": info.note,
        "params": [
            {"index": i, "offset": p.get("offset"), "size": p.get("size"), "type": info.types[i] if i < len(info.types) else None,
             "basis": info.bases[i] if i < len(info.bases) else "untyped"}
            for i, p in enumerate(params)
        ],  # fmt: skip
        "words": words,
        "access": access,
    }


def _spans_text(spans: tuple) -> str:
    """"read [lo, hi), write [lo, hi)" of a decoded pointer's spans (hi None: to its allocation's end)."""
    parts = []
    for label, span in zip(("read", "write"), spans):
        if span is not None:
            lo, hi = span
            parts.append(f"{label} [{lo}, {'end' if hi is None else hi})")
    return ", ".join(parts) or "not accessed"


def render_explain(ex: dict[str, Any], console: Console) -> None:
    out = console.print
    acc = ex["access"]
    out(f"launch {ex['seq']}: {ex['name']}", highlight=False)
    if ex["kernel"] != ex["name"]:
        out(f"  mangled: {ex['kernel']}", highlight=False)
    out(f"  layout: {ex['layout']}; pointers from: {ex['source']}; types: {ex['prototype']}", highlight=False)
    if acc.get("captured"):
        out("  captured into a CUDA graph: it runs with each graph_launch, not now", highlight=False)
    out("  parameters:", highlight=False)
    for p in ex["params"]:
        out(f"    [{p['index']}] +{p['offset']} ({p['size']} B) {p['type'] or '?'}: {p['basis']}", highlight=False)
    out("  pointer words:", highlight=False)
    if not ex["words"]:
        out("    none", highlight=False)
    for w in ex["words"]:
        where = (
            f"allocation {w['alloc']} +{w['alloc_offset']} (of {w['alloc_size']} B)" if w["alloc"] is not None
            else "no traced allocation"
        )  # fmt: skip
        out(
            f"    param {w['param']} +{w['offset']}: {w['word']:#x} ({w['found']}"
            + (f" at {w['via']:#x}" if "via" in w else "") + f") -> {where}; "
            f"{w['type'] or 'type unknown'} -> {w['decision']}",
            highlight=False,
        )
    for label in ("reads", "writes"):
        entries = ", ".join(f"{e['alloc']}[{e['offset']}:+{e['size']}]" for e in acc[label]) or "none"
        out(f"  {label}: {entries}", highlight=False)
    if acc["unknown"]:
        out(f"  UNKNOWN: {acc.get('why')}", highlight=False)
    elif acc.get("why"):
        out(f"  note: {acc['why']}", highlight=False)
