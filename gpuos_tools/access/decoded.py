"""What an argument decoder says about one launch (gpuos_tools/access/extents.py): per pointer
word, the bytes read and the bytes written, relative to the pointer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Bytes ``[lo, hi)`` relative to a pointer; ``hi`` None: up to the end of its allocation (the
#: decoder knows the direction but not how far).
Span = tuple[int, int | None]
#: The direction of a pointer that a decoder knows nothing more of: read and write to the end.
REST: Span = (0, None)


@dataclass(slots=True)
class Decoded:
    """The accesses of one launch as its argument structures say."""

    via: str  #: the decoder (for ``how``: ``dptr:VIA``)
    #: (param, byte offset of the pointer word) -> (read span or None, written span or None)
    spans: dict[tuple[int, int], tuple[Span | None, Span | None]] = field(default_factory=dict)
    #: param -> [start, end) ranges of its bytes whose layout the decoder read: a word found
    #: there that is not in ``spans`` is not a pointer (uninitialised padding, a size, a stride)
    regions: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    #: (param, offset of the pointer word, bytes): the launch writes zeros to exactly the bytes
    #: from that pointer (a fill of the value zero), and nothing else
    zeroes: tuple[int, int, int] | None = None
    #: (param, offset) -> row bytes: a pointer whose rows are chosen by values in device memory,
    #: into a tensor its kernel's only caller creates zeroed just before the launch. Its spans
    #: run to the end of the allocation, unless the operation just before the launch, on its
    #: stream, zeroed whole rows from this pointer (``zeroes``): then they stop there
    #: (gpuos_tools/access/predict.py)
    fresh: dict[tuple[int, int], int] = field(default_factory=dict)

    def known(self, param: int, start: int, end: int) -> None:
        """Bytes [start, end) of ``param`` are laid out as the decoder read them."""
        self.regions.setdefault(param, []).append((start, end))

    def laid_out(self, param: int, offset: int) -> bool:
        """Whether the word at ``offset`` of ``param`` lies in a range the decoder read."""
        return any(s <= offset < e for s, e in self.regions.get(param, ()))

    def read(self, param: int, offset: int, size: int | None, start: int = 0) -> None:
        """``size`` bytes read from ``start`` bytes past the pointer (None: to its allocation's end)."""
        self._add(param, offset, size, 0, start)

    def write(self, param: int, offset: int, size: int | None, start: int = 0) -> None:
        self._add(param, offset, size, 1, start)

    def _add(self, param: int, offset: int, size: int | None, which: int, start: int = 0) -> None:
        key = (param, offset)
        spans = list(self.spans.get(key, (None, None)))
        new: Span | None = (start, None) if size is None else (start, start + size) if size > 0 else None
        old = spans[which]
        if new is not None:
            if old is None:
                spans[which] = new
            else:  # the same pointer twice (an in-place operand): the union
                hi = None if old[1] is None or new[1] is None else max(old[1], new[1])
                spans[which] = (min(old[0], new[0]), hi)
        self.spans[key] = (spans[0], spans[1])


#: A decoder of one kernel's launches: (each parameter's bytes, the launch record) -> Decoded,
#: or None when the bytes do not check out (the launch falls back to range).
Plan = Callable[[list[bytes], dict[str, Any]], "Decoded | None"]
#: Chooses a plan for a kernel from its demangled name and parameter sizes, or None.
Planner = Callable[[str, tuple[int, ...]], "Plan | None"]
