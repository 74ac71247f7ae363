"""The agent's native per-operation core (gpuos_tools/injection/csrc/gpuos_core.c), driven
without CUPTI through the entry points the tracer's callback uses.

The central check replays the traces recorded on the GPU (tests/data/recorded) through the core
and, beside it, through gpu-predict-access's predictor with no memo: every launch's access set
(unknown, written allocations, touched allocations) must be the same, although the core answers
most of them from its memo and invalidates it by its own rules."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest
import zstandard

from gpuos_tools.model import binary, wire
from gpuos_tools.agent.agent import DONE, Agent
from gpuos_tools.agent.view import ProcessView, launch_record
from gpuos_tools.injection import core as core_mod
from gpuos_tools.injection.core import F_TOUCH, NativeCore
from gpuos_tools.injection.start import AgentUpcalls

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

RECORDED = Path(__file__).parent / "data" / "recorded"
TRACES = sorted(RECORDED.glob("*.ndjson.zst"))
OP_LAUNCH, OP_WRITE, OP_FREE, OP_GRAPH = 1, 2, 3, 4
KIND_CODE = {k: i for i, k in enumerate(binary.ALLOC_KINDS)}


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return core_mod.build(tmp_path_factory.mktemp("build"))


@pytest.fixture
def core(library, tmp_path) -> NativeCore:
    """A fresh instance of the core: the library copied to its own path, so its state is its own."""
    path = tmp_path / "libcore.so"
    shutil.copy(library, path)
    return NativeCore(path)


def records(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        text = zstandard.ZstdDecompressor().stream_reader(f).read().decode()
    return [json.loads(line) for line in text.splitlines()]


def launch_args(rec: dict) -> tuple[tuple[int, ...] | None, bytes | None]:
    params = rec.get("params")
    if rec.get("layout") == "none" or params is None:
        return None, None
    return tuple(p["size"] for p in params), b"".join(bytes.fromhex(p["hex"]) for p in params)


def reference(view: ProcessView, kernel: str, sizes, args) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
    """gpu-predict-access's answer with no memo of ours (as Agent.predict_launch builds it)."""
    acc = view.pred.launch(launch_record(kernel, sizes, args))[0]
    writes = tuple(dict.fromkeys(e["alloc"] for e in acc["writes"]))
    touched = tuple(dict.fromkeys([e["alloc"] for e in acc["reads"]] + list(writes)))
    return bool(acc["unknown"]), writes, touched


class Driver:
    """Feeds one trace's records to the core as the tracer's callback would, and to a reference view."""

    def __init__(self, core: NativeCore, agent: Agent) -> None:
        self.core = core
        self.lib = core.lib
        self.agent = agent
        self.ref = ProcessView()

    def alloc(self, rec: dict) -> None:
        self.lib.core_lock_program()
        self.lib.core_after_alloc(rec["addr"], rec["size"], KIND_CODE.get(rec.get("kind"), 0))
        self.lib.core_unlock()
        self.ref.observe((wire.ALLOC, 0, 0, 0, rec["addr"], rec["size"], rec.get("kind"), 0))

    def free(self, rec: dict) -> None:
        self.lib.core_lock_program()
        self.lib.core_after_free(rec["addr"])
        self.lib.core_unlock()
        self.ref.observe((wire.FREE, 0, 0, 0, rec["addr"], -1, 0))

    def write(self, rec: dict) -> None:
        data = bytes.fromhex(rec["data"]) if rec.get("data") else None
        is_set = rec["type"] == "memset"
        n = rec["bytes"]
        if rec.get("height") and rec.get("width"):
            n = (rec["height"] - 1) * (rec.get("dst_pitch") or rec["width"]) + rec["width"]
        self.lib.core_enter(OP_WRITE, 0, 0, 0, rec.get("stream", 0), 0, None, None, 0, None,
                            core_mod.NO_ARGS, rec["dst"], 0 if is_set else rec.get("src", 0), 0)
        self.lib.core_issued()
        self.lib.core_lock_program()
        self.lib.core_after_write(rec["dst"], data, len(data) if data else n, 0, int(is_set))
        self.lib.core_unlock()
        if is_set:
            self.ref.observe((wire.SET, 0, 0, 0, rec["dst"], rec["bytes"], 0, 1, 0, False))
        else:
            shape = None
            if rec.get("height") and rec.get("width"):
                shape = (rec["width"], rec["height"], rec.get("src_pitch") or 0, rec.get("dst_pitch") or 0)
            self.ref.observe((wire.COPY, 0, 0, 0, rec.get("dir", "default"), rec["dst"], rec.get("src", 0),
                              rec["bytes"], 0, False, shape, data))

    def launch(self, rec: dict, stream: int = 0) -> tuple:
        sizes, args = launch_args(rec)
        name = rec.get("kernel") or ""
        if sizes is None:
            arr, n, buf, args_len = None, 0, None, core_mod.NO_ARGS
        else:
            arr = (ctypes.c_uint32 * max(1, len(sizes)))(*sizes)
            n, buf, args_len = len(sizes), args, len(args)
        self.lib.core_enter(OP_LAUNCH, 0, 0, 0, stream, rec["func"], name.encode(), arr, n, buf, args_len, 0, 0, 0)
        self.lib.core_issued()
        return name, sizes, args


