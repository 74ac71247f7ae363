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

A record type's checker is compiled: each kind also writes the Python statements that accept its
good values (``emit``), and a record type's are joined into one function, with no call per field.
Whatever it does not accept goes to the kinds' checkers, which find and say what is wrong (or
accept a value of a rarer form, such as an IntEnum being written). The compiled statements only
ever accept what the checkers accept.
"""

from __future__ import annotations

import binascii
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol


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


class _Source:
    """The source of one compiled checker: lines of Python, and the constants they name.

    Statements that ``emit`` writes end in ``self.fail`` for a value they do not accept: by
    default the function then hands its whole argument to the kinds' checkers.
    """

    def __init__(self, fail: str = "return _explain(_top)") -> None:
        self.fail = fail
        self.lines: list[str] = []
        self.names: dict[str, Any] = {"_M": _MISSING}
        self._count = 0

    def var(self) -> str:
        self._count += 1
        return f"v{self._count}"

    def const(self, value: Any) -> str:
        name = f"_c{len(self.names)}"
        self.names[name] = value
        return name

    def line(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def block(self, depth: int, head: str, body: Callable[[int], None]) -> None:
        """``head:`` and what ``body(depth + 1)`` writes under it; nothing when it writes nothing."""
        start = len(self.lines)
        self.line(depth, head + ":")
        body(depth + 1)
        if len(self.lines) == start + 1:
            del self.lines[start:]

    def emit(self, kind: Kind, var: str, depth: int) -> None:
        """Statements that accept the values of ``var`` that ``kind`` accepts. A kind whose
        ``checker`` a subclass replaced without replacing ``emit`` is called as a function."""
        cls = type(kind)
        own = next(c for c in cls.__mro__ if "emit" in c.__dict__)
        if issubclass(own, next(c for c in cls.__mro__ if "checker" in c.__dict__)):
            kind.emit(self, var, depth)
        else:
            Kind.emit(kind, self, var, depth)

    def longer(self, var: str, most: int) -> str:
        """The test that ``var`` (a str, list or dict) is longer than ``most``; skipped when the
        function's ``_short`` says the value came from a line shorter than SHORT_LINE, if that
        already bounds it."""
        return f"len({var}) > {most}" if most < SHORT_LINE else f"not _short and len({var}) > {most}"

    def function(self, name: str, good: str = "None", **names: Any) -> Callable[..., Any]:
        """The compiled function ``check(_top, _short=False)``: ``good`` for a value the statements
        accept, else what ``fail`` says; ``names`` are more constants they use."""
        source = "\n".join(["def check(_top, _short=False):", *self.lines, f"    return {good}", ""])
        namespace = {**self.names, **names}
        exec(compile(source, f"<checker of {name}>", "exec"), namespace)  # noqa: S102 (source from schemas)
        check = namespace["check"]
        check.source = source
        return check  # type: ignore[no-any-return]


#: what ``get`` gives for a field the object does not have (None is JSON null)
_MISSING: Any = object()

#: A value decoded from a JSON line shorter than this many characters is shorter too (a string's
#: every character, a list's every item, an object's every key takes at least one): a compiled
#: checker told so skips the length bounds at or above it.
SHORT_LINE = 1 << 15


class Kind:
    """What a field's value may be. ``text`` describes it in the man pages."""

    text = "any value"

    def checker(self) -> Checker:
        return lambda value: None

    def emit(self, src: _Source, var: str, depth: int) -> None:
        """Write the statements that accept ``var``'s good values (see _Source); by default, a
        call of ``checker``."""
        if type(self).checker is not Kind.checker:
            src.line(depth, f"if {src.const(self.checker())}({var}) is not None: {src.fail}")


@dataclass(frozen=True)
class Anything(Kind):
    text: str = "any JSON value"

    def emit(self, src: _Source, var: str, depth: int) -> None:
        pass


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        if self.lo == 0 and self.hi >= 0 and self.hi & (self.hi + 1) == 0:  # 0..2^k-1: one shift tests both ends
            bounds = f"{var} >> {self.hi.bit_length()}"
        else:
            bounds = f"{var} < {self.lo} or {var} > {self.hi}"
        src.line(depth, f"if {var}.__class__ is not int or {bounds}: {src.fail}")


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        # finite bounds: an infinity, NaN and an integer past the largest float all fail them
        lo = src.const(max(self.lo, -sys.float_info.max))
        hi = src.const(min(self.hi, sys.float_info.max))
        src.line(depth, f"if {var}.__class__ is not float and {var}.__class__ is not int "
                        f"or not {lo} <= {var} <= {hi}: {src.fail}")


