"""The compiled record checkers (gpuos_tools.stream.schema): they refuse exactly what the kinds'
checkers refuse, with the same words, on the records the GPU machines wrote and on every change
of one of their values; and a bad value of each kind of field is caught when a stream is read."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fuzz
from gpuos_tools.stream import StreamError, open_input
from gpuos_tools.stream import records as R
from gpuos_tools.stream.schema import (
    Anything,
    Either,
    Field,
    Hex,
    Int,
    List,
    Map,
    Num,
    Obj,
    RecordType,
    Str,
    SHORT_LINE,
    Tuple,
    when_present,
)

#: values at and past the edges of the kinds' ranges and forms, besides tests/fuzz.py's
EDGES: list[Any] = [
    -(1 << 31) - 1, 8, 9, 1 << 15, (1 << 15) + 1, 1 << 16, (1 << 16) + 1, (1 << 32) - 1, 1 << 32, 1 << 48,
    (1 << 48) + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, -0.5, 2.5, 1e308, -1e308, 10**309,
    "00", "0", "abc", "zz", "00 11", " 00", "00\n", "ABCDEF", "é0", "00" * 4096, "00" * 4097,
    "sha256:" + "0" * 64, "sha256:" + "A" * 64, "sha256:" + "0" * 63, "HtoD", "create", "R", "SIGKILL",
    "x" * 33, [0, 0, "device"], [0, 0], [1, 2, 3, 4], {"const": 5}, {"scale": 1, "args": [[0, 0, 8]]},
    {"max": []}, {"offset": 0, "size": 8, "hex": "00" * 8}, {"offset": 0}, {"type": "launch"},
]
VALUES = fuzz.NASTY + EDGES
#: a change that removes the field
DROP: Any = object()


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a record (the first 8 items of a list)."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value[:8]) if isinstance(value, list) else ()
    for key, inner in items:
        if prefix or key != "type":
            out.append((*prefix, key))
            out.extend(_paths(inner, (*prefix, key)))
    return out


def _changed(record: dict[str, Any], rng: random.Random, per_path: int) -> Iterator[dict[str, Any]]:
    """``record`` with one value replaced by ``per_path`` of VALUES, or removed, or under another
    name, wherever it is (changed in place, and back after each)."""
    for path in _paths(record):
        parent = record
        for key in path[:-1]:
            parent = parent[key]
        key, old = path[-1], parent[path[-1]]
        for value in rng.sample(VALUES, per_path):
            parent[key] = value
            yield record
        parent[key] = old
        if isinstance(parent, dict):
            del parent[key]
            yield record
            parent["other"] = old  # the same number of keys, one of them unknown
            yield record
            del parent["other"]
            parent[key] = old


def _recorded() -> dict[str, list[dict[str, Any]]]:
    """Two records of each type the recorded traces have (the first and the longest), modules cut
    to three kernels."""
    by_type: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((Path(__file__).parent / "data" / "recorded").glob("*.ndjson.zst")):
        with open_input(path) as reader:
            for rec in reader:
                if rec["type"] == "module":
                    rec["kernels"] = rec.get("kernels", [])[:3]
                by_type.setdefault(rec["type"], []).append(rec)
    return {t: [recs[0], max(recs, key=lambda r: len(json.dumps(r)))] for t, recs in by_type.items()}


#: good records of the types the traces lack, and few-field records (each type's required fields
#: and one more), which the compiled checkers walk key by key
MADE: list[dict[str, Any]] = [
    {"type": "access", "of": "launch", "seq": 3, "kernel": "k", "reads": [{"alloc": 1, "offset": 0, "size": 8}],
     "writes": [{"alloc": 2, "offset": 8, "size": 16, "how": "fixed"}], "unknown": False, "ts": 5,
     "validated": {"reads": "ok"}},
    {"type": "access_template", "kernel": "k", "param": 0, "offset": 0, "read": {"const": 64},
     "write": {"max": [{"scale": 4, "args": [[1, 0, 4], [2, 0, 8]]}, {"const": 0}]}, "samples": 3,
     "fits": {"scale": 1}},
    {"type": "io", "dev": 1, "t_us": 12.5, "op": "R", "offset": 4096, "size": 4096, "pending": 3, "lat_us": 80},
    {"type": "error", "message": "m", "source": "s", "line": 3, "ts": 1},
    {"type": "launch", "seq": 1, "x": 1},
    {"type": "launch", "seq": 1, "params": [{"offset": 0, "size": 8, "hex": "00" * 8}], "dptrs": [[0, 0, "device"]]},
    {"type": "memcpy", "dir": "HtoD", "dst": 0, "src": 0, "bytes": 16, "height": 2, "width": 8},
    {"type": "memset", "dst": 0, "bytes": 16, "height": 2, "pitch": 8},
    {"type": "alloc", "id": 1, "addr": 4096, "size": 8},
    {"type": "validation", "seq": 1, "checked": False, "why": "skipped"},
    {"type": "exit", "code": None, "signal": "SIGKILL"},
    {"type": "header", "schema": "gpuos/1", "pid": None, "gpus": [{"index": 0, "memory": 1 << 34}]},
]


def _good() -> list[dict[str, Any]]:
    return [rec for recs in _recorded().values() for rec in recs] + copy.deepcopy(MADE)


def test_the_compiled_checkers_refuse_what_the_kinds_checkers_refuse_in_the_same_words() -> None:
    explainers = {name: t.explainer() for name, t in R.INPUT.types.items()}
    rng = random.Random(20261125)
    cases = refused = 0
    for rec in _good():
        for case in _changed(rec, rng, 40):
            check = R.INPUT.checkers[case["type"]]
            said = check(case)
            assert said == explainers[case["type"]](case), case
            if len(json.dumps(case)) < SHORT_LINE:  # as a reader checks a record from a short line
                assert check(case, True) == said, case
            cases += 1
            refused += said is not None
    assert cases > 20_000 and refused > cases // 3  # the changes reached the checks


def test_good_records_never_reach_the_kinds_checkers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled statements accept every good record themselves (else they would be no faster)."""

    def explain(rec: dict[str, Any]) -> None:
        raise AssertionError(f"the compiled statements refused a good record: {rec}")

    for check in R.INPUT.checkers.values():
        monkeypatch.setitem(check.__globals__, "_explain", explain)
    for rec in _good():
        assert R.INPUT.checkers[rec["type"]](rec) is None


