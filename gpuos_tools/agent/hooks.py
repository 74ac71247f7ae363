"""Hooks: how other code acts on the agent's path without subclassing `Agent` (as CuPy's memory
hooks extend its allocator). An object derived from `AgentHooks` is registered with
``agent.add_hooks(obj)``; the agent then calls the hooks the object offers, in registration
order, before its own work. `gpu-prefetch-sched run`'s executor (gpuos_tools/sched/executor.py)
is the one user: it decides evictions and loads before each launch, copy and memset.

The agent keeps, per operation hook, a tuple of the registered callables: with none registered
a launch, copy or memset costs one attribute look-up more than the agent's own work, and no call.

Every hook runs on the program's thread with the agent's lock held (the native core's lock on
the native path), except ``gate``, which runs before it. A hook that raises does not skip the
agent's own work for that operation (snapshots stay consistent); the exception goes on to the
tracer, which reports it and lets the program go on.
"""

from __future__ import annotations

from typing import Any

#: the hook names, in the order the agent's life calls them
HOOKS = ("engine_started", "gate", "before_launch", "before_write", "before_graph", "at_exit")
#: the hooks called once per operation of the program
OPERATION_HOOKS = ("before_launch", "before_write", "before_graph")


class AgentHooks:
    """Base class of an object registered with `Agent.add_hooks`. A subclass overrides the hooks
    it needs; ``offered`` says which the agent registers (by default every one the subclass
    overrides: the others cost nothing)."""

    #: a launch, copy or memset into a stream being captured into a CUDA graph is skipped (it
    #: only adds a node to a graph) also when no snapshot is in progress
    skip_captured = False

    #: whether the operation hooks must see every launch, copy and memset of the program. False:
    #: only those the agent acts on anyway (the native core calls Python only when something
    #: there has work: `Agent.hooks_see_every_operation`)
    every_operation = True

    def offered(self) -> tuple[str, ...]:
        """The hooks to register (names from ``HOOKS``)."""
        cls = type(self)
        return tuple(name for name in HOOKS if getattr(cls, name) is not getattr(AgentHooks, name))

    def engine_started(self, agent: Any) -> None:
        """The agent's residency engine has started (``agent.engine``; `Agent.start_engine`)."""

    def gate(self) -> None:
        """Before a launch, copy, memset or graph launch of the program, BEFORE the agent's lock is
        taken: it may block (serve's GPU turn). At most one object registers a gate."""

    def before_launch(self, agent: Any, api: str, stream: int, kernel: str, sizes: Any, args: Any) -> None:
        """Before a kernel launch is issued: ``api`` the driver call, ``stream`` the stream it
        runs on (a ``_ptsz`` call's 0 is the per-thread stream, `stream_of`), ``kernel`` the
        mangled name, ``sizes``/``args`` its parameters' sizes and argument bytes (None: not
        known). ``agent.launch_touches(kernel, sizes, args)`` predicts what it reads and writes."""

    def before_write(self, agent: Any, api: str, addr: int, stream: int, src: int) -> None:
        """Before a copy or memset into ``addr`` (from ``src``, for a copy; 0: none or not
        known), or a free of ``addr``, is issued on ``stream`` (as in ``before_launch``)."""

    def before_graph(self, agent: Any, stream: int) -> None:
        """Before a CUDA graph is launched on ``stream`` (the handle the call gave)."""

    def at_exit(self, agent: Any) -> None:
        """The program is exiting (`Agent.stop_background`), before the agent's own shutdown."""
