"""Online execution inside the program (`gpu-prefetch-sched run`): the agent's launch path asks
the online policy (gpuos_tools/sched/online.py) what to do and carries it out through the
residency engine (gpuos_tools/memory/engine.py) -- the same engine that serves lazy loads, not a
second one. Over 800 lines: the executor's decisions, its mover thread and serve's ledger all act
under the engine's lock on one shared view of which records are where.

The `Executor` is hooks on the agent (gpuos_tools/agent/hooks.py): when the boot config has an
online part (injection/config.py `OnlineConfig`: budget or fraction, policy, lookahead, the
summary file's path; its `executor_config()` is the ``cfg`` dict taken here), which
`gpu-prefetch-sched run` gives with the program's allocations owned, the in-process start-up
(gpuos_tools/injection/tracer.py `make_agent`) makes a plain Agent and calls
``attach(agent, cfg)``; when the agent's residency engine starts, an Executor is made on it and
registers itself.

Before each launch, copy and memset of the program (its thread, the agent's lock held):

1. the records the operation touches: the engine's predictor's allocation ids mapped to owned
   records (None when the prediction is unknown; a graph launch is always unknown);
2. the policy's actions, in order: ``evict`` -> `ResidencyEngine.evict_from_operation` (the
   save is ordered here after everything the program has enqueued, on the engine's evict
   stream; the release follows on the engine's evict thread once the save is done);
   ``require`` -> room is waited for first (see below), then `ResidencyEngine.require` loads
   what is released on the engine's demand stream and makes the operation's stream wait on
   the GPU for every load of its records; ``prefetch`` -> queued to the mover thread;
3. the agent's own hooks run after (snapshots, the engine's first-touch bookkeeping).

The mover thread issues the queued prefetches in order, each once there is room for it under
the budget (the records evicted for it have been released), through
`ResidencyEngine.prefetch` (make resident + load on the engine's prefetch stream). So loads,
evictions and the program's kernels run on three streams at once, and the program's thread
never waits for a prefetch.

Room. The budget holds physical memory: a record counts from the moment it is mapped until its
release, so an eviction frees room only when its save has completed. A demand load (the
policy's require of a record that is not resident: before a period is known, or when a
prediction failed) waits on the host until evictions in flight free the room; that wait is a
stall, counted (`room_waits`, `room_wait_s`). Allocations are the program's: a new record is
mapped at once, so the memory can rise above the budget between an allocation and the next
launch, which then evicts (`over_physical` counts decisions that found it so afterwards).

Parking. Under `run` the owned library parks a released record's physical memory (unmapped,
kept: gpuos_alloc.c, "parked physical memory") and the next load of a record of the same size
maps it again, because creating and releasing physical memory makes the driver clear it on a
copy engine, which halves host-to-device copies meanwhile (scripts/probe_swap.py). Parked memory
is held, so it counts against the budget (`physical`); a load that maps parked memory again adds
nothing, and when the room is short by parked memory no load here reuses, as much of it as the
room lacks goes back to the driver first, the oldest first (`_fits`; `park_trims` counts it).
serve's jobs do not park (a yield must leave the memory to the next job). GPUOS_ENGINE_NO_PARK=1
turns it off.

Timeline. With the config's ``timeline`` (a path), the executor also keeps a bounded log of
events ``[t_s, kind, value]`` (seconds from its start) and writes it there at the end (JSON:
`sched_timeline`, read by gpuos_tools/sched/plot.py): ``mapped`` (owned bytes mapped, measured
after each decision and each prefetch; once per replay for the decisions of the operations the
fast path let go by: nothing moved for them), ``budget`` (when the budget a decision uses changes),
``evict`` (a record's bytes, at the eviction's issue), ``load`` (bytes a launch's require
loads, at its issue), ``prefetch`` (a record's bytes, at the mover's issue), ``wait`` (a host
wait for room: value = seconds, t = its start). Past ``timeline_max`` events (default 200000)
the rest are counted in ``dropped``, not kept.

Diagnostics in the summary: ``kernels`` (per kernel or API name: operations, unknown ones with
the predictor's reason, mean bytes of the records predicted; `kernel_profile`) and ``agent``
(the time the launch path spent in the agent's hooks and in the executor). `current_counts`
gives a program under `run` the counts so far, for its own timed regions.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from bisect import bisect_right
from typing import Any

from gpuos_tools.agent.agent import Agent
from gpuos_tools.agent.hooks import AgentHooks
from gpuos_tools.cuda.driver import relax_capture
from gpuos_tools.errors import GpuosError
from gpuos_tools.memory.engine import opaque_copy
from gpuos_tools.memory.eviction import PER_THREAD_STREAM
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.states import LOADING
from gpuos_tools.memory.threads import WaitCountingLock
from gpuos_tools.sched.ledger import Ledger
from gpuos_tools.sched.online import OnlinePolicy
from gpuos_tools.sched.serve import CoordinatorClient
from gpuos_tools.stream import atomic

PARK_LIMIT = 1 << 62  #: parked bytes count against the budget and are trimmed when it is short
ROOM_TIMEOUT_S = 10.0  #: longest wait for room before a load goes ahead over the budget
NEED_WAIT_S = 0.2  #: serving: how long the coordinator's trims may take to show in the ledger
INFLIGHT_REFRESH_S = 0.01  #: serving: a waiting job says its bytes in flight again this often
POLL_S = 50e-6
KERNELS_MAX = 2048  #: kernel names profiled one by one (the rest pooled)
#: the time plan samples the GPU time of one operation in this many: a prime, so that the
#: sampled phases of a period go round every launch key unless the period is a multiple of it
SAMPLE_EVERY = 31
SAMPLES_MAX = 32  #: samples in flight at most (their timer events are reused)
FAST_MAX = 4096  #: decisions the core's fast path may let go by at most before Python looks again
MARKS = 256  #: last-use marks kept at least per stream (``Executor._mark``)
MIXED = -1  #: a record's operations came on more than one stream (``Executor._used_on``)


class Executor(AgentHooks):
    """The policy's actions carried out through the engine (module docstring); ``attach``
    registers it on the engine's agent."""

    #: a launch captured into a CUDA graph does not run: no decision for it (the graph's launch
    #: is one, unknown); without this its stream waits would be captured into the graph
    skip_captured = True

    def __init__(self, engine: Any, cfg: dict[str, Any], lib: Any = None) -> None:
        self.engine = engine
        self.lib = lib if lib is not None else engine.ops.lib
        self.cfg = cfg
        self.policy = OnlinePolicy(cfg.get("budget"), cfg.get("policy", "belady"), int(cfg.get("lookahead", 2)),
                                   fraction=cfg.get("fraction"), plan=cfg.get("plan", "count"),
                                   proactive=bool(cfg.get("proactive", False)), batch=int(cfg.get("batch", 1)),
                                   slack=float(cfg.get("slack", 0.0)))
        if cfg.get("bw"):
            self.policy.note_bandwidth(*cfg["bw"])
        #: the time plan's duration samples (``_sample``): None when off (the count plan, or ops
        #: without timer events)
        # durations sampled for the plans that use them: the time plan's walk, the fixed plan's
        # leads (``fixed.leads_by_time``)
        self._timing = (self.policy.plan in ("time", "fixed") and hasattr(engine.ops, "timer")
                        and hasattr(engine.ops, "elapsed_ms"))
        self._ops_n = 0
        self._open: tuple[int, Any, Any] | None = None  #: (key, stream, start event) of the sampled operation
        self._samples: list[tuple[int, Any, Any]] = []  #: (key, start, end) recorded, not read yet
        self._timers: list[Any] = []  #: free timer events
        self._records: dict[int, int] = {}
        self._small: set[int] = set()
        self._unpinned: list[int] = []  #: records whose host copy the mover has not pinned yet
        self._bases: list[int] = []
        self._total = 0
        self._key: tuple | None = None
        self._budget = 0
        self._moves: queue.Queue[Any] = queue.Queue()
        self._mover: threading.Thread | None = None
        #: a room check and the load it allows, together (who waited for it: the summary's ``mover_lock_waits``)
        self._load_lock = WaitCountingLock()
        self._demand = threading.Event()  #: the program's thread waits for room: the mover holds off
        self.counts = {"room_waits": 0, "room_wait_s": 0.0, "room_timeouts": 0, "over_physical": 0,
                       "peak_resident": 0, "peak_settled": 0, "settled": 0, "evict_refused": 0,
                       "prefetch_skipped": 0, "mover_errors": 0, "pins": 0, "pin_errors": 0,
                       "before_s": 0.0, "decisions": 0, "samples": 0, "sample_errors": 0}
        self._under = False
        self._settled_key: tuple | None = None
        self.error: str | None = None
        self._closing = False
        self._over_pending = False
        self._measured_budget = 0  #: the budget ``_measure`` saw last
        self.t0 = time.perf_counter()
        self._log: list[list] | None = [] if cfg.get("timeline") else None
        self._log_max = int(cfg.get("timeline_max", 200_000))
        self._log_dropped = 0
        self._log_budget = -1
        # gpu-prefetch-sched serve (cfg["serve"]: {"socket", "job"}): the GPU turn; None: `run`
        self.serve: Any = None
        self._held = False  #: this job holds the turn
        self._hold = False  #: the mover issues nothing (from a yield or trim to the next grant)
        self._gate_lock = threading.Lock()  #: one program thread at a time talks to the coordinator
        self._others = 0  #: what the other jobs hold mapped, as the last grant or budget said
        self._want = 0
        self._turn_peak = 0
        self._overlap = False  #: a switch's saves and the next job's loads overlap (experimental; else: in series)
        self.ledger: Any = None  #: serve's byte ledger (gpuos_tools/sched/ledger.py), shared by the jobs
        self._charged: dict[int, int] = {}  #: records booked in the ledger (mapped, or reserved to be)
        self._book = threading.Lock()  #: ``_charged`` (taken after the engine's lock, before the ledger's)
        self._inflight_said = -1
        self.turns = {"turn_waits": 0, "turn_wait_s": 0.0, "yields": 0, "yield_s": 0.0, "trims": 0,
                      "prepares": 0, "prepared": 0, "prepared_now": 0, "budget_updates": 0, "release_timeouts": 0,
                      "ledger_waits": 0, "ledger_wait_s": 0.0, "room_asks": 0, "squeezes": 0, "forced_loads": 0,
                      "prefetch_no_room": 0, "unreserved_maps": 0, "turn_peak_max": 0, "gate_errors": 0}
        if cfg.get("serve"):
            srv = cfg["serve"]
            self._overlap = bool(srv.get("overlap", False))
            if srv.get("ledger"):
                self.ledger = Ledger(srv["ledger"], int(srv["job"]))
                self.engine.ops = _LedgerOps(self.engine.ops, self)
            elif not srv.get("unsafe_overlap"):  # (a test's knob: the overlap without the ledger, unsafe)
                self._overlap = False  # no ledger, nothing makes the next job's loads wait: serial
            try:
                self.serve = CoordinatorClient(srv["socket"], int(srv["job"]))
            except OSError as exc:  # not served, it would run over everyone's budget: it must not start
                raise RuntimeError(f"gpu-prefetch-sched serve: cannot reach the coordinator at {srv['socket']}: {exc}") from exc
        #: per kernel (or copy/memset API) name: [operations, unknown ones, bytes of the records
        #: predicted, launches with no owned record predicted]; names past KERNELS_MAX are pooled
        self.kernels: dict[str, list[int]] = {}
        self.why: dict[str, str] = {}  #: kernel -> why the predictor said unknown (the agent fills it)
        # parked physical memory (module docstring, "Parking"): under `run` only; serve's jobs
        # give their memory to each other, so a yield must leave none parked
        #: nothing to decide: a budget of the whole footprint or more, and no other job (`run` at
        #: --budget 100%); the native core then does not call the executor's hooks at all
        fraction = cfg.get("fraction")
        self.dormant = self.serve is None and fraction is not None and float(fraction) >= 1.0
        self.every_operation = not self.dormant
        settings = getattr(engine, "settings", None)  # (GPUOS_ENGINE_NO_PARK=1 turns parking off)
        #: the native core's fast path (``use_core``; on unless GPUOS_SCHED_FAST=0): under `run`
        #: only (serve's gate and ledger act on every operation)
        self.fast = (self.serve is None and not self.dormant
                     and bool(cfg.get("fast", getattr(settings, "fast", EngineSettings.fast))))
        self._core: Any = None
        self._fast_flag = 0  #: the core's flag that turns it on (``use_core``)
        self._fast_checked: tuple | None = None  #: the records' key when the core's cover was checked
        #: (records, sorted bases, small segments, version) at the last allowance: the replay's
        self._fast_books: tuple | None = None
        #: ((periods learned, p), the launch index it was taken at, one period's keys): ``_fast_horizon``'s
        self._cycle: tuple | None = None
        #: a queued operation's key -> what it gives the replay (``_replay_entry``), valid for
        #: ``_replay_for`` (the records' version, the predictor's epoch)
        self._replay_memo: dict[tuple, tuple | bool] = {}
        self._replay_for: tuple | None = None
        #: (kernel, sizes, args, addresses) of the launch ``before_launch`` last decided, for ``launch_addrs``
        self._launch: tuple | None = None
        self.fast_off: str | None = None  #: why the fast path went off, if it did
        self._api_of: Any = lambda cbid: ""
        self.counts.update({"fast_replayed": 0, "fast_late": 0, "fast_allowed": 0, "fast_allowances": 0,
                            "fast_allowed_none": 0, "fast_replay_s": 0.0, "fast_after_s": 0.0})
        #: last-use marks (``_mark``, ``_after_last_use``): an event on the operation's stream
        #: before each operation that enters Python, so that an eviction's save waits for its
        #: record's last use rather than for everything enqueued (on unless GPUOS_SCHED_LAST_USE=0)
        self._last_use = bool(cfg.get("last_use", getattr(settings, "last_use", EngineSettings.last_use)))
        self._seq = 0  #: operations decided or replayed so far (the order of last uses and marks)
        self._used_at: dict[int, int] = {}  #: record base -> the ``_seq`` of the last operation touching it
        #: record base -> the stream of the operations touching it since its last eviction (MIXED:
        #: more than one, or the per-thread default stream, which is one stream per thread)
        self._used_on: dict[int, int] = {}
        #: record base -> the stream of its uses before its last eviction (``_used_on`` then): the
        #: stream the mover orders after its load (``_ready_on_stream``)
        self._stream_before: dict[int, int] = {}
        self.counts.update({"ready_on_stream": 0, "ready_on_stream_skipped": 0, "ready_loading": 0})
        #: why the allocation an operation called for (a write not ready, a read not readable)
        #: was not marked, as things stood when the call came (``note_unready``)
        self.unready_why: dict[str, int] = {}
        self._unknown_at = -1  #: the ``_seq`` of the last operation touching every record
        self._unknown_on: int | None = None  #: the stream of those operations (MIXED: several)
        #: stream -> (ascending ``_seq``s, events): a mark's event completes once the operations
        #: before it on its stream have
        self._marks: dict[int, tuple[list[int], list[Any]]] = {}
        self._mark_free: list[Any] = []
        self.counts.update({"marks": 0, "last_use_saves": 0, "mark_errors": 0, "last_use_mixed": 0})
        #: where a decision's time goes (``_before``): the wait for the mover's lock, the policy,
        #: the evictions' issue, the require (its wait for room and loads), the marks and measures
        self.counts.update({"lock_wait_s": 0.0, "policy_s": 0.0, "evict_s": 0.0, "require_s": 0.0, "measure_s": 0.0})
        self._park = (self.serve is None and (settings is None or settings.park)
                      and hasattr(self.lib, "set_park_limit"))
        if self._park:
            self.lib.set_park_limit(PARK_LIMIT)
        self.counts["park_trims"] = 0
        # a fixed plan asks where its records are dead (the owned library's torch cache says),
        # and is made again with it: dropped there, they move no bytes
        self._dead = getattr(engine.ops, "dead", None) if (settings is None or settings.drop_dead) else None
        self.policy.sees_dead = (self._dead is not None and self.policy.plan == "fixed"
                                 and (settings is None or settings.dead_plan))
        self.counts.update({"dead_asked": 0, "dead_ask_s": 0.0, "ready_now": 0})
        self.policy.keep_leads = settings is None or settings.keep_leads

    # -- the hooks on the agent (gpuos_tools/agent/hooks.py) ------------------------------------

    def attach(self, agent: Agent) -> None:
        """Register on ``agent`` (the engine's): its launches, copies and memsets come to
        ``before`` first, its exit to ``at_exit``; serving, its operations wait at ``gate``."""
        self.why = agent.unknown_why
        agent.add_hooks(self)

    def offered(self) -> tuple[str, ...]:
        """The gate only when serving (else it would cost a call per operation)."""
        return tuple(name for name in super().offered() if name != "gate" or self.serve is not None)

    def before_launch(self, agent: Any, api: str, stream: int, kernel: str, sizes: Any, args: Any) -> None:
        """The records the launch reads or writes, by the agent's prediction (None: unknown)."""
        self._launch = None
        addrs = _touched_addrs(agent, kernel, sizes, args)
        if self._core is not None:  # the fast path's marks after this call use the same (``launch_addrs``)
            self._launch = (kernel, sizes, args, addrs)
        self.before(kernel, addrs, stream)

    def launch_addrs(self, agent: Any, kernel: str, sizes: Any, args: Any) -> tuple | list:
        """The addresses of the allocations a launch touches, for ``fast_after`` (empty when
        unknown): the ones this launch's ``before_launch`` found when it ran in this upcall (the
        same objects: a prediction per upcall, not two), else the agent's prediction now."""
        last, self._launch = self._launch, None
        if last is not None and last[0] is kernel and last[1] is sizes and last[2] is args:
            addrs = last[3]
        else:
            addrs = _touched_addrs(agent, kernel, sizes, args)
        return () if addrs is None else addrs

    def before_write(self, agent: Any, api: str, addr: int, stream: int, src: int) -> None:
        """Copies and memsets (a free is no decision). 3D copies and copies through CUDA arrays:
        the engine does not read their addresses and loads everything; the policy counts them
        unknown the same way."""
        if api.startswith(("cuMemcpy", "cuMemset")):
            self.before(api, None if opaque_copy(api) else [a for a in (addr, src) if a], stream)

    def before_graph(self, agent: Any, stream: int) -> None:
        self.before("cuGraphLaunch", None, stream)

    def at_exit(self, agent: Any) -> None:
        """The program ends: the mover stops, and the timeline and summary are written where the
        config says."""
        self.fast_drain()
        self.close()
        tl = self.cfg.get("timeline")
        if tl:
            data = self.timeline()
            data["summary"] = {k: v for k, v in self.summary().items() if not isinstance(v, (dict, list))}
            _write_json(tl, data, "timeline", separators=(",", ":"))
        path = self.cfg.get("summary")
        if path:
            _write_json(path, self.summary(), "summary")

    # -- the timeline ---------------------------------------------------------------------------

    def _event(self, kind: str, value: float, t: float | None = None) -> None:
        log = self._log
        if log is None:
            return
        if len(log) >= self._log_max:
            self._log_dropped += 1
            return
        log.append([round((time.perf_counter() if t is None else t) - self.t0, 6), kind, value])

    # -- the owned records -------------------------------------------------------------------

    def records(self) -> dict[int, int]:
        """base -> bytes of every owned record (released ones included), re-read when the
        allocator's counts moved."""
        st = self.lib.stats()
        key = (st["mallocs"], st["frees"], st["reserved_bytes"])
        if key != self._key:
            old = self._records
            table = self.lib.table()
            self._records = {r.base: r.size for r in table}
            # segments of small blocks: left out of the launches' keys (OnlinePolicy.before)
            self._small = {r.base for r in table if getattr(r, "block", 0)}
            if self.cfg.get("prepin", True) and self._may_evict():
                # pinning 64 MiB takes ~30 ms: on the mover, not on the program's thread at an eviction
                self._unpinned.extend(b for b in self._records if b not in old)
            self._bases = sorted(self._records)
            self._total = sum(self._records.values())
            self._key = key
            for b in [b for b in old if b not in self._records]:  # freed: a new record may take its address
                self._used_at.pop(b, None)
                self._used_on.pop(b, None)
                self._stream_before.pop(b, None)
            if self.ledger is not None:
                self._book_records(old)
        return self._records

    # -- the ledger (serving): this job's booked bytes -------------------------------------------

    def _book_records(self, old: dict[int, int]) -> None:
        """The allocator's counts moved: records that went are unbooked (late: conservative);
        every record mapped and not booked is booked now (an allocation, mapped by the allocator
        when it was made: the ledger may pass its total, an allocation is the program's; an
        address reused by a new allocation too), and a booked one whose size changed follows."""
        eng = self.engine
        with eng.lock, self._book:
            for b in [b for b in self._charged if b not in self._records]:
                self.ledger.uncharge(self._charged.pop(b))
            new = 0
            for b, size in self._records.items():
                if b in self._charged:
                    if self._charged[b] != size:
                        diff = size - self._charged[b]
                        self._charged[b] = size
                        if diff > 0:
                            new += diff
                        else:
                            self.ledger.uncharge(-diff)
                elif eng.state(b) != "released":
                    self._charged[b] = size
                    new += size
            self.ledger.charge(new, "alloc")

    def _book_load(self, bases, force: bool = False) -> bool:
        """Reserve in the ledger the records of ``bases`` that a load would map (released, not
        booked yet), if all the jobs' bytes and these fit in the budget (or ``force``: booked
        anyway, counted). ``_load_lock`` held. True when booked (or nothing to book)."""
        if self.ledger is None:
            return True
        eng = self.engine
        with eng.lock, self._book:
            todo = {b: self._records[b] for b in bases if b in self._records and b not in self._charged
                    and b in eng.pending and eng.pending[b].state == "released"}
            if not self.ledger.reserve(sum(todo.values()), force):
                return False
            self._charged.update(todo)
        if force and todo:
            self.turns["forced_loads"] += 1
        return True

    def _unbook_unloaded(self, bases) -> None:
        """Reserved records that were not loaded after all (freed meanwhile): unbooked."""
        if self.ledger is None:
            return
        eng = self.engine
        with eng.lock, self._book:
            for b in bases:
                if b in self._charged and b in eng.pending and eng.pending[b].state == "released":
                    self.ledger.uncharge(self._charged.pop(b))

    def _on_map(self, base: int) -> None:
        """The engine maps ``base`` (its lock held): booked before, else booked now (counted)."""
        with self._book:
            if base in self._charged:
                return
            r = self.engine.ops.lookup(base)
            size = r.size if r is not None else self._records.get(base, 0)
            self._charged[base] = size
            self.turns["unreserved_maps"] += 1
            self.ledger.charge(size, "unreserved")

    def _on_unmap(self, base: int) -> None:
        """The engine released ``base`` (its lock held; the entry still says evicting): unbooked,
        after the unmap."""
        with self._book:
            size = self._charged.pop(base, 0)
            self.ledger.uncharge(size)
        self._say_inflight(exclude=base)

    def _evicting(self, exclude: int | None = None) -> int:
        """Bytes of this job's evictions issued and not released yet (mapped meanwhile)."""
        eng = self.engine
        with eng.lock:
            return sum(e.size for e in eng.pending.values() if e.state == "evicting" and e.base != exclude)

    def _say_inflight(self, exclude: int | None = None) -> None:
        """This job's evictions in flight, in the ledger when they changed (computed and written
        under the engine's lock: two threads never write them out of order)."""
        if self.ledger is None:
            return
        with self.engine.lock:
            n = self._evicting(exclude)
            if n != self._inflight_said:
                self._inflight_said = n
                self.ledger.set_inflight(n)

    def policy_total(self) -> int:
        """The serve's total (the budget of a job alone)."""
        return self.ledger.total if self.ledger is not None else self._budget + self._others

    def _room_from_coordinator(self, want: int, budget: int) -> int:
        """Serving, a launch's working set is larger than this job's budget (the others keep
        too much: its want was not known): ask the coordinator to trim the waiting jobs for
        ``want`` and wait (up to NEED_WAIT_S) for the budget that follows; the budget now."""
        c = self.serve
        self._ask_room(want)
        t = time.perf_counter()
        while time.perf_counter() - t < NEED_WAIT_S and not c.gone:
            msg = c.update
            if msg is not None and int(msg["budget"]) >= want:
                c.update = None
                self._set_budget(int(msg["budget"]), int(msg["others"]))
                self.turns["budget_updates"] += 1
                return int(msg["budget"])
            time.sleep(POLL_S * 4)
        return budget

    def _ask_room(self, want: int) -> None:
        """Tell the coordinator this job, holding the turn, needs ``want`` bytes mapped: it trims
        the waiting jobs for it (``need``)."""
        c = self.serve
        if c is None:
            return
        self._want = max(self._want, want)
        try:
            c.send({"op": "need", "want": self._want})
            self.turns["room_asks"] += 1
        except OSError:
            pass

    def _squeeze(self, ws, need: int) -> bool:
        """A load of this job's does not fit in the ledger although it fits in the job's budget,
        and nothing is in flight anywhere: the others hold more than the coordinator said (an
        allocation not reported yet). Evict this job's own records outside ``ws`` (the policy's
        order) to make the room (agent's lock held: inside an operation's callback). True when
        evictions were issued."""
        snap = self.ledger.snapshot()
        short = snap["sum"] + need - self.ledger.total
        if short <= 0:
            return False
        with self._load_lock:
            recs = self.records()
            victims = [b for op, b in self.policy.shed(max(0, self.policy.used - short), recs, protect=set(ws))
                       if op == "evict"]
            for b in victims:
                self._evict(b)
        self._say_inflight()
        self.turns["squeezes"] += 1
        return bool(victims)

    def _may_evict(self) -> bool:
        """Whether a record may ever be evicted: not under a budget of 100% or more of the owned
        bytes, which grows with them (and no serving, whose switches evict). Pinning a host copy
        holds the driver's lock (~30 ms per 64 MiB), during which the program's launches wait:
        on an H200 a CNN's 2.3 GB of records pinned at 100% took 0.6 s, into its timed loop."""
        fraction = self.cfg.get("fraction")
        return self.serve is not None or self.cfg.get("serve") is not None or fraction is None or fraction < 1

    def bases_of(self, addrs) -> list[int]:
        """The records holding any of ``addrs`` (others: not owned, nothing to do)."""
        return _bases_in(addrs, self._bases, self._records)

    def physical(self) -> int:
        """Bytes of physical memory the owned records hold now: all but the released ones are
        mapped, and released ones' parked memory is still held."""
        eng = self.engine
        if not eng.pending:  # nothing released (the common case with room for everything); a
            return self._total + self._parked()  # released record the program freed may leave memory parked
        with eng.lock:  # a release parks its memory and says RELEASED under it: read both at once
            return self._total - eng.released_bytes + self._parked()

    def _parked(self) -> int:
        return self.lib.parked_bytes() if self._park else 0

    def _fits(self, bases, need: int, budget: int) -> bool:
        """Whether loading the released records among ``bases`` (``need`` bytes) fits under
        ``budget`` (``_load_lock`` held: the load it allows comes before the next check). Parked
        memory of a record's size is mapped again by its load, so it is not counted twice; when
        the room is short by parked memory that no load here maps again, what it is short by goes
        back to the driver first (all of it, when the oldest parked were of the load's sizes)."""
        phys = self.physical()
        if phys + need <= budget:
            return True
        if not self._park:
            return False
        sizes: dict[int, int] = {}
        eng = self.engine
        with eng.lock:
            for b in bases:
                e = eng.pending.get(b)
                if e is not None and e.state == "released":
                    sizes[e.size] = sizes.get(e.size, 0) + e.size
        reuse = sum(min(n, self.lib.parked(size)) for size, n in sizes.items())
        if phys + need - reuse <= budget:
            return True
        parked = self.lib.parked_bytes()
        if parked:
            # only what the room is short by goes back to the driver (the oldest parked first):
            # memory released and created again costs driver calls and a clearing copy, and on
            # a job of many record sizes (an LLM's weights) dropping all of it at every shortfall
            # gave most loads new memory
            self.lib.trim_parked(max(0, parked - (phys + need - reuse - budget)))
            self.counts["park_trims"] += 1
            reuse = sum(min(n, self.lib.parked(size)) for size, n in sizes.items())
            return self.physical() + need - reuse <= budget
        return False

    # -- the native core's fast path (docs/native-core.md, "The fast path") ---------------------

    def use_core(self, core: Any, api_of: Any, flag: int) -> None:
        """Run the fast path on ``core`` (injection/core.py NativeCore; the agent's lock is its
        lock; ``api_of``: cbid -> API name; ``flag``: the core's flag that turns it on): from the
        next decision on, the core lets the operations go by whose records are marked ready
        while the policy allows (``fast_after``), and queues them for ``fast_replay``."""
        self._core = core if self.fast else None
        self._api_of = api_of
        self._fast_flag = flag

    def fast_replay(self, entries: list[tuple], act: bool = True) -> None:
        """The operations the core let go by, in order (core.py ``parse_fast``), into the books
        as if each had been decided when it ran: the policy's decision (the period, recency,
        counts), the kernel profile, the engine's launch order and recency (agent's lock held,
        before this operation's own decision). An action one of them yields (the plan changed
        meanwhile: a key off the period) is carried out now, late, and counted (with ``act``
        False, at the program's end, only counted).

        The loop repeats its operations, so what an operation's ids or addresses give (its
        records, the launch key's records, their bytes) is kept per operation key until the
        records or the predictor's allocations change (``_replay_entry``); the mover's lock is
        taken once for the batch, not once per operation."""
        if not entries:
            return
        t = time.perf_counter()
        eng = self.engine
        # the records as they were when these operations went by: no allocation came or went
        # between the allowance and them (the core calls at the first operation after one)
        books = self._fast_books
        if books is None:
            self.records()
            books = (self._records, self._bases, self._small, self._key)
        recs, _, _, version = books
        memo_for = (version, eng.agent.pred.epoch)
        if self._replay_for != memo_for:
            self._replay_memo.clear()
            self._replay_for = memo_for
        memo = self._replay_memo
        before = self.policy.before
        # under a fixed plan, an operation the plan has nothing for only moves its phase on
        fixed_next = self.policy.fixed_next if self.policy.plan == "fixed" else None
        profile = self._profile
        launched, touched_now = eng._launched, eng._touched
        used, on = self._used_at, self._used_on
        late = 0
        if eng.clean:
            # first the writes, as the engine's hook takes them: a clean record written is clean
            # no more (its host copy is stale), before any action below, or a decision after
            # this replay, evicts it on the strength of a copy that is no longer current
            self._replay_writes(entries)
        with self._load_lock:
            for e in entries:
                if e[0] == "launch":
                    kernel, touched = e[4], e[6]
                    launched(kernel)
                    for i in touched:
                        touched_now(i)
                    if eng.clean:  # the predicted readers of clean records, as the engine's hook keeps them
                        writes = e[5]
                        for i in touched:
                            if i not in writes:
                                b = eng._id_base(i)
                                if b in eng.clean:
                                    eng._read_while_clean(b, kernel)
                    mk = (kernel, touched)
                else:
                    mk = (e[2], e[4], e[5])
                hit = memo.get(mk)
                if hit is None:
                    hit = memo[mk] = self._replay_entry(e, books)
                if hit is False:  # a write that is no decision (not a copy or memset)
                    continue
                kernel, bases, key, nbytes = hit
                seq = self._seq
                self._seq = seq + 1
                stream = e[3]
                for b in bases:
                    used[b] = seq
                    was = on.get(b)
                    if was != stream:
                        on[b] = _one_stream(was, stream)
                profile(kernel, bases, recs, nbytes)
                if fixed_next is not None and fixed_next(kernel):
                    continue
                actions = before(kernel, bases, recs, key, version)
                if (len(actions) != 1 or actions[0][0] != "require") and any(op != "require" for op, _ in actions):
                    late += 1  # an action besides the require: carried out late
                    if act:
                        for op, arg in actions:
                            if op == "evict":
                                self._evict(arg)
                        for op, arg in actions:
                            if op == "prefetch":
                                self._start_mover()
                                self._moves.put(arg)
            self._budget = self.policy.last_budget
        self.policy.dead_ask()  # a phase replayed is past: what is dead now is not what was there
        c = self.counts
        c["fast_replayed"] += len(entries)
        c["fast_late"] += late
        c["fast_replay_s"] += time.perf_counter() - t
        self._measure(self._budget, False)

    def note_unready(self, addr: int) -> None:
        """An operation called because the allocation starting at ``addr`` had no mark it needed
        (agent's lock held, before the replay and the decision): counted by why, as things stand
        now (``unready_why`` in the summary): not an owned record; a record the policy's books
        do not hold (freed, new, or evicted); one the engine has an entry for (its state); or
        a resident one whose mark went (an eviction since cancelled, or never marked since its
        load) -- the last is what more marks could save."""
        b = self.bases_of((addr,))
        if not b:
            why = "not_owned"
        elif b[0] not in self.policy.resident:
            why = "not_in_books"
        else:
            e = self.engine.pending.get(b[0])
            why = "resident_unmarked" if e is None else e.state
        self.unready_why[why] = self.unready_why.get(why, 0) + 1

    def _replay_writes(self, entries: list[tuple]) -> None:
        """What the queued operations write (a launch's predicted writes, a copy's or memset's
        destination), told to the engine, which takes it off its clean set. The core lets a
        write to a clean record go by (its mark is ready), so this is where the engine learns
        of it."""
        api_of = self._api_of
        ids = [i for e in entries if e[0] == "launch" for i in e[5]]
        addrs = [e[4] for e in entries
                 if e[0] != "launch" and e[4] and api_of(e[2]).startswith(("cuMemcpy", "cuMemset"))]
        self.engine.written(ids, addrs)

    def _replay_entry(self, e: tuple, books: tuple) -> tuple | bool:
        """What a queued operation gives the replay: (its kernel or API name, the records it
        touches, those that key it, their bytes for the profile); False for a write that is not
        a copy or memset (no decision)."""
        recs, bases_list, small, _ = books
        if e[0] == "launch":
            kernel = e[4]
            by_id = self.engine.agent.by_id
            addrs = [by_id[i].addr for i in e[6] if i in by_id]
        else:
            kernel = self._api_of(e[2])
            if not kernel.startswith(("cuMemcpy", "cuMemset")):
                return False
            addrs = [a for a in (e[4], e[5]) if a]
        bases = _bases_in(addrs, bases_list, recs)
        key = None if not small else [b for b in bases if b not in small]
        return kernel, bases, key, sum(recs.get(b, 0) for b in set(bases))

    def fast_after(self, addrs, stream: Any = None) -> None:
        """After an operation's decision and the engine's hook (agent's lock held): the
        allocations at ``addrs`` (its records and others) marked ready or not, and the number of
        next decisions the core may let go by (``_fast_horizon``). ``stream``: the operation's,
        whose wait for a record still loading lets later operations on it go by too."""
        core = self._core
        if core is None:
            return
        t = time.perf_counter()
        try:
            self._fast_after(core, addrs, stream)
        finally:
            self.counts["fast_after_s"] += time.perf_counter() - t

    def _fast_after(self, core: Any, addrs, stream: Any = None) -> None:
        recs = self.records()
        self._fast_books = (self._records, self._bases, self._small, self._key)  # what the next replay uses
        if self._key != self._fast_checked:
            # the core marks allocations: an owned record it did not see mapped (its map not
            # through the interposer or CUPTI) could never lose a mark it does not have, and an
            # operation on it would look like one on host memory: no fast path then
            self._fast_checked = self._key
            missing = core.fast_uncovered(recs)
            if missing:
                self.fast_off = f"{missing} owned records not seen by the native core"
                self._core = None
                core.fast_allow(0)
                core.set_flag(self._fast_flag, False)
                return
        eng = self.engine
        ready: list[int] = []
        unready: list[int] = []
        on_stream: list[int] = []  #: still loading, the operation's stream made to wait for the load
        loading_ok = stream is not None and stream != PER_THREAD_STREAM and not self._closing
        with eng.lock:  # the engine's threads change pending and clean under it
            for a in addrs:
                b = self.bases_of((a,))
                if not b:  # not owned: nothing to do on it
                    ready.append(a)
                    continue
                e = eng.pending.get(b[0])
                if b[0] not in self.policy.resident:
                    unready.append(a)
                elif e is None:
                    # ready, clean or not: a write to a clean record that goes by reaches the
                    # engine in the replay, before any eviction can ask whether it is clean
                    ready.append(a)
                elif loading_ok and e.state == LOADING and stream in e.ordered:
                    # loaded for this operation (a demand load): its stream waits for the load
                    # already, so the next operations on that stream may touch it without a
                    # call, as after the mover's loads (``_ready_on_stream``); others still call
                    on_stream.append(a)
                else:
                    unready.append(a)
            if on_stream:
                capturing = getattr(eng.ops, "capturing", None)
                if capturing is not None and capturing(stream):  # its wait would be in the graph
                    unready += on_stream
                    on_stream = []
            core.fast_mark(unready, 0)
            core.fast_mark(ready, 2)
            if on_stream:
                core.fast_mark_on(on_stream, 2, stream)
                self.counts["ready_loading"] += len(on_stream)
        n = self._fast_horizon()
        self.counts["fast_allowed"] += n
        self.counts["fast_allowances"] += 1
        self.counts["fast_allowed_none"] += n == 0
        core.fast_allow(n)

    def _fast_horizon(self) -> int:
        """How many next decisions have no action, if the learned period holds: under the count
        plan, the decision of a launch prefetches the working sets of the ``lookahead`` launches
        after it and evicts only for a record not resident (or over the budget); so, with d the
        first predicted launch whose working set is unknown or not all resident, the d - 1 -
        lookahead launches before the one that prefetches for it. Under the time plan a decision
        walks its first max(lookahead, 1) launches and stops at the first launch after them that
        needs nothing (nothing queued, nothing missing: its copies take no time), so one launch
        more than the count plan's must be resident. Under a fixed plan, up to its next acting
        phase. While a duration sample is open (the time and fixed plans), 0: the next operation
        closes it (``_sample_end``). 0 (every decision calls) under proactive
        eviction, while digests of conservative kernels are kept (their launches must drop them),
        without a period, or above the budget. A launch off the period is caught by
        ``fast_replay`` (a late action)."""
        pol, eng = self.policy, self.engine
        if pol.proactive or (eng.conservative and eng.digests) or self._open is not None:
            return 0
        quiet = pol.fixed_quiet(FAST_MAX)
        if quiet >= 0:  # a fixed plan: up to its next action (records it did not load are not marked)
            return quiet
        per = pol.period
        p = per.known
        if p is None or pol.used > pol.last_budget:
            return 0
        ahead = pol.lookahead if pol.plan == "count" else max(pol.lookahead, 1) + 1
        res, sets = pol.resident, pol._sets
        # the predicted keys without predicting: while a period holds, the key of launch i is
        # the key of launch i - p, so one period's keys, taken once per period learned (as the
        # policy's phase table is), rotated by the launches since give every prediction; the
        # walk then costs what it looks at (predicting up to 4096 keys at every call cost more
        # than the decisions it saved)
        cyc = self._cycle
        if cyc is None or cyc[0] != (per.learned, p):
            cyc = self._cycle = ((per.learned, p), per.n, per.predict(p))
        keys, rot = cyc[2], (per.n - cyc[1]) % p
        limit = min(p, FAST_MAX) + ahead
        d = limit + 1
        for j in range(limit):
            ws = sets[keys[(rot + j) % p]]
            if ws is None or any(b not in res for b in ws):
                d = j + 1
                break
        return max(0, min(FAST_MAX, d - 1 - ahead))

    def fast_drain(self) -> None:
        """The core's queue replayed now (at the program's end: the summary counts everything)."""
        core = self._core
        if core is None:
            return
        agent = self.engine.agent
        with agent.lock:
            self.fast_replay(core.fast_take(), act=False)

    # -- per operation (program thread, agent's lock held) ----------------------------------

    def before(self, kernel: str, addrs, stream: Any) -> None:
        """Before an operation touching the allocations at ``addrs`` (None: unknown)."""
        t = time.perf_counter()
        try:
            self._before(kernel, addrs, stream)
        finally:
            self.counts["before_s"] += time.perf_counter() - t
            self.counts["decisions"] += 1

    def _before(self, kernel: str, addrs, stream: Any) -> None:
        if self._timing:
            self._sample_end(stream)
        recs = self.records()
        if self._unpinned and getattr(self.engine.agent, "ctx", None) is not None:
            # the mover pins in the program's context, known once the program has made it current
            self._start_mover()
            for b in self._unpinned:
                if b in recs:
                    self._moves.put(("pin", b, recs[b]))
            self._unpinned.clear()
        over_before = self.policy.stats.over_budget
        bases = None if addrs is None else self.bases_of(addrs)
        seq = self._seq
        self._seq = seq + 1
        if bases is None:
            self._unknown_at = seq
            self._unknown_on = _one_stream(self._unknown_on, stream)
        else:
            used, on = self._used_at, self._used_on
            for b in bases:
                used[b] = seq
                was = on.get(b)
                if was != stream:
                    on[b] = _one_stream(was, stream)
        self._profile(kernel, bases, recs)
        clock = time.perf_counter
        c = self.counts
        t0 = clock()
        with self._load_lock:  # the mover checks the policy's books and loads under it too
            t1 = clock()
            c["lock_wait_s"] += t1 - t0
            key = None if bases is None or not self._small else [b for b in bases if b not in self._small]
            actions = self.policy.before(kernel, bases, recs, key, self._key)
            t0 = clock()
            c["policy_s"] += t0 - t1
            self._budget = budget = self.policy.last_budget
            over = self.policy.stats.over_budget != over_before
            if over:
                self._over_pending = True  # the mover's measures meanwhile must not count it
            if self._log is not None and budget != self._log_budget:
                self._log_budget = budget
                self._event("budget", budget)
            for op, arg in actions:
                if op == "evict":
                    self._evict(arg)
        t1 = clock()
        c["evict_s"] += t1 - t0
        if self.ledger is not None and any(op == "evict" for op, _ in actions):
            self._say_inflight()
        for op, arg in actions:
            if op == "require":
                self._require(arg, recs, budget, stream)
            elif op == "prefetch":
                self._start_mover()
                self._moves.put(arg)
        t0 = clock()
        c["require_s"] += t0 - t1
        ask = self.policy.dead_ask() if self.policy.sees_dead else None
        if ask is not None:
            self._note_dead(*ask)
        if self._last_use:
            self._mark(seq, stream)
        if self._timing:
            self._sample_start(stream)
        self._measure(budget, over)
        self._over_pending = False
        c["measure_s"] += clock() - t0

    def _note_dead(self, phase: int, bases: tuple[int, ...]) -> None:
        """Tell the policy which of ``bases`` are dead now, before the launch of ``phase``."""
        t = time.perf_counter()
        dead = self._dead
        try:
            self.policy.note_dead(phase, [b for b in bases if dead(b)])
        except Exception as exc:  # noqa: BLE001 (the plan stays as it is)
            self.policy.sees_dead = False
            self.error = f"dead records: {type(exc).__name__}: {exc}"
        self.counts["dead_asked"] += len(bases)
        self.counts["dead_ask_s"] += time.perf_counter() - t

    # -- last-use marks -------------------------------------------------------------------------

    def _mark(self, seq: int, stream: Any) -> None:
        """An event on ``stream`` before operation ``seq`` is enqueued: once it completes, every
        operation before ``seq`` on that stream has. The newest MARKS are kept; an older event
        is recorded again (a wait enqueued on it already keeps the point it was recorded at)."""
        try:
            ev = self._mark_free.pop() if self._mark_free else self.engine.ops.event()
            self.engine.ops.record(ev, stream)
        except Exception as exc:  # noqa: BLE001 (no marks: every save waits for everything enqueued)
            self._last_use = False
            self.counts["mark_errors"] += 1
            self.error = f"last-use marks off: {type(exc).__name__}: {exc}"
            return
        marks = self._marks.get(stream)
        if marks is None:
            marks = self._marks[stream] = ([], [])
        seqs, evs = marks
        seqs.append(seq)
        evs.append(ev)
        self.counts["marks"] += 1
        if len(seqs) > 2 * MARKS:
            self._mark_free += evs[:MARKS]
            del seqs[:MARKS], evs[:MARKS]

    def _after_last_use(self, base: int) -> Any:
        """The first mark after the record's last use on the stream of its uses, for its
        eviction's save to wait on; None (the save waits for everything enqueued) without marks,
        when operations on more than one stream touched it since its last eviction (an operation
        touching every record counts on each: a mark orders one stream; the per-thread default
        stream is one per thread of the program), or when no mark on that stream came since. The
        program's other streams do not matter: their operations do not touch the record."""
        if not self._last_use:
            return None
        s = self._used_on.get(base)
        u = self._unknown_on
        if s is None:
            s = u if u is not None else 0  # untouched since its load: any stream's mark will do
        elif u is not None and u != s:
            s = MIXED
        if s == MIXED:
            self.counts["last_use_mixed"] += 1
            return None
        marks = self._marks.get(s)
        if marks is None:
            return None
        last = max(self._used_at.get(base, -1), self._unknown_at)
        i = bisect_right(marks[0], last)
        return marks[1][i] if i < len(marks[1]) else None

    # -- the time plan's durations --------------------------------------------------------------

    def _sample_start(self, stream: Any) -> None:
        """One operation in SAMPLE_EVERY: a timer event on its stream after the require's waits,
        just before the driver enqueues it; the next operation's ``_sample_end`` closes it.
        Between the two events the stream runs this operation alone, so their interval is its
        GPU time without the waits for its loads; where the GPU then waits for the host to
        enqueue the next operation, the interval includes that wait too: the time until the next
        operation can start, which is what the plan needs. Two event records per sample (a few
        µs), none on the other operations beyond a counter."""
        self._ops_n += 1
        if self._ops_n % SAMPLE_EVERY or len(self._samples) >= SAMPLES_MAX:
            return
        try:
            ev = self._timers.pop() if self._timers else self.engine.ops.timer()
            self.engine.ops.record(ev, stream)
            self._open = (self.policy.last_key, stream, ev)
        except Exception as exc:  # noqa: BLE001 (no samples: the plan falls back to the lookahead)
            self._sample_failed(exc)

    def _sample_end(self, stream: Any) -> None:
        """Before the next operation's require: the end event of the open sample, when this
        operation is on the same stream (else the interval would not be one operation's); then
        the samples whose events completed go to the policy."""
        ops = self.engine.ops
        try:
            if self._open is not None:
                key, s, start = self._open
                self._open = None
                if _same_stream(s, stream):
                    end = self._timers.pop() if self._timers else ops.timer()
                    ops.record(end, stream)
                    self._samples.append((key, start, end))
                else:
                    self._timers.append(start)
            while self._samples and ops.done(self._samples[0][2]):
                key, start, end = self._samples.pop(0)
                self.policy.note_duration(key, ops.elapsed_ms(start, end) / 1e3)
                self.counts["samples"] += 1
                self._timers += (start, end)
        except Exception as exc:  # noqa: BLE001
            self._sample_failed(exc)

    def _sample_failed(self, exc: Exception) -> None:
        self._timing = False
        self.counts["sample_errors"] += 1
        self.error = f"duration samples off: {type(exc).__name__}: {exc}"

    def _profile(self, kernel: str, bases: list[int] | None, recs: dict[int, int], nbytes: int | None = None) -> None:
        """One launch in the kernel profile; ``nbytes``: its records' bytes, where the caller kept them."""
        k = self.kernels.get(kernel)
        if k is None:
            if len(self.kernels) >= KERNELS_MAX:
                kernel = "(other kernels)"
                k = self.kernels.get(kernel)
            if k is None:
                k = self.kernels[kernel] = [0, 0, 0, 0]
        k[0] += 1
        if bases is None:
            k[1] += 1
        else:
            k[2] += sum(recs.get(b, 0) for b in set(bases)) if nbytes is None else nbytes
            k[3] += not bases

    def kernel_profile(self, top: int = 40) -> dict[str, Any]:
        """What the predictions looked like per kernel: the most launched ``top`` names and every
        unknown one, each with its operations, unknown ones, mean predicted owned bytes, and (for
        unknown ones) the predictor's reason."""
        rows = sorted(self.kernels.items(), key=lambda kv: -kv[1][0])
        keep = [kv for i, kv in enumerate(rows) if i < top or kv[1][1]]
        ops = sum(v[0] for v in self.kernels.values())
        unknown = sum(v[1] for v in self.kernels.values())
        return {
            "names": len(self.kernels), "operations": ops, "unknown": unknown,
            "unknown_share": round(unknown / ops, 6) if ops else 0.0,
            "no_owned": sum(v[3] for v in self.kernels.values()),
            "top": [{"kernel": name[:160], "ops": v[0], "unknown": v[1],
                     "mean_bytes": (v[2] // (v[0] - v[1])) if v[0] > v[1] else None,
                     **({"why": self.why.get(name, "")[:240]} if v[1] else {})} for name, v in keep],
        }

    def _evict(self, base: int, own: int = 1) -> None:
        """``own``: operations of this thread being issued (1 inside an operation's callback; 0
        at serve's gate, before the operation's callback)."""
        if self._core is not None:  # no operation on it goes by the hooks from now on
            self._core.fast_unready(base, self._records.get(base, 1))
        try:
            after = self._after_last_use(base) if own else None
            ok = self.engine.evict_from_operation(base, own, after)
            if ok:
                # later saves of it come after this one's wait on the evict stream: its uses from
                # here on are what a later eviction waits for
                was = self._used_on.pop(base, None)
                if was is not None:
                    self._stream_before[base] = was
                if after is not None:
                    self.counts["last_use_saves"] += 1
        except Exception as exc:  # noqa: BLE001 (safe: it stays resident, over the budget)
            ok = False
            self.error = f"evict {base:#x}: {type(exc).__name__}: {exc}"
        if not ok:
            self.counts["evict_refused"] += 1
        else:
            self._event("evict", self._records.get(base, 0))

    def _measure(self, budget: int, over_budget: bool) -> None:
        """Mapped bytes after a decision (or a prefetch): the peak; and, from the first time
        they were within the budget since the last allocation or over-budget launch, the peak
        and the decisions that found them above it."""
        now = self.physical()
        self._event("mapped", now)
        c = self.counts
        c["peak_resident"] = max(c["peak_resident"], now)
        cut = budget < self._measured_budget and self.policy.fraction is not None
        self._measured_budget = budget
        if cut:  # the settled peak is the one under the budget the run ends with
            c["peak_settled"] = 0
        if self._key != self._settled_key or over_budget or self._over_pending or cut:
            # the program allocated (its new memory is mapped at once), a launch needed more
            # than the budget, or a percentage budget shrank (a period learned: online.py):
            # above it until the evictions that follow complete
            self._under = False
            self._settled_key = self._key
        if not self._under and now <= budget:
            self._under = True
            c["settled"] += 1
        if self._under:
            c["peak_settled"] = max(c["peak_settled"], now)
            if now > budget and not over_budget:
                c["over_physical"] += 1
            if self.serve is not None:  # this job's part; the combined peak is the ledger's (serve.py)
                self._turn_peak = max(self._turn_peak, now)
                self.turns["turn_peak_max"] = max(self.turns["turn_peak_max"], now)
        if self.ledger is not None:
            self._say_inflight()

    def _released(self, bases) -> int:
        eng = self.engine
        with eng.lock:
            return sum(eng.pending[b].size for b in bases if b in eng.pending and eng.pending[b].state == "released")

    def _require(self, bases, recs: dict[int, int], budget: int, stream: Any) -> None:
        """The engine's require of ``bases`` (None: all), once what it loads fits under the
        budget beside what is mapped: evictions in flight free the room (a host wait, a stall)."""
        if bases is not None and not self.engine.pending:
            # nothing released, loading or evicting: the engine's require would do nothing.
            # Entries are added only by evictions (this thread's, or the engine's evict thread
            # under the agent's lock, which this callback holds) and adopt (under it too)
            return
        ws = list(recs) if bases is None else bases
        ws_bytes = sum(recs[b] for b in ws if b in recs)
        too_big = ws_bytes > budget  # over budget anyway: no wait
        if too_big and self.serve is not None and self._released(ws) and ws_bytes <= self.policy_total():
            budget = self._room_from_coordinator(ws_bytes, budget)  # the others trimmed for it
            too_big = ws_bytes > budget
        t = time.perf_counter()
        waited = False
        led_t: float | None = None  # since when the ledger (the other jobs' bytes) holds it back
        asked: float | None = None  # when the coordinator was asked for the room (``need``)
        squeezed = False
        self._demand.set()  # the mover holds off: the launch at hand goes first
        try:
            while True:
                with self._load_lock:
                    need = self._released(ws)
                    late = time.perf_counter() - t > ROOM_TIMEOUT_S
                    if not need or too_big or late or self._fits(ws, need, budget):
                        # serving: the ledger too; past the budget only when waiting cannot help
                        stuck = False
                        if need and self.ledger is not None and not late:
                            stuck = squeezed and not self.ledger.anything_in_flight()
                        elif self.ledger is None:
                            stuck = too_big
                        with self.engine.lock:  # no release between the booking and the loads it books
                            booked = self._book_load(ws, force=late or stuck)
                            if booked:
                                if late:
                                    self.counts["room_timeouts"] += 1
                                if need:
                                    self._event("load", need)
                                self.engine.require(bases, stream)
                                self._unbook_unloaded(ws)
                        if booked:
                            break
                        now = time.perf_counter()
                        if led_t is None:
                            led_t = now
                        need_now = 0
                        if not self.ledger.anything_in_flight():
                            # waiting cannot help: first the coordinator trims the waiting jobs
                            # for this job's want; then this job evicts its own records (the
                            # others hold more than it knew); then the load goes over, counted
                            if asked is None:
                                asked = now
                                self._ask_room(self.physical() + need)
                            elif not squeezed and now - asked > NEED_WAIT_S:
                                squeezed = True
                                need_now = need
                    else:
                        need_now = 0
                if need_now:
                    self._squeeze(ws, need_now)
                elif led_t is not None:
                    self._say_inflight()  # an eviction of this job's that failed is in flight no more
                waited = True
                time.sleep(POLL_S)
        finally:
            self._demand.clear()
        if led_t is not None:
            self.turns["ledger_waits"] += 1
            self.turns["ledger_wait_s"] += time.perf_counter() - led_t
        if waited:
            self.counts["room_waits"] += 1
            self.counts["room_wait_s"] += time.perf_counter() - t
            self._event("wait", round(time.perf_counter() - t, 6), t)

    # -- the mover ----------------------------------------------------------------------------

    def _start_mover(self) -> None:
        if self._mover is None:
            self._mover = threading.Thread(target=self._move_loop, name="gpuos-sched-mover", daemon=True)
            self._mover.start()

    def _move_loop(self) -> None:
        relax_capture()  # its pinning and loads must not break a graph the program captures meanwhile
        eng = self.engine
        while True:
            base = self._moves.get()
            if base is None:
                return
            if self._closing:
                continue
            if isinstance(base, tuple):  # ("pin", base, size): the engine's host copy, made ahead
                try:
                    eng.pin_host(base[1], base[2])
                    self.counts["pins"] += 1
                except Exception as exc:  # noqa: BLE001 (the eviction pins it then, on the program's thread)
                    self.counts["pin_errors"] += 1
                    self.counts["pin_error"] = f"{type(exc).__name__}: {exc}"
                continue
            try:
                t = time.perf_counter()
                issued = None  #: the event of the load issued, if one was
                dead_before = eng.counts["dead_loads"]
                while not self._closing:
                    with self._load_lock:
                        if self._hold or base not in self.policy.resident:  # evicted again, or a switch came
                            self.counts["prefetch_skipped"] += 1
                            break
                        if not self._demand.is_set():
                            need = self._released([base])
                            late = time.perf_counter() - t > ROOM_TIMEOUT_S
                            if self.ledger is not None and (not need or late or self.physical() + need <= self._budget):
                                # serving: a prefetch never goes past the ledger; when waiting
                                # cannot help (nothing in flight) or took too long, it is dropped
                                # (the launch that needs the record loads it on demand)
                                with eng.lock:  # no release between the booking and the load
                                    booked = self._book_load([base])
                                    if booked:
                                        if need:
                                            self._event("prefetch", need)
                                        eng.prefetch(base)
                                        self._unbook_unloaded([base])
                                if booked:
                                    break
                                if late or not self.ledger.anything_in_flight():
                                    self.turns["prefetch_no_room"] += 1
                                    self.policy.forget(base)
                                    break
                            elif not need or late or self._fits([base], need, self._budget):
                                if late:
                                    self.counts["room_timeouts"] += 1
                                # a load from the engine's own host copy leaves it clean until written
                                if need:
                                    self._event("prefetch", need)
                                issued = eng.prefetch(base)
                                break
                    time.sleep(POLL_S)
                if issued is not None:  # after the mover's lock: the core lock comes first elsewhere
                    self._ready_on_stream(base, issued)
                elif self._core is not None and eng.counts["dead_loads"] != dead_before:
                    self._ready_now(base)  # mapped with nothing to copy: resident now
                self._measure(self._budget, False)
            except Exception as exc:  # noqa: BLE001 (the launch that needs it loads it on demand)
                self.counts["mover_errors"] += 1
                self.error = f"{type(exc).__name__}: {exc}"

    def _ready_on_stream(self, base: int, ev: Any) -> None:
        """A load the mover just issued (event ``ev``): the one stream the record's operations
        came on before its eviction waits for it now, and the native core may let operations on
        that stream alone touch it without a call. Otherwise the first operation to touch it
        would call, only to make its stream wait and see the load still in flight: on an LLM
        decode under a fixed plan that was a call for every weight loaded. A stream the program
        enqueues work on after the wait is ordered after the load; the mark is set after the
        wait, under the core lock, so no operation of the program can come between. Skipped
        (the first touch calls, as before): without the core, a record used on several streams
        or on the per-thread default stream, a stream capturing a graph, an entry no longer
        loading."""
        core = self._core
        s = self._stream_before.get(base)
        if core is None or s is None or s == MIXED or s == PER_THREAD_STREAM or self._closing:
            self.counts["ready_on_stream_skipped"] += 1
            return
        eng = self.engine
        with eng.agent.lock:  # the core lock: the program's operations wait outside
            with eng.lock:
                e = eng.pending.get(base)
                if e is None or e.state != LOADING or e.event is not ev or base not in self.policy.resident:
                    self.counts["ready_on_stream_skipped"] += 1
                    return
                capturing = getattr(eng.ops, "capturing", None)
                if capturing is not None and capturing(s):
                    self.counts["ready_on_stream_skipped"] += 1
                    return
                if s not in e.ordered:
                    eng.ops.wait(s, ev)
                    e.ordered.add(s)
                # ready: a write to it, clean or not, reaches the engine in the replay
                core.fast_mark_on((base,), 2, s)
        self.counts["ready_on_stream"] += 1

    def _ready_now(self, base: int) -> None:
        """A record the mover mapped with nothing to copy (its contents dead): resident with
        nothing in flight, so the native core may let any operation touch it without a call, as
        after an operation's decision (``_fast_after``). Otherwise the first operation to touch
        it would call only to find it resident."""
        core, eng = self._core, self.engine
        if core is None or self._closing:
            return
        with eng.agent.lock:  # the core lock: the program's operations wait outside
            with eng.lock:
                if base in eng.pending or base not in self.policy.resident:
                    return
                core.fast_mark((base,), 2)
        self.counts["ready_now"] += 1

    # -- serving: the GPU turn (gpu-prefetch-sched serve, gpuos_tools/sched/serve.py) ---------

    def gate(self) -> None:
        """Before a launch, copy or memset of the program, on its thread, BEFORE the agent's lock
        is taken: the tracer's callback calls this first (the agent's gate, registered only
        when serving).

        Why here and not in ``before`` (which runs with the agent's lock held): waiting for the
        turn can take whole slices of the other jobs, and the engine's threads take the agent's
        lock (its evict thread on its ``evict`` path, snapshots, the agent's server); holding it
        while blocked would stall them, or deadlock with a job that waits for one of them. Here
        the thread holds no lock of ours. The yield and the trims take the agent's lock only to
        issue their evictions (``evict_from_operation``: the program's thread, no operation of
        it between its callback and the driver -- this one has not reached its callback), and
        let it go before waiting for the releases, which the engine's evict thread completes
        under the engine's lock alone. ``_gate_lock`` is held while blocked: the program's other
        threads wait on it, holding nothing either."""
        c = self.serve
        if c is None or (self._held and c.ask is None and c.update is None):
            return  # the turn is ours, nothing asked: the cost of serving per operation
        try:
            with self._gate_lock:
                if self.serve is None:
                    return
                if self._held and c.update is not None:
                    msg, c.update = c.update, None
                    self._set_budget(int(msg["budget"]), int(msg["others"]))
                    self.turns["budget_updates"] += 1
                if self._held and c.ask is not None:
                    msg, c.ask = c.ask, None
                    t = time.perf_counter()
                    self._want = self._mapped_now()
                    self._shed(int(msg["keep"]))
                    self._held = False
                    self.turns["yields"] += 1
                    self.turns["yield_s"] += time.perf_counter() - t
                if not self._held:
                    self._wait_turn()
        except Exception as exc:  # noqa: BLE001 (serving off: the job runs on alone, within its last budget)
            self.turns["gate_errors"] += 1
            self.error = f"serve: {type(exc).__name__}: {exc}"
            self._leave_serving()

    def _leave_serving(self) -> None:
        c, self.serve = self.serve, None
        self._held, self._hold = True, False
        if c is not None:
            c.close()

    def _wait_turn(self) -> None:
        """Say what this job holds, then wait for the grant (trimming when asked meanwhile).

        ``mapped`` is what this job keeps once its evictions in flight complete, ``releasing``
        what they still hold (serial switch: none, ``_shed`` waited for them). The coordinator's
        budgets count kept bytes; the bytes in flight are the ledger's business: the next
        job's loads wait in it until the releases complete (overlapped switch)."""
        c = self.serve
        t = time.perf_counter()
        mapped, releasing = self._holding()
        self._want = max(self._want, mapped)
        c.send({"op": "wait", "mapped": mapped, "want": self._want, "peak": self._turn_peak, "releasing": releasing})
        self._turn_peak = 0
        while True:
            try:  # this job's bytes in flight said again meanwhile: a cancelled eviction, or one that
                # failed on the engine's evict thread, leaves no release to say it (else the
                # holder's loads would wait for them up to ROOM_TIMEOUT_S)
                msg = c.inbox.get(timeout=INFLIGHT_REFRESH_S if self.ledger is not None else None)
            except queue.Empty:
                self._say_inflight()
                continue
            op = msg.get("op")
            if op == "trim":
                self._shed(int(msg["keep"]))
                self.turns["trims"] += 1
                mapped, releasing = self._holding()
                c.send({"op": "wait", "mapped": mapped, "want": self._want, "peak": 0, "releasing": releasing})
            elif op == "grant":
                c.update = None  # sent before the grant (while this job held the turn): stale
                self._grant(int(msg["budget"]), int(msg["others"]))
                break
            else:  # the coordinator is gone: on alone, within the last budget
                self._leave_serving()
                break
        self.turns["turn_waits"] += 1
        self.turns["turn_wait_s"] += time.perf_counter() - t

    def _mapped_now(self) -> int:
        with self.engine.agent.lock:  # the records re-read as a decision would
            self.records()
            return self.physical()

    def _holding(self) -> tuple[int, int]:
        """(owned bytes mapped once the evictions in flight complete, bytes they still hold),
        read together under the engine's lock (a release between two reads would count twice)."""
        with self.engine.agent.lock:
            self.records()
            with self.engine.lock:
                now = self.physical()
                releasing = self._evicting()
        return max(0, now - releasing), releasing

    def _set_budget(self, budget: int, others: int) -> None:
        """The budget of the next decisions (agent's lock not needed: the program's thread, at
        its gate, is the only one deciding)."""
        with self._load_lock:
            old = self.policy.fixed
            self.policy.fixed = self._budget = budget
            self._others = others
            if old is None or budget < old:
                self._under = False  # above it until this job's evictions complete: settle anew

    def _reconcile(self) -> None:
        """The policy's books after the mover was held (``_load_lock`` held): what it counted as
        prefetched but was never loaded is not resident."""
        self.policy._sync(self.records())  # records seen for the first time: resident unless released
        for b in list(self.policy.resident):
            if self.engine.state(b) == "released":
                self.policy.forget(b)

    def _shed(self, keep: int) -> None:
        """At a yield or a trim: evict down to ``keep`` bytes mapped (the policy's order). The
        serial switch then waits until every eviction of this job has been released (no lock
        of ours held: see ``gate``), so the next job is granted with nothing in flight; the
        overlapped one returns at once: the evictions are in the ledger's ``inflight`` before
        the ``wait`` that lets the coordinator grant the next job goes."""
        agent = self.engine.agent
        with agent.lock, self._load_lock:
            self._hold = True  # the mover issues nothing until the next grant
            self._reconcile()
            recs = self.records()
            victims = [b for op, b in self.policy.shed(keep, recs) if op == "evict"]
            for b in victims:
                self._evict(b, own=0)
        self._say_inflight()
        if not self._overlap:
            deadline = time.perf_counter() + ROOM_TIMEOUT_S
            while self._evicting():
                if time.perf_counter() > deadline:
                    self.turns["release_timeouts"] += 1
                    break
                time.sleep(POLL_S * 4)
            self._say_inflight()
        self._measure(self._budget, False)

    def _grant(self, budget: int, others: int) -> None:
        """The turn: the new budget, then the job's predicted next working sets prefetched
        (``OnlinePolicy.prepare``) before its operation goes on."""
        self._set_budget(budget, others)
        agent = self.engine.agent
        with agent.lock, self._load_lock:
            self._hold = False
            self._reconcile()
            recs = self.records()
            actions = self.policy.prepare(recs)
            for op, b in actions:
                if op == "evict":
                    self._evict(b, own=0)
        pre = [b for op, b in actions if op == "prefetch"]
        # the loads that fit now are enqueued here, before the program's operation goes on (on
        # the engine's prefetch stream: the host only enqueues); the mover takes the rest as
        # room comes. Else the program's next launch would overtake the mover and load on demand.
        issued = 0
        with self._load_lock:
            for b in pre:
                with self.engine.lock:  # no release between the booking and the load
                    need = self._released([b])
                    if need and (self.physical() + need > self._budget or not self._book_load([b])):
                        break  # the mover waits for the room (the others' releases in flight)
                    if need:
                        self._event("prefetch", need)
                    self.engine.prefetch(b)
                    self._unbook_unloaded([b])
                issued += 1
        if pre[issued:]:
            self._start_mover()
            for b in pre[issued:]:
                self._moves.put(b)
        self.turns["prepares"] += 1
        self.turns["prepared"] += len(pre)
        self.turns["prepared_now"] += issued
        self._held = True

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """At the program's exit: prefetches not issued yet are dropped (no launch will need
        them), the mover ends."""
        self._closing = True
        if self._mover is not None:
            self._moves.put(None)
            self._mover.join(30)
        if self.serve is not None:  # the coordinator sees the connection close: out of the rotation
            self.serve.close()
        if self.ledger is not None:  # its bytes stay booked until the coordinator reaps the process
            self.turns["ledger"] = {k: self.ledger.snapshot()[k] for k in ("peak", "peak_loads", "forced_loads")}

    def _fast_summary(self) -> dict[str, Any]:
        c = self.counts
        out: dict[str, Any] = {"on": self._core is not None, "replayed": c["fast_replayed"], "late": c["fast_late"],
                               "replay_s": round(c["fast_replay_s"], 6), "after_s": round(c["fast_after_s"], 6)}
        if self.fast_off:
            out["off"] = self.fast_off
        if self._core is not None:
            counts = self._core.fast_counts()
            out["operations"] = counts["fast"]
            out["calls_why"] = {k[4:] if k.startswith("why_") else k: v for k, v in counts.items()
                                if k.startswith("why_") or k == "marks_dropped"}
            out["unready_why"] = dict(self.unready_why)
        return out

    def timeline(self) -> dict[str, Any]:
        """The event log (module docstring) with what a picture's title needs."""
        return {"type": "sched_timeline", "version": 1, "policy": self.policy.policy,
                "lookahead": self.policy.lookahead, "plan": self.policy.plan, "fraction": self.cfg.get("fraction"),
                "footprint": self._total, "events": list(self._log or []), "dropped": self._log_dropped,
                "max_events": self._log_max}

    def summary(self) -> dict[str, Any]:
        eng = self.engine.stats()
        pol = self.policy.stats.as_dict()
        out = {
            "policy": self.policy.policy, "lookahead": self.policy.lookahead, "plan": self.policy.plan,
            "proactive": self.policy.proactive, "prefetch_batch": self.policy.batch, "fraction": self.cfg.get("fraction"),
            # a percentage: of the steady working set once a period is learned (online.py), and
            # the bytes it became at the last decision; bytes: the largest budget a decision had
            "budget": self.policy.last_budget if self.policy.fraction is not None else pol["budget_max"],
            "budget_of": self.policy.budget_of(), "steady_bytes": pol["steady_bytes"],
            "footprint": self._total, "launches": pol["launches"], "unknown": pol["unknown"],
            "bytes_in": eng.get("loaded_bytes", 0), "bytes_out": eng.get("saved_bytes", 0),
            "loads": eng.get("prefetches", 0) + eng.get("demand_loads", 0), "prefetches": eng.get("prefetches", 0),
            "demand_loads": eng.get("demand_loads", 0), "evictions": eng.get("evictions", 0),
            "evict_saves": eng.get("evict_saves", 0), "stream_waits": eng.get("stream_waits", 0),
            # evictions whose host copy was current (engine.py, "Digests"): by digest, or clean
            "digest": eng.get("digest"), "digests": eng.get("digests", 0), "digest_skips": eng.get("digest_skips", 0),
            "bytes_not_written_back": eng.get("unsaved_bytes", 0),
            # evictions of records whose torch blocks were all freed: nothing saved, nothing
            # copied back at their loads (docs/residency-engine.md, "Dead records")
            "dead_evictions": eng.get("dead_evictions", 0), "dead_bytes": eng.get("dead_bytes", 0),
            "dead_loads": eng.get("dead_loads", 0),
            # who waited for the engine's lock, and how long (its threads issue driver calls under it)
            "engine_lock_waits": eng.get("lock_waits", {}), "mover_lock_waits": self._load_lock.waits(),
            # writes no prediction showed, and the kernels treated as unknown since (engine.py, "Mismatches")
            "mismatches": eng.get("mismatches", 0), "conservative": eng.get("conservative", []),
            "stalls": pol["stalls"], "over_budget": pol["over_budget"], "over_budget_bytes": pol["over_budget_bytes"],
            "peak_resident": self.counts["peak_resident"], "peak_settled": self.counts["peak_settled"],
            "over_physical": self.counts["over_physical"], "peak_planned": pol["peak_resident"],
            "periods": pol["periods"], "period_use": pol["period_use"], "predicted": pol["predicted"],
            # why the learned period broke (online.py's Stats.breaks: the first few)
            "period_breaks": pol["period_breaks"], "breaks": pol["breaks"],
            "breaks_last": pol["breaks_last"],
            "wall_s": round(time.perf_counter() - self.t0, 6),
            # nothing to decide at this budget: the native core ran the program without the hooks
            "dormant": self.dormant,
            # the native core's fast path: on, and the operations it let go by without the hooks
            "fast": self._fast_summary(),
            "executor": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.counts.items()},
            "policy_stats": pol, "engine": eng, "kernels": self.kernel_profile(),
        }
        if self._park:
            out["park"] = self.lib.park_stats()
        if self.serve is not None:
            out["serve"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.turns.items()}
        agent = getattr(self.engine, "agent", None)
        calls = getattr(agent, "hook_calls", None)
        if isinstance(calls, int):  # where the program's time on the launch path went
            out["agent"] = {"launch_hooks": calls, "launch_hook_s": round(agent.hook_ns / 1e9, 6),
                            "memo_misses": getattr(agent, "memo_misses", None),
                            "executor_s": round(self.counts["before_s"], 6)}
        # the streams the marks were recorded on (an eviction's save waits on one of them) and
        # the program's streams: those its operations used, and all it created
        out["streams"] = {"marked": sorted(int(k) for k in self._marks if isinstance(k, int)),
                          "used": len(getattr(agent, "used_streams", None) or getattr(agent, "streams", ()) or ()),
                          "created": len(getattr(agent, "streams", ()) or ())}
        if self.error:
            out["error"] = self.error
        return out


