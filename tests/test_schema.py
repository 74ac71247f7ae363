"""The record schemas as data (gpuos_tools.stream.schema): each kind's checks, where a problem is
said to be, and the man-page text they render."""

from __future__ import annotations

import math

import pytest

from gpuos_tools.stream import records as R
from gpuos_tools.stream.schema import (
    Bool,
    Either,
    Field,
    Int,
    List,
    Map,
    Num,
    Obj,
    RecordType,
    Registry,
    Str,
    Tuple,
    render,
)


@pytest.mark.parametrize("kind, good, bad", [
    (Int(0, 10), [0, 10, 5], [-1, 11, True, 1.0, "1", None, [1]]),
    (Num(0), [0, 1.5, 10**300], [-0.1, math.nan, math.inf, 10**400, False, "1"]),
    (Bool(), [True, False], [0, 1, "true", None]),
    (Str(("a", "b")), ["a", "b"], ["c", "", 1]),
    (Str(pattern="[0-9a-f]{4}"), ["00ff"], ["00fg", "00f", "00ff0"]),
    (List(Int(), length=3), [[1, 2, 3]], [[1, 2], [1, 2, 3, 4], [1, -2, 3], (1, 2, 3)]),
    (List(Int(), max_len=2), [[], [1, 2]], [[1, 2, 3]]),
    (Tuple((Int(), Str())), [[1, "a"]], [[1], [1, 2], ["a", 1]]),
    (Map(Int()), [{}, {"a": 1}], [{"a": -1}, [1]]),
    (Either((Str(), Int())), ["a", 1], [1.5, None, []]),
    (Obj((Field("a", Int(), required=True),)), [{"a": 1}, {"a": 1, "other": "kept"}], [{}, {"a": "1"}, []]),
])
def test_kinds_accept_and_refuse(kind, good, bad) -> None:
    check = kind.checker()
    for value in good:
        assert check(value) is None, value
    for value in bad:
        assert check(value) is not None, value


def test_problems_name_the_path_inside_the_record() -> None:
    rt = RecordType("t", "a test type", (
        Field("items", List(Obj((Field("n", Int(0, 3)),))), required=True),
        Field("name", Str(), null=True),
    ))
    check = rt.checker()
    assert check({"type": "t", "items": [{"n": 1}, {"n": 9}]}) == "field 'items[1].n': must be integer 0..3, not 9"
    assert check({"type": "t"}) == "field 'items' is missing"
    assert check({"type": "t", "items": [], "name": None}) is None


def test_an_int_enum_or_a_numpy_float_written_by_a_tool_counts_as_a_number() -> None:
    import enum

    import numpy as np

    class Code(enum.IntEnum):
        A = 3

    assert Int().checker()(Code.A) is None and Num().checker()(np.float64(1.5)) is None
    assert Num().checker()(np.float64("nan")) is not None


def test_the_registry_checks_the_type_field_first() -> None:
    reg = Registry([R.ALLOC])
    assert reg.check({"type": 5}).startswith("field 'type'")
    assert reg.check({"type": "mystery", "size": -1}) is None  # unknown types pass through
    assert reg.check({"type": "alloc", "id": 1, "addr": 0, "size": 4}) is None


def test_a_type_defined_twice_is_a_bug() -> None:
    with pytest.raises(ValueError, match="twice"):
        Registry([R.ALLOC, R.ALLOC])


def test_an_exit_record_of_a_program_ended_by_a_signal() -> None:
    assert R.INPUT.check({"type": "exit", "code": None, "signal": 9, "complete": False, "records": {}}) is None
    # gpu-trace run writes the signal's name
    assert R.INPUT.check({"type": "exit", "code": None, "signal": "SIGKILL", "complete": False, "records": {}}) is None


def test_render_lists_fields_with_their_kinds_and_optional_marks() -> None:
    text = render([R.ALLOC], omit=("ts", "tid", "api"))
    assert text.startswith("`alloc`: an allocation the program made.")
    assert "- `size` (bytes 0..2^48)" in text and "- `stream`? (handle 0..2^64-1)" in text
    assert "`ts`" not in text


# -- what tools write ----------------------------------------------------------------------------

