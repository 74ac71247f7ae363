"""The validator's chunk bookkeeping (gpuos_tools/agent/validate.py), without a GPU."""

import numpy as np

from gpuos_tools.agent.validate import CHUNK, Layout, complement
from gpuos_tools.model.allocs import Allocation


def regions():
    # a 300-byte allocation (2 full chunks and a 44-byte tail) and a 256-byte one right after
    return [Allocation(1, 0x10000, 300), Allocation(2, 0x10200, 256)]


def test_chunks_cover_every_byte_once():
    lay = Layout(regions())
    assert lay.n == 3 + 2
    assert list(lay.len) == [CHUNK, CHUNK, 44, CHUNK, CHUNK]
    assert lay.total == 556


def test_mask_and_ranges_round_trip():
    lay = Layout(regions())
    m = lay.mask([(0x10000 + 130, 0x10000 + 131), (0x10200, 0x10201)])
    assert list(m) == [False, True, False, True, False]
    assert lay.ranges(m) == [[0x10080, CHUNK], [0x10200, CHUNK]]
    # adjacent chunks merge; a tail chunk ends its allocation
    assert lay.ranges(np.array([False, True, True, False, False])) == [[0x10080, CHUNK + 44]]


def test_complement_skips_kept_ranges():
    out = complement(regions(), [(0x10010, 0x10020), (0x10200, 0x10300)])
    assert out == [(0x10000, 0x10010), (0x10020, 0x1012C)]


def test_subset_keeps_order_and_chunk_boundaries():
    lay = Layout(regions())
    m = np.array([False, True, True, True, False])
    sub = lay.subset(m)
    assert [(int(a), int(n)) for a, n in zip(sub.addr, sub.len)] == [
        (int(lay.addr[i]), int(lay.len[i])) for i in np.flatnonzero(m)
    ]
    # the run inside allocation 1 and the chunk of allocation 2 stay separate regions
    assert [(r.addr, r.size) for r in sub.regions] == [(0x10080, CHUNK + 44), (0x10200, CHUNK)]
