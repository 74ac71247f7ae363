"""Residency planning: which chunks to load and which to evict before each step.

A planner walks the known sequence of steps in order, under the byte budget, and decides per
step: the chunks to copy in, the chunks to make resident with nothing to copy (memory never
written), the chunks to evict (each written back or dropped) and the chunks that did not fit.
It decides what moves; when the copies run is the time model's business. Steps can be
appended as they become known (a chunk with no known next use then counts as never used
again), but a step once appended cannot be taken back, so `gpu-prefetch-sched run`, whose
future is a learned period that any launch may contradict, decides with its own per-record
policy (see ONLINE EXECUTION). The policies differ only in the victim:

- `belady`: the resident chunk whose next use is furthest in the future (never used again
  first). Next uses come from an index built once over the sequence (per chunk, its step
  positions and a cursor) and victims from a max-heap keyed by next use with lazy deletion, so
  a step costs O(w log n) for a working set of w chunks. With equal chunk sizes this is
  Belady's MIN, which loads the fewest chunks of any policy; with unequal sizes it is the
  usual heuristic.
- `lru`: the resident chunk used least recently (no knowledge of the future). Both prefetch
  along the predicted sequence as `--lookahead` allows; `--lookahead 0` makes them reactive.
- `demand`: CUDA managed memory, fault-driven, without the predictions (see TIME MODEL).

Rules shared by `belady` and `lru`:

- Chunks of the step's own working set are never victims while it is planned.
- A chunk is populated once written; making one resident that is not (fresh memory, or memory
  only ever read) copies nothing. A chunk is dirty when written since it was last copied in;
  only dirty chunks are written back when evicted, clean ones are dropped.
- A freed allocation's chunks leave residency at no cost and lose their contents.
- A working set larger than the budget cannot be resident at once: everything else is
  evicted, what fits is placed, and the rest is charged as demand paging (`over_budget`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from gpuos_tools.sched.workload import Step

NEVER = 1 << 62  #: next use of a chunk that is not used again


class Decision:
    """What has to change before step ``step`` runs, in the order it was decided.

    A plain class rather than a dataclass: one is made per step, and eight ``default_factory``
    calls cost more than the literals.
    """

    __slots__ = ("evicts", "first", "freed", "loads", "overflow", "overflow_in", "overflow_out", "step", "writeback")

    def __init__(self, step: int) -> None:
        self.step = step
        self.loads: list[int] = []  #: chunks copied host -> device
        self.first: list[int] = []  #: chunks made resident, nothing to copy
        self.evicts: list[int] = []  #: chunks removed to make room
        self.writeback: list[bool] = []  #: per evict: copied device -> host first
        self.overflow: list[int] = []  #: working-set chunks that did not fit
        self.overflow_in: list[bool] = []  #: per overflow chunk: it held data before
        self.overflow_out: list[bool] = []  #: per overflow chunk: it holds data after
        self.freed: list[int] = []  #: resident chunks released by a free

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__ if name != "step")
        return f"Decision(step={self.step}, {fields})"


class Planner:
    """Shared bookkeeping; subclasses choose victims (`_touch`, `_insert`, `_after`, `_victim`,
    `_remove`, `_extended`).

    Offline (the simulator)::

        planner = BeladyPlanner(chunks.sizes, budget, steps)
        for d in planner.decisions():   # one Decision per step, in order
            ...

    Online, the engine appends the steps it predicts as it predicts them and plans each step
    before it is issued; everything planned so far is reflected in ``resident``, ``dirty`` and
    ``used``::

        planner = BeladyPlanner(sizes, budget, predicted_so_far)
        planner.extend(newly_predicted)       # sizes must already cover new chunk ids
        d = planner.plan(planner.position)    # evict d.evicts (write back where d.writeback),
                                              # then copy in d.loads, map d.first
    """

    name = "base"

    def __init__(self, sizes: Sequence[int], budget: int, steps: Sequence[Step]) -> None:
        self.sizes = sizes  #: bytes per chunk id; may grow between calls (see `extend`)
        self.budget = budget
        self.steps: list[Step] = list(steps)
        n = len(sizes)
        self.resident = bytearray(n)
        self.dirty = bytearray(n)
        self.populated = bytearray(n)
        self._pin = [-1] * n
        self.used = 0
        self.peak = 0
        self.position = 0  #: the next step to plan

    def decisions(self) -> Iterator[Decision]:
        """Plan every known step not planned yet, in order."""
        while self.position < len(self.steps):
            yield self.plan(self.position)

    def extend(self, steps: Iterable[Step]) -> None:
        """Append steps to the known future, as an online engine learns them (predictions of
        launches not issued yet). Chunk ids in them may be new: ``sizes`` must already cover
        them. Planning decides with the future known at the time: a chunk with no known next
        use counts as never used again."""
        start = len(self.steps)
        self.steps.extend(steps)
        grow = len(self.sizes) - len(self.resident)
        if grow > 0:
            self.resident.extend(bytes(grow))
            self.dirty.extend(bytes(grow))
            self.populated.extend(bytes(grow))
            self._pin.extend([-1] * grow)
        self._extended(start, grow)

    def _extended(self, start: int, grow: int) -> None:
        """Steps from ``start`` on were appended; ``grow`` new chunk ids exist."""

    def plan(self, i: int) -> Decision:
        """Decide step ``i`` (steps must be planned in order, each once)."""
        if i != self.position:
            raise ValueError(f"planned step {i}, expected {self.position}")
        self.position += 1
        st = self.steps[i]
        sizes = self.sizes
        resident = self.resident
        d = Decision(i)
        for c in st.frees:
            if resident[c]:
                resident[c] = 0
                self.used -= sizes[c]
                self._remove(c)
                d.freed.append(c)
            self.dirty[c] = 0
            self.populated[c] = 0
        ws = st.ws
        pin = self._pin
        missing: list[int] = []
        need = 0
        for c in ws:
            pin[c] = i
            if not resident[c]:
                missing.append(c)
                need += sizes[c]
        self._touch(ws, i)
        if missing:
            budget = self.budget
            if self.used + need > budget:
                dirty = self.dirty
                while self.used + need > budget:
                    v = self._victim(i)
                    if v is None:
                        break
                    resident[v] = 0
                    self.used -= sizes[v]
                    d.evicts.append(v)
                    d.writeback.append(bool(dirty[v]))
                    dirty[v] = 0
            populated = self.populated
            for c in missing:
                if self.used + sizes[c] <= budget:
                    resident[c] = 1
                    self.used += sizes[c]
                    self._insert(c, i)
                    (d.loads if populated[c] else d.first).append(c)
                else:
                    d.overflow.append(c)
                    d.overflow_in.append(bool(populated[c]))
            self.peak = max(self.peak, self.used)
        if st.writes:
            dirty = self.dirty
            populated = self.populated
            for c in st.writes:
                populated[c] = 1
                if resident[c]:
                    dirty[c] = 1
        if d.overflow:
            populated = self.populated
            d.overflow_out = [bool(populated[c]) for c in d.overflow]
        self._after(ws, i)
        return d

    # -- policy hooks ----------------------------------------------------------------------

    def _touch(self, ws: tuple[int, ...], i: int) -> None:
        """The chunks of ``ws`` are used by step ``i`` (resident or not)."""

    def _insert(self, c: int, i: int) -> None:
        """Chunk ``c`` became resident for step ``i``."""

    def _after(self, ws: tuple[int, ...], i: int) -> None:
        """Step ``i`` is planned and its writes applied."""

    def _victim(self, i: int) -> int | None:
        """A resident chunk not pinned by step ``i``, to evict; None if there is none."""
        raise NotImplementedError

    def _remove(self, c: int) -> None:
        """Chunk ``c`` left residency other than as a victim (its allocation was freed)."""


class BeladyPlanner(Planner):
    """Evict the resident chunk used furthest in the future."""

    name = "belady"

    def __init__(self, sizes: Sequence[int], budget: int, steps: Sequence[Step]) -> None:
        super().__init__(sizes, budget, steps)
        uses: list[list[int]] = [[] for _ in range(len(sizes))]
        for i, st in enumerate(steps):
            for c in st.ws:
                uses[c].append(i)
        for u in uses:
            u.append(NEVER)
        self._uses = uses
        self._cursor = [0] * len(sizes)
        self._next = [NEVER] * len(sizes)
        self._heap: list[tuple[int, int, int]] = []

    def _extended(self, start: int, grow: int) -> None:
        uses = self._uses
        if grow > 0:
            uses.extend([NEVER] for _ in range(grow))
            self._cursor.extend([0] * grow)
            self._next.extend([NEVER] * grow)
        touched: set[int] = set()
        for i in range(start, len(self.steps)):
            for c in self.steps[i].ws:
                u = uses[c]
                u[-1] = i  # the NEVER sentinel becomes this use, and goes after it
                u.append(NEVER)
                touched.add(c)
        nxt = self._next
        cursor = self._cursor
        resident = self.resident
        dirty = self.dirty
        for c in touched:
            if nxt[c] == NEVER and cursor[c] > 0:  # had no known next use: now it has one
                nxt[c] = uses[c][cursor[c]]
                if resident[c]:
                    heapq.heappush(self._heap, (-nxt[c], dirty[c], c))

    def next_use(self, c: int) -> int:
        """The next step (after the last one planned) that uses chunk ``c``, or NEVER."""
        return self._next[c]

    def _touch(self, ws: tuple[int, ...], i: int) -> None:
        uses = self._uses
        cursor = self._cursor
        nxt = self._next
        for c in ws:
            k = cursor[c] + 1
            cursor[c] = k
            nxt[c] = uses[c][k]

    def _after(self, ws: tuple[int, ...], i: int) -> None:
        # Pushed once the step's writes are known, so that among chunks used equally far ahead
        # (above all those never used again) a clean one, which costs no write-back, goes first.
        nxt = self._next
        resident = self.resident
        dirty = self.dirty
        heap = self._heap
        push = heapq.heappush
        for c in ws:
            if resident[c]:
                push(heap, (-nxt[c], dirty[c], c))

    def _victim(self, i: int) -> int | None:
        heap = self._heap
        nxt = self._next
        resident = self.resident
        dirty = self.dirty
        pin = self._pin
        held: list[tuple[int, int, int]] = []
        found = None
        while heap:
            entry = heapq.heappop(heap)
            key, dirt, c = entry
            if not resident[c] or nxt[c] != -key or dirty[c] != dirt:
                continue  # stale: evicted, freed, or used again since
            if pin[c] == i:
                held.append(entry)
                continue
            found = c
            break
        for entry in held:
            heapq.heappush(heap, entry)
        if len(heap) > 4 * len(nxt) + 64:
            self._compact()
        return found

    def _compact(self) -> None:
        """Drop stale heap entries (they pile up as chunks are used again)."""
        nxt = self._next
        resident = self.resident
        dirty = self.dirty
        self._heap = [(-nxt[c], dirty[c], c) for c in range(len(nxt)) if resident[c]]
        heapq.heapify(self._heap)


class LRUPlanner(Planner):
    """Evict the resident chunk used least recently."""

    name = "lru"

    def __init__(self, sizes: Sequence[int], budget: int, steps: Sequence[Step]) -> None:
        super().__init__(sizes, budget, steps)
        self._order: OrderedDict[int, None] = OrderedDict()

    def _touch(self, ws: tuple[int, ...], i: int) -> None:
        order = self._order
        resident = self.resident
        for c in ws:
            if resident[c]:
                order.move_to_end(c)

    def _insert(self, c: int, i: int) -> None:
        self._order[c] = None

    def _victim(self, i: int) -> int | None:
        order = self._order
        pin = self._pin
        for c in order:
            if pin[c] == i:
                return None  # chunks are in recency order: the rest are this step's too
            del order[c]
            return c
        return None

    def _remove(self, c: int) -> None:
        self._order.pop(c, None)


PLANNERS: dict[str, type[Planner]] = {"belady": BeladyPlanner, "lru": LRUPlanner}