def test_every_record_type_is_compiled_from_its_schema() -> None:
    for name, t in R.INPUT.types.items():
        source = R.INPUT.checkers[name].source
        assert source.startswith("def check(_top, _short=False):")
        for f in t.fields:  # every field with a check is looked up by its name
            assert repr(f.name) in source or isinstance(f.kind, Anything) and not f.required, f


# -- what a reader says about one bad value of each kind ----------------------------------------

LAUNCH = {"type": "launch", "ts": 57691730129, "tid": 613, "seq": 1, "api": "cuLaunchKernel", "func": 776540704,
          "kernel": "_Z6kernelPf", "name": "kernel(float*)", "grid": [1, 1, 1], "block": [256, 1, 1], "smem": 0,
          "stream": 0, "layout": "cuFuncGetParamInfo",
          "params": [{"offset": 0, "size": 8, "hex": "0000a0c3127f0000"}, {"offset": 8, "size": 4, "hex": "00010000"}],
          "module": "sha256:" + "ab" * 32, "dptrs": [[0, 0, "device"]]}

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("launch", {"seq": -1}, "field 'seq': must be integer >= 0, not -1"),
    ("launch", {"seq": "7"}, "field 'seq': must be an integer (integer >= 0), not '7'"),
    ("launch", {"seq": True}, "field 'seq': must be an integer (integer >= 0), not true"),
    ("launch", {"seq": None}, "field 'seq': must be an integer (integer >= 0), not null"),
    ("launch", {"func": 1 << 64}, "field 'func': must be handle 0..2^64-1, not 18446744073709551616"),
    ("launch", {"smem": 1.0}, "field 'smem': must be an integer (integer 0..2^32-1), not 1.0"),
    ("launch", {"api": 5}, "field 'api': must be a string (string), not 5"),
    ("memcpy", {"dir": "up"}, """field 'dir': must be "HtoD"|"DtoH"|"DtoD"|"HtoH"|"default"|"peer", not 'up'"""),
    ("launch", {"module": "sha256:" + "A" * 64},
     """field 'module': must be "sha256:<64 hex digits>", not 'sha256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAA...'"""),
    ("launch", {"params": [{"offset": 0, "size": 8, "hex": "00" * 8}, {"offset": 8, "size": 8, "hex": "00 0"}]},
     "field 'params[1].hex': must be hex bytes (an even number of hex digits), not '00 0'"),
    ("launch", {"params": [{"offset": 0, "size": 8, "hex": "zz"}]},
     "field 'params[0].hex': must be hex bytes (an even number of hex digits), not 'zz'"),
    ("launch", {"params": [{"offset": 0, "size": 8, "hex": "abc"}]},
     "field 'params[0].hex': must be hex bytes (an even number of hex digits), not 'abc'"),
    ("memcpy", {"data": "00" * 4097}, "field 'data': must be at most 4096 bytes, not 4097"),
    ("launch", {"captured": 1}, "field 'captured': must be true or false, not 1"),
    ("launch", {"grid": [1, 1]}, "field 'grid': must have 3 items, not 2"),
    ("launch", {"grid": [1, -1, 1]}, "field 'grid[1]': must be integer 0..2^32-1, not -1"),
    ("launch", {"block": "1,1,1"}, "field 'block': must be a list, not '1,1,1'"),
    ("launch", {"dptrs": [[0, 0]]},
     """field 'dptrs[0]': must be a list of 3 ([param, offset, "device"|"unified"]), not a list of 2"""),
    ("launch", {"dptrs": [[0, "0", "device"]]}, "field 'dptrs[0][1]': must be an integer (integer 0..2^16), not '0'"),
    ("launch", {"params": [{"offset": 65537, "size": 8, "hex": ""}]},
     "field 'params[0].offset': must be integer 0..2^16, not 65537"),
    ("launch", {"params": ["00"]}, "field 'params[0]': must be an object, not '00'"),
    ("exit", {"records": {"launch": -2}}, "field 'records.launch': must be integer >= 0, not -2"),
    ("exit", {"signal": 1.5}, "field 'signal': must be string or integer 0..2^16, not 1.5"),
    ("exit", {"wall_s": math.nan}, "field 'wall_s': must be a finite s >= 0, not NaN"),
    ("exit", {"wall_s": -1}, "field 'wall_s': must be a finite s >= 0, not -1"),
    ("exit", {"code": 1 << 31}, "field 'code': must be integer -2147483648..2^31-1, not 2147483648"),
    ("validation", {"checked": True, "extents": [{"param": 0, "offset": 0, "ptr": 0, "limit": 8}]},
     "field 'extents[0].read' is missing"),
    ("validation", {"checked": True, "predicted": {"reads": [[0, 1 << 49]]}},
     "field 'predicted.reads[0][1]': must be bytes 0..2^48, not 562949953421312"),
    ("access_template", {"kernel": "k", "param": 0, "offset": 0, "read": {"scale": 1, "args": [[0, 0, 9]]}},
     "field 'read.args[0][2]': must be integer 1..8, not 9"),
    ("launch", {"params": [{"offset": 0, "size": 1, "hex": "0000"}], "dptrs": []},
     "field 'params[0].hex': holds 2 bytes, but size says 1"),
    ("launch", {"params": [{"offset": 0, "size": 8, "hex": "00" * 8}], "dptrs": [[1, 0, "device"]]},
     "field 'dptrs[0]': names parameter 1, but the launch has 1"),
    ("alloc", {"id": 1, "addr": (1 << 64) - 4, "size": 8},
     "field 'size': runs past the end of the 64-bit address space (addr 0xfffffffffffffffc + 8)"),
    ("memcpy", {"height": 1 << 40, "width": 1 << 20}, "field 'height': the copy spans more than 256 TiB"),
    ("launch", {"api": "x" * 65537}, "field 'api': must be at most 65536 characters long, not 65537"),
    ("launch", {"params": [{"offset": 0, "size": 8, "hex": "00"}] * 32769},
     "field 'params': must have at most 32768 items, not 32769"),
    ("launch", {"seq": DROP}, "field 'seq' is missing"),
]