def track(agent: Agent) -> None:
    """Start a period of write tracking (as a first snapshot's T0 does): from here on every
    launch's access set is looked up."""
    with agent.lock:
        agent._take_dirty()


def wired(core: NativeCore) -> tuple[Agent, AgentUpcalls]:
    agent = Agent(0)
    return agent, AgentUpcalls(core, agent, {})


@pytest.mark.parametrize("trace", TRACES, ids=[t.name for t in TRACES])
def test_every_launch_gets_the_access_set_of_the_predictor(core, trace):
    agent, _ = wired(core)
    track(agent)
    drv = Driver(core, agent)
    compared = 0
    for rec in records(trace):
        kind = rec["type"]
        if kind == "alloc":
            drv.alloc(rec)
        elif kind == "free":
            drv.free(rec)
        elif kind in ("memcpy", "memset"):
            drv.write(rec)
        elif kind == "launch" and not rec.get("captured"):
            name, sizes, args = drv.launch(rec)
            got = core.last_access()
            want = reference(drv.ref, name, sizes, args)
            assert got is not None
            assert got[0] == want[0], f"launch {rec.get('seq')} {name[:60]}: unknown"
            assert set(got[1]) == set(want[1]), f"launch {rec.get('seq')} {name[:60]}: writes"
            assert set(got[2]) == set(want[2]), f"launch {rec.get('seq')} {name[:60]}: touched"
            compared += 1
    assert compared > 0
    c = core.counters()
    assert c["memo_misses"] + c["memo_hits"] == compared
    assert c["ops"] == compared + sum(1 for r in records(trace) if r["type"] in ("memcpy", "memset"))


def test_repeated_launches_come_from_the_memo_and_an_allocation_invalidates_it(core):
    recs = records(RECORDED / "torch.ndjson.zst")
    agent, _ = wired(core)
    track(agent)
    drv = Driver(core, agent)
    launches = []
    for rec in recs:
        if rec["type"] == "alloc":
            drv.alloc(rec)
        elif rec["type"] == "free":
            drv.free(rec)
        elif rec["type"] in ("memcpy", "memset"):
            drv.write(rec)
        elif rec["type"] == "launch":
            drv.launch(rec)
            launches.append(rec)
    for rec in launches[-10:]:  # after the trace's last frees: predicted anew, once
        drv.launch(rec)
    misses = core.counters()["memo_misses"]
    for rec in launches[-10:]:  # the same launches again: nothing changed, all from the memo
        drv.launch(rec)
    assert core.counters()["memo_misses"] == misses
    epoch = core.counters()["epoch"]
    drv.alloc({"addr": 1 << 46, "size": 4096, "kind": "device"})  # a new allocation: predictions may change
    assert core.counters()["epoch"] > epoch
    drv.launch(launches[-1])
    assert core.counters()["memo_misses"] == misses + 1


TABLE = 0x7F0000000000  #: a pointer table, then three arrays of 1 MiB (``table_and_arrays``)


