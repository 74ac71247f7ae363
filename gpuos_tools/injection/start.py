"""Start-up of the in-process side, from the bootstrap (gpuos_tools/injection/boot/sitecustomize.py),
as the launcher's `BootConfig` (injection/config.py) says: the tracer alone, the validator or the
Python agent (injection/tracer.py), or the agent on the native per-operation core
(`NativeAgentTracer`)."""

from __future__ import annotations

import atexit
import cProfile
import io
import os
import pstats
import threading
import time
from typing import Any

from gpuos_tools.injection import intercept, tracelib, tracer
from gpuos_tools.injection.config import BootConfig
from gpuos_tools.injection.core import (
    F_ENGINE, F_EXEC, F_FAST, F_GATE, F_SKIP_CAPTURED, F_TOUCH, PTSZ, UP_GATE, UP_GRAPH, UP_LAUNCH, UP_PREDICT,
    UP_CUT, UP_PROTECT, UP_REFERENCE, UP_WRITE, VIEW_DRAIN_BYTES, NativeCore, NativeLock, OwnThreads, apply_view,
    launch_args, report,
)
from gpuos_tools.memory import owned, threads
from gpuos_tools.memory.engine import opaque_copy
from gpuos_tools.model import wire

DRAIN_S = 0.5  #: how often the background thread looks at the view queue's size


def boot(cfg: BootConfig) -> Any:
    """The program's environment made plain again (the launcher's PYTHONPATH entries taken
    off: programs this one starts are not traced), then `start`."""
    path = cfg.program_pythonpath(os.environ.get("PYTHONPATH"))
    if path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = path
    if cfg.agent is not None and cfg.agent.mechanism == "intercept" and cfg.agent.native:
        preload = intercept.unpreload(os.environ.get(intercept.PRELOAD), cfg.agent.native)
        if preload is None:
            os.environ.pop(intercept.PRELOAD, None)
        else:
            os.environ[intercept.PRELOAD] = preload
    return start(cfg)


def start(cfg: BootConfig) -> Any:
    """Start tracing (and the agent) as ``cfg`` says."""
    if cfg.agent is not None and cfg.agent.native:
        return start_native_agent(cfg)
    return tracer.start(cfg)


def start_native_agent(cfg: BootConfig) -> NativeAgentTracer:
    agent = tracer.make_agent(cfg.agent)
    t = NativeAgentTracer(cfg.trace.fd, cfg.trace.flush_ms / 1000.0, cfg.agent.native, cfg.trace.check_pointers,
                          agent, cfg.agent.mechanism)
    threads.set_own_threads(agent.own)  # memory's own-thread marks: the core's table (set by the upcalls)
    # the handle to the running agent that programs under test look up, as for the Python agent
    tracer._tracer = t
    if cfg.agent.profile_out:
        t.upcalls.profile_to(cfg.agent.profile_out)
    t.start()
    if cfg.agent.stage_ahead:
        agent.stage_ahead()
    # the program's CuPy and PyTorch allocations through the owned allocator, installed after
    # the tracer so that its mappings are traced
    if owned.boot(cfg.own):
        agent.start_engine()
        t.engine_started()
    return t


