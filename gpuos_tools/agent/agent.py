"""The in-process agent (`gpu-trace run --agent`): consistent snapshots of a running program's
device memory, taken while it keeps launching work. Over 800 lines: the snapshot's hooks on every
operation, its copier and the rollback share the snapshot's state and the agent's one lock.

The agent rides on the tracer's callbacks (the native core in C, or Python). It keeps the live
allocations and the streams the program uses, predicts each launch's write set (gpu-predict-access
at range granularity, made in-process), and answers requests on its control socket
(gpuos_tools/agent/control.py).

A snapshot captures every device allocation as it was at T0, the moment the request took the
agent's lock (no program callback runs while it is held, so T0 falls between two of the
program's operations: `ops_before` says how many launches, copies, memsets and frees came
before it):

- at T0 an event is recorded on every stream the program has used, and a side stream of the
  agent waits on all of them: its copies come after all work submitted before T0;
- a copier thread then copies the allocations one by one, device to pinned host memory, on the
  side stream, a bounded amount in flight;
- the program goes on. Before each operation that may write an allocation not yet copied
  (its predicted write set; every allocation for launches marked unknown; frees count as
  writes), the agent acts on the operation's own stream, before it, without waiting on the
  host: an allocation not yet started is copied on the GPU into a copy-on-write slot (the
  copier takes it from there), or, past the slot budget, copied to host memory right there; an
  allocation whose copy is in flight makes the stream wait for that copy's event. Streams first
  wait for the T0 events, so those copies too come after everything before T0;
- when every copy has completed, the snapshot is the host buffers; the program never stopped.

Before T0 the agent makes its host staging as large as the program's device memory, pinned a
piece of 64 MiB at a time with rests between (pinning is ~2 GB/s and competes with the
program's driver calls), and keeps it for later snapshots; with `--stage-ahead` a background
thread keeps it that large from the start, so that no snapshot waits for it. The device memory
of the copy-on-write slots is allocated before T0 too, and freed after the snapshot.

What the program feels: the agent's time inside its callbacks (reported as `stall_s`), and
GPU-side waits of its streams behind in-flight copies of what it is about to overwrite.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from gpuos_tools.agent import cut as job_cut
from gpuos_tools.agent import durable
from gpuos_tools.agent.control import ControlServer
from gpuos_tools.agent.hooks import HOOKS, OPERATION_HOOKS, AgentHooks
from gpuos_tools.agent.suspend import Suspension
from gpuos_tools.agent.view import ProcessView, launch_record
from gpuos_tools.cuda.driver import context_facts
from gpuos_tools.cuda.driver import ok as _ok
from gpuos_tools.cuda.driver import relax_capture
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import open_image
from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.memory.eviction import PER_THREAD_STREAM
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.staging import PIECE, Staging, driver_staging
from gpuos_tools.model.allocs import Allocation

UNSAVED, ENQUEUED, COW, HOST, DONE = range(5)
IN_FLIGHT = 4  # pieces in flight on the side stream
SETTLE_S = 2.0  # how long T0 or a rollback waits for operations being issued
MEMO_MAX = 65536  # launch predictions kept (see Agent.predict_launch)
WHY_MAX = 256  # kernels whose last unknown prediction keeps its reason (Agent.unknown_why)


def STAGING_PAUSE(took: float) -> float:
    """Rest after pinning a piece of staging for a snapshot request: half the piece's time,
    so the program keeps two thirds of its driver time while the first snapshot pins."""
    return took / 2


@dataclass
class Snap:
    """One snapshot in progress."""

    buffers: list[Allocation]
    offsets: list[int]
    staging: Staging  #: pinned host memory holding every buffer, at offsets
    total: int
    side: Any
    t0_events: list
    t0_ns: int
    ops_before: int
    budget: int  #: bytes of copy-on-write slots allowed on the device
    pool: int = 0  #: the device memory of the slots (allocated before T0)
    pool_used: int = 0
    state: list[int] = field(default_factory=list)
    event: list = field(default_factory=list)  #: per buffer: the event after its copy
    slot: list[int] = field(default_factory=list)  #: COW: the slot's address
    ordered: set = field(default_factory=set)  #: program streams already after the T0 events
    #: per buffer, once its copy is enqueued: the program streams whose later writes are ordered
    #: after that copy (the stream it was enqueued on, or made to wait), None: every stream
    #: (the copy completed); a write on such a stream needs nothing more
    safe: list = field(default_factory=list)
    spare: list = field(default_factory=list)  #: events made before T0 for the callbacks
    created: list = field(default_factory=list)  #: every event of this snapshot, destroyed after
    index: dict[int, int] = field(default_factory=dict)  #: allocation id -> buffer index
    cow: int = 0
    cow_bytes: int = 0
    host_saves: int = 0
    waits: int = 0
    stall_ns: int = 0
    #: where stall_ns went: "order" (streams made to wait for T0), "copy" (copy-on-write or save
    #: enqueued, event created and recorded), "wait" (a stream made to wait for a copy)
    parts_ns: dict[str, int] = field(default_factory=lambda: {"order": 0, "copy": 0, "wait": 0})


@dataclass
class Prep:
    """What a snapshot made before its T0 (``Agent._prepare``)."""

    staging: Staging
    cow_budget: int
    pool: int
    side: Any
    spare: list
    staging_s: float
    pool_s: float
    #: allocation kinds left out of the snapshot (a job's cut leaves out NCCL's mappings)
    exclude: tuple[str, ...] = ()


@dataclass
class Taken:
    """A snapshot whose T0 is taken (``Agent._t0``)."""

    snap: Snap
    prep: Prep
    written: set[int] | None
    unsettled: int
    t_start: float
    left_out: list[Allocation] = field(default_factory=list)  #: live at T0, of a kind left out


class Agent(ProcessView):
    """State and operations of the agent; the tracer calls its hooks from callbacks. Other code
    acts on the same path through hooks registered with ``add_hooks`` (gpuos_tools/agent/hooks.py)."""

    #: the registered hooks' gate (`AgentHooks.gate`), which the tracer calls before a launch,
    #: copy or memset, BEFORE the agent's lock; None: no hook has one
    gate = None

    #: launches, copies and memsets into a stream being captured are skipped (they only add a
    #: node to a graph) also when no snapshot is in progress (a registered hook asks for it)
    skip_captured = False

    def __init__(self, cow_budget: int | None = None) -> None:
        #: the native per-operation core (gpuos_tools/injection), when it runs the program's
        #: callbacks: it counts operations and streams, tracks what was written and protects a
        #: snapshot's buffers itself, and calls the hooks below only when Python must act
        self.core: Any = None
        self._ops = 0
        super().__init__()
        self.lock: Any = threading.RLock()
        self.own: Any = set()  #: thread ids whose CUDA calls are the agent's own
        self.snap: Snap | None = None
        self.cow_budget = cow_budget
        self.server = None
        #: how the program's driver calls reach the agent: "cupti" (callbacks; the driver's checkpoint
        #: API refuses the process) or "intercept" (the preloaded interposer). The Python agent runs on
        #: CUPTI only; the agent on the native core is given the boot config's at start-up.
        self.mechanism = "cupti"
        self.references: set[int] = set()  #: operation counts at whose start the state is dumped (tests)
        self.reference_out: str | None = None
        #: how long the program's exit waits for an image in flight, and in all (durable.py)
        self.exit_wait_s = durable.EXIT_WAIT_S
        self.exit_max_s = durable.EXIT_MAX_S
        #: the residency engine's switches, and the MAC key of the images the agent writes and
        #: reads (None: unsigned); both from the boot config, never the program's environment
        self.engine_settings = EngineSettings()
        self.image_key: bytes | None = None
        self.last: dict[str, Any] | None = None
        self._ctx: Any = None
        self.staging: Staging | None = None  #: pinned host memory, kept between snapshots
        self._staging_made = threading.Lock()
        self._memo: dict[tuple, tuple[bool, tuple[int, ...], tuple[int, ...]]] = {}  #: see predict_launch
        self._memo_words: dict[tuple, tuple[bool, tuple[int, ...], tuple[int, ...]]] = {}
        self._memo_epoch = -1
        self._given: tuple[Any, Any, tuple[bool, tuple[int, ...], tuple[int, ...]]] | None = None
        self.memo_misses = 0
        #: kernel -> the predictor's reason for its last unknown prediction (at most WHY_MAX kernels)
        self.unknown_why: dict[str, str] = {}
        #: the agent's own time in the program's launch callbacks, and how many (ping says)
        self.hook_ns = 0
        self.hook_calls = 0
        self._ahead_stop = threading.Event()
        #: allocation ids written since the last snapshot's T0 (predicted); None: not known
        #: (no snapshot yet, or an unknown launch since), so the next image must be full
        self.dirty: set[int] | None = None
        self.last_image: str | None = None  #: path of the last image this agent wrote
        #: the program's launches, copies, memsets and frees past their enter callback and not
        #: yet at their exit: seen by the agent but maybe not yet enqueued by the driver
        self.issuing = 0
        self._issued = threading.Condition(threading.Lock())
        self.suspension = None  #: gpuos_tools/agent/suspend.py's Suspension, from the first suspend
        #: a job's cut (gpuos_tools/agent/cut.py), from the first arm; and, on the Python agent,
        #: the program's collective launches and graph launches (the native core counts its own)
        self.cut: job_cut.Cut | None = None
        self.collectives = 0
        self.graph_launches = 0
        #: gpuos_tools/memory/engine.py's ResidencyEngine, when the program's memory is owned
        self.engine = None
        #: the native core's side of the engine, set by its wiring when it runs (injection/start.py):
        #: the engine calls ``engine_busy()`` when it has work on the program's operations and
        #: ``predictions_changed()`` when launch predictions the core memoised are stale, and
        #: reads ``native_touches()`` ((allocation id, first touch, last touch) of those touched)
        self.engine_busy: Callable[[], None] | None = None
        self.predictions_changed: Callable[[], None] | None = None
        self.native_touches: Callable[[], list[tuple[int, int, int]]] | None = None
        #: the core's fast path, when on: the engine calls ``fast_unready(base, size)`` before a
        #: record stops being simply resident (docs/native-core.md, "The fast path")
        self.fast_unready: Callable[[int, int], None] | None = None
        #: the registered hooks (``add_hooks``), and per hook name the callables they offered
        self.hooks: list[AgentHooks] = []
        self._on: dict[str, tuple[Callable[..., None], ...]] = {name: () for name in HOOKS}
        self._launch_hooks: tuple[Callable[..., None], ...] = ()
        self._write_hooks: tuple[Callable[..., None], ...] = ()
        self._graph_hooks: tuple[Callable[..., None], ...] = ()

    @property
    def ops(self) -> int:
        """Launches, copies, memsets and frees seen (for T0 and references)."""
        return self.core.ops() if self.core is not None else self._ops

    @ops.setter
    def ops(self, value: int) -> None:
        self._ops = value

    @property
    def ctx(self) -> Any:
        """The program's context, which the agent's threads make current (None: no CUDA call
        yet). On the native core: the context of the first call the core saw."""
        if self._ctx is None and self.core is not None:
            handle = self.core.context()
            if handle:
                from cuda.bindings import driver as drv

                self._ctx = drv.CUcontext(handle)
        return self._ctx

    @ctx.setter
    def ctx(self, value: Any) -> None:
        self._ctx = value

    @property
    def streams(self) -> set[int]:  # type: ignore[override]
        """The streams the program has used or created (the core's set when it runs)."""
        return self.core.streams() | {0} if self.core is not None else self._streams

    @property
    def used_streams(self) -> set[int]:
        """The streams an operation of the program has used: the only ones holding its work (a
        stream only created holds none; the residency engine's own streams are created on the
        program's context too). Without the core, the hooks see operations only: the same set."""
        return self.core.streams(used=True) | {0} if self.core is not None else self._streams

    @streams.setter
    def streams(self, value: set[int]) -> None:
        self._streams = value

    def use_native(self, core: Any, lock: Any, own: Any) -> None:
        """Run on the native core (gpuos_tools/injection): its lock is the agent's lock, its
        thread table the agent's ``own``. Before the tracer starts."""
        self.core, self.lock, self.own = core, lock, own

    # -- hooks (gpuos_tools/agent/hooks.py) -----------------------------------------------------

    def add_hooks(self, hooks: AgentHooks) -> None:
        """Register ``hooks``: from now on the agent calls the hooks it offers, after those
        registered before it. The program may be running: an operation sees the hooks of
        before or after the call (each hook's callables are one tuple, replaced whole)."""
        offered = hooks.offered()
        if "gate" in offered and self.gate is not None:
            raise ValueError("a gate is registered already: the agent takes one")
        self.hooks.append(hooks)
        for name in offered:
            self._on[name] = (*self._on[name], getattr(hooks, name))
        self._hooks_changed()

    def remove_hooks(self, hooks: AgentHooks) -> None:
        """No more calls to ``hooks``."""
        self.hooks.remove(hooks)
        for name in HOOKS:
            self._on[name] = tuple(f for f in self._on[name] if getattr(f, "__self__", None) is not hooks)
        self._hooks_changed()

    def _hooks_changed(self) -> None:
        on = self._on
        self._launch_hooks, self._write_hooks, self._graph_hooks = (on[name] for name in OPERATION_HOOKS)
        gates = on["gate"]
        if gates:
            self.gate = gates[0]
        else:
            self.__dict__.pop("gate", None)  # the class's None
        if any(h.skip_captured for h in self.hooks):
            self.skip_captured = True
        else:
            self.__dict__.pop("skip_captured", None)

    @property
    def hooks_see_every_operation(self) -> bool:
        """Whether a registered hook must see every launch, copy and memset (the native core
        then calls the agent for each; else only when the engine or a snapshot needs it)."""
        return any(h.every_operation for h in self.hooks if set(h.offered()) & set(OPERATION_HOOKS))

    def _take_dirty(self) -> set[int] | None:
        """What was written since the last call (None: not known); a new period starts (lock held)."""
        if self.core is not None:
            return self.core.take_dirty()
        written, self.dirty = self.dirty, set()
        return written

    def _forget_dirty(self) -> None:
        """What was written is not known from here on: the next image is full."""
        if self.core is not None:
            self.core.forget_dirty()
        self.dirty = None

    def start_engine(self) -> None:
        """Consult a residency engine on the launch path (the owned allocator is loaded); the
        hooks' ``engine_started`` follow."""
        self.engine = ResidencyEngine(self)
        for hook in self._on["engine_started"]:
            hook(self)

    # -- operations being issued (the tracer calls these) ---------------------------------------

    def issue_begin(self) -> None:
        """At an operation's enter callback, with the agent's lock held (the Python tracer; the
        native core counts them itself)."""
        with self._issued:
            self.issuing += 1

    def issue_end(self) -> None:
        """At its exit callback, without the lock (the agent may hold it in ``settle``)."""
        with self._issued:
            self.issuing = max(0, self.issuing - 1)
            if self.issuing == 0:
                self._issued.notify_all()

    def settle(self, timeout: float = SETTLE_S, own: int = 0) -> int:
        """With the lock held (no operation can start), wait until every operation that started
        has been enqueued by the driver; return how many had not after ``timeout`` seconds (0:
        all), which would mean an exit callback never came. ``own``: operations of the caller's
        that count as issuing and are not waited for (1 from inside an operation's enter callback)."""
        core = getattr(self, "core", None)  # (the engine's tests borrow this method)
        if core is not None:
            return core.settle(timeout, own)
        with self._issued:
            self._issued.wait_for(lambda: self.issuing <= own, timeout)
            return max(0, self.issuing - own)

    # -- bookkeeping from the tracer's records ------------------------------------------------

    def on_alloc(self, addr: int, size: int, kind: str) -> None:
        if self.core is None and self.ctx is None:  # the context the agent's threads make current
            from cuda.bindings import driver as drv

            err, ctx = drv.cuCtxGetCurrent()
            if err == drv.CUresult.CUDA_SUCCESS and int(ctx):
                self.ctx = ctx
        super().on_alloc(addr, size, kind)
        if self.core is None and self.dirty is not None:
            self.dirty.add(self.next_id - 1)  # new since the parent: the next image needs it

    def buffers(self) -> list[Allocation]:
        return self.device_allocations()

    # -- hooks before an operation (the callback's enter site, lock held) ------------------------

    def _operation(self, stream: int) -> None:
        """Count one operation of the program (and dump a reference where one is asked for)."""
        if self.core is not None:  # the core counted it, and asks for references itself
            return
        self.ops += 1
        self.streams.add(stream)
        if self.references and self.ops in self.references:
            self.dump_reference(self.ops)

    def before_launch(self, api: str, stream: int, kernel: str, sizes, args) -> None:
        """A kernel launch is about to be issued (the registered hooks first)."""
        t = time.perf_counter_ns()
        try:
            hooks = self._launch_hooks
            if hooks:
                try:
                    real = stream_of(api, stream)
                    for hook in hooks:
                        hook(self, api, real, kernel, sizes, args)
                finally:  # whatever happened, the agent's own work: the engine loads, snapshots protect
                    self._before_launch(api, stream, kernel, sizes, args)
            else:
                self._before_launch(api, stream, kernel, sizes, args)
        finally:
            self.hook_ns += time.perf_counter_ns() - t
            self.hook_calls += 1

    def _before_launch(self, api: str, stream: int, kernel: str, sizes, args) -> None:
        if self.core is None and job_cut.is_collective(kernel):  # the core counts its own
            self.collectives += 1
            cut = self.cut
            if cut is not None and cut.state == "armed" and cut.k == self.collectives:
                self.cut_now(cut.k)  # T0 before this launch (and before it counts as an operation)
        self._operation(stream)
        eng = self.engine
        try:
            if eng is not None and eng.watching:  # records to load first, touches to learn or sample
                eng.launch(stream_of(api, stream), kernel, sizes, args)
        finally:  # a failing engine must not skip a snapshot's protection (they never run together)
            self._before_launch_snap(api, stream, kernel, sizes, args)

    def _before_launch_snap(self, api: str, stream: int, kernel: str, sizes, args) -> None:
        snap = self.snap
        if self.core is not None or (snap is None and self.dirty is None):  # the core does this
            return
        unknown, writes, _ = self.predict_launch(kernel, sizes, args)
        if self.dirty is not None:
            if unknown:
                self.dirty = None
            else:
                self.dirty.update(writes)
        if snap is None:
            return
        if unknown:
            targets = range(len(snap.buffers))
        else:
            targets = [snap.index[w] for w in writes if w in snap.index]
        self._protect(snap, targets, stream_of(api, stream))

    def launch_writes(self, kernel: str, sizes, args) -> tuple[bool, tuple[int, ...]]:
        """(unknown, allocation ids written) of a launch (``predict_launch``)."""
        return self.predict_launch(kernel, sizes, args)[:2]

    def launch_touches(self, kernel: str, sizes, args) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
        """(unknown, allocation ids read or written, ids written) of a launch (``predict_launch``)."""
        unknown, writes, touched = self.predict_launch(kernel, sizes, args)
        return unknown, touched, writes

    def predict_launch(self, kernel: str, sizes, args) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
        """(unknown, allocation ids written, ids read or written) of a launch, memoised until the predictor's epoch
        moves (an allocation came or went, or known device memory changed): a training loop
        repeats its launches every step, and predicting one costs 30-300 us in Python, paid on
        the program's launch path.

        Two levels: the exact arguments (a dict lookup), then only the words of them that fall
        inside the allocations' address range, which are all a range prediction depends on: a
        launch whose arguments differ only in scalars (a step count, a random seed, a learning
        rate) reuses the prediction."""
        given = self._given
        if given is not None and given[0] is sizes and given[1] is args:
            return self._conservative(kernel, given[2])
        if self._memo_epoch != self.pred.epoch:
            self._memo.clear()
            self._memo_words.clear()
            self._memo_epoch = self.pred.epoch
        key = (kernel, sizes, args)
        hit = self._memo.get(key)
        if hit is None:
            words = self.pred.pointer_key(kernel, sizes, args)
            hit = self._memo_words.get(words) if words is not None else None
            if hit is None:
                self.memo_misses += 1
                acc = self.pred.launch(launch_record(kernel, sizes, args))[0]
                writes = tuple(dict.fromkeys(e["alloc"] for e in acc["writes"]))
                if acc["unknown"] and (kernel in self.unknown_why or len(self.unknown_why) < WHY_MAX):
                    self.unknown_why[kernel] = str(acc.get("why", ""))
                hit = (bool(acc["unknown"]), writes,
                       tuple(dict.fromkeys([e["alloc"] for e in acc["reads"]] + list(writes))))
                if words is not None:
                    if len(self._memo_words) >= MEMO_MAX:
                        self._memo_words.clear()
                    self._memo_words[words] = hit
            if len(self._memo) >= MEMO_MAX:
                self._memo.clear()
            self._memo[key] = hit
        return self._conservative(kernel, hit)

    def _conservative(self, kernel: str, hit: tuple[bool, tuple[int, ...], tuple[int, ...]]
                      ) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
        eng = getattr(self, "engine", None)
        if eng is not None and getattr(eng, "conservative", None) and kernel in eng.conservative:
            # a write its prediction did not show was detected (engine.py, "Mismatches"): unknown from now on
            return (True, *hit[1:])
        return hit

    def given_access(self, sizes: Any, args: Any, access: tuple[bool, tuple[int, ...], tuple[int, ...]] | None
                     ) -> None:
        """The access set of the launch about to be hooked, as the native core's memo holds it
        (``predict_launch``'s form): the hook's predictions of that launch (the same ``sizes``
        and ``args`` objects) take it instead of predicting again. None: forget it."""
        self._given = None if access is None else (sizes, args, access)

    def before_write(self, api: str, addr: int, stream: int, src: int = 0) -> None:
        """A copy or memset into ``addr`` (from ``src``, for a copy), or a free of it, is about
        to be issued (the registered hooks first)."""
        hooks = self._write_hooks
        failed = None
        if hooks:
            try:
                real = stream_of(api, stream)
                for hook in hooks:
                    hook(self, api, addr, real, src)
            except BaseException as exc:  # noqa: BLE001 (the agent's own work still runs; raised after it)
                failed = exc
        self._operation(stream)
        eng = self.engine
        try:
            if eng is not None and eng.watching:
                eng.access(api, stream_of(api, stream), addr, src)
        finally:
            self._before_write_snap(api, addr, stream)
        if failed is not None:
            raise failed

    def _before_write_snap(self, api: str, addr: int, stream: int) -> None:
        if self.core is not None:  # the core does this
            return
        snap = self.snap
        a = self.pred.allocs.find(addr)
        if a is not None and self.dirty is not None:
            self.dirty.add(a.id)
        if snap is None:
            return
        if a is not None and a.id in snap.index:
            self._protect(snap, [snap.index[a.id]], stream_of(api, stream))

    def before_graph(self, stream: int) -> None:
        """A graph is about to be launched on ``stream`` (the registered hooks first): its
        kernels' footprint is not predicted here, so every owned record must be back first, and
        it may write any buffer (what was written is not known; a snapshot in progress protects
        every buffer)."""
        hooks = self._graph_hooks
        failed = None
        if hooks:
            try:
                for hook in hooks:
                    hook(self, stream)
            except BaseException as exc:  # noqa: BLE001 (the agent's own work still runs; raised after it)
                failed = exc
        eng = self.engine
        if eng is not None and (eng.pending or eng.clean):
            eng.graph(stream)
        if self.core is None:  # the core does this
            self.graph_launches += 1
            self.dirty = None
            snap = self.snap
            if snap is not None:
                self._protect(snap, range(len(snap.buffers)), stream)
        if failed is not None:
            raise failed

    def cut_now(self, k: int) -> None:
        """The program is about to launch its ``k``-th collective with a cut armed there: T0
        now, on its thread (gpuos_tools/agent/cut.py)."""
        job_cut.cut_now(self, k)

    def protect_native(self, targets: list[int], stream: int) -> None:
        """The core found ``targets`` (buffer indexes of the snapshot in progress) not yet safe
        for a write on ``stream``: protect them, and tell the core what is safe now."""
        snap = self.snap
        if snap is None:
            return
        targets = [i for i in targets if i < len(snap.buffers)]
        try:
            self._protect(snap, targets, stream)
        finally:
            core = self.core
            for i in targets:
                safe = snap.safe[i]
                if safe is None or snap.state[i] == DONE:
                    core.snap_done(i)
                elif safe:
                    core.snap_safe(i, safe)

    def _protect(self, snap: Snap, targets, stream: int) -> None:
        from cuda.bindings import driver as drv

        t0 = time.perf_counter_ns()
        me = threading.get_native_id()
        self.own.add(me)
        try:
            parts = snap.parts_ns
            for i in targets:
                st = snap.state[i]
                if st == DONE:
                    continue
                if st == UNSAVED:
                    if stream not in snap.ordered:
                        t = time.perf_counter_ns()
                        for ev in snap.t0_events:
                            _ok(drv.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent(T0)")
                        snap.ordered.add(stream)
                        parts["order"] += time.perf_counter_ns() - t
                    t = time.perf_counter_ns()
                    b = snap.buffers[i]
                    if snap.spare:
                        ev = snap.spare.pop()
                    else:
                        ev = _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                        snap.created.append(ev)
                    slot = self._slot(snap, b.size)
                    if slot is not None:
                        _ok(drv.cuMemcpyDtoDAsync(slot, b.addr, b.size, stream), "cuMemcpyDtoDAsync(cow)")
                        snap.state[i], snap.slot[i] = COW, slot
                        snap.cow += 1
                        snap.cow_bytes += b.size
                    else:
                        base = snap.staging.base + snap.offsets[i]
                        for host, n in snap.staging.spans(snap.offsets[i], b.size):
                            _ok(drv.cuMemcpyDtoHAsync(host, b.addr + (host - base), n, stream),
                                "cuMemcpyDtoHAsync(save)")
                        snap.state[i] = HOST
                        snap.host_saves += 1
                    _ok(drv.cuEventRecord(ev, stream), "cuEventRecord")
                    snap.event[i] = ev
                    snap.safe[i] = {stream}  # its later writes follow the copy in stream order
                    parts["copy"] += time.perf_counter_ns() - t
                else:  # in flight, or saved on another stream: this stream writes after it
                    safe = snap.safe[i]
                    if safe is None or stream in safe:
                        continue
                    ev = snap.event[i]
                    if drv.cuEventQuery(ev)[0] == drv.CUresult.CUDA_SUCCESS:
                        if st == ENQUEUED:
                            snap.state[i] = DONE
                        snap.safe[i] = None
                        continue
                    t = time.perf_counter_ns()
                    _ok(drv.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent(copy)")
                    snap.waits += 1
                    safe.add(stream)
                    parts["wait"] += time.perf_counter_ns() - t
        finally:
            self.own.discard(me)
            snap.stall_ns += time.perf_counter_ns() - t0

    def _slot(self, snap: Snap, size: int) -> int | None:
        size_aligned = (size + 255) // 256 * 256
        if not snap.pool or snap.pool_used + size_aligned > snap.budget:
            return None
        slot = snap.pool + snap.pool_used
        snap.pool_used += size_aligned
        return slot

    # -- the snapshot (on the control thread) -----------------------------------------------------

    def snapshot(self, digest: bool = True, cow_budget: int | None = None, image: str | None = None,
                 parent: str | None = None, compress: bool = False, chunk_size: int | None = None,
                 checksum: str = "auto", threads: int | None = None) -> dict[str, Any]:
        """Take a consistent snapshot; return its description (per-buffer digests with
        ``digest``). With ``image``, write it there (gpuos_tools/image/; ``threads``
        writer threads); with ``parent`` (this agent's last image), an incremental image of what
        was written since."""
        self.own.add(threading.get_native_id())
        prep = self._prepare(cow_budget)
        self.lock.acquire()
        try:
            taken = self._t0(prep)
        except BaseException:
            self.lock.release()
            self._discard(prep)
            raise
        self.lock.release()
        return self._finish(taken, digest=digest, image=image, parent=parent, compress=compress,
                            chunk_size=chunk_size, checksum=checksum, threads=threads)

    def _prepare(self, cow_budget: int | None, exclude: tuple[str, ...] = ()) -> Prep:
        """What a snapshot needs before its T0, made while the program runs: the pinned staging,
        the copy-on-write slots' device memory, the side stream, an event per buffer."""
        from cuda.bindings import driver as drv

        if self.ctx is None:
            raise RuntimeError("the program has no CUDA allocation yet: nothing to snapshot")
        _ok(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        with self.lock:
            total = sum(b.size for b in self.buffers() if b.kind not in exclude)
        t_prep = time.perf_counter()
        staging = self.ensure_staging(total, pause=STAGING_PAUSE)
        staging_s = time.perf_counter() - t_prep
        if cow_budget is None:
            cow_budget = self.cow_budget
        if cow_budget is None:
            free, _ = _ok(drv.cuMemGetInfo(), "cuMemGetInfo")
            cow_budget = min(int(free) // 4, total)
        # the slots' device memory is allocated here, before T0, and not in the program's
        # callback at its first copy-on-write (a multi-GiB cuMemAlloc is milliseconds)
        pool = 0
        t_pool = time.perf_counter()
        if cow_budget > 0:
            err, ptr = drv.cuMemAlloc(cow_budget)
            if err == drv.CUresult.CUDA_SUCCESS:
                pool = int(ptr)
            else:
                cow_budget = 0  # no room: writes save to host on the program's stream
        pool_s = time.perf_counter() - t_pool
        side = _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        # an event for each copy-on-write the callbacks may issue, made here and not there
        with self.lock:
            n_now = len(self.buffers())
        spare = [_ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                 for _ in range(n_now)]
        return Prep(staging, cow_budget, pool, side, spare, staging_s, pool_s, exclude)

    def _discard(self, prep: Prep) -> None:
        """Give back what ``_prepare`` made, for a snapshot that will not be taken."""
        from cuda.bindings import driver as drv

        drv.cuStreamDestroy(prep.side)
        if prep.pool:
            drv.cuMemFree(prep.pool)
        for ev in prep.spare:
            drv.cuEventDestroy(ev)

    def _t0(self, prep: Prep, own: int = 0) -> Taken:
        """T0, with the agent's lock held: every operation issued so far is ordered before the
        snapshot's copies (an event on every stream the side stream waits for), and from here on
        the program's writes to its buffers are protected. ``own``: operations of the caller's
        being issued (1 on the program's thread, inside an operation's enter)."""
        from cuda.bindings import driver as drv

        if self.snap is not None:  # one snapshot at a time (a cut's and a request's may meet)
            raise GpuosError("a snapshot is in progress: try again after it", ExitCode.WRONG_STATE)
        t_start = time.perf_counter()
        unsettled = self.settle(own=own)
        if self.engine is not None and not self.engine.settled:  # evicted since the request came
            raise GpuosError(f"buffers are not all back ({_pending(self.engine)}): snapshot after "
                             "they are", ExitCode.WRONG_STATE)
        live = self.buffers()
        buffers = [b for b in live if b.kind not in prep.exclude]
        total = sum(b.size for b in buffers)
        if total > prep.staging.capacity:
            raise RuntimeError("allocations grew while the snapshot was prepared; try again")
        offsets, off = [], 0
        for b in buffers:
            offsets.append(off)
            off += b.size
        events = []
        for s in sorted(self.streams):
            ev = _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            if drv.cuEventRecord(ev, s)[0] != drv.CUresult.CUDA_SUCCESS:
                drv.cuEventDestroy(ev)
                continue  # a stream the program destroyed
            _ok(drv.cuStreamWaitEvent(prep.side, ev, 0), "cuStreamWaitEvent(side)")
            events.append(ev)
        n = len(buffers)
        snap = Snap(buffers, offsets, prep.staging, total, prep.side, events, time.time_ns(), self.ops,
                    prep.cow_budget, pool=prep.pool, state=[UNSAVED] * n, event=[None] * n, slot=[0] * n,
                    index={b.id: i for i, b in enumerate(buffers)}, safe=[None] * n,
                    spare=prep.spare, created=events + prep.spare)
        if self.core is not None:
            self.core.snap_begin([b.id for b in buffers])
        self.snap = snap
        written = self._take_dirty()  # what changed since the last T0, and anew
        return Taken(snap, prep, written, unsettled, t_start, [b for b in live if b.kind in prep.exclude])

    def _finish(self, taken: Taken, digest: bool = True, image: str | None = None, parent: str | None = None,
                compress: bool = False, chunk_size: int | None = None, checksum: str = "auto",
                threads: int | None = None, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        """After T0 (the lock let go): copy every buffer, then the description and the image."""
        snap, prep = taken.snap, taken.prep
        try:
            self._copy_all(snap)
            elapsed = time.perf_counter() - taken.t_start
            out: dict[str, Any] = {
                "ok": True, "t0_ns": snap.t0_ns, "ops_before": snap.ops_before, "buffers": len(snap.buffers),
                "bytes": snap.total, "seconds": round(elapsed, 6),
                "gbps": round(snap.total / elapsed / 1e9, 3) if elapsed > 0 else None,
                "cow": snap.cow, "cow_bytes": snap.cow_bytes, "host_saves": snap.host_saves,
                "stream_waits": snap.waits, "stall_s": round(snap.stall_ns / 1e9, 6), "unsettled": taken.unsettled,
                "stall_parts_s": {k: round(v / 1e9, 6) for k, v in snap.parts_ns.items()},
                "t0_streams": len(snap.t0_events),
                "staging_s": round(prep.staging_s, 6), "pool_s": round(prep.pool_s, 6), "cow_budget": prep.cow_budget,
                "allocations": [[b.id, b.addr, b.size, b.kind] for b in snap.buffers],
            }
            if digest:
                out["digests"] = self._digests(snap)
            if image is not None:
                out["image"] = self._write_image(snap, image, parent, taken.written, compress, chunk_size, checksum,
                                                 threads, manifest)
            self.last = out
            return out
        except BaseException:
            self._forget_dirty()  # the next image cannot be an increment of this one
            raise
        finally:
            self._release(snap)

    def ensure_staging(self, total: int, pause=None, stop: threading.Event | None = None) -> Staging:
        """Pinned host memory of at least ``total`` bytes (gpuos_tools/memory/staging.py). It is
        pinned a piece at a time, with ``pause`` between pieces, and kept between snapshots."""
        from cuda.bindings import driver as drv

        with self._staging_made:
            if self.staging is None:
                dev = _ok(drv.cuCtxGetDevice(), "cuCtxGetDevice")
                reserve = int(_ok(drv.cuDeviceTotalMem(dev), "cuDeviceTotalMem")) + PIECE
                self.staging = driver_staging(reserve)
        self.staging.grow(total, pause, stop)
        return self.staging

    def stage_ahead(self, interval: float = 0.5) -> threading.Thread:
        """Keep the pinned staging as large as the program's device memory from now on, in a
        background thread, so that no snapshot waits for pinning (`gpu-trace run --agent
        --stage-ahead`). It pins a piece, then rests three times as long: pinning competes with
        the program's own driver calls. The cost is host memory: as much pinned as the program
        has on the device, for as long as it runs."""

        def loop() -> None:
            from cuda.bindings import driver as drv

            relax_capture()  # its copies must not break a graph the program captures meanwhile
            self.own.add(threading.get_native_id())
            while not self._ahead_stop.wait(interval):
                if self.ctx is None:
                    continue
                with self.lock:
                    total = sum(b.size for b in self.buffers())
                if self.staging is not None and self.staging.capacity >= total:
                    continue
                try:
                    _ok(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
                    self.ensure_staging(total, pause=lambda took: 3 * took, stop=self._ahead_stop)
                except Exception as exc:  # noqa: BLE001 (a snapshot will pin what it needs, or say why)
                    print(f"gpuos agent: staging ahead stopped: {exc}", file=sys.stderr, flush=True)
                    return

        t = threading.Thread(target=loop, name="gpuos-agent-staging", daemon=True)
        t.start()
        return t

    def stop_background(self) -> None:
        """At exit, after the hooks' ``at_exit``: no more staging ahead (a piece being pinned
        finishes); a suspended program is resumed. A checkpoint request in progress finishes
        first (durable.py)."""
        try:
            for hook in self._on["at_exit"]:
                hook(self)
        finally:
            self._stop_background()

    def _stop_background(self) -> None:
        durable.finish_at_exit(self.server, self.exit_wait_s, self.exit_max_s)
        self._ahead_stop.set()
        if self.suspension is not None:
            self.suspension.shutdown()
        if self.engine is not None:
            self.engine.close()

    # -- rollback (on the control thread) ---------------------------------------------------------

    def rollback(self, image: str, lazy: bool = False, check: bool = False) -> dict[str, Any]:
        """Write ``image`` (and its parent chain) back into the program's allocations, at the
        same addresses, stop-the-world.

        An image of a job's cut (its manifest's ``cut``) leaves out allocations of some kinds
        (NCCL's mappings): they are left as they are, and the fit is of the others only.
        ``check``: every check and the read, nothing written (a job's rollback checks every rank
        before writing into any).

        The image is read and every chunk checked into pinned host memory first, while the
        program runs; nothing is written unless all of it is sound and it fits this process
        (``fit_problems``). Then, under the agent's lock (the program's next launch, copy,
        memset or free waits in its callback, and none is between its callback and the driver),
        the context is synchronised, every buffer is copied back and the copies complete before
        the lock is let go. Only device memory goes back: the program's host state is its own.

        ``lazy``: the same checks and staging, and the same synchronisation under the lock; then
        every buffer is handed to the residency engine as pending (``adopt(..., mapped=True)``,
        its contents in the staging) and the lock is let go at once: each operation of the
        program waits on the GPU for the write-back of the buffers it touches (unknown: all),
        while the engine's thread writes the rest back, the most recently touched first, then in
        first-touch order. A program whose memory is not owned gets an engine here
        (``owned=False``: loads only), which learns touches from then on; its first lazy
        rollback writes back in address order.
        """
        from cuda.bindings import driver as drv

        if self.ctx is None:
            raise GpuosError("the program has no CUDA allocation yet: nothing to roll back", ExitCode.WRONG_STATE)
        _ok(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        img = open_image(image, key=self.image_key)
        img.chain()  # a broken chain is refused before anything else
        facts = context_facts()
        excluded = tuple((img.manifest.get("cut") or {}).get("excluded_kinds") or ())

        def live_buffers() -> list[Allocation]:
            return [b for b in self.buffers() if b.kind not in excluded]

        with self.lock:
            live = live_buffers()
        problems = fit_problems(img.manifest, live, facts)
        if problems:
            raise GpuosError(f"{img.path} does not fit process {os.getpid()}: " + "; ".join(problems),
                             ExitCode.IMAGE_MISMATCH)
        entries = sorted(img.buffers, key=lambda b: int(b["addr"]))
        total = sum(int(b["size"]) for b in entries)
        staging = self.ensure_staging(total)
        view = staging.view(total)
        t_read = time.perf_counter()
        offsets, off = [], 0
        for b in entries:
            offsets.append(off)
            img.read(int(b["id"]), view[off : off + int(b["size"])])  # checksums checked, through the chain
            off += int(b["size"])
        read_s = time.perf_counter() - t_read
        if check:
            return {"ok": True, "image": img.path, "image_id": img.image_id, "checked": True, "buffers": len(entries),
                    "bytes": total, "read_s": round(read_s, 6)}
        eng = self.engine
        if lazy:
            if eng is None:  # plain allocations: an engine that only loads (made now, used once settled under the lock)
                eng = ResidencyEngine(self, owned=False)
            eng.make_streams("demand", "background")  # here, not in the program's first callback after
        side = _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        try:
            with self.lock:
                if self.snap is not None:
                    raise GpuosError("a snapshot is in progress; roll back after it", ExitCode.WRONG_STATE)
                problems = fit_problems(img.manifest, live_buffers(), facts)
                if problems:
                    raise GpuosError(f"the program's allocations changed while {img.path} was read: "
                                     + "; ".join(problems), ExitCode.IMAGE_MISMATCH)
                t0 = time.perf_counter()
                hold_at = time.monotonic()
                unsettled = self.settle()
                if unsettled:
                    raise GpuosError(f"{unsettled} operations of the program were still being issued after "
                                     f"{SETTLE_S} s; nothing was written", ExitCode.WRONG_STATE)
                if self.engine is not None and not self.engine.settled:  # evicted since the request came
                    raise GpuosError(f"buffers are not all back ({_pending(self.engine)}); nothing was "
                                     "written", ExitCode.WRONG_STATE)
                _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
                if self.engine is not None:  # the device copies change: no host copy of the engine's is current
                    with self.engine.lock:
                        self.engine.clean.clear()
                if lazy:  # every check passed: from here on the engine writes each buffer back
                    for b, o in zip(entries, offsets):
                        eng.adopt(int(b["addr"]), int(b["size"]), list(staging.spans(o, int(b["size"]))), mapped=True)
                    self.engine = eng
                    eng.load_rest(kind="rollback")
                else:
                    for b, o in zip(entries, offsets):
                        addr = int(b["addr"])
                        for host, n in staging.spans(o, int(b["size"])):
                            _ok(drv.cuMemcpyHtoDAsync(addr + (host - staging.base - o), host, n, side),
                                "cuMemcpyHtoDAsync(rollback)")
                    _ok(drv.cuStreamSynchronize(side), "cuStreamSynchronize(rollback)")
                stall = time.perf_counter() - t0
                go_at = time.monotonic()
                # what was written since the last image is no longer known: the next one is full
                self._forget_dirty()
                ops = self.ops
        finally:
            drv.cuStreamDestroy(side)
        out = {"ok": True, "image": img.path, "image_id": img.image_id, "chain": len(img.chain()),
               "buffers": len(entries), "bytes": total, "read_s": round(read_s, 6),
               "stall_s": round(stall, 6), "gbps": round(total / stall / 1e9, 3) if stall > 0 and not lazy else None,
               "ops_before": ops, "t0_image_ns": img.manifest.get("t0_ns"),
               "hold_at": round(hold_at, 6), "go_at": round(go_at, 6)}
        if lazy:  # the write-back's own figures: the agent's ping, residency.lazy, once done
            out.update(lazy=True, owned=eng.owned, order_predicted=(eng.lazy or {}).get("order_predicted"))
        return out

    def _write_image(self, snap: Snap, path: str, parent: str | None, written: set[int] | None,
                     compress: bool, chunk_size: int | None, checksum: str,
                     threads: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the snapshot's host copies as an image; incremental when ``parent`` is the
        image this agent wrote last and what was written since it is known. Through
        gpuos_tools/agent/durable.py: all buffers queued at once, and handed over to gpu-ckpt
        if the program exits meanwhile."""
        incremental = parent is not None and written is not None and self.last_image is not None \
            and os.path.realpath(parent) == os.path.realpath(self.last_image)
        manifest = {
            "source": "gpuos-agent", "pid": os.getpid(), "argv": sys.argv, "t0_ns": snap.t0_ns,
            "ops_before": snap.ops_before, **context_facts(),
            "allocations": [{"id": b.id, "addr": b.addr, "size": b.size, "kind": b.kind} for b in snap.buffers],
            **(extra or {}),
        }
        view = snap.staging.view(snap.total)
        entries = [(b.id, b.addr, b.size, view[off : off + b.size]) for b, off in zip(snap.buffers, snap.offsets)
                   if not (incremental and b.id not in written)]
        summary = durable.write_image(path, manifest, entries, parent=parent if incremental else None,
                                      compress=compress, chunk_size=chunk_size, checksum=checksum, threads=threads,
                                      key=self.image_key)
        if not summary.get("handover"):
            self.last_image = summary["path"]
        summary["incremental"] = incremental
        if parent is not None and not incremental:
            summary["why_full"] = ("the parent is not this agent's last image" if written is not None
                                   else "what was written since the parent is not known (an unknown launch, "
                                        "a rollback, or no image since the agent started)")
        return summary

    def _copy_all(self, snap: Snap) -> None:
        from cuda.bindings import driver as drv

        in_flight: list = []
        for i, b in enumerate(snap.buffers):
            with self.lock:
                st = snap.state[i]
                if st in (UNSAVED, COW):
                    src = b.addr if st == UNSAVED else snap.slot[i]
                    if st == COW:
                        _ok(drv.cuStreamWaitEvent(snap.side, snap.event[i], 0), "cuStreamWaitEvent(cow)")
                    base = snap.staging.base + snap.offsets[i]
                    for host, n in snap.staging.spans(snap.offsets[i], b.size):
                        _ok(drv.cuMemcpyDtoHAsync(host, src + (host - base), n, snap.side), "cuMemcpyDtoHAsync")
                    ev = _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                    snap.created.append(ev)
                    _ok(drv.cuEventRecord(ev, snap.side), "cuEventRecord(side)")
                    if st == UNSAVED:
                        snap.state[i], snap.event[i] = ENQUEUED, ev
                        snap.safe[i] = set()  # every stream's next write waits for it
                    in_flight.append(ev)
            while len(in_flight) > IN_FLIGHT:
                _ok(drv.cuEventSynchronize(in_flight.pop(0)), "cuEventSynchronize")
        _ok(drv.cuStreamSynchronize(snap.side), "cuStreamSynchronize(side)")
        for i, st in enumerate(snap.state):
            if st == HOST:
                _ok(drv.cuEventSynchronize(snap.event[i]), "cuEventSynchronize(saved)")
        with self.lock:
            snap.state = [DONE] * len(snap.state)
            self.snap = None
            if self.core is not None:
                self.core.snap_end()

    def _digests(self, snap: Snap) -> list[str]:
        view = snap.staging.view(snap.total)
        return [hashlib.sha256(view[o : o + b.size]).hexdigest() for b, o in zip(snap.buffers, snap.offsets)]

    def _release(self, snap: Snap) -> None:
        from cuda.bindings import driver as drv

        with self.lock:
            if self.snap is snap:
                self.snap = None
                if self.core is not None:
                    self.core.snap_end()
        drv.cuStreamSynchronize(snap.side)
        if snap.pool:
            drv.cuMemFree(snap.pool)
        drv.cuStreamDestroy(snap.side)
        for ev in snap.created:  # recorded work completes first; the driver releases them then
            drv.cuEventDestroy(ev)

    # -- references for tests: the state after exactly N operations, stop-the-world ------------

    def dump_references(self, at: tuple[int, ...] | list[int], out: str | None) -> None:
        """Tests: dump a digest of every buffer into ``out`` at the start of operation k+1 for
        each k in ``at``, to compare with a snapshot whose 'ops_before' is k."""
        self.references = {k + 1 for k in at}
        self.reference_out = out

    def dump_reference(self, n: int) -> None:
        """Before operation n+1... called at operation n's enter: the state after n-1 ops."""
        from cuda.bindings import driver as drv

        me = threading.get_native_id()
        self.own.add(me)
        try:
            _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            digests = []
            for b in self.buffers():
                buf = (ctypes.c_char * b.size)()
                _ok(drv.cuMemcpyDtoH(ctypes.addressof(buf), b.addr, b.size), "cuMemcpyDtoH(reference)")
                digests.append(hashlib.sha256(memoryview(buf)).hexdigest())
            with open(self.reference_out, "a") as f:
                f.write(json.dumps({"ops_before": n - 1, "digests": digests,
                                    "sizes": [b.size for b in self.buffers()]}) + "\n")
        finally:
            self.own.discard(me)

    # -- control ------------------------------------------------------------------------------

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        sus = self.suspension
        if sus is not None and sus.held:  # the holder has the lock: answer without it
            if op == "ping":
                return {"ok": True, "pid": os.getpid(), "ops": self.ops, "mechanism": self.mechanism, **sus.status()}
            if op == "resume":
                return sus.resume(lazy=bool(request.get("lazy")))
            if op in ("suspend", "snapshot", "rollback", "arm", "disarm"):
                raise GpuosError(f"the program is {sus.state}: {op} after `gpu-restore --agent PID --resume`",
                                 ExitCode.WRONG_STATE)
        eng = self.engine
        if op in ("suspend", "snapshot", "rollback") and eng is not None and not eng.settled:
            raise GpuosError(f"buffers are not all back ({_pending(eng)}): {op} after they are "
                             "(a lazy resume or rollback still loading, or buffers evicted)", ExitCode.WRONG_STATE)
        if op == "suspend":
            if self.suspension is None:
                self.suspension = Suspension(self)
            return self.suspension.suspend(
                partial=bool(request.get("partial")), image=request.get("image"),
                compress=bool(request.get("compress")), chunk_size=request.get("chunk_size"),
                checksum=request.get("checksum") or "crc32", max_hold_s=request.get("max_hold_s"))
        if op == "resume":
            raise GpuosError("the program is not suspended: nothing to resume", ExitCode.WRONG_STATE)
        if op == "ping":
            with self.lock:
                bufs = self.buffers()
            out = {"ok": True, "pid": os.getpid(), "ops": self.ops, "mechanism": self.mechanism, "buffers": len(bufs),
                   "bytes": sum(b.size for b in bufs), "streams": len(self.streams), "state": "running",
                   "collectives": job_cut.counts(self)["collectives"],
                   "launch_hooks": self._hook_figures()}
            if eng is not None:
                out["residency"] = eng.stats()
            return out
        if op == "snapshot":
            return self.snapshot(
                digest=bool(request.get("digest", True)), cow_budget=request.get("cow_budget"),
                image=request.get("image"), parent=request.get("parent"), compress=bool(request.get("compress")),
                chunk_size=request.get("chunk_size"), checksum=request.get("checksum") or "auto",
                threads=request.get("threads"),
            )
        if op == "rollback":
            if not isinstance(request.get("image"), str):
                return {"ok": False, "error": "rollback needs 'image': the image's path"}
            return self.rollback(request["image"], lazy=bool(request.get("lazy")), check=bool(request.get("check")))
        if op == "collectives":
            return job_cut.counts(self)
        if op == "arm":
            return job_cut.arm(self, request)
        if op == "disarm":
            return job_cut.disarm(self)
        if op == "cut":
            return job_cut.status(self, request.get("wait_s") or 0.0)
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _hook_figures(self) -> dict[str, Any]:
        """The agent's time on the program's operations (ping's ``launch_hooks``)."""
        if self.core is not None:
            c = self.core.counters()
            return {"native": True, "calls": c["enters"], "seconds": round((c["enter_ns"]) / 1e9, 6),
                    "upcalls": c["upcalls"], "upcall_seconds": round(c["upcall_ns"] / 1e9, 6),
                    "predicted": c["memo_misses"], "memo_hits": c["memo_hits"], "epoch": c["epoch"]}
        return {"calls": self.hook_calls, "seconds": round(self.hook_ns / 1e9, 6),
                "predicted": self.memo_misses, "epoch": self.pred.epoch}

    def start_server(self) -> str:
        def handler(request: dict[str, Any]) -> dict[str, Any]:
            self.own.add(threading.get_native_id())
            return self.handle(request)

        self.server = ControlServer(handler)
        self.server.start()
        return str(self.server.path)


def _pending(engine: Any) -> str:
    st = engine.stats()["pending"]
    return ", ".join(f"{v['records']} {k}" for k, v in sorted(st.items())) or "none"


def fit_problems(manifest: dict[str, Any], live: list[Allocation], facts: dict[str, Any]) -> list[str]:
    """Why an image (its manifest) cannot be rolled back into a process whose live device
    allocations are ``live`` on a GPU and driver described by ``facts`` (``cuda.driver.context_facts``);
    empty when it fits. The allocation tables must be the same set of (address, size): a buffer
    of the image with nowhere to go, or an allocation the image would leave as it is, refuses."""
    problems = []
    for key, what in (("gpu", "GPU"), ("cuda", "CUDA driver version")):
        mine, theirs = facts.get(key), manifest.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"the image was taken on {what} {theirs}, this process has {mine}")
        elif theirs is None:
            problems.append(f"the image does not say its {what}")
    want = {(int(b["addr"]), int(b["size"])) for b in manifest.get("buffers", [])}
    have = {(a.addr, a.size) for a in live}

    def listed(pairs: set[tuple[int, int]]) -> str:
        first = sorted(pairs)[:3]
        more = f" and {len(pairs) - 3} more" if len(pairs) > 3 else ""
        return ", ".join(f"{size} B at {addr:#x}" for addr, size in first) + more

    if want - have:
        problems.append(f"{len(want - have)} of its buffers have no allocation of that address and size "
                        f"here ({listed(want - have)})")
    if have - want:
        problems.append(f"{len(have - want)} allocations of this process are not in the image "
                        f"({listed(have - want)})")
    return problems


def stream_of(api: str, stream: int) -> int:
    """The stream an API call really uses: handle 0 of a _ptsz call is the per-thread stream."""
    return PER_THREAD_STREAM if stream == 0 and api.endswith(("_ptsz", "_ptds")) else stream