def table_and_arrays(core: NativeCore) -> Driver:
    """A driver for the core tracking writes, with the pointer table at TABLE and three arrays
    after it."""
    agent, _ = wired(core)
    track(agent)
    drv = Driver(core, agent)
    for i in range(4):
        drv.alloc({"addr": TABLE + i * 0x100000, "size": 0x100000, "kind": "device"})
    return drv


def copy_pointers(drv: Driver, targets: list[int]) -> None:
    """The host copies ``targets`` into the pointer table."""
    data = b"".join(t.to_bytes(8, "little") for t in targets)
    drv.write({"type": "memcpy", "dir": "HtoD", "dst": TABLE, "src": 0x1000, "bytes": len(data), "data": data.hex()})


def checked_launch(core: NativeCore, drv: Driver, ptr: int) -> tuple:
    """A launch of a kernel given ``ptr`` (and a scalar): the core's access set, required equal
    to the predictor's without a memo, as (unknown, writes, touched) of sets."""
    rec = {"func": 0xF00, "kernel": "kernel_ptrs", "layout": "x",
           "params": [{"size": 8, "hex": ptr.to_bytes(8, "little").hex()}, {"size": 8, "hex": "07" + "00" * 7}]}
    name, sizes, args = drv.launch(rec)
    got = core.last_access()
    want = reference(drv.ref, name, sizes, args)
    assert (got[0], set(got[1]), set(got[2])) == (want[0], set(want[1]), set(want[2])), hex(ptr)
    return want[0], set(want[1]), set(want[2])


def test_a_pointer_array_copied_from_the_host_changes_the_prediction(core):
    """A kernel given a pointer to device memory that holds pointers (copied from the host):
    the predictor follows them, so a new copy into that memory must reach the core's memo."""
    drv = table_and_arrays(core)
    copy_pointers(drv, [TABLE + 0x100000])
    first = checked_launch(core, drv, TABLE)
    copy_pointers(drv, [TABLE + 0x200000, TABLE + 0x300000])  # now it points elsewhere
    second = checked_launch(core, drv, TABLE)
    assert first[2] != second[2]


def test_a_pointer_moved_within_its_allocation_is_memoised_unless_it_points_into_host_bytes(core):
    """The memo keys a word by the allocation it points into (a decode's cache tensors move
    within their segment every token), but by the word itself where it points into bytes
    copied from the host, whose stored pointers the predictor follows from there on."""
    drv = table_and_arrays(core)
    drv.alloc({"addr": TABLE + 0x600000, "size": 0x100000, "kind": "device"})  # a hole before it
    copy_pointers(drv, [TABLE + 0x100000, TABLE + 0x200000])

    def launch(ptr: int) -> tuple:
        return checked_launch(core, drv, ptr)

    misses = core.counters()["memo_misses"]
    assert launch(TABLE + 0x300000) == launch(TABLE + 0x300000 + 4096) == launch(TABLE + 0x3FFFF8)
    assert core.counters()["memo_misses"] == misses + 1
    both, second = launch(TABLE), launch(TABLE + 8)  # into the copied bytes: each word its own
    assert core.counters()["memo_misses"] == misses + 3
    assert len(both[2]) == 3 and len(second[2]) == 2
    assert launch(TABLE + 0x1000) == launch(TABLE + 0x2000)  # past them: the allocation counts
    assert core.counters()["memo_misses"] == misses + 4
    assert launch(TABLE + 0x500000)[2] == set()  # in the hull's hole: no allocation
    assert launch(TABLE + 0x500000 + 64)[2] == set()
    assert core.counters()["memo_misses"] == misses + 5


def test_a_hooked_launch_takes_the_access_set_it_was_handed(core):
    """The hook's predictions of the launch the core handed an access set with take it: the
    predictor does not run; another launch's arguments, or none handed, predict as before; a
    kernel the engine made conservative is unknown either way."""
    agent, _ = wired(core)
    drv = Driver(core, agent)
    for i in range(2):
        drv.alloc({"addr": 0x7F0000000000 + i * 0x100000, "size": 0x100000, "kind": "device"})
    with agent.lock:  # drains the view: the agent knows the allocations
        pass
    sizes, args = (8,), (0x7F0000000000).to_bytes(8, "little")
    handed = (False, (2,), (1, 2))  # not what the predictor would say: the point is it is not asked
    agent.given_access(sizes, args, handed)
    assert agent.predict_launch("k", sizes, args) == handed and agent.memo_misses == 0
    assert agent.predict_launch("k", sizes, bytes(bytearray(args))) == (False, (1,), (1,))  # other objects: predicted
    assert agent.memo_misses == 1
    agent.engine = types.SimpleNamespace(conservative={"k"})
    assert agent.predict_launch("k", sizes, args) == (True, (2,), (1, 2))
    agent.given_access(None, None, None)
    assert agent.predict_launch("k", sizes, args) == (True, (1,), (1,))
    agent.engine = None


