"""What the residency engine keeps for a record that is not simply resident: its state and an
``Entry`` (docs/residency-engine.md, "States")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RESIDENT, LOADING, RELEASED, EVICTING = "resident", "loading", "released", "evicting"

Pieces = list[tuple[int, int]]  #: (host address, bytes), contiguous over a record, in order


@dataclass
class Entry:
    """A record that is not simply resident."""

    base: int
    size: int
    state: str
    pieces: Pieces  #: where its host copy is
    event: Any = None  #: loading: after the load; evicting: after the save
    ordered: set = field(default_factory=set)  #: streams already waiting on ``event`` (loading)
    cancelled: bool = False  #: evicting: an operation touched it, it stays
    on_demand: bool = False
    own_copy: bool = False  #: ``pieces`` are the engine's own pinned copy (kept after the load)
    mapped: bool = False  #: a lazy rollback's: mapped all along, only the load is missing
    #: evicted while every torch block of it was freed: nothing saved, and its load maps memory
    #: without copying anything back (docs/residency-engine.md, "Dead records")
    dead: bool = False
    #: evicting with a digest check while clean: the kernels that may have written it (a mismatch)
    suspects: tuple[list[str], str, bool] | None = None
