"""Suspend and resume through the agent, the parts a CPU can check: which memory is owned, the
refusals and their exit status, the staging layout and the image's buffers, the agent's control
ops while a program is held (answered without the agent's lock), and `gpu-ckpt --agent --suspend`
/ `gpu-restore --agent --resume` against a stand-in agent. The GPU part is
tests/gpu/test_suspend_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuos_tools.agent import control
from gpuos_tools.memory import owned
from gpuos_tools.agent.agent import Agent
from gpuos_tools.agent.suspend import (SUSPENDED, Span, Suspension, image_buffers, layout, named, refusal, split,
                                       summary)
from gpuos_tools.agent.view import ProcessView
from gpuos_tools.ckpt import records as _schemas  # noqa: F401 -- registers the schemas check_written uses
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.model.allocs import Allocation
from gpuos_tools.stream.records import check_written

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def rec(base: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(base=base, size=size)


def test_split_tells_owned_allocations_from_the_others():
    records = [rec(0x100000, 2 * MIB), rec(0x800000, 4 * MIB)]
    allocs = [Allocation(1, 0x100000, 2 * MIB, "vmm"), Allocation(2, 0x800000 + MIB, MIB, "vmm"),
              Allocation(3, 0x900000, 8 * MIB, "device"),  # starts inside a record, runs past it
              Allocation(4, 0x10, 64, "device"), Allocation(5, 0x2000000, MIB, "async")]
    mine, outside = split(allocs, records)
    assert [a.id for a in mine] == [1, 2] and [a.id for a in outside] == [3, 4, 5]
    assert split(allocs, []) == ([], allocs)


def test_summary_and_names_list_the_largest_first():
    allocs = [Allocation(i, 0x1000 * i, size, "device") for i, size in enumerate([64, 3 * MIB, MIB, 7, 5 * MIB, 9, 1])]
    s = summary(allocs, top=2)
    assert s["count"] == 7 and s["bytes"] == sum(a.size for a in allocs)
    assert [x["size"] for x in s["largest"]] == [5 * MIB, 3 * MIB]
    text = named(allocs, top=2)
    assert text.startswith("7 allocations, 9.0 MiB: 5.0 MiB at 0x4000 (device), 3.0 MiB at 0x1000") and "and 5 more" in text


def test_refusals():
    ws = [Allocation(9, 0x7000, 8 * MIB, "device")]
    not_owned = refusal(False, 0, ws, partial=True)
    assert "GPUOS_AGENT_OWN=1" in not_owned and "8.0 MiB at 0x7000" in not_owned
    assert "GPUOS_AGENT_OWN=1" in refusal(False, 0, [], partial=False)
    outside = refusal(True, 3, ws, partial=False)
    assert "--partial" in outside and "8.0 MiB at 0x7000 (device)" in outside
    assert refusal(True, 3, ws, partial=True) is None
    assert refusal(True, 3, [], partial=False) is None
    assert "nothing to suspend" in refusal(True, 0, [], partial=True)


def test_layout_puts_records_first_and_the_image_finds_each_allocation():
    records = [rec(0x100000, 2 * MIB), rec(0x400000, 2 * MIB)]
    extra = [Allocation(7, 0x50, 100, "device")]
    spans, total = layout(records, extra)
    assert spans == [Span(0x100000, 2 * MIB, 0, True), Span(0x400000, 2 * MIB, 2 * MIB, True),
                     Span(0x50, 100, 4 * MIB, False)]
    assert total == 4 * MIB + 100
    allocs = [Allocation(1, 0x100000, 2 * MIB, "vmm"), Allocation(2, 0x400000 + 4096, 512, "vmm"), extra[0],
              Allocation(3, 0x9000000, 64, "device")]  # in no span: not saved, left out
    got = [(a.id, off) for a, off in image_buffers(allocs, spans)]
    assert got == [(1, 0), (2, 2 * MIB + 4096), (7, 4 * MIB)]


def test_resume_without_a_suspend_is_refused():
    a = Agent()
    with pytest.raises(GpuosError) as e:
        a.handle({"op": "resume"})
    assert e.value.code == ExitCode.WRONG_STATE and "not suspended" in str(e.value)


def test_suspend_of_a_program_not_owned_is_refused_naming_its_memory(monkeypatch):
    monkeypatch.setattr(owned, "_library", None)
    a = Agent()
    ProcessView.on_alloc(a, 0x7F0000000000, 256 * MIB, "device")
    ProcessView.on_alloc(a, 0x7F0010000000, 4 * MIB, "device")
    with pytest.raises(GpuosError) as e:
        a.handle({"op": "suspend", "partial": True})
    assert e.value.code == ExitCode.NOT_OWNED
    assert "GPUOS_AGENT_OWN=1" in str(e.value) and "256.0 MiB at 0x7f0000000000" in str(e.value)
    assert a.suspension is not None and not a.suspension.held  # nothing changed
    assert a.handle({"op": "ping"})["state"] == "running"


def test_a_held_program_answers_ping_without_the_lock_and_refuses_what_would_wait():
    a = Agent()
    sus = Suspension(a)
    a.suspension = sus
    sus.state = SUSPENDED
    sus._held_since = time.perf_counter()
    sus.info = {"released_bytes": 123}
    holder_has_it, done = threading.Event(), threading.Event()

    def holder() -> None:  # as the holder thread does: the lock stays taken while suspended
        with a.lock:
            holder_has_it.set()
            done.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    holder_has_it.wait()
    try:
        answer = {}
        th = threading.Thread(target=lambda: answer.update(a.handle({"op": "ping"})))
        th.start()
        th.join(2)
        assert not th.is_alive(), "ping waited for the agent's lock"
        assert answer["state"] == SUSPENDED and answer["released_bytes"] == 123
        for op in ("snapshot", "rollback", "suspend"):
            with pytest.raises(GpuosError) as e:
                a.handle({"op": op, "image": "/x"})
            assert e.value.code == ExitCode.WRONG_STATE and "--resume" in str(e.value)
    finally:
        done.set()
        t.join()


def test_resume_hands_over_to_the_holder_and_returns_its_answer():
    a = Agent()
    sus = Suspension(a)
    sus.state = SUSPENDED

    def holder() -> None:
        assert sus._wake.get(timeout=5) == "resume"
        sus._answers.put({"ok": True, "state": "running", "bytes": 42})

    t = threading.Thread(target=holder)
    t.start()
    assert sus.resume(timeout=5)["bytes"] == 42
    t.join()
    sus.state = SUSPENDED
    threading.Thread(target=lambda: (sus._wake.get(timeout=5),
                                     sus._answers.put(GpuosError("could not map", ExitCode.CUDA_ERROR)))).start()
    with pytest.raises(GpuosError) as e:
        sus.resume(timeout=5)
    assert e.value.code == ExitCode.CUDA_ERROR


# -- the commands against a stand-in agent -------------------------------------------------------

SUSPENDED_ANSWER = {"ok": True, "state": "suspended", "pid": 1, "ops_before": 9, "buffers": 3, "released_bytes": 6 * MIB,
                    "saved_bytes": 6 * MIB, "owned_allocations": 3, "save_gbps": 50.0, "suspend_s": 0.2,
                    "not_owned": {"count": 1, "bytes": 8 * MIB, "largest": [{"addr": 4096, "size": 8 * MIB,
                                                                             "kind": "device"}]}}


@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    requests: list[dict] = []
    refuse: list[GpuosError] = []

    def handler(req):
        requests.append(req)
        if refuse:
            raise refuse.pop(0)
        if req["op"] == "suspend":
            return dict(SUSPENDED_ANSWER)
        return {"ok": True, "state": "running", "buffers": 3, "bytes": 6 * MIB, "resume_s": 0.1, "load_gbps": 48.0,
                "held_s": 2.5}

    srv = control.ControlServer(handler, control.socket_path(os.getpid()))
    srv.start()
    yield srv, requests, refuse
    srv.close()


def cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{tool}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))


def test_gpu_ckpt_agent_suspend_and_gpu_restore_agent_resume_write_records(agent, tmp_path):
    srv, requests, _ = agent
    s = cli("ckpt", "--agent", str(srv.path), "--suspend", "--partial", "--image", "img", "--max-hold", "30")
    assert s.returncode == 0, s.stderr
    lines = [json.loads(x) for x in s.stdout.splitlines()]
    assert lines[0]["type"] == "header" and lines[1]["type"] == "agent_suspend"
    assert all(check_written(rec) is None for rec in lines), lines
    assert lines[1]["not_owned"]["count"] == 1 and lines[1]["agent"] == str(srv.path)
    assert requests[-1] == {"op": "suspend", "partial": True, "compress": False, "checksum": "auto",
                            "image": str(Path(ROOT, "img")), "max_hold_s": 30.0}
    r = cli("restore", "--agent", str(srv.path), "--resume")
    assert r.returncode == 0, r.stderr
    rec_ = [json.loads(x) for x in r.stdout.splitlines()][-1]
    assert rec_["type"] == "agent_resume" and rec_["held_s"] == 2.5 and check_written(rec_) is None
    assert requests[-1] == {"op": "resume"}
    r = cli("restore", "--agent", str(srv.path), "--resume", "--lazy")
    assert r.returncode == 0, r.stderr
    assert requests[-1] == {"op": "resume", "lazy": True}
    assert all(check_written(json.loads(x)) is None for x in r.stdout.splitlines())


def test_the_records_of_a_suspend_and_a_resume_have_schemas():
    """agent_suspend and agent_resume are checked (a record of them can be wrong), and the
    agent's answers, as the tools write them, are right."""
    assert check_written({"type": "agent_suspend", "agent": "1"}) == "field 'state' is missing"
    assert "field 'agent'" in check_written({"type": "agent_resume", "state": "running", "buffers": 1, "bytes": 1})
    suspended = {"type": "agent_suspend", "agent": "1", **{k: v for k, v in SUSPENDED_ANSWER.items() if k != "ok"}}
    assert check_written(suspended) is None
    assert "not_owned.largest" in check_written({**suspended, "not_owned": {"count": 1, "largest": [{"size": -1}]}})
    assert "field 'state'" in check_written({**suspended, "state": "running"})