def test_dirty_ids_follow_the_predicted_writes_as_the_python_agent_does(core):
    recs = records(RECORDED / "torch.ndjson.zst")
    agent, _ = wired(core)
    drv = Driver(core, agent)
    python = Agent(0)  # the Python path's own bookkeeping, fed the same operations
    python.dirty = None
    python.ctx = "a context"  # (it would ask the driver for the current one)
    for i, rec in enumerate(recs):
        kind = rec["type"]
        if i == len(recs) // 2:  # T0 of a first snapshot, halfway
            with agent.lock:
                assert agent._take_dirty() is None  # nothing was known before
            python._take_dirty()
        if kind == "alloc":
            drv.alloc(rec)
            python.observe((wire.ALLOC, 0, 0, 0, rec["addr"], rec["size"], rec.get("kind"), 0))
        elif kind == "free":
            drv.free(rec)
            python.observe((wire.FREE, 0, 0, 0, rec["addr"], -1, 0))
        elif kind in ("memcpy", "memset"):
            drv.write(rec)
            python.before_write("cuMemcpyAsync", rec["dst"], 0)
            data = bytes.fromhex(rec["data"]) if rec.get("data") else None
            if kind == "memset":
                python.observe((wire.SET, 0, 0, 0, rec["dst"], rec["bytes"], 0, 1, 0, False))
            else:
                python.observe((wire.COPY, 0, 0, 0, rec.get("dir"), rec["dst"], rec.get("src", 0), rec["bytes"], 0,
                                False, None, data))
        elif kind == "launch":
            name, sizes, args = drv.launch(rec)
            python.before_launch("cuLaunchKernel", 0, name, sizes, args)
    with agent.lock:
        native_dirty = agent._take_dirty()
    python_dirty = python._take_dirty()
    live = {a.id for a in python.pred.allocs._live.values()}
    assert native_dirty is not None and python_dirty is not None
    assert native_dirty == python_dirty & live
    assert native_dirty  # the second half of the step wrote something


