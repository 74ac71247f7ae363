"""The in-process validator's read checks (gpuos_tools/agent/validate.py) on a fake driver: the
bisection and the whole-set poison trial see an operand read where the launch overwrites it (an
update in place), and never a read where the launch only writes, wholly or in part.

The driver is tests/fake_vmm.py's fake GPU memory with the driver calls Validator makes on top
(allocations, copies, memsets, and its chunk-hash kernel computed on the host); the launches
replayed are fake_vmm's Python kernels."""

from __future__ import annotations

import ctypes
import struct
import types

import numpy as np
import pytest

from fake_cuda import install_driver
from fake_vmm import KERNELS, FakeDevice
from gpuos_tools.agent.validate import CHUNK, Layout, Validator, WrittenBytes
from gpuos_tools.model.allocs import Allocation

X, Y, Z, T = 0x7F0000000000, 0x7F0000010000, 0x7F0000020000, 0x7F0000030000
SIZE = 4096  # bytes of each allocation
N = 100  # floats the kernels are told to touch: 400 bytes, the read extent's cut is the chunk past them
SCRATCH = 0x100000000000  # where the validator's own allocations go
#: the prototypes the prediction reads (const-ness: what it calls read only)
SCALE = "_Z5scalePfS_i"  # scale(float*, float*, int)
OVERWRITE = "_Z9overwritePfPKfi"  # overwrite(float*, float const*, int)
PARTIAL = "_Z7partialPfS_i"  # partial(float*, float*, int)
COPY = "_Z4copyIfEvPKT_PS0_i"  # copy<float>(float const*, float*, int)
HIDDEN = "_Z12hidden_scalePKyPfi"  # hidden_scale(unsigned long long const*, float*, int)


