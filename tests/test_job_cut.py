"""A job's consistent cut on the CPU: the native core counts NCCL's collective launches and calls
the agent at the armed one (driven through the tracer's entry points, without CUPTI); the
agent's arm, T0, disarm and status (the Python agent, its snapshot steps faked); and the
coordinator of `gpu-ckpt --job PID --cut` / `gpu-restore --job PID --cut` against fake agents
over the real control socket."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuos_tools.agent import cut as cut_mod
from gpuos_tools.agent.agent import Agent
from gpuos_tools.agent.control import ControlServer, socket_path
from gpuos_tools.ckpt import agent_job
from gpuos_tools.ckpt.records import CKPT_JOB_CUT, CKPT_JOB_ROLLBACK
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection import core as core_mod
from gpuos_tools.injection.core import NativeCore
from gpuos_tools.injection.start import AgentUpcalls

OP_LAUNCH, OP_GRAPH = 1, 4
has_cc = bool(shutil.which("cc") or shutil.which("gcc"))
NAMES = [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", True),
    ("_Z40ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE", True),
    ("_Z39ncclKernel_AllReduce_RING_LL_Sum_floatP11ncclDevCommmP8ncclWork", True),
    ("ncclKernel_Broadcast_RING_LL", True),
    ("ncclDevFunc_AllReduce_Sum_f32", False),
    ("_ZN4nccl14ncclDevKernel_E", False),
    ("_Zx", False),
    ("_Z", False),
    ("ampere_sgemm_128x64_nn", False),
    ("_Z12ncclKerneX_v", False),
    ("", False),
]


# ---------------------------------------------------------------- the native core

@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    if not has_cc:
        pytest.skip("no C compiler")
    return core_mod.build(tmp_path_factory.mktemp("build"))


@pytest.fixture
def core(library, tmp_path) -> NativeCore:
    path = tmp_path / "libcore.so"
    shutil.copy(library, path)
    return NativeCore(path)


def launch(core: NativeCore, func: int, name: str, stream: int = 0) -> None:
    core.lib.core_enter(OP_LAUNCH, 0, 0, 0, stream, func, name.encode(), None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
    core.lib.core_issued()


@pytest.mark.parametrize("name,want", NAMES)
def test_the_core_and_the_python_agent_tell_collectives_by_the_same_names(library, name, want):
    lib = NativeCore(library).lib
    assert bool(lib.core_collective_name(name.encode())) is want
    assert cut_mod.is_collective(name) is want


def test_the_core_counts_collectives_and_calls_the_agent_before_the_armed_one(core):
    agent = Agent(0)
    AgentUpcalls(core, agent, {})
    seen: list[tuple[int, int, int, bool]] = []

    def cut_now(k: int) -> None:  # what the agent sees at the upcall (the core lock is held)
        held = core.lib.core_trylock_py(0.0) == 1 and not _other_thread_can_lock(core)
        if held:
            core.lib.core_unlock()
        seen.append((k, core.ops(), core.collectives()["collectives"], held))

    agent.cut_now = cut_now
    for func, name in ((1, "gemm"), (1, "gemm"), (2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
                       (2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")):
        launch(core, func, name)
    assert core.collectives()["collectives"] == 2 and core.ops() == 4
    with agent.lock:
        assert core.arm(2) is False  # at it already: nothing armed
        assert core.collectives()["armed"] == 0
        assert core.arm(4) is True
    launch(core, 3, "_Z30ncclDevKernel_Broadcast_RING_LLv")  # collective 3
    launch(core, 1, "gemm")
    assert seen == []
    launch(core, 2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")  # collective 4: the cut, before it counts as an op
    assert seen == [(4, 6, 4, True)]
    assert core.ops() == 7 and core.collectives()["armed"] == 0
    launch(core, 2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert len(seen) == 1  # armed once, cut once
    with agent.lock:
        assert core.arm(9) is True
        assert core.arm(0) is True  # disarmed
    for _ in range(5):
        launch(core, 2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert len(seen) == 1 and core.collectives()["collectives"] == 10


def _other_thread_can_lock(core: NativeCore) -> bool:
    """Whether the core lock is free for another thread (it is recursive for its holder)."""
    got: list[bool] = []

    def probe() -> None:
        ok = core.lib.core_trylock_py(0.0) == 1
        if ok:
            core.lib.core_unlock()
        got.append(ok)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


def test_a_function_handle_reused_after_a_module_unload_is_named_again(core):
    launch(core, 7, "gemm")
    launch(core, 7, "gemm")
    assert core.collectives()["collectives"] == 0
    core.lib.core_module_unloading()
    launch(core, 7, "ncclDevKernel_AllGather_RING_LL")  # the handle now names another kernel
    assert core.collectives()["collectives"] == 1


def test_graphs_make_the_count_unknown_unless_captured_without_collectives(core):
    launch(core, 2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert cut_mod.unknown_why(core.collectives()) is None
    core.lib.core_enter(OP_GRAPH, 0, 0, 0, 9, 0, None, None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
    core.lib.core_issued()
    c = core.collectives()
    assert c["graphs"] == 1 and "node by node" in cut_mod.unknown_why(c)

    query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)(lambda stream: int(stream == 5))
    core.lib.core_set_capture_query.argtypes = [ctypes.c_void_p]
    core.lib.core_set_capture_query(ctypes.cast(query, ctypes.c_void_p))
    core.lib.core_capture_begun()
    assert cut_mod.unknown_why(core.collectives()) is None  # graphs came from captures of no collective
    launch(core, 3, "gemm", stream=5)
    assert cut_mod.unknown_why(core.collectives()) is None
    launch(core, 2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", stream=5)  # captured: runs with its graph
    c = core.collectives()
    assert c["collectives"] == 1 and c["captured"] == 1 and "captured" in cut_mod.unknown_why(c)
    core.lib.core_set_capture_query(None)


# ---------------------------------------------------------------- the agent (Python backend)

class StepAgent(Agent):
    """The Python agent with its snapshot's CUDA steps replaced (no GPU here)."""

    def __init__(self, fail_t0: bool = False) -> None:
        super().__init__(0)
        self.prepared: list[tuple] = []
        self.discarded: list = []
        self.t0_at: tuple | None = None
        self.fail_t0 = fail_t0

    def _prepare(self, cow_budget, exclude=()):  # noqa: ANN001
        self.prepared.append(exclude)
        return f"prep{len(self.prepared)}"

    def _discard(self, prep):  # noqa: ANN001
        self.discarded.append(prep)

    def _t0(self, prep, own=0):  # noqa: ANN001
        if self.fail_t0:
            raise RuntimeError("allocations grew while the snapshot was prepared; try again")
        self.t0_at = (prep, self.ops, self.collectives, own)
        return "taken"

    def _finish(self, taken, **kw):  # noqa: ANN001
        Path(kw["image"]).mkdir()
        (Path(kw["image"]) / "manifest.json").write_text(json.dumps(kw["manifest"]))
        return {"ok": True, "t0_ns": 1, "ops_before": self.t0_at[1], "buffers": 1, "bytes": 8, "seconds": 0.01,
                "stall_s": 0.002, "image": {"path": kw["image"], "image_id": "abc"}}