class AgentUpcalls:
    """The Python half of the native core: the agent wired to it, and the answers to its upcalls
    (the program's thread, core lock held; the gate before it). ``names``: cbid -> API name."""

    def __init__(self, core: NativeCore, agent: Any, names: dict[int, str]) -> None:
        self.core = core
        self.agent = agent
        self.names = names
        agent.use_native(core, NativeLock(core, on_acquire=self.drain), OwnThreads(core))
        agent.engine_busy = lambda: core.set_flag(F_ENGINE, True)
        agent.predictions_changed = core.bump_epoch
        agent.native_touches = core.touches
        if agent.references:
            core.set_references(sorted(agent.references))
        core.set_flag(F_SKIP_CAPTURED, bool(agent.skip_captured))
        self._seen: set[str] = set()
        #: the hooks that run the core's fast path (the scheduler's executor), once the engine starts
        self.fast: Any = None
        core.set_upcall(self.dispatch)

    def profile_to(self, path: str) -> None:
        """Run every upcall under cProfile (a developer's view of where the agent's time goes on
        the program's thread, the time an upcall waited for the GIL or a lock included; on
        Python 3.12 cProfile sees every thread while it is on, so the mover's and the evict
        thread's work during an upcall shows too) and write its statistics to ``path`` at the
        exit (`write_profile`)."""
        prof = self._profile = cProfile.Profile()
        plain = self.dispatch

        def dispatch(ptr: Any) -> int:
            prof.enable()
            try:
                return plain(ptr)
            finally:
                prof.disable()

        self._profile_path = path
        self.core.set_upcall(dispatch)
        atexit.register(self.write_profile)

    def write_profile(self) -> None:
        """The upcalls' profile so far, by own time and by cumulative time, into its file."""
        out = io.StringIO()
        stats = pstats.Stats(self._profile, stream=out)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(60)
        with open(self._profile_path, "w") as f:
            f.write(out.getvalue())

    def drain(self) -> None:
        """Bring the agent's view up to date (core lock held)."""
        events = self.core.take_view()
        if events:
            apply_view(self.agent, events)

    def dispatch(self, ptr: Any) -> int:
        u = ptr.contents
        what = u.what
        agent = self.agent
        try:
            if what == UP_GATE:
                gate = agent.gate
                if gate is not None:
                    gate()
                return 0
            self.drain()
            if what == UP_PREDICT:
                sizes, args = launch_args(u)
                kernel = (u.name or b"").decode(errors="replace")
                unknown, writes, touched = agent.predict_launch(kernel, sizes, args)
                u.nw, u.nt, u.unknown = len(writes), len(touched), int(unknown)
                if len(writes) + len(touched) <= u.cap:
                    ids = u.ids
                    for k, i in enumerate((*writes, *touched)):
                        ids[k] = i
                return 0
            if what == UP_PROTECT:
                agent.protect_native([u.targets[i] for i in range(u.ntargets)], u.stream)
                return 0
            if what == UP_REFERENCE:
                agent.dump_reference(int(u.n))
                return 0
            if what == UP_CUT:
                agent.cut_now(int(u.n))
                return 0
            api = self.names.get(u.cbid, "")
            fast = self.fast
            if fast is not None:
                unready = self.core.fast_last_unready()
                if unready:  # why the allocation this call came for was not marked, as things stand
                    fast.note_unready(unready)
                # the operations the core let go by come first, in order
                fast.fast_replay(self.core.fast_take())
            if what == UP_LAUNCH:
                sizes, args = launch_args(u)
                kernel = (u.name or b"").decode(errors="replace")
                if u.ids:  # the core's memo holds its access set: the hook's predictions take it
                    n = u.nw + u.nt
                    ids = u.ids[:n]
                    agent.given_access(sizes, args, (bool(u.unknown), tuple(ids[:u.nw]), tuple(ids[u.nw:n])))
                try:
                    agent.before_launch(api, u.raw_stream, kernel, sizes, args)
                    if fast is not None:  # the addresses its hook found for this launch
                        fast.fast_after(fast.launch_addrs(agent, kernel, sizes, args), u.raw_stream)
                finally:
                    agent.given_access(None, None, None)
            elif what == UP_WRITE:
                agent.before_write(api, u.dst, u.raw_stream, u.src)
                if fast is not None:
                    fast.fast_after([a for a in (u.dst, u.src) if a], u.raw_stream)
            elif what == UP_GRAPH:
                agent.before_graph(u.raw_stream)
                if fast is not None:
                    fast.fast_after(())
            self.sync_flags()
        except Exception as exc:  # never let the agent break the program
            if self.fast is not None:
                self.core.fast_allow(0)  # every next decision through Python again
            report(exc, self.core, self._seen, f"upcall {what}")
            return 1
        return 0

    def sync_flags(self) -> None:
        """Whether the engine still needs the hooks (it asks again when it does: engine_busy)."""
        eng = self.agent.engine
        if eng is None:
            self.core.set_flag(F_ENGINE, False)
            return
        with eng.lock:  # the engine's threads change what it holds under it
            self.core.set_flag(F_ENGINE, eng.needs_operations)

    def engine_started(self) -> None:
        """The owned allocator and the residency engine are in: touches are tracked from now on,
        and the scheduler's hooks run unless it has nothing to decide (`Executor.dormant`)."""
        core, agent = self.core, self.agent
        core.set_flag(F_TOUCH, True)
        core.set_flag(F_EXEC, agent.hooks_see_every_operation)
        core.set_flag(F_GATE, agent.gate is not None)
        self.start_fast()
        self.sync_flags()

    def start_fast(self) -> None:
        """The scheduler's fast path, when its executor has it on (GPUOS_SCHED_FAST=1): the
        engine clears a record's mark in the core before it stops being simply resident, copies
        whose addresses the core does not read always call, and the core lets operations go by
        from the executor's first decision on (docs/native-core.md, "The fast path")."""
        core, agent = self.core, self.agent
        fast = next((h for h in agent.hooks if getattr(h, "fast", False) and hasattr(h, "use_core")), None)
        if fast is None:
            return
        names = self.names
        fast.use_core(core, lambda cbid: names.get(cbid, ""), F_FAST)
        for cbid, name in names.items():
            if opaque_copy(name):
                core.fast_slow_cbid(cbid)
        agent.fast_unready = core.fast_unready
        core.fast_allow(0)
        core.set_flag(F_FAST, True)
        self.fast = fast