class FakeDriver(FakeDevice):
    """cuda.bindings.driver as the validator calls it, over fake_vmm's memory."""

    def __init__(self) -> None:
        super().__init__(KERNELS)
        self.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
        self.next = SCRATCH

    def cuCtxGetCurrent(self):
        return (0, 1)

    def cuModuleLoadData(self, image):
        return (0, 1)

    def cuModuleGetFunction(self, module, name):
        return (0, name)

    def cuCtxSynchronize(self):
        return (0,)

    def cuMemAlloc(self, n):
        addr = self.next
        self.next += -(-n // 4096) * 4096 + 4096
        self.maps[addr] = np.zeros(n, np.uint8)
        return (0, addr)

    def cuMemFree(self, addr):
        del self.maps[addr]
        return (0,)

    def cuMemsetD8(self, dst, value, n):
        buf, pos = self._at(dst, n)
        buf[pos : pos + n] = value
        return (0,)

    def cuMemcpy(self, dst, src, n):
        self.upload(dst, self.download(src, n))
        return (0,)

    def cuMemcpyDtoH(self, host, src, n):
        data = self.download(src, n)  # held: a temporary's memory is gone before memmove reads it
        ctypes.memmove(host, data.ctypes.data, n)
        return (0,)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        """The chunk-hash kernel: per 128 bytes, the PTX's hash, and a flag for a word in [lo, hi)."""
        assert fn == b"gpuos_chunk_hash"
        src, out, n, seed, flags, lo, hi = (ctypes.c_uint64.from_address(p).value
                                           for p in (ctypes.c_void_p * 7).from_address(params))
        words = self.download(src, CHUNK * n).view("<u8").reshape(n, CHUNK // 8)
        h = np.full(n, seed, np.uint64)
        for k in range(CHUNK // 8):
            h = (h ^ words[:, k]) * np.uint64(1099511628211)
            h ^= h >> np.uint64(29)
        self.upload(out, h.view(np.uint8))
        self.upload(flags, ((words >= np.uint64(lo)) & (words < np.uint64(hi))).any(axis=1).astype(np.uint8))
        return (0,)


class FakeValidator(Validator):
    """Validator relaunching fake_vmm's kernels: ``raw`` is (kernel, parameter byte strings)."""

    def __init__(self, drv: FakeDriver, **kw) -> None:
        super().__init__(**kw)
        self.drv = drv

    def _relaunch(self, launch: tuple) -> None:
        name, params = launch
        self.drv.launch(name, None, None, 0, params)


@pytest.fixture
def drv(monkeypatch) -> FakeDriver:
    return install_driver(monkeypatch, FakeDriver())


def program(drv: FakeDriver, **kw) -> FakeValidator:
    """x = 1, 2, ...; y = 1001, 1002, ... (no zero, and no value of x's); z as x; the table T
    holds z's address."""
    v = FakeValidator(drv, samples=1, **kw)
    for addr in (X, Y, Z, T):
        v.on_alloc(addr, SIZE, "device")
        drv.maps[addr] = np.zeros(SIZE, np.uint8)
    drv.upload(X, np.arange(1, SIZE // 4 + 1, dtype=np.float32).view(np.uint8))
    drv.upload(Y, np.arange(1001, 1001 + SIZE // 4, dtype=np.float32).view(np.uint8))
    drv.upload(Z, np.arange(1, SIZE // 4 + 1, dtype=np.float32).view(np.uint8))
    drv.upload(T, np.frombuffer(struct.pack("<Q", Z), np.uint8))
    return v


def validate(v: FakeValidator, drv: FakeDriver, kernel: str, fake: str, a: int = X, b: int = Y) -> dict:
    """One sampled launch of ``fake`` on (a, b, N), predicted from the prototype ``kernel``."""
    params = [struct.pack("<Q", a), struct.pack("<Q", b), struct.pack("<i", N)]
    before = {addr: drv.download(addr, SIZE) for addr in (X, Y, Z, T)}
    v.enter(1, "cuLaunchKernel", (fake, params), 1, kernel, (8, 8, 4), b"".join(params))
    for addr, data in before.items():  # the trials left the program's memory as it was
        assert np.array_equal(drv.download(addr, SIZE), data), hex(addr)
    drv.launch(fake, None, None, 0, params)  # the program's own launch
    rec = v.exit(1, 0)
    assert rec["checked"], rec
    assert "snapshot did not restore" not in rec.get("why", ""), rec
    return rec


def extents(rec: dict) -> dict[int, dict]:
    return {e["ptr"]: e for e in rec["extents"]}


def test_an_update_in_place_reads_what_it_overwrites(drv):
    rec = validate(program(drv), drv, SCALE, "scale")
    assert rec["reads"] == "ok" and rec["written"] == [[X, 512]], rec
    ext = extents(rec)
    # the first chunk boundary past the 400 bytes read; only the written bytes could show it
    assert ext[X]["read"] == 512 and ext[X]["in_place"] > 0, ext
    assert ext[Y]["read"] == 0 and ext[Y]["in_place"] == 0, ext
    assert "why" not in rec, rec


def test_an_overwrite_from_another_buffer_reads_none_of_what_it_overwrites(drv):
    rec = validate(program(drv), drv, OVERWRITE, "overwrite")
    assert rec["reads"] == "ok" and rec["written"] == [[X, 512]], rec
    ext = extents(rec)
    assert ext[X]["read"] == 0 and ext[X]["in_place"] == 0, ext
    assert ext[Y]["read"] == 512 and ext[Y]["in_place"] == 0, ext  # seen in the chunks it did not zero


def test_a_partial_writer_reads_none_of_what_it_leaves(drv):
    """Every other word of x written, none read: the words left keep the trial's zeros, and are
    not compared (the control did not change them)."""
    rec = validate(program(drv), drv, PARTIAL, "partial")
    assert rec["reads"] == "ok" and rec["written"] == [[X, 896]], rec  # 100 words 8 bytes apart
    ext = extents(rec)
    assert ext[X]["read"] == 0 and ext[X]["in_place"] == 0, ext
    assert ext[Y]["read"] == 0, ext


def test_a_read_of_one_buffer_and_a_write_of_another_measure_as_before(drv):
    rec = validate(program(drv), drv, COPY, "copy")
    assert rec["reads"] == "ok" and rec["written"] == [[Y, 512]], rec
    ext = extents(rec)
    assert ext[X]["read"] == 512 and ext[X]["in_place"] == 0, ext
    assert ext[Y]["read"] == 0 and ext[Y]["written"] == 512, ext


def test_the_whole_set_trial_sees_an_unpredicted_buffer_read_in_place(drv):
    """hidden_scale updates z, found only through the pointer the table holds on the GPU: the
    prediction names neither the write nor the read. The poison trial zeroes z; the chunks it
    zeroed are not compared as chunks, but the bytes the control wrote in them show the read."""
    rec = validate(program(drv), drv, HIDDEN, "hidden_scale", T, Y)
    assert rec["missed_writes"] == [[Z, 512]], rec
    assert rec["reads"] == "missed" and rec["read_effects"] == [[Z, 512]], rec
    assert [T, Z] in rec["stored_pointers"]


def test_over_the_limit_the_written_bytes_are_not_compared_and_the_record_says_so(drv):
    rec = validate(program(drv, inplace_max_bytes=256), drv, SCALE, "scale")
    ext = extents(rec)
    assert ext[X]["read"] == 0 and "in_place" not in ext[X], ext  # as before the comparison
    assert "in-place reads not compared: the launch wrote 512 B in 1 pieces" in rec["why"], rec


def test_written_bytes_compare_only_what_the_control_visibly_wrote():
    before = np.zeros(1024, np.uint8)
    after = before.copy()
    after[[5, 300, 700]] = 1  # three bytes written, in chunks 0, 2 and 5 of the piece
    w = WrittenBytes([(0x1000, 0x1400)], [after], [before])
    now = after.copy()
    now[[6, 7]] = 9  # bytes the control did not change: ignored
    assert w.differing([(0x1000, 0x1400)], lambda a, n: now[a - 0x1000 : a - 0x1000 + n]) == []
    now[[300, 700]] = 0
    fetch = lambda a, n: now[a - 0x1000 : a - 0x1000 + n]  # noqa: E731
    assert w.differing([(0x1000, 0x1400)], fetch) == [0x1100, 0x1280]
    assert w.differing([(0x1000, 0x1400)], fetch, first=True) == [0x1100]
    assert w.differing([(0x1000, 0x1100), (0x1300, 0x1400)], fetch) == []  # outside the ranges asked


def test_layout_runs_pieces_and_chunks_at():
    a, b = Allocation(1, 0x1000, 1000, "device"), Allocation(2, 0x1000 + 1000, 4096, "device")
    layout = Layout([a, b])
    m = np.zeros(layout.n, bool)
    m[[0, 1, 7, 8, 30]] = True  # a's first two chunks, a's tail and b's first, and one far in b
    assert layout.runs(m) == [(0x1000, 0x1100), (0x1000 + 896, 0x1000 + 1000 + 128), (0x1000 + 1000 + 22 * 128,
                                                                                        0x1000 + 1000 + 23 * 128)]
    # one allocation at a time; a gap of 5 chunks (a's) merges under 1 KiB, one of 21 (b's) under 4 KiB
    assert layout.pieces(m, 4096) == [(0x1000, 0x1000 + 1000), (0x1000 + 1000, 0x1000 + 1000 + 23 * 128)]
    assert layout.pieces(m, 1024) == [(0x1000, 0x1000 + 1000), (0x1000 + 1000, 0x1000 + 1000 + 128),
                                      (0x1000 + 1000 + 22 * 128, 0x1000 + 1000 + 23 * 128)]
    assert len(layout.pieces(m, 512)) == 4
    assert np.flatnonzero(layout.chunks_at([0x1000 + 5, 0x1000 + 999, 0x1000 + 1000])).tolist() == [0, 7, 8]
