"""Record types written once, as data: which fields a record has, of what type and range, and
what each means.

The same objects do three jobs. Readers validate every record of a known type as it is read, so
that a bad value is reported with its line and field (``trace.ndjson:12: alloc record, field
'size': ...``) instead of failing somewhere deep in a tool. The man pages' RECORDS sections are
rendered from them (``render``). And the tests check every stream they make against them.

A type is *open*: fields it does not list are passed through untouched, so a newer writer's
additions never break an older reader. Fields it lists are checked whenever present; those marked
required must be present. Integers are bounded (an address is 64 bits; a size is at most
``gpuos_tools.units.MAX_BYTES``, more than any machine holds), floats must be finite, and lists
have a largest length, so no single record can make a tool allocate without bound.

Checkers return None for a good value and ``(path, problem)`` for a bad one, where ``path`` says
where inside the value (``[3].hex``); they never raise, whatever JSON they are given.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


#: None, or (where inside the value, what is wrong)
Problem = tuple[str, str] | None
Checker = Callable[[Any], Problem]

U64 = (1 << 64) - 1
_INFINITE = (math.inf, -math.inf)
I63 = (1 << 63) - 1


def _bound(n: int | float) -> str:
    """A bound for people: powers of two as 2^k (and 2^k-1), others as written."""
    if isinstance(n, int) and n > 4096:
        for k in range(12, 65):
            if n == 1 << k:
                return f"2^{k}"
            if n == (1 << k) - 1:
                return f"2^{k}-1"
    return str(n)


def _show(value: Any) -> str:
    """A short picture of a bad value for a message."""
    if isinstance(value, bool) or value is None:
        return "true" if value is True else "false" if value is False else "null"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return repr(text)
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else repr(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 10**21 else f"a {len(str(abs(value)))}-digit number"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class Kind:
    """What a field's value may be. ``text`` describes it in the man pages."""

    text = "any value"

    def checker(self) -> Checker:
        return lambda value: None


@dataclass(frozen=True)
class Anything(Kind):
    text: str = "any JSON value"


@dataclass(frozen=True)
class Int(Kind):
    lo: int = 0
    hi: int = I63
    #: the word the man page uses for the value ("bytes", "address"); "" for a plain integer
    unit: str = ""

    @property
    def text(self) -> str:  # type: ignore[override]
        word = self.unit or "integer"
        if (self.lo, self.hi) == (0, I63):
            return f"{word} >= 0" if not self.unit else word
        return f"{word} {_bound(self.lo)}..{_bound(self.hi)}"

    def checker(self) -> Checker:
        lo, hi, text = self.lo, self.hi, self.text

        def check(value: Any) -> Problem:
            if value.__class__ is int and lo <= value <= hi:
                return None
            # subclasses (IntEnum) are for records being written; JSON gives exact ints
            if value.__class__ is not int and (not isinstance(value, int) or isinstance(value, bool)):
                return "", f"must be an integer ({text}), not {_show(value)}"
            if value < lo or value > hi:
                return "", f"must be {text}, not {_show(value)}"
            return None

        return check


@dataclass(frozen=True)
class Num(Kind):
    """A finite number, integer or not."""

    lo: float = -math.inf
    hi: float = math.inf
    unit: str = "number"

    @property
    def text(self) -> str:  # type: ignore[override]
        if self.lo == -math.inf and self.hi == math.inf:
            return self.unit
        if self.hi == math.inf:
            return f"{self.unit} >= {self.lo:g}"
        return f"{self.unit} {self.lo:g}..{self.hi:g}"

    def checker(self) -> Checker:
        # an integer beyond the largest float is no number a reader can compute with
        lo, hi, text = max(self.lo, -sys.float_info.max), min(self.hi, sys.float_info.max), self.text

        def check(value: Any) -> Problem:
            if value.__class__ is not float and value.__class__ is not int and (
                    not isinstance(value, (int, float)) or isinstance(value, bool)):  # numpy floats are floats
                return "", f"must be a number ({text}), not {_show(value)}"
            if not lo <= value <= hi or value in _INFINITE:  # the comparison is False for NaN too
                return "", f"must be a finite {text}, not {_show(value)}"
            return None

        return check


@dataclass(frozen=True)
class Bool(Kind):
    text: str = "true or false"

    def checker(self) -> Checker:
        def check(value: Any) -> Problem:
            return None if value is True or value is False else ("", f"must be true or false, not {_show(value)}")

        return check