class NativeAgentTracer(tracer.Tracer):
    """The agent on the native core: the C front end (the CUPTI callback, or the preloaded
    interposer under ``mechanism`` "intercept", which never loads CUPTI) and the core do the
    per-operation work and ship the trace; Python answers the core's upcalls (`AgentUpcalls`)."""

    backend = "native-agent"

    def __init__(self, fd: int, flush_interval: float, library: str, check_pointers: bool, agent: Any,
                 mechanism: str) -> None:
        self.mechanism = mechanism
        if mechanism == "intercept":
            super().__init__(fd, flush_interval, table=tracer.named_table(intercept.entry_names(library)))
        else:
            super().__init__(fd, flush_interval)
        self.agent = agent
        agent.mechanism = mechanism
        kinds = {cbid: kind | (PTSZ if name.endswith(("_ptsz", "_ptds")) else 0)
                 for cbid, (name, _, kind) in self.table.items()}
        session = intercept.AgentSession if mechanism == "intercept" else tracelib.NativeSession
        self.session = session(library, fd, kinds, flush_interval * 1000, check_pointers)
        self.core = NativeCore(library)
        self.upcalls = AgentUpcalls(self.core, agent, {cbid: name for cbid, (name, _, _) in self.table.items()})
        self._drainer: threading.Thread | None = None

    def engine_started(self) -> None:
        self.upcalls.engine_started()

    def _drain_loop(self) -> None:
        self.agent.own.add(threading.get_native_id())
        while not self.stop.wait(DRAIN_S):
            if self.core.view_pending() > VIEW_DRAIN_BYTES:
                with self.agent.lock:  # acquiring it drains
                    pass

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        wire.write_all(self.fd, wire.encode_frame([self.hello()]))
        self.session.start()
        # an output: child tools of the program find its agent there
        os.environ["GPUOS_AGENT_SOCKET"] = self.agent.start_server()
        self._drainer = threading.Thread(target=self._drain_loop, name="gpuos-agent-view", daemon=True)
        self._drainer.start()
        atexit.register(self.shutdown)
        os.register_at_fork(after_in_child=self._close)

    def shutdown(self) -> None:
        """At interpreter exit (after the frameworks' own handlers)."""
        self.stop.set()
        agent = self.agent
        agent.stop_background()
        if agent.server is not None:
            agent.server.close()
        counters: dict[str, Any] = self.session.stop()
        counters["core"] = self.core.counters()
        try:
            wire.write_all(self.fd, wire.encode_frame([(wire.END, time.monotonic_ns(), counters)]))
        except OSError:
            pass
        self._close()