#: a good record of each type with many of its fields, and the fields it cannot do without
MANY = {"launch": LAUNCH, "memcpy": {"type": "memcpy", "ts": 1, "tid": 2, "api": "cuMemcpyHtoD_v2", "dir": "HtoD",
                                     "dst": 1 << 40, "src": 4096, "bytes": 64, "stream": 0, "async": False},
        "exit": {"type": "exit", "ts": 9, "code": 0, "complete": True, "records": {"launch": 1}, "wall_s": 1.5},
        "validation": {"type": "validation", "ts": 1, "tid": 2, "api": "cuLaunchKernel", "seq": 1, "checked": True,
                       "chunk": 4096, "checked_bytes": 4096, "written": [], "reads": "ok"},
        "access_template": {"type": "access_template", "samples": 2, "fits": {"const": 1}},
        "alloc": {"type": "alloc", "ts": 1, "tid": 2, "api": "cuMemAlloc_v2", "kind": "device", "stream": 0}}
FEW = {"launch": {"seq": 1}, "memcpy": {"dir": "HtoD", "dst": 0, "src": 0, "bytes": 0}, "validation": {"seq": 1}}


@pytest.mark.parametrize("fields", ["many", "few"])
@pytest.mark.parametrize("kind, change, message", BAD, ids=[m.split(":")[0] for _, _, m in BAD])
def test_a_bad_value_of_each_kind_is_caught_on_read(
    tmp_path: Path, kind: str, change: dict[str, Any], message: str, fields: str,
) -> None:
    """A record with most of its type's fields and one with few are checked by different code."""
    rec = {**(MANY[kind] if fields == "many" else {"type": kind, **FEW.get(kind, {})}), **change}
    rec = {k: v for k, v in rec.items() if v is not DROP}
    path = tmp_path / "t.ndjson"
    lines = [{"type": "header", "schema": "gpuos/1"}, {"type": "launch", "seq": 1}, rec]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    with pytest.raises(StreamError) as caught, open_input(path) as reader:
        list(reader)
    assert str(caught.value) == f"{path}:3: {kind} record, {message}"
    with open_input(path, on_error="emit") as reader:
        assert list(reader)[2]["message"] == f"{kind} record, {message}"