@dataclass(frozen=True)
class Str(Kind):
    """A string; ``choices`` limits it to those values, ``pattern`` (a regular expression that
    must match all of it) to a form, ``max_len`` bounds it."""

    choices: tuple[str, ...] = ()
    pattern: str | None = None
    max_len: int | None = None
    #: how the man page names the form when there is a pattern
    form: str = ""

    @property
    def text(self) -> str:  # type: ignore[override]
        if self.choices:
            return "|".join(f'"{c}"' for c in self.choices)
        return self.form or "string"

    def checker(self) -> Checker:
        choices = frozenset(self.choices)
        match = re.compile(self.pattern).fullmatch if self.pattern else None
        max_len, text = self.max_len, self.text

        def check(value: Any) -> Problem:
            if value.__class__ is not str:
                return "", f"must be a string ({text}), not {_show(value)}"
            if choices and value not in choices:
                return "", f"must be {text}, not {_show(value)}"
            if max_len is not None and len(value) > max_len:
                return "", f"must be at most {max_len} characters long, not {len(value)}"
            if match is not None and match(value) is None:
                return "", f"must be {text}, not {_show(value)}"
            return None

        return check


@dataclass(frozen=True)
class Hex(Kind):
    """Bytes as an even number of hex digits (checked in C: a launch has several per record)."""

    max_bytes: int | None = None
    text: str = "hex bytes"

    def checker(self) -> Checker:
        limit = None if self.max_bytes is None else 2 * self.max_bytes

        def check(value: Any) -> Problem:
            if value.__class__ is not str:
                return "", f"must be a string of hex bytes, not {_show(value)}"
            try:  # fromhex is C speed; it skips whitespace, which the length then shows
                ok = len(bytes.fromhex(value)) * 2 == len(value)
            except ValueError:
                ok = False
            if not ok:
                return "", f"must be hex bytes (an even number of hex digits), not {_show(value)}"
            if limit is not None and len(value) > limit:
                return "", f"must be at most {limit // 2} bytes, not {len(value) // 2}"
            return None

        return check


@dataclass(frozen=True)
class List(Kind):
    item: Kind = field(default_factory=Anything)
    max_len: int = 1 << 20
    #: exact length, when the list is a fixed-size vector
    length: int | None = None

    @property
    def text(self) -> str:  # type: ignore[override]
        if self.length is not None:
            return f"[{self.length} x {self.item.text}]"
        return f"[{self.item.text}, ...]"

    def checker(self) -> Checker:
        item, max_len, length = self.item.checker(), self.max_len, self.length
        anything = isinstance(self.item, Anything)

        def check(value: Any) -> Problem:
            if value.__class__ is not list:
                return "", f"must be a list, not {_show(value)}"
            if length is not None and len(value) != length:
                return "", f"must have {length} items, not {len(value)}"
            if len(value) > max_len:
                return "", f"must have at most {max_len} items, not {len(value)}"
            if anything:
                return None
            for v in value:  # the common case, without bookkeeping
                if item(v) is not None:
                    break
            else:
                return None
            for i, v in enumerate(value):
                p = item(v)
                if p is not None:
                    return f"[{i}]{p[0]}", p[1]
            return None

        return check