def test_a_snapshot_protects_each_buffer_once_per_stream(core):
    agent, _ = wired(core)
    drv = Driver(core, agent)
    base = 0x7F0000000000
    for i in range(3):
        drv.alloc({"addr": base + i * 0x100000, "size": 0x100000, "kind": "device"})
    calls: list[tuple[list[int], int]] = []

    class Snap:  # what protect_native reads of the agent's snapshot
        buffers = [0, 1, 2]
        state = [0, 0, 0]
        safe: list = [None, None, None]

    snap = Snap()

    def protect(snap_, targets, stream):
        calls.append((list(targets), stream))
        for i in targets:
            snap.state[i] = 3  # saved to host on that stream
            snap.safe[i] = (snap.safe[i] or set()) | {stream}

    agent.snap = snap
    agent._protect = protect
    with agent.lock:
        agent.core.snap_begin([1, 2, 3])
    write = {"type": "memset", "dst": base + 0x100000 + 64, "bytes": 16}
    drv.write(write)  # buffer 1, stream 0: protected
    drv.write(write)  # again on stream 0: already safe
    drv.lib.core_enter(OP_WRITE, 0, 0, 0, 7, 0, None, None, 0, None, core_mod.NO_ARGS, base + 0x100000, 0, 0)
    drv.lib.core_issued()  # stream 7: its writes are not ordered after the save yet
    assert calls == [([1], 0), ([1], 7)]
    snap.state[2] = DONE
    snap.safe[2] = None
    drv.lib.core_enter(OP_GRAPH, 0, 0, 0, 9, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
    drv.lib.core_issued()  # a graph launch may write anything: every buffer not safe on stream 9
    assert calls[-1] == ([0, 1, 2], 9)
    drv.lib.core_enter(OP_GRAPH, 0, 0, 0, 9, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
    drv.lib.core_issued()
    assert len(calls) == 3  # buffer 2 is done, 0 and 1 are safe on stream 9 now
    with agent.lock:
        agent.core.snap_end()
    drv.write(write)
    assert len(calls) == 3


def test_settle_waits_for_operations_between_enter_and_exit(core):
    lib = core.lib
    lib.core_enter(OP_WRITE, 0, 0, 0, 0, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
    assert core.settle(0.05, 0) == 1  # one past its enter, not at its exit
    assert core.settle(0.05, 1) == 0  # the caller's own
    done = threading.Timer(0.1, lib.core_issued)
    done.start()
    assert core.settle(5.0, 0) == 0
    done.join()


def test_the_agents_own_threads_are_skipped(core):
    agent, _ = wired(core)
    me = threading.get_native_id()
    assert not core.lib.core_skip()
    agent.own.add(me)
    assert core.lib.core_skip() and me in agent.own
    agent.own.discard(me)
    assert not core.lib.core_skip()


def test_streams_and_operations_are_counted(core):
    lib = core.lib
    for stream in (0, 5, 5, 9):
        lib.core_enter(OP_WRITE, 0, 0, 0, stream, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
        lib.core_issued()
    lib.core_enter(OP_WRITE, 0, 1, 0, 0, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)  # a _ptsz call
    lib.core_issued()
    lib.core_stream_event(11, 0)
    lib.core_stream_event(9, 1)
    assert core.ops() == 5
    assert core.streams() == {0, 5, 11}
    assert core.streams(used=True) == {0, 5}  # 11 only created: none of the program's work on it
    lib.core_enter(OP_GRAPH, 0, 0, 0, 11, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)  # a graph launched on it
    lib.core_issued()
    assert core.streams(used=True) == {0, 5, 11} and core.ops() == 5  # used, though not counted as an operation


def test_a_stream_destroyed_and_made_again_is_used_again_from_every_thread(core):
    """A thread that used a stream remembers it (most operations repeat theirs); once any stream
    is destroyed, a new stream of the same handle is seen used again, from that thread too."""
    lib = core.lib

    def use(stream: int) -> None:
        lib.core_enter(OP_WRITE, 0, 0, 0, stream, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
        lib.core_issued()

    use(7)

    def remake() -> None:  # another thread destroys it and makes a stream of the same handle
        lib.core_stream_event(7, 1)
        lib.core_stream_event(7, 0)

    t = threading.Thread(target=remake)
    t.start()
    t.join()
    assert 7 in core.streams() and 7 not in core.streams(used=True)
    use(7)
    assert 7 in core.streams(used=True)


def test_the_view_queue_replays_into_the_agents_view(core):
    agent, up = wired(core)
    drv = Driver(core, agent)
    drv.alloc({"addr": 0x7F0000000000, "size": 1 << 20, "kind": "device"})
    drv.alloc({"addr": 0x7F0000200000, "size": 1 << 20, "kind": "host"})
    drv.write({"type": "memcpy", "dir": "HtoD", "dst": 0x7F0000000000, "src": 0x10, "bytes": 8,
               "data": (0x7F0000200000).to_bytes(8, "little").hex()})
    drv.free({"addr": 0x7F0000200000})
    with agent.lock:  # acquiring drains
        assert [a.id for a in agent.device_allocations()] == [1]
        assert 1 in agent.pred.contents


def test_a_program_thread_holding_the_gil_lets_it_go_while_it_waits_for_the_lock(library, tmp_path):
    """A Python thread of the agent holds the lock and needs the GIL to finish; a program thread
    reaches the core holding the GIL (PyDLL keeps it held, as PyTorch's launch does): without
    letting the GIL go while it waits, neither could go on. Run in a child with a timeout."""
    path = tmp_path / "libcore.so"
    shutil.copy(library, path)
    code = textwrap.dedent(f"""
        import ctypes, threading, time
        held = ctypes.CDLL({str(path)!r})
        program = ctypes.PyDLL({str(path)!r})  # calls keep the GIL
        held.core_lock_py()
        got = []
        def program_thread():
            program.core_lock_program()  # blocks holding the GIL unless the core lets it go
            got.append(1)
            program.core_unlock()
        t = threading.Thread(target=program_thread)
        t.start()
        time.sleep(0.2)
        total = sum(range(10**6))  # Python work under the lock: needs the GIL
        held.core_unlock()
        t.join(5)
        print("ok" if got and not t.is_alive() else "stuck")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_touches_alone_come_from_the_argument_words_without_python(core):
    """With only the engine's touch order wanted, a launch touches the allocations its argument
    words point into, and Python is not asked (whatever the memo's state)."""
    agent, _ = wired(core)
    core.set_flag(F_TOUCH, True)
    drv = Driver(core, agent)
    base = 0x7F0000000000
    for i in range(3):
        drv.alloc({"addr": base + i * 0x100000, "size": 0x100000, "kind": "device"})
    for target in (2, 0):
        addr = base + target * 0x100000 + 256
        drv.launch({"func": 0xF00 + target, "kernel": "k", "layout": "x",
                    "params": [{"size": 8, "hex": addr.to_bytes(8, "little").hex()},
                               {"size": 4, "hex": "01000000"}]})
    assert core.counters()["upcalls"] == 0
    touches = sorted(core.touches(), key=lambda t: t[2])
    assert [t[0] for t in touches] == [3, 1]  # allocation ids, oldest touch first


def test_the_agent_runs_on_the_core_unless_asked_not_to_or_it_cannot_be_built(monkeypatch):
    from gpuos_tools import cbuild
    from gpuos_tools.errors import GpuosError
    from gpuos_tools.trace import run

    said: list[str] = []
    monkeypatch.setattr(core_mod, "build", lambda: Path("/cache/libgpuos_agent-x.so"))
    assert run.native_agent_library("auto", said.append) == "/cache/libgpuos_agent-x.so"
    assert run.native_agent_library("python", said.append) is None
    monkeypatch.setenv("GPUOS_AGENT_BACKEND", "python")
    assert run.native_agent_library("auto", said.append) is None
    monkeypatch.delenv("GPUOS_AGENT_BACKEND")

    def broken():
        raise cbuild.BuildError("no C compiler (cc, gcc or clang) on PATH")

    monkeypatch.setattr(core_mod, "build", broken)
    assert run.native_agent_library("auto", said.append) is None
    assert said == ["the agent's native core is unavailable (no C compiler (cc, gcc or clang) on PATH); "
                    "running it through Python callbacks (slower)"]
    with pytest.raises(GpuosError, match="cannot build the agent's native core"):
        run.native_agent_library("native", said.append)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_the_executors_hooks_set_the_cores_flags(core, monkeypatch, fraction):
    """gpu-prefetch-sched run on the native core: the executor attached to a plain agent skips
    captured launches from the start, and once the engine starts the core calls the agent on
    every operation only when the executor has something to decide (below 100%: F_EXEC); no
    gate when not serving."""
    from test_engine import FakeOps, Rec
    from test_sched_executor import FakeLib

    from gpuos_tools.agent import agent as agent_mod
    from gpuos_tools.injection.core import F_EXEC, F_GATE, F_SKIP_CAPTURED
    from gpuos_tools.memory.engine import ResidencyEngine
    from gpuos_tools.sched import executor

    recs = [Rec(0x1000_0000, 1 << 20)]
    ops = FakeOps(recs, auto=True)
    ops.lib = FakeLib(recs)
    monkeypatch.setattr(agent_mod, "ResidencyEngine", lambda agent: ResidencyEngine(agent, ops))
    monkeypatch.setattr(executor, "_current", None)
    agent = Agent(0)
    executor.attach(agent, {"fraction": fraction, "prepin": False})
    upcalls = AgentUpcalls(core, agent, {})
    assert core.flags() & (F_SKIP_CAPTURED | F_EXEC | F_GATE | F_TOUCH) == F_SKIP_CAPTURED
    agent.start_engine()
    upcalls.engine_started()
    flags = core.flags()
    assert flags & F_TOUCH and not flags & F_GATE
    assert bool(flags & F_EXEC) == (fraction < 1.0) == (not executor._current.dormant)
    agent.engine.close()