_current: Executor | None = None  #: this process's executor (``attach``)


def current_counts() -> dict[str, Any] | None:
    """The running executor's counts so far, or None when this process is not under
    `gpu-prefetch-sched run`: a program (a benchmark's job) reads them at the start and end of
    its timed region to know the bytes moved inside it. A program looks for this module in
    sys.modules rather than importing it (it is loaded only under the agent)."""
    ex = _current
    if ex is None:
        return None
    e, p = ex.engine.counts, ex.policy.stats
    out = {"bytes_in": e["loaded_bytes"], "bytes_out": e["saved_bytes"], "evictions": e["evictions"],
           "loads": e["prefetches"] + e["demand_loads"], "demand_loads": e["demand_loads"],
           "stream_waits": e["stream_waits"], "stalls": p.stalls, "launches": p.launches, "unknown": p.unknown,
           "over_budget": p.over_budget, "room_wait_s": round(ex.counts["room_wait_s"], 6),
           "decisions": ex.counts["decisions"], "fast_allowances": ex.counts["fast_allowances"],
           "fast_allowed": ex.counts["fast_allowed"], "fast_allowed_none": ex.counts["fast_allowed_none"],
           "fixed_acting_decisions": p.fixed_acting_decisions, "fixed_other_decisions": p.fixed_other_decisions,
           "t": time.perf_counter()}
    core = ex._core
    if core is not None:  # why the operations that called did (the native core's counts)
        out.update({k: v for k, v in core.fast_counts().items() if k.startswith("why_")})
    return out


