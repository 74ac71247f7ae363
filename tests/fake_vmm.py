"""A fake GPU for the validator process's unit tests: a VMM address space in host memory.

It implements gpuos_tools.agent.replay's Device: reservations (``taken`` addresses, addresses
the validator's FakeSpace holds, and with ``hints=False`` every address, come back elsewhere, as a
driver does with a hint it cannot honour), mappings, read-only protection (refused
when ``read_only=False``, as a driver without it would), copies, and "kernels": Python functions
of (device, parameter byte strings) that load and store through the mappings, so that an access
outside them faults like an illegal address. Every call is counted so tests see leaks."""

from __future__ import annotations

import struct

import numpy as np

from gpuos_tools.agent.cuda_device import TIMED_OUT


#: where reservations without a hint start: away from the tests' program addresses
ANYWHERE = 0x7E0000000000


class Fault(Exception):
    pass


class Spins(Exception):
    """A kernel that would never end (it waits for a value it will not see)."""


class FakeSpace:
    """The validator's placeholders over the program's windows (vaspace.AddressClaims): what it
    holds, as [start, end) ranges; ``others`` are addresses something else of the process holds."""

    def __init__(self, others: tuple[tuple[int, int], ...] = ()):
        self.held: list[tuple[int, int]] = []
        self.others = list(others)
        self.released: list[tuple[int, int]] = []

    def claim(self, windows):
        from gpuos_tools.agent.vaspace import free_gaps, merge

        busy = [_Range(s, e) for s, e in self.others]
        for addr, size in windows:
            self.held = merge(self.held + free_gaps(addr, addr + size, busy))
        return []

    def release(self, addr, size):
        self.released.append((addr, addr + size))
        keep = []
        for s, e in self.held:
            keep += [(s, min(e, addr))] if s < addr else []
            keep += [(max(s, addr + size), e)] if e > addr + size else []
        self.held = [(s, e) for s, e in keep if s < e]

    def holds(self, addr, size) -> bool:
        return any(s < addr + size and addr < e for s, e in self.held + self.others)

    def holder(self, addr, size):
        return f"the validator holds {addr:#x}"

    def by_driver(self, addr, size) -> bool:
        return not self.holds(addr, size)


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class FakeDevice:
    def __init__(self, kernels: dict, granularity: int = 4096, taken: tuple[int, ...] = (),
                 read_only: bool = True, space: FakeSpace | None = None, hints: bool = True):
        self.kernels = kernels
        self.granularity = granularity
        self.taken = set(taken)
        self.space = space  # a reservation over anything the space holds lands elsewhere, as under UVA
        self.read_only = read_only
        self.hints = hints  # False: the program's addresses lie outside this driver's own areas
        self.reserved: dict[int, int] = {}
        self.anywhere = ANYWHERE  # where the next reservation without a hint goes
        self.maps: dict[int, np.ndarray] = {}  # start -> bytes
        self.ro: set[int] = set()
        self.launches = 0
        self.loaded: list[bytes] = []  # modules loaded now
        self.state = 0  # a counter kernels may use to be nondeterministic
        self.variables: dict[str, bytes] = {}  # the loaded module's variables, as set
        self.timeouts: list[float | None] = []  # each launch's timeout

    # -- Device
    def reserve(self, addr: int, size: int) -> int:
        if addr == 0:  # no hint: anywhere free, as the driver picks
            got = self.anywhere
            self.anywhere += -(-size // self.granularity) * self.granularity
            self.reserved[got] = size
            return got
        refused = not self.hints or addr in self.taken or (self.space is not None and self.space.holds(addr, size))
        refused = refused or any(s < addr + size and addr < s + n for s, n in self.reserved.items())
        got = addr if not refused else addr + (1 << 40)
        self.reserved[got] = size
        return got

    def free_address(self, addr: int, size: int) -> None:
        assert self.reserved.pop(addr) == size

    def map(self, addr: int, size: int) -> None:
        assert any(s <= addr and addr + size <= s + n for s, n in self.reserved.items()), "map outside a reservation"
        assert all(a + len(b) <= addr or addr + size <= a for a, b in self.maps.items()), "mapped twice"
        self.maps[addr] = np.zeros(size, np.uint8)

    def unmap(self, addr: int, size: int) -> None:
        assert len(self.maps.pop(addr)) == size
        self.ro.discard(addr)

    def protect(self, addr: int, size: int, read_only: bool) -> bool:
        if read_only and not self.read_only:
            return False
        (self.ro.add if read_only else self.ro.discard)(addr)
        return True

    def upload(self, addr: int, data: np.ndarray) -> None:
        buf, pos = self._at(addr, len(data))
        buf[pos : pos + len(data)] = data

    def download(self, addr: int, size: int) -> np.ndarray:
        buf, pos = self._at(addr, size)
        return buf[pos : pos + size].copy()

    def load(self, image: bytes, name: str):
        if name not in self.kernels:
            from gpuos_tools.agent.replay import ReplayError

            raise ReplayError("cuModuleGetFunction", "CUDA_ERROR_NOT_FOUND")
        self.loaded.append(image)
        return image, name

    def unload(self, module) -> None:
        self.loaded.remove(module)
        self.variables.clear()

    def set_variable(self, module, name: str, data: bytes) -> None:
        assert module in self.loaded
        self.variables[name] = bytes(data)

    def launch(self, fn, grid, block, shared, params, attributes=(), timeout=None):
        self.launches += 1
        self.attributes = list(attributes)
        self.timeouts.append(timeout)
        try:
            self.kernels[fn](self, params)
        except Fault:
            return "CUDA_ERROR_ILLEGAL_ADDRESS"
        except AssertionError:
            return "CUDA_ERROR_ASSERT"
        except Spins:
            assert timeout is not None, "a kernel that never ends, waited for with no timeout"
            return TIMED_OUT
        return None

    # -- what kernels use
    def _at(self, addr: int, size: int) -> tuple[np.ndarray, int]:
        for start, buf in self.maps.items():
            if start <= addr and addr + size <= start + len(buf):
                return buf, addr - start
        raise Fault(f"{addr:#x}+{size}")

    def fetch(self, addr: int, size: int) -> bytes:
        buf, pos = self._at(addr, size)
        return buf[pos : pos + size].tobytes()

    def store(self, addr: int, data: bytes) -> None:
        buf, pos = self._at(addr, len(data))
        start = addr - pos
        if start in self.ro:
            raise Fault(f"write to read-only {addr:#x}")
        buf[pos : pos + len(data)] = np.frombuffer(data, np.uint8)


def ptr(p: bytes) -> int:
    return struct.unpack("<Q", p[:8])[0]


def i32(p: bytes) -> int:
    return struct.unpack("<i", p[:4])[0]


# kernels of (x, y, n) parameters, on float32 elements
def copy(dev: FakeDevice, params) -> None:
    """y[i] = x[i] for i < n."""
    x, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    dev.store(y, dev.fetch(x, 4 * n))


def copy_and_spill(dev: FakeDevice, params) -> None:
    """copy, and also y[n + 32] = 1.0: a chunk past what a prediction of n floats says."""
    copy(dev, params)
    y, n = ptr(params[1]), i32(params[2])
    dev.store(y + 4 * (n + 32), struct.pack("<f", 1.0))


def sum_past(dev: FakeDevice, params) -> None:
    """y[0] = sum of x[0 .. 2n): reads twice what a prediction of n floats says."""
    x, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    vals = np.frombuffer(dev.fetch(x, 8 * n), np.float32)
    dev.store(y, struct.pack("<f", float(vals.sum())))


def far_read(dev: FakeDevice, params) -> None:
    """copy, but from x + 1 MiB: far outside any granule of x."""
    x, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    dev.store(y, dev.fetch(x + (1 << 20), 4 * n))


def scribble_input(dev: FakeDevice, params) -> None:
    """copy, then x[0] = -1: a write to memory predicted read-only."""
    copy(dev, params)
    dev.store(ptr(params[0]), struct.pack("<f", -1.0))


def stamp(dev: FakeDevice, params) -> None:
    """y[0] = a counter that changes at every launch (like clock64)."""
    dev.state += 1
    dev.store(ptr(params[1]), struct.pack("<i", dev.state))


def asserting(dev: FakeDevice, params) -> None:
    """A device-side assert on every launch."""
    raise AssertionError("device-side assert")


def lut_copy(dev: FakeDevice, params) -> None:
    """y[i] = table[i] for i < n, the table's address read from the module variable ``lut`` (zero,
    as a module starts, unless set): params (y, n)."""
    table = ptr(dev.variables.get("lut", bytes(8)))
    y, n = ptr(params[0]), i32(params[1])
    dev.store(y, dev.fetch(table, 4 * n))


def follow(dev: FakeDevice, params) -> None:
    """y[i] = x[i] for i < n, x's address read from a pointer table: params (table, y, n)."""
    table, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    dev.store(y, dev.fetch(ptr(dev.fetch(table, 8)), 4 * n))


def follow_offset(dev: FakeDevice, params) -> None:
    """As follow, but x lies at the table's address plus a 32-bit offset stored in the table: a
    pointer no word holds."""
    table, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    dev.store(y, dev.fetch(table + i32(dev.fetch(table, 4)), 4 * n))


def scale(dev: FakeDevice, params) -> None:
    """x[i] = 2 x[i] + 1 for i < n: x updated in place (it reads what it overwrites); y unused."""
    x, n = ptr(params[0]), i32(params[2])
    dev.store(x, (2 * np.frombuffer(dev.fetch(x, 4 * n), np.float32) + 1).astype(np.float32).tobytes())


def overwrite(dev: FakeDevice, params) -> None:
    """x[i] = y[i] for i < n: x written from y only."""
    x, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    dev.store(x, dev.fetch(y, 4 * n))


def partial(dev: FakeDevice, params) -> None:
    """x[2i] = i + 0.5 for i < n: every other 4-byte word of x written, none of x read; y unused."""
    x, n = ptr(params[0]), i32(params[2])
    for i in range(n):
        dev.store(x + 8 * i, struct.pack("<f", i + 0.5))


def hidden_scale(dev: FakeDevice, params) -> None:
    """scale, of the x whose address the table holds: params (table, y, n)."""
    scale(dev, [dev.fetch(ptr(params[0]), 8), params[1], params[2]])


def accumulate(dev: FakeDevice, params) -> None:
    """x[i] += y[i] for i < n: x read and updated in place, as an optimizer's state or an output
    accumulated from zero."""
    x, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    vals = np.frombuffer(dev.fetch(x, 4 * n), np.float32) + np.frombuffer(dev.fetch(y, 4 * n), np.float32)
    dev.store(x, vals.astype(np.float32).tobytes())


def turnstile(dev: FakeDevice, params) -> None:
    """Waits until the 32-bit counter at x is 0, then sets it to 1 and copies n floats from
    y + 4 to x + 4: a kernel that spins forever on a counter it is not given at zero."""
    x, y, n = ptr(params[0]), ptr(params[1]), i32(params[2])
    if i32(dev.fetch(x, 4)) != 0:
        raise Spins
    dev.store(x, struct.pack("<i", 1))
    dev.store(x + 4, dev.fetch(y + 4, 4 * n))


KERNELS = {f.__name__: f for f in (copy, copy_and_spill, sum_past, far_read, scribble_input, stamp, asserting,
                                   follow, follow_offset, scale, overwrite, partial, hidden_scale, accumulate,
                                   turnstile)}
KERNELS["_Z8lut_copyPfi"] = lut_copy  # void lut_copy(float*, int)
KERNELS["_Z4copyIfEvPKT_PS0_i"] = copy  # void copy<float>(const float*, float*, int), as a program names it