@dataclass(frozen=True)
class Bool(Kind):
    text: str = "true or false"

    def checker(self) -> Checker:
        def check(value: Any) -> Problem:
            return None if value is True or value is False else ("", f"must be true or false, not {_show(value)}")

        return check

    def emit(self, src: _Source, var: str, depth: int) -> None:
        src.line(depth, f"if {var} is not True and {var} is not False: {src.fail}")


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        bad = [f"{var}.__class__ is not str"]
        if self.choices:
            bad.append(f"{var} not in {src.const(frozenset(self.choices))}")
        if self.max_len is not None:
            bad.append(src.longer(var, self.max_len))
        if self.pattern:
            # the strings that matched are remembered: a trace names one module hash many times
            seen = _MATCHED.setdefault(self.pattern, set())
            bad.append(f"{var} not in {src.const(seen)} and {src.const(_matcher(self.pattern, seen))}({var})")
        src.line(depth, f"if {' or '.join(bad)}: {src.fail}")


#: per pattern, strings known to match it all (at most _MATCHED_MAX, none longer than 256)
_MATCHED: dict[str, set[str]] = {}
_MATCHED_MAX = 4096


def _matcher(pattern: str, seen: set[str]) -> Callable[[str], bool]:
    """True for a string that ``pattern`` does not match all of; one that it does is added to ``seen``."""
    match = re.compile(pattern).fullmatch

    def unmatched(value: str) -> bool:
        if match(value) is None:
            return True
        if len(seen) < _MATCHED_MAX and len(value) <= 256:
            seen.add(value)
        return False

    return unmatched


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        limit = "" if self.max_bytes is None else f" or {src.longer(var, 2 * self.max_bytes)}"
        src.line(depth, f"if {var}.__class__ is not str{limit}: {src.fail}")
        src.line(depth, "try:")  # unhexlify takes only an even number of hex digits (no spaces)
        src.line(depth + 1, f"{src.const(binascii.unhexlify)}({var})")
        src.line(depth, "except ValueError:")
        src.line(depth + 1, src.fail)


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        bad = [f"{var}.__class__ is not list"]
        if self.length is None or self.length > self.max_len:
            bad.append(src.longer(var, self.max_len))
        if self.length is not None:
            bad.append(f"len({var}) != {self.length}")
        src.line(depth, f"if {' or '.join(bad)}: {src.fail}")
        if self.length is not None and self.length <= 4:  # a vector: its items one by one
            _emit_items(src, [self.item] * self.length, var, depth)
            return
        item = src.var()
        src.block(depth, f"for {item} in {var}", lambda d: src.emit(self.item, item, d))


def _emit_items(src: _Source, kinds: list[Kind], var: str, depth: int) -> None:
    """Statements for the items of ``var``, a list known to have one per kind."""
    if kinds:
        names = [src.var() for _ in kinds]
        src.line(depth, f"{', '.join(names)}, = {var}")
        for kind, name in zip(kinds, names):
            src.emit(kind, name, depth)


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        src.line(depth, f"if {var}.__class__ is not list or len({var}) != {len(self.items)}: {src.fail}")
        _emit_items(src, list(self.items), var, depth)


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        src.line(depth, f"if {var}.__class__ is not dict or {src.longer(var, self.max_len)}: {src.fail}")
        item = src.var()
        src.block(depth, f"for {item} in {var}.values()", lambda d: src.emit(self.value, item, d))


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


def _emit_fields(src: _Source, fields: Iterable[Field], obj: str, depth: int) -> None:
    """Statements that accept an object (``obj``, known to be a dict) whose fields are good. They
    look up each field the type lists, as records carry most of their type's fields."""
    get = src.var()
    src.line(depth, f"{get} = {obj}.get")
    for f in fields:
        value = src.var()
        start = len(src.lines)
        src.line(depth, f"{value} = {get}({f.name!r}, _M)")
        if f.required:
            src.line(depth, f"if {value} is _M: {src.fail}")
            if f.null:
                src.block(depth, f"if {value} is not None", lambda d: src.emit(f.kind, value, d))
            else:
                src.emit(f.kind, value, depth)
            continue
        present = f"{value} is not _M" + (f" and {value} is not None" if f.null else "")
        src.block(depth, f"if {present}", lambda d: src.emit(f.kind, value, d))
        if len(src.lines) == start + 1:  # a field of any value: not even looked up
            del src.lines[start:]