def attach(agent: Agent, cfg: dict[str, Any]) -> None:
    """`gpu-prefetch-sched run`: the online executor in front of ``agent``'s launches, copies and
    memsets from the start of its residency engine (`Agent.start_engine`; the owned allocator is
    loaded), which it acts through. ``cfg``: the config (`OnlineConfig.executor_config()`). From now
    on launches captured into a CUDA graph are skipped (`Executor.skip_captured`)."""
    agent.add_hooks(_OnEngine(cfg))


class _OnEngine(AgentHooks):
    """Until the agent's engine starts: captured launches skipped; then the executor is made
    on the engine and registered."""

    skip_captured = True

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg

    def engine_started(self, agent: Any) -> None:
        global _current
        ex = Executor(agent.engine, self.cfg)
        ex.attach(agent)
        _current = ex


class _LedgerOps:
    """The engine's ops under serve's ledger: after each ``make_resident`` and ``release`` (the
    engine's lock held) the executor's books follow (``Executor._on_map`` / ``_on_unmap``);
    everything else goes to the real ops."""

    def __init__(self, ops: Any, ex: Executor) -> None:
        self._ops = ops
        self._ex = ex

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def make_resident(self, base: int) -> None:
        self._ex._on_map(base)  # booked before the map (a reservation, or now: counted)
        self._ops.make_resident(base)

    def release(self, base: int) -> None:
        self._ops.release(base)
        self._ex._on_unmap(base)


