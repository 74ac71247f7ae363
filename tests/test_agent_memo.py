"""The agent's memo of launch write sets (Agent._writes): the same launch is predicted once,
and a change of the allocation table or of known device memory makes it predict again."""

import struct

import pytest

from gpuos_tools.model import wire
from gpuos_tools.agent.agent import Agent

KERNEL = "_Z5scalePffx"  # scale(float*, float, long long)
SIZES = (8, 4, 8)


def args(ptr: int) -> bytes:
    return struct.pack("<Qfq", ptr, 2.0, 1024)


@pytest.fixture
def agent(monkeypatch):
    a = Agent()
    a.ctx = object()  # no CUDA here: on_alloc must not look for the program's context
    a.dirty = set()  # tracking writes (after a first snapshot), no snapshot in progress
    calls = []
    real = a.pred.launch
    monkeypatch.setattr(a.pred, "launch", lambda rec: calls.append(rec["kernel"]) or real(rec))
    a.calls = calls
    return a


def test_a_repeated_launch_is_predicted_once(agent):
    agent.on_alloc(0x7000_0000, 4096, "device")
    for _ in range(3):
        agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    assert agent.calls == [KERNEL]
    assert agent.dirty == {1}
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0010))  # other arguments
    assert len(agent.calls) == 2


def test_a_new_allocation_at_the_same_address_is_predicted_anew(agent):
    agent.on_alloc(0x7000_0000, 4096, "device")
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    agent.observe((wire.FREE, 0, 0, 0, 0x7000_0000))
    agent.on_alloc(0x7000_0000, 4096, "device")  # id 2 now lives there
    agent.dirty = set()
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    assert len(agent.calls) == 2
    assert agent.dirty == {2}


def test_a_pointer_table_copied_to_the_gpu_is_predicted_anew(agent):
    agent.on_alloc(0x7000_0000, 4096, "device")
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    epoch = agent.pred.epoch
    data = struct.pack("<Q", 0x7000_0100)
    agent.observe((wire.COPY, 0, 0, 0, "HtoD", 0x7000_0000, 0, len(data), 0, 0, None, data))
    assert agent.pred.epoch != epoch
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    assert len(agent.calls) == 2


def test_an_unknown_launch_stops_incremental_tracking(agent):
    agent.on_alloc(0x7000_0000, 4096, "device")
    agent.before_launch("cuLaunchKernel", 0, KERNEL, None, None)  # no layout: unknown
    assert agent.dirty is None


def test_bytes_with_no_pointer_keep_the_memo(agent):
    """A training step copies labels or scalars to the GPU every step: they hold no address of
    an allocation, so no prediction can change and the memo stays."""
    agent.on_alloc(0x7000_0000, 4096, "device")
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    epoch = agent.pred.epoch
    labels = struct.pack("<8q", *range(8))
    agent.observe((wire.COPY, 0, 0, 0, "HtoD", 0x7000_0040, 0, len(labels), 0, 0, None, labels))
    agent.observe((wire.COPY, 0, 0, 0, "HtoD", 0x7000_0040, 0, len(labels), 0, 0, None, labels[::-1]))
    assert agent.pred.epoch == epoch
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    assert len(agent.calls) == 1
    # overwriting a stored pointer with plain bytes does change what is reachable
    table = struct.pack("<Q", 0x7000_0100)
    agent.observe((wire.COPY, 0, 0, 0, "HtoD", 0x7000_0080, 0, len(table), 0, 0, None, table))
    epoch = agent.pred.epoch
    agent.observe((wire.COPY, 0, 0, 0, "HtoD", 0x7000_0080, 0, 8, 0, 0, None, bytes(8)))
    assert agent.pred.epoch != epoch


def test_ping_reports_the_launch_hooks_cost(agent):
    agent.on_alloc(0x7000_0000, 4096, "device")
    for _ in range(4):
        agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    hooks = agent.handle({"op": "ping"})["launch_hooks"]
    assert hooks["calls"] == 4 and hooks["predicted"] == 1 and hooks["seconds"] > 0


def test_arguments_that_differ_only_in_scalars_share_a_prediction(agent):
    """A step count, seed or learning rate changes every step; the pointers do not."""
    agent.on_alloc(0x7000_0000, 4096, "device")
    for step in range(5):
        a = struct.pack("<Qfq", 0x7000_0000, 0.1 * step, 1000 + step)
        agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, a)
    assert agent.calls == [KERNEL]
    assert agent.dirty == {1}


def test_a_pointer_at_another_word_is_another_prediction(agent):
    agent.on_alloc(0x7000_0000, 4096, "device")
    agent.on_alloc(0x7100_0000, 4096, "device")
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7000_0000))
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, args(0x7100_0000))
    # the same value in a scalar slot (the last 8 bytes) is not a pointer for the kernel's type,
    # but it is in the hull: another key, predicted again (conservative)
    agent.before_launch("cuLaunchKernel", 0, KERNEL, SIZES, struct.pack("<Qfq", 0x7000_0000, 1.0, 0x7100_0000))
    assert len(agent.calls) == 3
    assert agent.dirty == {1, 2}