def _field_function(f: Field) -> Callable[[Any], bool] | None:
    """True for a value of ``f`` that its statements do not accept; None for a field of any value."""
    src = _Source("return True")
    if f.null:
        src.line(1, "if _top is None: return False")
    start = len(src.lines)
    src.emit(f.kind, "_top", 1)
    return None if len(src.lines) == start else src.function(f.name, "False")


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

    def emit(self, src: _Source, var: str, depth: int) -> None:
        src.line(depth, f"if {var}.__class__ is not dict: {src.fail}")
        if not 1 < len(self.fields) <= 8:
            _emit_fields(src, self.fields, var, depth)
            return
        # An object with as many keys as its kind has fields most likely has those fields (a
        # launch's parameters all do): they are taken without a lookup each; any other key
        # sends the object to the checkers.
        values = [src.var() for _ in self.fields]
        src.line(depth, f"if len({var}) == {len(self.fields)}:")
        src.line(depth + 1, "try:")
        for f, value in zip(self.fields, values):
            src.line(depth + 2, f"{value} = {var}[{f.name!r}]")
        src.line(depth + 1, "except KeyError:")
        src.line(depth + 2, src.fail)
        for f, value in zip(self.fields, values):
            if f.null:
                src.block(depth + 1, f"if {value} is not None", lambda d: src.emit(f.kind, value, d))
            else:
                src.emit(f.kind, value, depth + 1)
        src.line(depth, "else:")
        _emit_fields(src, self.fields, var, depth + 1)


#: A check across fields of one record: None, or (field path, problem).
CrossCheck = Callable[[dict[str, Any]], Problem]


class RecordChecker(Protocol):
    """None for a good record, else what is wrong; ``short``: it was read from a line shorter
    than SHORT_LINE characters."""

    def __call__(self, record: dict[str, Any], short: bool = False, /) -> str | None: ...


def when_present(*names: str) -> Callable[[CrossCheck], CrossCheck]:
    """Mark a cross-field check as one that only applies to a record with at least one of these
    fields: a record without them all skips it."""

    def mark(check: CrossCheck) -> CrossCheck:
        check.when_present = names  # type: ignore[attr-defined]
        return check

    return mark


def _applies(cross: CrossCheck, fields: Iterable[Field]) -> tuple[str, ...]:
    """The fields one of which a record must have for ``cross`` to apply; () when it always does."""
    names: tuple[str, ...] = getattr(cross, "when_present", ())
    required = {f.name for f in fields if f.required}
    return () if any(n in required for n in names) else names


@dataclass(frozen=True)
class RecordType:
    """One record type: its ``type`` value, what it is, its fields and cross-field checks."""

    name: str
    doc: str
    fields: tuple[Field, ...] = ()
    checks: tuple[CrossCheck, ...] = ()
    #: text for the man page after the field list
    note: str = ""

    def checker(self) -> RecordChecker:
        """A function that returns None for a good record, else "field 'x': problem": the
        fields' statements compiled into one function, then the cross-field checks. Its second
        argument says the record was read from a line shorter than SHORT_LINE."""
        src = _Source()
        n = len(self.fields)
        if n >= 6:
            # A record with few of its type's fields walks its own keys instead, each a call.
            plan = {f.name: check for f in self.fields if (check := _field_function(f)) is not None}
            src.line(1, f"if len(_top) * 3 < {n}:")
            for f in self.fields:
                if f.required:
                    src.line(2, f"if {f.name!r} not in _top: {src.fail}")
            name, value, check = src.var(), src.var(), src.var()
            src.line(2, f"for {name}, {value} in _top.items():")
            src.line(3, f"{check} = {src.const(plan)}.get({name})")
            src.line(3, f"if {check} is not None and {check}({value}, _short): {src.fail}")
            src.line(1, "else:")
            _emit_fields(src, self.fields, "_top", 2)
        else:
            _emit_fields(src, self.fields, "_top", 1)
        for cross in self.checks:
            gate = " or ".join(f"{n!r} in _top" for n in _applies(cross, self.fields))
            call = f"{src.const(cross)}(_top) is not None"
            src.line(1, f"if ({gate}) and {call}: {src.fail}" if gate else f"if {call}: {src.fail}")
        return src.function(self.name, _explain=self.explainer())

    def explainer(self) -> Callable[[dict[str, Any]], str | None]:
        """What ``checker`` gives, found field by field with the kinds' checkers: slower, and
        what says where a record is wrong."""
        fields = _fields_checker(self.fields)
        checks = [(cross, _applies(cross, self.fields)) for cross in self.checks]

        def check(record: dict[str, Any]) -> str | None:
            p = fields(record)
            if p is None:
                for cross, names in checks:
                    if names and not any(n in record for n in names):
                        continue
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
        self.checkers: dict[str, RecordChecker] = {
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