def _one_stream(was: int | None, stream: Any) -> int:
    """The stream of a record's uses after one more on ``stream`` (``was``: before; None: none)."""
    if stream == PER_THREAD_STREAM or (was is not None and was != stream):
        return MIXED
    return stream


def _touched_addrs(agent: Any, kernel: str, sizes: Any, args: Any) -> list[int] | None:
    """The addresses of the allocations a launch touches, by the agent's prediction (None: unknown)."""
    unknown, touched, _ = agent.launch_touches(kernel, sizes, args)
    by_id = agent.by_id
    return None if unknown else [by_id[i].addr for i in touched if i in by_id]


def _bases_in(addrs, bases: list[int], records: dict[int, int]) -> list[int]:
    """The records (``bases`` sorted, ``records`` base -> bytes) holding any of ``addrs``."""
    out = []
    for a in addrs:
        i = bisect_right(bases, a) - 1
        if i >= 0 and a < bases[i] + records[bases[i]]:
            out.append(bases[i])
    return out


def _same_stream(a: Any, b: Any) -> bool:
    """Two stream handles name the same stream (driver handles compare by their address)."""
    try:
        return int(a) == int(b)
    except (TypeError, ValueError):
        return a == b


def _write_json(path: str, data: Any, what: str, **dump: Any) -> None:
    """JSON to ``path`` through a temp file and a rename; a failure is said, not raised (the
    program is ending)."""
    try:
        atomic.replace(path, json.dumps(data, **dump).encode())
    except (OSError, GpuosError) as exc:  # create_temp says why as a GpuosError
        print(f"gpu-prefetch-sched: cannot write the {what}: {exc}", file=sys.stderr, flush=True)
