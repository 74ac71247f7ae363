"""Hooks on the agent (gpuos_tools/agent/hooks.py): what is registered, when each hook is called
relative to the agent's own work, and what a hook that raises leaves done. No GPU."""

from __future__ import annotations

import struct

import pytest

from gpuos_tools.agent import agent as agent_mod
from gpuos_tools.agent.agent import PER_THREAD_STREAM, Agent
from gpuos_tools.agent.hooks import AgentHooks

KERNEL = "_Z5scalePffx"  # scale(float*, float, long long)
BASE = 0x7000_0000


class Recorder(AgentHooks):
    """Every call, with the agent's operation count at that moment."""

    def __init__(self, log: list, fail: bool = False) -> None:
        self.log = log
        self.fail = fail

    def _note(self, *what) -> None:
        self.log.append(what)
        if self.fail:
            raise RuntimeError("hook failed")

    def before_launch(self, agent, api, stream, kernel, sizes, args) -> None:
        self._note("launch", agent.ops, stream, agent.launch_touches(kernel, sizes, args))

    def before_write(self, agent, api, addr, stream, src) -> None:
        self._note("write", agent.ops, api, addr, stream, src)

    def before_graph(self, agent, stream) -> None:
        self._note("graph", agent.ops, stream)


def agent_with_buffer() -> Agent:
    a = Agent()
    a.ctx = object()  # no CUDA here: on_alloc must not look for the program's context
    a.on_alloc(BASE, 4096, "device")
    return a


def test_without_hooks_nothing_is_registered_and_the_class_defaults_hold():
    a = Agent()
    assert a.hooks == [] and a.gate is None and not a.skip_captured and not a.hooks_see_every_operation
    assert a._launch_hooks == a._write_hooks == a._graph_hooks == ()
    assert AgentHooks().offered() == ()  # the base class offers nothing


def test_hooks_run_before_the_agents_own_work_on_the_stream_the_operation_uses():
    a = agent_with_buffer()
    log: list = []
    h = Recorder(log)
    assert h.offered() == ("before_launch", "before_write", "before_graph")
    a.add_hooks(h)
    assert a.hooks_see_every_operation and a.gate is None and not a.skip_captured
    args = struct.pack("<Qfq", BASE, 2.0, 1024)
    a.before_launch("cuLaunchKernel_ptsz", 0, KERNEL, (8, 4, 8), args)  # stream 0 of a _ptsz call
    a.before_write("cuMemcpyHtoDAsync_v2", BASE, 7, 0x1234)
    a.before_graph(9)
    assert log == [("launch", 0, PER_THREAD_STREAM, (False, (1,), (1,))),
                   ("write", 1, "cuMemcpyHtoDAsync_v2", BASE, 7, 0x1234),
                   ("graph", 2, 9)]
    assert a.ops == 2 and a.hook_calls == 1  # the agent counted its launch and copy after the hooks
    a.remove_hooks(h)
    a.before_graph(9)
    assert len(log) == 3 and a.hooks == [] and not a.hooks_see_every_operation


def test_a_hook_that_raises_leaves_the_agents_own_work_done_and_the_error_goes_on():
    a = agent_with_buffer()
    a.dirty = set()  # writes tracked (after a first snapshot)
    log: list = []
    a.add_hooks(Recorder(log, fail=True))
    args = struct.pack("<Qfq", BASE, 2.0, 1024)
    with pytest.raises(RuntimeError, match="hook failed"):
        a.before_launch("cuLaunchKernel", 0, KERNEL, (8, 4, 8), args)
    assert a.ops == 1 and a.dirty == {1} and a.hook_calls == 1
    with pytest.raises(RuntimeError, match="hook failed"):
        a.before_write("cuMemsetD8_v2", BASE, 0)
    assert a.ops == 2
    with pytest.raises(RuntimeError, match="hook failed"):
        a.before_graph(0)
    assert a.dirty is None  # the graph's writes are not known: the agent said so all the same
    assert [entry[0] for entry in log] == ["launch", "write", "graph"]


def test_hooks_are_called_in_the_order_they_were_registered():
    a = agent_with_buffer()
    log: list = []

    class Tagged(AgentHooks):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def before_graph(self, agent, stream) -> None:
            log.append(self.tag)

    first, second = Tagged("first"), Tagged("second")
    a.add_hooks(first)
    a.add_hooks(second)
    a.before_graph(0)
    a.remove_hooks(first)
    a.before_graph(0)
    assert log == ["first", "second", "second"]


def test_engine_started_follows_the_engine_and_at_exit_comes_before_the_agents_shutdown(monkeypatch):
    log: list = []

    class Engine:
        def __init__(self, agent) -> None:
            log.append("engine made")

        def close(self) -> None:
            log.append("engine closed")

    class Life(AgentHooks):
        skip_captured = True
        every_operation = False

        def engine_started(self, agent) -> None:
            log.append(("started", type(agent.engine).__name__))

        def at_exit(self, agent) -> None:
            log.append("at_exit")
            raise RuntimeError("at_exit failed")

    monkeypatch.setattr(agent_mod, "ResidencyEngine", Engine)
    a = Agent()
    a.add_hooks(Life())
    assert a.skip_captured and not a.hooks_see_every_operation  # no operation hook offered
    a.start_engine()
    with pytest.raises(RuntimeError, match="at_exit failed"):
        a.stop_background()
    assert log == ["engine made", ("started", "Engine"), "at_exit", "engine closed"]


def test_one_gate_at_most():
    class Gate(AgentHooks):
        def gate(self) -> None:
            pass

    a = Agent()
    g = Gate()
    a.add_hooks(g)
    assert a.gate == g.gate
    with pytest.raises(ValueError, match="gate"):
        a.add_hooks(Gate())
    assert a.hooks == [g]
    a.remove_hooks(g)
    assert a.gate is None and "gate" not in a.__dict__