#: Every module that registers the schemas of records it writes (each command imports its own).
_REGISTERING = ("gpuos_tools.ckpt.records", "gpuos_tools.sched.records", "gpuos_tools.kinfer.records",
                "gpuos_tools.trace.stats", "gpuos_tools.access.report")
#: "type" values in the source that are no stream record's
_NOT_RECORDS = {"sched_timeline": "the --timeline JSON file, read back by sched.plot.load_timeline"}


def _written_types() -> dict[str, str]:
    """Every literal ``"type": "NAME"`` in the package's source, with a file that writes it."""
    import pathlib
    import re

    import gpuos_tools

    root = pathlib.Path(gpuos_tools.__file__).parent
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for name in re.findall(r"""["']type["']\s*:\s*["']([a-z_]+)["']""", path.read_text(encoding="utf-8")):
            found.setdefault(name, str(path.relative_to(root)))
    return found


def test_every_record_type_a_tool_writes_has_a_schema() -> None:
    import importlib

    for module in _REGISTERING:
        importlib.import_module(module)
    written = _written_types()
    assert {"agent_snapshot", "agent_rollback", "stats_summary", "kinfer_answer", "serve_job"} <= set(written)
    missing = {name: where for name, where in written.items() if name not in _NOT_RECORDS and R.registered(name) is None}
    assert not missing, f"record types written without a schema: {missing}"
    for name in written.keys() - _NOT_RECORDS.keys():
        assert R.check_written({"type": name}) != R.check_written({"type": "no_such_record_type"}), name


def test_check_written_refuses_a_type_without_a_schema() -> None:
    problem = R.check_written({"type": "made_up_by_a_tool", "x": 1})
    assert problem is not None and "'made_up_by_a_tool' has no schema" in problem
    assert R.check_written({"type": "alloc", "id": 1, "addr": 4096, "size": 1}) is None


def test_check_written_checks_the_agents_snapshot_and_rollback_answers() -> None:
    import gpuos_tools.ckpt.records  # noqa: F401 -- registers them

    snap = {"type": "agent_snapshot", "ok": True, "t0_ns": 5, "ops_before": 3, "buffers": 2, "bytes": 1 << 20,
            "seconds": 0.01, "gbps": 0.1, "cow": 0, "cow_bytes": 0, "stall_s": 0.0001,
            "stall_parts_s": {"order": 0.0001}, "image": {"path": "/tmp/x", "image_id": "a", "bytes": 1 << 20}}
    assert R.check_written(snap) is None
    assert "field 'stall_s'" in R.check_written({**snap, "stall_s": -1})
    assert "field 't0_ns' is missing" == R.check_written({k: v for k, v in snap.items() if k != "t0_ns"})
    back = {"type": "agent_rollback", "agent": "4242", "image": "/tmp/x", "buffers": 2, "bytes": 1 << 20,
            "read_s": 0.1, "stall_s": 0.01, "gbps": None, "lazy": True}
    assert R.check_written(back) is None
    assert "field 'agent' is missing" == R.check_written({k: v for k, v in back.items() if k != "agent"})


def test_a_record_of_another_tool_passes_through_under_the_check(tmp_path, monkeypatch) -> None:
    """A type without a schema that came from the input is another tool's: a filter writes it on
    unchanged with GPUOS_CHECK_RECORDS=1, while one it made up itself is refused."""
    from gpuos_tools.errors import ExitCode
    from gpuos_tools.stream import StreamError, open_input, open_output, passthrough

    monkeypatch.setenv("GPUOS_CHECK_RECORDS", "1")
    src = tmp_path / "in.ndjson"
    src.write_text('{"type":"header","schema":"gpuos/1"}\n{"type":"someone_elses","v":1}\n')
    with open_input(str(src)) as reader, open_output(str(tmp_path / "out.ndjson")) as writer:
        passthrough(reader, writer, (), lambda rec: [rec])
    assert (tmp_path / "out.ndjson").read_text().splitlines()[1] == '{"type":"someone_elses","v":1}'
    with pytest.raises(StreamError) as e, open_output(str(tmp_path / "own.ndjson")) as writer:
        writer.write({"type": "header", "schema": "gpuos/1"})
        writer.write({"type": "invented_here"})
    assert e.value.code == ExitCode.SOFTWARE and "no schema" in str(e.value)