@dataclass(frozen=True)
class Tuple(Kind):
    """A fixed-length list whose items have their own kinds ([param, offset, kind])."""

    items: tuple[Kind, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def text(self) -> str:  # type: ignore[override]
        return "[" + ", ".join(self.names or tuple(k.text for k in self.items)) + "]"

    def checker(self) -> Checker:
        items = [k.checker() for k in self.items]
        n = len(items)

        def check(value: Any) -> Problem:
            if value.__class__ is not list or len(value) != n:
                return "", f"must be a list of {n} ({self.text}), not {_show(value)}"
            for c, v in zip(items, value):  # the common case, without bookkeeping
                if c(v) is not None:
                    break
            else:
                return None
            for i, (c, v) in enumerate(zip(items, value)):
                p = c(v)
                if p is not None:
                    return f"[{i}]{p[0]}", p[1]
            return None

        return check


@dataclass(frozen=True)
class Map(Kind):
    """An object used as a dictionary: any string keys, values of one kind."""

    value: Kind = field(default_factory=Anything)
    max_len: int = 1 << 16

    @property
    def text(self) -> str:  # type: ignore[override]
        return f"{{name: {self.value.text}}}"

    def checker(self) -> Checker:
        value_check, max_len = self.value.checker(), self.max_len

        def check(value: Any) -> Problem:
            if value.__class__ is not dict:
                return "", f"must be an object, not {_show(value)}"
            if len(value) > max_len:
                return "", f"must have at most {max_len} keys, not {len(value)}"
            for k, v in value.items():
                p = value_check(v)
                if p is not None:
                    return f".{k}{p[0]}", p[1]
            return None

        return check


@dataclass(frozen=True)
class Either(Kind):
    """One of several kinds (tried in order; the first kind's problem is reported)."""

    kinds: tuple[Kind, ...] = ()

    @property
    def text(self) -> str:  # type: ignore[override]
        return " or ".join(k.text for k in self.kinds)

    def checker(self) -> Checker:
        checks = [k.checker() for k in self.kinds]
        text = self.text

        def check(value: Any) -> Problem:
            problems = [c(value) for c in checks]
            if any(p is None for p in problems):
                return None
            # a nested problem (inside a list that was the right kind) says more than "must be ..."
            nested = [p for p in problems if p is not None and p[0]]
            return nested[0] if nested else ("", f"must be {text}, not {_show(value)}")

        return check


@dataclass(frozen=True)
class Field:
    """One field of a record (or of an object inside one)."""

    name: str
    kind: Kind
    doc: str = ""
    required: bool = False
    #: null is allowed as well as the kind's values
    null: bool = False

    @property
    def text(self) -> str:
        return self.kind.text + (" or null" if self.null else "")


def _fields_checker(fields: Iterable[Field]) -> Callable[[dict[str, Any]], Problem]:
    """Check an object's fields. It walks the object's own keys (most records carry a few of
    the fields their type allows), so the cost follows the record, not the schema."""
    fields = list(fields)
    plan = {f.name: (f.null, f.kind.checker()) for f in fields}
    required = tuple(f.name for f in fields if f.required)

    def check(obj: dict[str, Any]) -> Problem:
        for name in required:
            if name not in obj:
                return name, "is missing"
        for name, value in obj.items():
            entry = plan.get(name)
            if entry is None or value is None and entry[0]:
                continue
            p = entry[1](value)
            if p is not None:
                return name + p[0], p[1]
        return None

    return check


@dataclass(frozen=True)
class Obj(Kind):
    """A nested object with known fields (others pass)."""

    fields: tuple[Field, ...] = ()
    text: str = "object"

    def checker(self) -> Checker:
        inner = _fields_checker(self.fields)

        def check(value: Any) -> Problem:
            if value.__class__ is not dict:
                return "", f"must be an object, not {_show(value)}"
            p = inner(value)
            return None if p is None else (f".{p[0]}", p[1])

        return check


#: A check across fields of one record: None, or (field path, problem).
CrossCheck = Callable[[dict[str, Any]], Problem]


@dataclass(frozen=True)
class RecordType:
    """One record type: its ``type`` value, what it is, its fields and cross-field checks."""

    name: str
    doc: str
    fields: tuple[Field, ...] = ()
    checks: tuple[CrossCheck, ...] = ()
    #: text for the man page after the field list
    note: str = ""

    def checker(self) -> Callable[[dict[str, Any]], str | None]:
        """A function that returns None for a good record, else "field 'x': problem"."""
        fields = _fields_checker(self.fields)
        checks = self.checks

        def check(record: dict[str, Any]) -> str | None:
            p = fields(record)
            if p is None:
                for cross in checks:
                    p = cross(record)
                    if p is not None:
                        break
                else:
                    return None
            return f"field '{p[0]}' {p[1]}" if p[1] == "is missing" else f"field '{p[0]}': {p[1]}"

        return check


class Registry:
    """Record types by name, with their compiled checkers."""

    def __init__(self, types: Iterable[RecordType]):
        self.types: dict[str, RecordType] = {}
        for t in types:
            if t.name in self.types:
                raise ValueError(f"record type {t.name!r} defined twice")
            self.types[t.name] = t
        self.checkers: dict[str, Callable[[dict[str, Any]], str | None]] = {
            name: t.checker() for name, t in self.types.items()
        }

    def __contains__(self, name: object) -> bool:
        return name in self.types

    def __getitem__(self, name: str) -> RecordType:
        return self.types[name]

    def check(self, record: dict[str, Any]) -> str | None:
        """None for a good record (or one of a type not here), else what is wrong."""
        kind = record.get("type")
        if kind.__class__ is not str or not kind:
            return f"field 'type': must be a non-empty string, not {_show(kind)}"
        checker = self.checkers.get(kind)
        return None if checker is None else checker(record)

    def merged(self, *others: Registry) -> Registry:
        return Registry([*self.types.values(), *(t for o in others for t in o.types.values())])


# -- rendering ---------------------------------------------------------------------------------


def _field_items(f: Field, prefix: str = "") -> Iterable[str]:
    """List items for a field and, flattened with dotted names, the fields of its objects."""
    yield f"- `{prefix}{f.name}`{'' if f.required else '?'} ({f.text})" + (f": {f.doc}" if f.doc else "")
    kind, sub = f.kind, "."
    if isinstance(kind, List):
        kind, sub = kind.item, "[]."
    if isinstance(kind, Obj):
        for inner in kind.fields:
            yield from _field_items(inner, f"{prefix}{f.name}{sub}")


def render(types: Iterable[RecordType], omit: Iterable[str] = ()) -> str:
    """The RECORDS text of a man page for these types, in gpuos_tools.commands.manpage's markup: a
    paragraph per type, then its fields as a list (``name?`` marks an optional field). Fields
    named in ``omit`` (ones every type shares, said once by the caller) are left out."""
    blocks = []
    skip = set(omit)
    for t in types:
        blocks.append(f"`{t.name}`: {t.doc}")
        items = [item for f in t.fields if f.name not in skip for item in _field_items(f)]
        if items:
            blocks.append("\n".join(items))
        if t.note:
            blocks.append(t.note)
    return "\n\n".join(blocks)