def test_lazy_resume_hands_every_released_record_to_the_engine_with_its_staging_pieces():
    """Suspension._resume_lazy: the records still owned are adopted (their host copies are the
    staging's pieces), one freed meanwhile is counted, the background loader is started."""

    class Staging:
        base = 0x10_0000

        def spans(self, offset, n):  # pieces of 4 MiB, as the pinned staging cuts them
            while n > 0:
                k = min(n, 4 * MIB - offset % (4 * MIB))
                yield self.base + offset, k
                offset, n = offset + k, n - k

    class Engine:
        def __init__(self):
            self.adopted, self.started = [], 0

        def adopt(self, base, size, pieces):
            self.adopted.append((base, size, pieces))

        def load_rest(self):
            self.started += 1

    a = SimpleNamespace(engine=Engine(), staging=Staging())
    sus = Suspension(a)
    sus._lib = SimpleNamespace(lookup=lambda addr: None if addr == 0x3000 else rec(addr, 0))
    sus._spans = [Span(0x1000, 6 * MIB, 0, True), Span(0x3000, MIB, 6 * MIB, True), Span(0x5000, 2 * MIB, 7 * MIB, True)]
    sus._held_since = time.perf_counter()
    out = sus._resume_locked(lazy=True)
    assert out["lazy"] and out["buffers"] == 2 and out["bytes"] == 8 * MIB and out["freed_meanwhile"] == 1
    assert out.pop("ok") is True and check_written({"type": "agent_resume", "agent": "1", **out}) is None
    assert a.engine.started == 1 and sus._spans == []
    (b1, s1, p1), (b2, s2, p2) = a.engine.adopted
    assert (b1, s1, p1) == (0x1000, 6 * MIB, [(0x10_0000, 4 * MIB), (0x10_0000 + 4 * MIB, 2 * MIB)])
    assert (b2, s2, p2) == (0x5000, 2 * MIB, [(0x10_0000 + 7 * MIB, MIB), (0x10_0000 + 8 * MIB, MIB)])