# -- how the compiled code is made ------------------------------------------------------------


def test_a_record_from_a_short_line_skips_only_the_bounds_the_line_already_keeps() -> None:
    check = R.INPUT.checkers["exit"]
    long_name = {"type": "exit", "signal": "S" * 33, "records": {str(i): 1 for i in range(SHORT_LINE)}}
    said = f"field 'signal': must be string or integer 0..2^16, not '{'S' * 33}'"
    assert check(long_name, True) == check(long_name) == said
    too_many = {"type": "exit", "records": {str(i): 1 for i in range(1 << 16 | 1)}}
    assert check(too_many) == "field 'records': must have at most 65536 keys, not 65537"
    assert check(too_many, True) is None  # such a record cannot come from a short line


def test_a_kind_that_replaces_its_checker_is_called_as_one() -> None:
    """A subclass with its own checker but no statements of its own is not taken for its base."""

    class Even(Int):
        def checker(self) -> Any:
            base = super().checker()
            return lambda v: base(v) or (None if v % 2 == 0 else ("", "must be even"))

    check = RecordType("t", "test", (Field("n", Even()),)).checker()
    assert check({"type": "t", "n": 4}) is None
    assert check({"type": "t", "n": 3}) == "field 'n': must be even"


def test_a_cross_check_applies_only_to_records_with_its_fields() -> None:
    @when_present("a", "b")
    def never(rec: dict[str, Any]) -> Any:
        return "a", "never good"

    t = RecordType("t", "test", (Field("a", Int()), Field("b", Int()), Field("c", Int())), (never,))
    for check in (t.checker(), t.explainer()):
        assert check({"type": "t", "c": 1}) is None
        assert check({"type": "t", "b": 1}) == "field 'a': never good"
    # a required field is always there: the check always applies
    t = RecordType("t", "test", (Field("a", Int(), required=True),), (when_present("a")(lambda rec: None),))
    assert "'a' in _top" not in t.checker().source


@pytest.mark.parametrize("fields", [1, 8])
def test_every_kind_compiles_and_agrees_with_its_checker(fields: int) -> None:
    """A type with a field of every kind, walked key by key (few of its fields) or field by field."""
    kinds = [
        Int(-5, 5), Int(0, (1 << 20) - 1), Num(0, 1), Str(("a", "b")), Str(pattern="[a-z]{2}", max_len=2),
        Hex(2), List(Int(0, 3), max_len=2), List(Str(), length=2), Tuple((Int(), Str())), Map(Int(0, 1)),
        Either((Str(max_len=1), Int(0, 1))), Obj((Field("x", Int(), required=True), Field("y", Str(), null=True))),
    ]
    t = RecordType("t", "test", tuple(Field(f"f{i}", k, null=i % 3 == 0, required=i == 0)
                                      for i, k in enumerate(kinds)) + tuple(Field(f"pad{i}", Int()) for i in range(8)))
    check, explain = t.checker(), t.explainer()
    good = [0, 7, 0.5, "a", "ab", "00ff", [3], ["", ""], [1, "s"], {"k": 1}, "x", {"x": 1, "y": None}]
    rng = random.Random(fields)
    for _ in range(3000):
        rec: dict[str, Any] = {"type": "t"}
        for i in rng.sample(range(len(kinds)), fields):
            rec[f"f{i}"] = copy.deepcopy(rng.choice([good[i], good[i], *VALUES]))
        if fields > 1:
            rec.update({f"pad{i}": i for i in range(8)})
        assert check(rec) == explain(rec), rec
    assert check({"type": "t", **{f"f{i}": v for i, v in enumerate(good)}}) is None