def py_launch(agent: Agent, kernel: str) -> None:
    with agent.lock:
        agent.before_launch("cuLaunchKernel", 0, kernel, None, None)


def test_the_python_agent_counts_arms_and_takes_t0_before_the_collective(tmp_path):
    agent = StepAgent()
    py_launch(agent, "gemm")
    py_launch(agent, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert agent.handle({"op": "collectives"})["collectives"] == 1
    with pytest.raises(GpuosError) as e:
        agent.handle({"op": "arm", "k": 3})
    assert e.value.code == ExitCode.USAGE
    ans = agent.handle({"op": "arm", "k": 3, "image": str(tmp_path / "r0")})
    assert ans["armed"] is True and agent.prepared == [cut_mod.JOB_EXCLUDED_KINDS]
    with pytest.raises(GpuosError) as e:  # one cut at a time
        agent.handle({"op": "arm", "k": 5, "image": str(tmp_path / "other")})
    assert e.value.code == ExitCode.WRONG_STATE
    py_launch(agent, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")  # 2
    py_launch(agent, "gemm")
    assert agent.handle({"op": "cut"})["state"] == "armed"
    py_launch(agent, "_Z30ncclDevKernel_Broadcast_RING_LLv")  # 3: T0 here, before it counts
    assert agent.t0_at == ("prep1", 4, 3, 1)
    st = agent.handle({"op": "cut", "wait_s": 5})
    assert st["state"] == "done", st
    res = st["result"]
    assert res["collective"] == 3 and res["ops_before"] == 4 and res["protect_stall_s"] == 0.002
    assert res["stall_s"] == pytest.approx(0.002 + res["t0_stall_s"], abs=2e-6)
    manifest = json.loads((tmp_path / "r0" / "manifest.json").read_text())
    assert manifest["cut"] == {"collective": 3, "excluded_kinds": ["vmm"]}
    assert agent.discarded == []

    ans = agent.handle({"op": "arm", "k": 2, "image": str(tmp_path / "r1")})  # past it: nothing armed
    assert ans == {"ok": True, "armed": False, "collectives": 3, "k": 2}
    assert agent.discarded == ["prep2"]

    assert agent.handle({"op": "arm", "k": 50, "image": str(tmp_path / "r2")})["armed"] is True
    assert agent.handle({"op": "disarm"}) == {"ok": True, "disarmed": True, "state": "disarmed"}
    _until(lambda: agent.discarded == ["prep2", "prep3"])
    for _ in range(60):
        py_launch(agent, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert agent.t0_at[0] == "prep1" and not (tmp_path / "r2").exists()
    assert agent.handle({"op": "disarm"})["disarmed"] is False


def test_a_failing_t0_fails_the_cut_and_not_the_program(tmp_path):
    agent = StepAgent(fail_t0=True)
    agent.handle({"op": "arm", "k": 1, "image": str(tmp_path / "r0")})
    py_launch(agent, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")  # the program goes on
    st = agent.handle({"op": "cut", "wait_s": 5})
    assert st["state"] == "failed" and "allocations grew" in st["error_text"]
    _until(lambda: agent.discarded == ["prep1"])
    assert agent.ops == 1


def test_a_rank_that_launched_graphs_of_unknown_contents_is_not_armed(tmp_path):
    agent = StepAgent()
    with agent.lock:
        agent.before_graph(0)
    ans = agent.handle({"op": "collectives"})
    assert ans["known"] is False and "graphs" in ans["why"]
    with pytest.raises(GpuosError) as e:
        agent.handle({"op": "arm", "k": 4, "image": str(tmp_path / "r0")})
    assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and agent.prepared == []


def _until(cond, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


# ---------------------------------------------------------------- the coordinator, fake agents

class FakeRank:
    """An agent's cut protocol as a rank of a running job answers it: its count goes up as the
    job runs (``speed`` collectives per request), it reaches K and writes its image."""

    def __init__(self, pid: int, count: int, speed: int = 1, past_first: bool = False, never: bool = False,
                 fit: bool = True) -> None:
        self.pid, self.count, self.speed = pid, count, speed
        self.past_first, self.never, self.fit = past_first, never, fit
        self.k: int | None = None
        self.image: str | None = None
        self.state: str | None = None
        self.log: list[tuple] = []
        self.rolled: list[str] = []
        self.server = ControlServer(self.handle, path=socket_path(pid))
        self.server.start()

    def handle(self, req: dict) -> dict:
        op = req["op"]
        self.log.append((op, req.get("k"), req.get("check")))
        if not self.never:
            self.count += self.speed
        if op == "collectives":
            return {"ok": True, "collectives": self.count, "graphs": 0, "captured": 0, "armed": 0, "known": True}
        if op == "arm":
            if self.past_first:
                self.past_first = False
                self.count = req["k"] + 3
            if self.count >= req["k"]:
                return {"ok": True, "armed": False, "collectives": self.count, "k": req["k"]}
            self.k, self.image, self.state = req["k"], req["image"], "armed"
            return {"ok": True, "armed": True, "collectives": self.count, "k": req["k"]}
        if op == "cut":
            if self.state == "armed" and self.count >= self.k:
                Path(self.image).mkdir()
                (Path(self.image) / "manifest.json").write_text("{}")
                self.state = "done"
            out = {"ok": True, "state": self.state, "k": self.k}
            if self.state == "done":
                out["result"] = {"stall_s": 0.003, "t0_stall_s": 0.001, "protect_stall_s": 0.002, "bytes": 64,
                                 "buffers": 2, "ops_before": 10, "t0_ns": 5, "seconds": 0.1, "gpu": "GPU-x",
                                 "image": {"image_id": "id"}}
            return out
        if op == "disarm":
            if self.state == "armed":
                self.state = "disarmed"
                return {"ok": True, "disarmed": True, "state": "disarmed"}
            return {"ok": True, "disarmed": False, "state": self.state}
        if op == "rollback":
            if not self.fit:
                return {"ok": False, "error": "does not fit", "code": int(ExitCode.IMAGE_MISMATCH)}
            if not req.get("check"):
                self.rolled.append(req["image"])
            return {"ok": True, "stall_s": 0.01, "bytes": 64, "read_s": 0.001}
        return {"ok": False, "error": f"unknown op {op}"}

    def ops(self, name: str) -> list[tuple]:
        return [e for e in self.log if e[0] == name]


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    """Two processes of this test's tree with RANK 0 and 1, each with a fake agent (made by ``make``)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    procs_: list[subprocess.Popen] = []
    fakes: list[FakeRank] = []

    def make(*specs: dict) -> list[FakeRank]:
        for i, spec in enumerate(specs):
            world = {"WORLD_SIZE": str(spec.pop("world"))} if "world" in spec else {}
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 env={**os.environ, "RANK": str(i), **world})
            procs_.append(p)
            fakes.append(FakeRank(p.pid, **spec))
        return fakes

    yield make
    for f in fakes:
        f.server.close()
    for p in procs_:
        p.kill()
        p.wait()


def is_fake(fakes: list[FakeRank]):  # noqa: ANN201
    pids = {f.pid for f in fakes}
    return lambda p: p in pids


def test_a_cut_arms_every_rank_at_the_largest_count_plus_the_margin_and_writes_the_manifest_last(ranks, tmp_path):
    fakes = ranks({"count": 10}, {"count": 17})
    image = tmp_path / "job.img"
    rec = agent_job.cut_job(os.getpid(), image, margin=3, request=_request, is_cuda=is_fake(fakes))
    k = rec["k"]
    assert k == 17 + 1 + 3  # rank 1 counted one more by the time it answered
    assert [f.ops("arm") for f in fakes] == [[("arm", k, None)]] * 2
    assert rec["attempts"] == 1 and [r["rank"] for r in rec["ranks"]] == [0, 1]
    assert all(r["collective"] == k and r["stall_s"] == 0.003 for r in rec["ranks"])
    assert CKPT_JOB_CUT.checker()(rec) is None, CKPT_JOB_CUT.checker()(rec)
    manifest = json.loads((image / agent_job.MANIFEST).read_text())
    assert manifest["kind"] == agent_job.KIND and manifest["k"] == k and manifest["launcher"] == os.getpid()
    assert [(r["pid"], r["image"]) for r in manifest["ranks"]] == [(fakes[0].pid, "rank-0"), (fakes[1].pid, "rank-1")]
    written = (image / agent_job.MANIFEST).stat().st_mtime_ns
    assert all((image / r).stat().st_mtime_ns <= written for r in ("rank-0/manifest.json", "rank-1/manifest.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.img", "run"]  # no temporary left


def test_a_rank_past_k_undoes_the_attempt_and_the_cut_is_tried_with_a_larger_margin(ranks, tmp_path):
    fakes = ranks({"count": 5}, {"count": 5, "past_first": True})
    image = tmp_path / "job.img"
    rec = agent_job.cut_job(os.getpid(), image, margin=2, request=_request, is_cuda=is_fake(fakes))
    assert rec["attempts"] == 2
    arms0, arms1 = (f.ops("arm") for f in fakes)
    assert [a[1] for a in arms0] == [a[1] for a in arms1]  # the same K on every rank, at each attempt
    assert ("disarm", None, None) in fakes[0].log  # the rank armed at the first attempt was disarmed
    k1, k2 = arms0[0][1], arms0[1][1]
    assert rec["k"] == k2 and k2 >= k1 + 3 + 8  # rank 1 was 3 past k1; the margin fourfold
    assert (image / "rank-0").is_dir() and (image / "rank-1").is_dir()


def test_a_rank_that_never_reaches_k_times_out_disarms_every_rank_and_leaves_no_image(ranks, tmp_path):
    fakes = ranks({"count": 5}, {"count": 5, "never": True, "speed": 0})
    image = tmp_path / "job.img"
    with pytest.raises(GpuosError) as e:
        agent_job.cut_job(os.getpid(), image, margin=1, wait_s=1.5, request=_request, is_cuda=is_fake(fakes))
    assert e.value.code == ExitCode.LOCK_TIMEOUT and "every image deleted" in str(e.value)
    assert "not done after 1.5 s" in str(e.value)
    assert all(f.ops("disarm") for f in fakes)
    assert fakes[0].state == "done" and fakes[1].state == "disarmed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 0's image went with the temporary


def test_a_rank_whose_count_is_not_known_refuses_the_cut_untouched(ranks, tmp_path, monkeypatch):
    fakes = ranks({"count": 5}, {"count": 5})
    orig = fakes[1].handle

    def graphs(req: dict) -> dict:
        if req["op"] == "collectives":
            return {"ok": True, "collectives": 5, "known": False, "why": "it launched 2 CUDA graphs built node by node"}
        return orig(req)

    fakes[1].server.handler = graphs
    with pytest.raises(GpuosError) as e:
        agent_job.cut_job(os.getpid(), tmp_path / "job.img", request=_request, is_cuda=is_fake(fakes))
    assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and "node by node" in str(e.value)
    assert not any(f.ops("arm") for f in fakes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_job_rollback_checks_every_rank_before_writing_any(ranks, tmp_path):
    fakes = ranks({"count": 3}, {"count": 3})
    image = tmp_path / "job.img"
    agent_job.cut_job(os.getpid(), image, request=_request, is_cuda=is_fake(fakes))
    fakes[1].fit = False
    with pytest.raises(GpuosError) as e:
        agent_job.rollback_job(os.getpid(), image, request=_request, is_cuda=is_fake(fakes))
    assert e.value.code == ExitCode.IMAGE_MISMATCH and "nothing was written" in str(e.value)
    assert fakes[0].rolled == [] and fakes[0].ops("rollback") == [("rollback", None, True)]
    fakes[1].fit = True
    rec = agent_job.rollback_job(os.getpid(), image, request=_request, is_cuda=is_fake(fakes))
    assert [f.rolled for f in fakes] == [[str(image / "rank-0")], [str(image / "rank-1")]]
    assert CKPT_JOB_ROLLBACK.checker()(rec) is None and rec["k"] == json.loads((image / "job.json").read_text())["k"]


def test_a_rollback_into_other_processes_is_refused(ranks, tmp_path):
    fakes = ranks({"count": 3}, {"count": 3})
    image = tmp_path / "job.img"
    agent_job.cut_job(os.getpid(), image, request=_request, is_cuda=is_fake(fakes))
    manifest = json.loads((image / "job.json").read_text())
    manifest["ranks"][1]["starttime"] += 1  # another process under the same pid
    (image / "job.json").write_text(json.dumps(manifest))
    with pytest.raises(GpuosError) as e:
        agent_job.rollback_job(os.getpid(), image, request=_request, is_cuda=is_fake(fakes))
    assert e.value.code == ExitCode.IMAGE_MISMATCH and f"PID {fakes[1].pid}" in str(e.value)
    assert not any(f.ops("rollback") for f in fakes)


def test_a_cuda_rank_without_an_agent_refuses_the_cut(ranks, tmp_path):
    fakes = ranks({"count": 3})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RANK": "1"})
    try:
        with pytest.raises(GpuosError) as e:
            agent_job.cut_job(os.getpid(), tmp_path / "job.img", request=_request,
                              is_cuda=lambda p: p in (fakes[0].pid, other.pid))
        assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and f"1 (PID {other.pid})" in str(e.value)
        assert "start each rank with `gpu-ckpt run`" in str(e.value)
    finally:
        other.kill()
        other.wait()


def _request(target, op, timeout=None, **fields):  # noqa: ANN001, ANN201
    from gpuos_tools.agent.control import request

    return request(target, op, timeout=timeout, **fields)


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{module}", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


@pytest.mark.parametrize("module,args,says", [
    ("ckpt", ["--cut", "--image", "x"], "--cut and --margin go with --job"),
    ("ckpt", ["--job", "1", "--cut"], "needs --image"),
    ("ckpt", ["--job", "1", "--cut", "--image", "x", "--force"], "--job --cut goes with"),
    ("ckpt", ["--job", "1", "--margin", "9"], "--margin goes with --job PID --cut"),
    ("ckpt", ["--job", "1", "--margin", str(agent_job.MARGIN)], "--margin goes with --job PID --cut"),
    ("ckpt", ["--pid", "1", "--margin", str(agent_job.MARGIN)], "--cut and --margin go with --job"),
    ("ckpt", ["--job", "1", "--image", "x", "--compress"], "--compress and --checksum go with --agent PID or --job"),
    ("ckpt", ["--job", "1", "--image", "x", "--threads", "2"], "--threads goes with --agent PID --image DIR or --job "
     "PID --cut"),
    ("ckpt", ["--pid", "1", "--checksum", "auto"], "--compress and --checksum go with --agent PID or --job"),
    ("ckpt", ["--job", "1", "--cut", "--image", "x", "--margin", str(agent_job.MAX_MARGIN + 1)], "--margin"),
    ("restore", ["--job", "1", "--cut"], "--cut goes with --job PID --image DIR"),
    ("restore", ["--job", "1", "--timeout", "10"], "--timeout goes with --agent PID, --job PID --cut or --image DIR"),
    ("restore", ["--pid", "1", "--timeout", "3600"], "--timeout goes with --agent PID, --job PID --cut or --image"),
    ("restore", ["--job", "1", "--cut", "--image", "x", "--device-map", "0=1"], "--job --cut goes with"),
])
def test_the_cut_options_are_refused_out_of_place(module, args, says):
    done = _cli(module, *args)
    assert done.returncode == ExitCode.USAGE and says in done.stderr, done.stderr


def test_gpu_ckpt_and_gpu_restore_cut_and_roll_back_a_job_of_fake_agents(ranks, tmp_path):
    """The commands end to end: records on stdout after a header, the job found from its launcher
    (a process whose children are the fake ranks' processes)."""
    fakes = ranks({"count": 3}, {"count": 8})
    image = tmp_path / "job.img"
    # the ranks are this test's children; the commands look for them below this process
    done = _cli("ckpt", "--job", str(os.getpid()), "--cut", "--image", str(image), "--margin", "2")
    assert done.returncode == 0, done.stderr
    header, rec = (json.loads(line) for line in done.stdout.splitlines())
    assert header["type"] == "header" and rec["type"] == "ckpt_job_cut" and rec["k"] == rec["ranks"][0]["collective"]
    assert rec["k"] >= 8 + 2 and [f.ops("arm")[0][1] for f in fakes] == [rec["k"]] * 2
    done = _cli("restore", "--job", str(os.getpid()), "--cut", "--image", str(image))
    assert done.returncode == 0, done.stderr
    rec = json.loads(done.stdout.splitlines()[-1])
    assert rec["type"] == "ckpt_job_rollback" and [r["rank"] for r in rec["ranks"]] == [0, 1]
    assert all(f.rolled == [str(image / f"rank-{i}")] for i, f in enumerate(fakes))
    done = _cli("ckpt", "--job", str(os.getpid()), "--cut", "--image", str(image))
    assert done.returncode == ExitCode.USAGE and "exists" in done.stderr



def test_an_output_that_cannot_be_written_refuses_the_cut_and_the_rollback_untouched(ranks, tmp_path):
    fakes = ranks({"count": 3}, {"count": 8})
    image = tmp_path / "job.img"
    done = _cli("ckpt", "--job", str(os.getpid()), "--cut", "--image", str(image), "-o", str(tmp_path / "no" / "x"))
    assert done.returncode == ExitCode.IO_ERROR and "cannot create" in done.stderr, done.stderr
    assert not image.exists() and not any(f.ops("arm") for f in fakes)
    assert _cli("ckpt", "--job", str(os.getpid()), "--cut", "--image", str(image)).returncode == 0
    done = _cli("restore", "--job", str(os.getpid()), "--cut", "--image", str(image), "-o", str(tmp_path / "no" / "y"))
    assert done.returncode == ExitCode.IO_ERROR and all(f.rolled == [] for f in fakes)


def _images(tmp_path: Path) -> dict[str, Path]:
    """One directory of each kind an image can be, by the file that kind writes."""
    kinds = {"cut": (agent_job.MANIFEST, {"kind": agent_job.KIND, "k": 3, "ranks": []}),
             "criu-job": ("gpuos-ckpt.json", {"kind": "job", "pid": 1}),
             "criu": ("gpuos-ckpt.json", {"pid": 1}),
             "agent": ("manifest.json", {})}
    out = {}
    for kind, (name, content) in kinds.items():
        (tmp_path / kind).mkdir()
        (tmp_path / kind / name).write_text(json.dumps(content))
        out[kind] = tmp_path / kind
    return out


def test_each_kind_of_image_is_told_apart(tmp_path):
    images = _images(tmp_path)
    assert {kind: agent_job.image_kind(path) for kind, path in images.items()} == {k: k for k in images}
    (tmp_path / "empty").mkdir()
    assert agent_job.image_kind(tmp_path / "empty") is None and agent_job.image_kind(tmp_path / "none") is None


@pytest.mark.parametrize("args,kind,code,says", [
    (["--image", "{cut}"], "cut", ExitCode.USAGE, "`gpu-restore --job PID --cut --image {cut}` restores it"),
    (["--image", "{agent}"], "agent", ExitCode.USAGE, "`gpu-restore --agent PID --image {agent}` restores it"),
    (["--job", "1", "--image", "{cut}"], "cut", ExitCode.USAGE, "add --cut"),
    (["--job", "1", "--image", "{criu-job}"], "criu-job", ExitCode.USAGE, "`gpu-restore --image {criu-job}` restores"),
    (["--job", "1", "--cut", "--image", "{criu-job}"], "criu-job", ExitCode.USAGE, "not a job's cut"),
    (["--job", "1", "--cut", "--image", "{criu}"], "criu", ExitCode.USAGE, "`gpu-restore --image {criu}`"),
    (["--job", "1", "--cut", "--image", "{agent}"], "agent", ExitCode.USAGE, "--agent PID --image {agent}"),
    (["--job", "1", "--cut", "--image", "{none}"], None, ExitCode.NO_INPUT, "{none}: no such directory"),
    (["--agent", "999999", "--image", "{cut}"], "cut", ExitCode.USAGE, "--job PID --cut --image {cut}"),
    (["--agent", "999999", "--image", "{criu-job}"], "criu-job", ExitCode.USAGE, "not an agent-path image"),
])
def test_an_image_given_to_the_wrong_restore_names_the_right_one(tmp_path, args, kind, code, says):
    images = {k: str(v) for k, v in _images(tmp_path).items()}
    images["none"] = str(tmp_path / "none")
    done = _cli("restore", *[a.format(**images) for a in args])
    assert done.returncode == code, done.stderr
    assert says.format(**images) in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr


def test_a_cut_of_a_tree_without_agent_or_cuda_says_which_pid_to_give(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        done = _cli("ckpt", "--job", str(other.pid), "--cut", "--image", str(tmp_path / "job.img"))
    finally:
        other.kill()
        other.wait()
    assert done.returncode == ExitCode.NOT_CUDA_PROCESS and done.stdout == ""
    assert "launcher (torchrun)" in done.stderr and "gpu-ckpt run" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []



def test_a_cut_into_a_directory_it_cannot_write_is_refused_before_any_rank_is_armed(ranks, tmp_path):
    fakes = ranks({"count": 3}, {"count": 3})
    where = Path(f"/proc/{os.getpid()}")  # a directory in which no one, root included, makes one
    with pytest.raises(GpuosError) as e:
        agent_job.cut_job(os.getpid(), where / "job.img", request=_request, is_cuda=is_fake(fakes))
    assert e.value.code == ExitCode.IO_ERROR and "cannot write the job image" in str(e.value)
    assert not any(f.ops("arm") for f in fakes)



@pytest.mark.parametrize("change,says", [
    (lambda m: m.pop("k"), "no collective 'k'"),
    (lambda m: m.update(ranks=[]), "no ranks"),
    (lambda m: m["ranks"][1].pop("image"), "rank entry 1 lacks"),
    (lambda m: m["ranks"][0].update(image="../elsewhere"), "rank entry 0 lacks"),
    (lambda m: m["ranks"][0].update(pid="12"), "rank entry 0 lacks"),
    (lambda m: m["ranks"][1].update(image="rank-9"), "the image of rank 1 is missing"),
])
def test_a_damaged_job_manifest_is_refused_before_any_rank_is_asked(ranks, tmp_path, change, says):
    fakes = ranks({"count": 3}, {"count": 3})
    image = tmp_path / "job.img"
    agent_job.cut_job(os.getpid(), image, request=_request, is_cuda=is_fake(fakes))
    manifest = json.loads((image / "job.json").read_text())
    change(manifest)
    (image / "job.json").write_text(json.dumps(manifest))
    with pytest.raises(GpuosError) as e:
        agent_job.rollback_job(os.getpid(), image, request=_request, is_cuda=is_fake(fakes))
    assert e.value.code == ExitCode.IMAGE_CORRUPT and says in str(e.value), str(e.value)
    assert not any(f.ops("rollback") for f in fakes)



def test_a_tree_holding_only_some_ranks_of_the_job_is_refused(ranks, tmp_path):
    """A rank's PID given instead of the launcher's: its tree holds that rank alone."""
    fakes = ranks({"count": 3, "world": 2}, {"count": 3, "world": 2})
    with pytest.raises(GpuosError) as e:
        agent_job.cut_job(fakes[1].pid, tmp_path / "job.img", request=_request, is_cuda=is_fake(fakes))
    assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and "holds 1 of the job's 2 ranks (rank 1)" in str(e.value)
    assert "launcher" in str(e.value) and not any(f.ops("arm") for f in fakes)
    rec = agent_job.cut_job(os.getpid(), tmp_path / "job.img", request=_request, is_cuda=is_fake(fakes))
    assert [r["rank"] for r in rec["ranks"]] == [0, 1]  # the whole job: cut
