"""The agent's pinned staging, pinned in pieces (gpuos_tools/memory/staging.py), with the driver's
register/unregister calls replaced by recorders: the piece logic needs no GPU."""

import threading

import pytest

from gpuos_tools.memory.staging import Staging, StagingError

MIB = 1 << 20


class Driver:
    def __init__(self, fail_at: int | None = None):
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def register(self, addr: int, n: int) -> int:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        self.registered.append((addr, n))
        return 0

    def unregister(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0


def make(reserve=10 * MIB, piece=4 * MIB, **kw):
    d = Driver(**kw)
    return Staging(reserve, d.register, d.unregister, piece), d


def test_grows_a_piece_at_a_time_to_cover_what_is_asked():
    s, d = make()
    assert s.capacity == 0 and s.reserve == 12 * MIB  # rounded up to whole pieces
    s.grow(5 * MIB)
    assert s.capacity == 8 * MIB
    assert d.registered == [(s.base, 4 * MIB), (s.base + 4 * MIB, 4 * MIB)]
    s.grow(3 * MIB)  # already covered: nothing registered
    assert len(d.registered) == 2
    s.grow(12 * MIB)
    assert s.capacity == 12 * MIB and len(d.registered) == 3
    with pytest.raises(StagingError, match="reserved"):
        s.grow(13 * MIB)
    s.close()
    assert d.unregistered == [a for a, _ in d.registered]


def test_spans_never_cross_a_registration_and_cover_the_range_exactly():
    s, _ = make(reserve=16 * MIB, piece=4 * MIB)
    s.grow(16 * MIB)
    for offset, n in [(0, 16 * MIB), (3 * MIB, 6 * MIB), (4 * MIB, 4 * MIB), (5, 1), (7 * MIB, 0)]:
        spans = list(s.spans(offset, n))
        assert sum(k for _, k in spans) == n
        pos = s.base + offset
        for addr, k in spans:
            assert addr == pos and k > 0
            piece = (addr - s.base) // (4 * MIB)
            assert (addr + k - 1 - s.base) // (4 * MIB) == piece  # inside one registered piece
            pos += k
    with pytest.raises(StagingError, match="outside"):
        list(s.spans(15 * MIB, 2 * MIB))


def test_spans_refuse_bytes_not_yet_pinned():
    s, _ = make()
    s.grow(1)
    with pytest.raises(StagingError):
        list(s.spans(0, 4 * MIB + 1))


def test_pause_is_asked_after_each_piece_but_not_after_the_last():
    s, _ = make(reserve=16 * MIB, piece=4 * MIB)
    took = []
    s.grow(12 * MIB, pause=lambda t: took.append(t) or 0.0)
    assert len(took) == 2  # three pieces, a rest between them


def test_stop_ends_growing_early():
    s, _ = make(reserve=16 * MIB, piece=4 * MIB)
    stop = threading.Event()

    def pause(_t):
        stop.set()
        return 0.0

    s.grow(16 * MIB, pause=pause, stop=stop)
    assert s.capacity == 4 * MIB


def test_a_failed_registration_keeps_the_pieces_that_were_pinned():
    s, _ = make(fail_at=1)
    with pytest.raises(StagingError, match="CUresult 2.*4194304 bytes are pinned"):
        s.grow(8 * MIB)
    assert s.capacity == 4 * MIB
    assert list(s.spans(0, 4 * MIB)) == [(s.base, 4 * MIB)]


def test_the_host_view_is_the_staging_memory():
    s, _ = make()
    s.grow(1)
    v = s.view(8)
    v[:] = b"abcdefgh"
    import ctypes

    assert ctypes.string_at(s.base, 8) == b"abcdefgh"
    del v


def test_two_growers_register_each_piece_once():
    s, d = make(reserve=64 * MIB, piece=4 * MIB)
    threads = [threading.Thread(target=s.grow, args=(64 * MIB,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.capacity == 64 * MIB
    assert sorted(a for a, _ in d.registered) == [s.base + i * 4 * MIB for i in range(16)]


def test_bad_geometry_is_refused():
    d = Driver()
    with pytest.raises(ValueError):
        Staging(0, d.register, d.unregister)
    with pytest.raises(ValueError):
        Staging(MIB, d.register, d.unregister, piece=1000)