def test_lazy_resume_needs_the_engine():
    sus = Suspension(SimpleNamespace(engine=None))
    sus.state = SUSPENDED
    with pytest.raises(GpuosError) as e:
        sus.resume(timeout=1, lazy=True)
    assert e.value.code == ExitCode.USAGE and "GPUOS_AGENT_OWN" in str(e.value)
    assert sus.state == SUSPENDED and sus._wake.empty()


def test_lazy_resume_needs_an_owning_engine():
    """An engine made for a lazy rollback of plain allocations cannot bring released memory back."""
    sus = Suspension(SimpleNamespace(engine=SimpleNamespace(owned=False)))
    sus.state = SUSPENDED
    with pytest.raises(GpuosError) as e:
        sus.resume(timeout=1, lazy=True)
    assert e.value.code == ExitCode.USAGE and sus._wake.empty()


def test_refusals_keep_their_exit_status(agent):
    srv, _, refuse = agent
    refuse.append(GpuosError("device memory outside the owned allocator would stay on the GPU: 1 allocation",
                             ExitCode.NOT_OWNED))
    s = cli("ckpt", "--agent", str(srv.path), "--suspend")
    assert s.returncode == ExitCode.NOT_OWNED and "outside the owned allocator" in s.stderr
    refuse.append(GpuosError("the program is not suspended: nothing to resume", ExitCode.WRONG_STATE))
    r = cli("restore", "--agent", str(srv.path), "--resume")
    assert r.returncode == ExitCode.WRONG_STATE and "not suspended" in r.stderr


@pytest.mark.parametrize("tool,args,message", [
    ("ckpt", ["--suspend"], "go with --agent"),
    ("ckpt", ["--partial", "--pid", "5"], "go with --agent"),
    ("ckpt", ["--agent", "5", "--suspend", "--parent", "x"], "no --parent"),
    ("ckpt", ["--agent", "5", "--suspend", "--pid", "5"], "--agent --suspend goes with"),
    ("ckpt", ["--agent", "5", "--image", "x", "--partial"], "--agent goes with"),
    ("restore", ["--resume"], "goes with --agent"),
    ("restore", ["--agent", "5", "--resume", "--device", "1", "--device-map", "0=1"], "not both"),
    ("restore", ["--agent", "5", "--resume", "--image", "x"], "--agent --resume goes with"),
    ("restore", ["--pid", "5", "--lazy"], "--lazy goes with --agent"),
])
def test_usage_errors(tool, args, message):
    p = cli(tool, *args)
    assert p.returncode == ExitCode.USAGE and message in p.stderr, p.stderr
