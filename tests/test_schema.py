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
