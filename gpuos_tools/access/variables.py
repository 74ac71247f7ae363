"""Module variables (``__device__`` globals) the program located by name, and what it wrote into
them from the host: a kernel reads its own module's variables, so a pointer stored there is an
access of the kernel's that no argument shows.

cuFFT does this: after loading a JIT-compiled module it asks the driver where the module's
variable ``lut_sp`` lies (cuModuleGetGlobal) and copies the address of a twiddle table into it;
the module's kernel then reads the table through the variable. The trace's ``symbol`` records say
where each located variable lies and which module (or library) holds it, and which function
handles came from which module; its small host-to-device copies say what was written.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Variable:
    name: str
    parent: int  #: the module or library handle
    addr: int
    size: int | None  #: None: the program did not ask for it
    api: str  #: the call that located it (cuModuleGetGlobal_v2 or cuLibraryGetGlobal)
    #: known contents, (offset, bytes) by offset, never overlapping: what the host wrote
    pieces: list[tuple[int, bytes]] = field(default_factory=list)

    def extent(self, addr: int, n: int) -> int | None:
        """Bytes of [addr, addr + n) that fall in this variable from ``addr`` on, or None when
        ``addr`` is not in it (a variable of unknown size holds only writes that start at it)."""
        if self.size is None:
            return n if addr == self.addr else None
        if self.addr <= addr < self.addr + self.size:
            return min(n, self.addr + self.size - addr)
        return None

    def write(self, off: int, n: int, data: bytes | None) -> None:
        end = off + n
        self.pieces = [p for p in self.pieces if p[0] + len(p[1]) <= off or p[0] >= end]
        if data:
            insort(self.pieces, (off, bytes(data[:n])))

    def words(self) -> Iterator[int]:
        """The non-zero 8-byte-aligned words of the known contents."""
        for off, data in self.pieces:
            first = -(self.addr + off) % 8
            for k in range(first, len(data) - 7, 8):
                w = int.from_bytes(data[k : k + 8], "little")
                if w:
                    yield w


class ModuleVariables:
    """Feed ``symbol`` records and the writes into device memory; ask what a function's module
    variables hold."""

    def __init__(self) -> None:
        self._by_addr: dict[int, Variable] = {}
        self._starts: list[int] = []
        self._by_parent: dict[int, list[Variable]] = {}
        self._parent_of: dict[int, int] = {}  #: function handle -> module or library

    def __bool__(self) -> bool:
        return bool(self._by_addr)

    def symbol(self, rec: dict[str, Any]) -> None:
        parent = rec.get("parent") or 0
        if rec.get("of") == "function":
            if rec.get("func"):
                self._parent_of[rec["func"]] = parent
            return
        addr = rec.get("addr") or 0
        if not addr:
            return
        old = self._by_addr.pop(addr, None)
        if old is not None:  # a module unloaded and another loaded where it was
            self._starts.remove(addr)
            siblings = self._by_parent.get(old.parent, [])
            if old in siblings:
                siblings.remove(old)
        var = Variable(rec.get("name", ""), parent, addr, rec.get("bytes"), rec.get("api", ""))
        if old is not None and old.parent == parent and old.name == var.name:
            var.pieces = old.pieces  # the same variable located again
        self._by_addr[addr] = var
        insort(self._starts, addr)
        self._by_parent.setdefault(parent, []).append(var)

    def find(self, addr: int) -> Variable | None:
        i = bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        var = self._by_addr[self._starts[i]]
        return var if var.extent(addr, 1) is not None else None

    def write(self, addr: int, n: int, data: bytes | None) -> bool:
        """Bytes [addr, addr + n) were written, with ``data`` when known; whether they landed
        in a located variable."""
        var = self.find(addr)
        if var is None:
            return False
        take = var.extent(addr, n) or 0
        var.write(addr - var.addr, take, data[:take] if data else None)
        return True

    def of_function(self, func: int | None) -> list[Variable]:
        """The located variables of the module (or library) ``func`` came from."""
        if func is None:
            return []
        parent = self._parent_of.get(func)
        return self._by_parent.get(parent, []) if parent is not None else []
