"""Full-process images of a program under the agent (gpuos_tools/ckpt/agent_criu.py) on the CPU:
the dump has the agent suspend, then the driver checkpoints, then CRIU dumps; the restore runs
CRIU, the driver's restore, then the agent's resume; refusals and failures leave the program
resumed by its agent, and the guard resumes it when the tool is killed.

The program is tests/agent_criu_fake.py (a real process serving the agent's control socket), the
driver file_driver.py's fake (its states in files, so that the guard process sees them) and CRIU
a stand-in script; both fakes append their steps to one file, which gives the order across
processes. test_agent_criu_cpu.py runs the real CRIU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from file_driver import FileCheckpointer, FileDriver, guard_command
from helpers import REPO, child_env

from gpuos_tools import procs
from gpuos_tools.ckpt import agent_criu, agent_hold, criu, guard
from gpuos_tools.ckpt import records as _schemas  # noqa: F401 -- registers the schemas check_written uses
from gpuos_tools.ckpt.driver import CkptError
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream.records import check_written

TESTS = Path(__file__).resolve().parent
FAKE_AGENT = TESTS / "agent_criu_fake.py"

#: `criu` for these tests: says its version, passes `check`, and for dump and restore appends
#: "criu_dump PID" / "criu_restore 0" to $FAKE_CRIU_CALLS, its arguments to $FAKE_CRIU_ARGS, and
#: makes the files a finished dump or restore leaves; fails the verb $FAKE_CRIU_FAIL names.
STAND_IN = """#!/bin/sh
case "$1" in
  --version) echo "Version: 4.2"; exit 0 ;;
  check) echo "Looks good."; exit 0 ;;
  dump|restore) verb=$1 ;;
  *) exit 2 ;;
esac
echo "$*" >> "$FAKE_CRIU_ARGS"
dir=""; pidfile=""; tree=0
while [ $# -gt 0 ]; do
  case "$1" in
    --images-dir) dir=$2; shift ;;
    --pidfile) pidfile=$2; shift ;;
    --tree) tree=$2; shift ;;
  esac
  shift
done
if [ "$FAKE_CRIU_FAIL" = "$verb" ]; then
  printf '(00.01) Error (criu/cr-%s.c:7): %s FAILED.\\n' "$verb" "$verb" > "$dir/$verb.log"
  exit 1
fi
echo "criu_$verb $tree" >> "$FAKE_CRIU_CALLS"
if [ "$verb" = dump ]; then : > "$dir/inventory.img"; else echo "$FAKE_CRIU_RESTORED" > "$pidfile"; fi
exit 0
"""


class World:
    """The fake driver's directory, the stand-in CRIU, and programs under the fake agent."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch):
        self.tmp = tmp
        self._mp = monkeypatch
        self.states = tmp / "states"
        self.states.mkdir()
        self.run = Path(tempfile.mkdtemp(prefix="gac", dir="/tmp"))  # a socket path has at most 107 bytes
        bindir = tmp / "bin"
        bindir.mkdir()
        (bindir / "criu").write_text(STAND_IN)
        (bindir / "criu").chmod(0o755)
        self.args = tmp / "criu-args"
        monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(self.run))
        monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp / "state"))
        monkeypatch.setenv("FAKE_CRIU_CALLS", str(self.states / "calls"))
        monkeypatch.setenv("FAKE_CRIU_ARGS", str(self.args))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setattr(guard, "COMMAND", guard_command(self.states))
        monkeypatch.setattr(guard, "SETTLE_S", 0.05)
        self.driver = FileDriver(self.states)
        self.procs: list[subprocess.Popen] = []

    def dumped_and_gone(self, pid: int, image: Path, gone: int) -> None:
        """As after a real dump: the driver holds ``pid`` checkpointed, the image names a PID that
        is gone (``gone``), and the stand-in CRIU's restore brings back ``pid`` in its place."""
        self.driver.set(pid, "checkpointed")
        data = meta(image)
        data.update(pid=gone, pids=[gone], tids=[gone])  # the dumped tree's ids, free after it ended
        (image / criu.METADATA).write_text(json.dumps(data))
        self._mp.setenv("FAKE_CRIU_RESTORED", str(pid))

    def program(self, **env: str) -> int:
        """A program under the fake agent, running as far as the fake driver knows; its pid."""
        d = self.tmp / f"prog-{len(self.procs)}"
        d.mkdir()
        (d / "calls").symlink_to(self.states / "calls")
        with open(d / "stderr", "w") as err:
            p = subprocess.Popen([sys.executable, str(FAKE_AGENT), str(d)], stdin=subprocess.DEVNULL, stderr=err,
                                 env=child_env(XDG_RUNTIME_DIR=str(self.run), **env))
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while not (d / "agent-ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, (d / "stderr").read_text()
            time.sleep(0.01)
        self.driver.set(p.pid, "running")
        return p.pid

    def calls(self) -> list[str]:
        return [step for step, _ in self.driver.calls()]

    def ckpt(self, driver: FileDriver | None = None) -> FileCheckpointer:
        return FileCheckpointer(driver or self.driver)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        shutil.rmtree(self.run, ignore_errors=True)


@pytest.fixture
def world(tmp_path: Path, monkeypatch):
    w = World(tmp_path, monkeypatch)
    yield w
    w.close()


def meta(image: Path) -> dict:
    return json.loads((image / criu.METADATA).read_text())


def types(ckpt: FileCheckpointer) -> list[str]:
    return [r["type"] + (f":{r['step']}" if r["type"] == "ckpt_step" else "") for r in ckpt.records]


def ping(pid: int) -> dict:
    from gpuos_tools.agent import control

    return control.request(str(pid), "ping", timeout=10)


def test_the_dump_suspends_through_the_agent_then_the_driver_then_criu(world: World) -> None:
    pid = world.program()
    ckpt = world.ckpt()
    image = world.tmp / "image"
    result = agent_criu.dump(ckpt, pid, image)
    assert world.calls() == ["agent_suspend", "lock", "checkpoint", "criu_dump"]
    assert result["state"] == "dumped" and result["agent_suspended"] is True
    assert "the restore has it resume" in result["message"]
    agent = meta(image)["agent"]
    assert agent["suspended_by_dump"] is True and agent["mechanism"] == "intercept"
    assert agent["socket"].endswith(f"agent-{pid}.sock") and agent["released_bytes"] == 3 << 20
    # the records: the agent's suspend first, as `gpu-ckpt --agent --suspend` writes it
    assert types(ckpt)[0] == "agent_suspend" and types(ckpt)[-1] == "ckpt_result"
    assert ckpt.records[0]["agent"] == str(pid) and ckpt.records[0]["buffers"] == 3
    assert all(check_written(r) is None for r in ckpt.records)
    assert ping(pid)["state"] == "suspended"  # (the stand-in CRIU did not end it)


@pytest.mark.parametrize("lazy", [False, True])
def test_the_restore_runs_criu_then_the_driver_then_the_agents_resume(world: World, lazy: bool) -> None:
    pid = world.program()
    image = world.tmp / "image"
    agent_criu.dump(world.ckpt(), pid, image)
    world.dumped_and_gone(pid, image, 2**22 + 3)
    ckpt = world.ckpt()
    result = agent_criu.restore(ckpt, image, lazy=lazy)
    resume = "agent_resume_lazy" if lazy else "agent_resume"
    assert world.calls()[4:] == ["criu_restore", "restore", "unlock", resume]
    assert "its agent resumed it" in result["message"] and ping(pid)["state"] == "running"
    assert types(ckpt)[-1] == "agent_resume" and ckpt.records[-1]["agent"] == str(pid)
    assert all(check_written(r) is None for r in ckpt.records)
    assert world.driver.get_state(pid)[0] == "running"


def test_a_restore_while_an_id_of_the_image_is_taken_is_refused_untouched(world: World) -> None:
    """CRIU restores the tree under its old process and thread ids: a program dumped with
    --leave-running that has since ended, but that its parent has not reaped, still holds its
    pid; any other process can hold one of its thread ids. Either way the tool says which and
    touches nothing."""
    pid = world.program()
    image = world.tmp / "image"
    agent_criu.dump(world.ckpt(), pid, image)
    data = meta(image)
    assert pid in data["pids"] and pid in data["tids"] and len(data["tids"]) >= len(data["pids"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not procs.unreaped(ended.pid):  # ended, not reaped: a zombie of this test
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        before = world.calls()
        for tids, says in (([], f"{ended.pid} has ended, and its parent (PID {os.getpid()}) has not reaped it"),
                           ([os.getpid()], ", ".join(map(str, sorted([ended.pid, os.getpid()]))) + " are taken now")):
            (image / criu.METADATA).write_text(json.dumps(dict(data, pid=ended.pid, pids=[ended.pid], tids=tids)))
            with pytest.raises(CkptError) as e:
                criu.restore(world.ckpt(), image)
            assert e.value.code == ExitCode.WRONG_STATE and not e.value.touched
            assert says in str(e.value) and "nothing was touched" in str(e.value)
        assert world.calls() == before  # neither CRIU nor the driver was asked anything
    finally:
        ended.wait()
    assert not procs.unreaped(ended.pid)


def test_leave_running_has_the_agent_resume_after_the_dump(world: World) -> None:
    pid = world.program()
    ckpt = world.ckpt()
    result = agent_criu.dump(ckpt, pid, world.tmp / "image", leave_running=True)
    assert world.calls() == ["agent_suspend", "lock", "checkpoint", "criu_dump", "restore", "unlock", "agent_resume"]
    assert result["state"] == "running" and result["message"].endswith("its agent resumed it")
    assert types(ckpt)[-2:] == ["agent_resume", "ckpt_result"] and ping(pid)["state"] == "running"


def test_the_opt_out_dumps_the_plain_way(world: World) -> None:
    pid = world.program()
    result = agent_criu.dump(world.ckpt(), pid, world.tmp / "image", agent_suspend=False)
    assert world.calls() == ["lock", "checkpoint", "criu_dump"] and "agent_suspended" not in result
    agent = meta(world.tmp / "image")["agent"]
    assert agent["suspended_by_dump"] is False and agent["why"] == "--no-agent-suspend"


def test_an_agent_that_owns_nothing_is_dumped_the_plain_way(world: World) -> None:
    pid = world.program(FAKE_AGENT_SUSPEND="not_owned")
    agent_criu.dump(world.ckpt(), pid, world.tmp / "image")
    assert world.calls() == ["lock", "checkpoint", "criu_dump"]
    agent = meta(world.tmp / "image")["agent"]
    assert agent["suspended_by_dump"] is False and "nothing to suspend" in agent["why"]


def test_a_program_without_an_agent_is_dumped_as_before(world: World, tmp_path: Path) -> None:
    from helpers import fake_cuda_process

    with fake_cuda_process(tmp_path) as p:
        world.driver.set(p.pid, "running")
        agent_criu.dump(world.ckpt(), p.pid, world.tmp / "image")
    assert world.calls() == ["lock", "checkpoint", "criu_dump"]
    assert "agent" not in meta(world.tmp / "image") and "trace_pipe" not in meta(world.tmp / "image")


def test_a_program_already_suspended_stays_so_and_the_restore_says_it(world: World) -> None:
    pid = world.program()
    from gpuos_tools.agent import control

    control.request(str(pid), "suspend", timeout=10, partial=True)
    image = world.tmp / "image"
    agent_criu.dump(world.ckpt(), pid, image)
    assert world.calls() == ["agent_suspend", "lock", "checkpoint", "criu_dump"]  # the first suspend only
    assert meta(image)["agent"]["suspended_by_dump"] is False and meta(image)["agent"]["state"] == "suspended"
    with pytest.raises(GpuosError, match="did not suspend its program's agent"):
        agent_criu.restore(world.ckpt(), image, lazy=True)  # refused before anything is run
    assert world.calls()[-1] == "criu_dump"


def test_a_program_under_the_cupti_agent_is_refused_untouched(world: World) -> None:
    pid = world.program(FAKE_AGENT_MECHANISM="cupti")
    ckpt = world.ckpt()
    with pytest.raises(CkptError) as e:
        agent_criu.dump(ckpt, pid, world.tmp / "image")
    assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and not e.value.touched
    assert "CUPTI loaded" in str(e.value) and "GPUOS_AGENT_MECHANISM=cupti" in str(e.value)
    assert world.calls() == [] and not (world.tmp / "image").exists()
    assert ckpt.records[-1]["type"] == "ckpt_result" and ckpt.records[-1]["touched"] is False


def test_an_agent_that_refuses_to_suspend_stops_the_dump_untouched(world: World) -> None:
    pid = world.program(FAKE_AGENT_SUSPEND="refuse")
    with pytest.raises(CkptError) as e:
        agent_criu.dump(world.ckpt(), pid, world.tmp / "image")
    assert e.value.code == ExitCode.WRONG_STATE and not e.value.touched
    assert "nothing was touched" in str(e.value) and "--no-agent-suspend" in str(e.value)
    assert world.calls() == [] and not (world.tmp / "image").exists()
    assert not [n for n in os.listdir(world.tmp) if n.endswith(".tmp")]


def test_a_failed_criu_dump_has_the_agent_resume_the_program(world: World, monkeypatch) -> None:
    pid = world.program()
    monkeypatch.setenv("FAKE_CRIU_FAIL", "dump")
    ckpt = world.ckpt()
    with pytest.raises(CkptError) as e:
        agent_criu.dump(ckpt, pid, world.tmp / "image")
    assert e.value.code == ExitCode.CRIU_FAILED
    assert world.calls() == ["agent_suspend", "lock", "checkpoint", "restore", "unlock", "agent_resume"]
    assert str(e.value).endswith("no image was written; left running; its agent resumed it"), str(e.value)
    assert ping(pid)["state"] == "running" and ckpt.records[-1]["message"] == str(e.value)
    assert types(ckpt)[-2:] == ["agent_resume", "ckpt_result"]


class RefusingCheckpoint(FileDriver):
    def checkpoint(self, pid: int) -> str | None:
        with open(self.dir / "calls", "a") as f:
            f.write(f"checkpoint_refused {pid}\n")
        return "CUDA_ERROR_NOT_SUPPORTED"


def test_a_refused_driver_checkpoint_has_the_agent_resume_the_program(world: World) -> None:
    pid = world.program()
    with pytest.raises(CkptError) as e:
        agent_criu.dump(world.ckpt(RefusingCheckpoint(world.states)), pid, world.tmp / "image")
    assert world.calls() == ["agent_suspend", "lock", "checkpoint_refused", "unlock", "agent_resume"]
    assert "its agent resumed it" in str(e.value) and ping(pid)["state"] == "running"
    assert not (world.tmp / "image").exists()


def test_an_agent_that_does_not_resume_is_said_to_hold_the_program(world: World, monkeypatch) -> None:
    pid = world.program(FAKE_AGENT_RESUME="refuse")
    monkeypatch.setenv("FAKE_CRIU_FAIL", "dump")
    with pytest.raises(CkptError) as e:
        agent_criu.dump(world.ckpt(), pid, world.tmp / "image")
    assert e.value.code == ExitCode.CRIU_FAILED
    assert f"still held by its agent; `gpu-restore --agent {pid} --resume` resumes it" in str(e.value)
    assert "could not map" in str(e.value)


def test_an_agent_that_does_not_answer_the_resume_after_a_restore(world: World, monkeypatch) -> None:
    pid = world.program(FAKE_AGENT_RESUME="hang")
    image = world.tmp / "image"
    agent_criu.dump(world.ckpt(), pid, image)
    world.dumped_and_gone(pid, image, 2**22 + 5)
    monkeypatch.setattr(agent_hold, "RESUME_TIMEOUT_S", 1.0)
    with pytest.raises(CkptError) as e:
        agent_criu.restore(world.ckpt(), image)
    assert e.value.state == "running" and "did not answer" in str(e.value)
    assert f"restored from {image} and running on the driver's side" in str(e.value)
    assert f"`gpu-restore --agent {pid} --resume` resumes it" in str(e.value)


def test_the_trace_pipe_is_recorded_and_the_restore_hands_dev_null_in_its_place(world: World) -> None:
    read, write = os.pipe()
    try:
        boot = json.dumps({"trace": {"fd": write}})
        d = world.tmp / "prog-pipe"
        d.mkdir()
        (d / "calls").symlink_to(world.states / "calls")
        p = subprocess.Popen([sys.executable, str(FAKE_AGENT), str(d)], pass_fds=(write,), stdin=subprocess.DEVNULL,
                             env=child_env(XDG_RUNTIME_DIR=str(world.run), GPUOS_BOOT=boot))
        world.procs.append(p)
        while not (d / "agent-ready").exists():
            assert p.poll() is None
            time.sleep(0.01)
        world.driver.set(p.pid, "running")
        ino = os.fstat(write).st_ino
        assert agent_criu.trace_pipe(p.pid) == {"fd": write, "pipe": f"pipe:[{ino}]"}
        image = world.tmp / "image"
        agent_criu.dump(world.ckpt(), p.pid, image)
        assert meta(image)["trace_pipe"] == {"fd": write, "pipe": f"pipe:[{ino}]"}
        world.dumped_and_gone(p.pid, image, 2**22 + 7)
        agent_criu.restore(world.ckpt(), image)
        restore_args = world.args.read_text().splitlines()[-1].split()
        i = restore_args.index("--inherit-fd")
        assert restore_args[i + 1].startswith("fd[") and restore_args[i + 1].endswith(f"]:pipe:[{ino}]")
    finally:
        os.close(read)
        os.close(write)


def test_the_boot_variable_is_the_launchers() -> None:
    from gpuos_tools.injection.config import ENV

    assert agent_criu.BOOT_ENV == ENV


# -- the guard, when the tool is killed -------------------------------------------------------------

#: The killed tool: ``dump STATES PID IMAGE PHASE [leave]`` or ``restore STATES IMAGE PHASE``; it
#: stops (for the test to kill it) when it tells its guard PHASE.
TOOL = """import sys
from pathlib import Path
from file_driver import FileCheckpointer, FileDriver, stop_at_phase
from gpuos_tools.ckpt import agent_criu
what, states, *rest = sys.argv[1:]
ckpt = FileCheckpointer(FileDriver(states))
if what == "dump":
    pid, image, phase, *leave = rest
    stop_at_phase(states, phase)
    agent_criu.dump(ckpt, int(pid), Path(image), leave_running=bool(leave))
else:
    image, phase = rest
    stop_at_phase(states, phase)
    agent_criu.restore(ckpt, Path(image))
"""


def killed_at(world: World, phase: str, *args: str) -> dict:
    """Run the tool until it tells its guard ``phase``, SIGKILL it, wait for its guard: the guard's outcome."""
    (world.states / "guard.pid").unlink(missing_ok=True)
    with open(world.tmp / "tool.log", "ab") as log:
        tool = subprocess.Popen([sys.executable, "-c", TOOL, args[0], str(world.states), *args[1:]],
                                env=os.environ.copy(), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while not (world.states / f"at-{phase}").exists():
        assert tool.poll() is None, (world.tmp / "tool.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    tool.send_signal(signal.SIGKILL)
    tool.wait()
    (world.states / f"at-{phase}").unlink()
    gpid = int((world.states / "guard.pid").read_text())
    deadline = time.monotonic() + 60
    while procs.exists(gpid):
        assert time.monotonic() < deadline, "the guard did not finish"
        time.sleep(0.05)
    outcome = world.tmp / "state" / f"guard-{tool.pid}.json"
    rec = json.loads(outcome.read_text())
    assert check_written(rec) is None, rec
    return rec


@pytest.mark.parametrize("phase,leave,steps", [
    ("gpu", False, ["agent_suspend", "agent_resume"]),  # suspended, the driver not yet asked
    ("criu", False, ["agent_suspend", "lock", "checkpoint", "restore", "unlock", "agent_resume"]),
    ("agent_resume", True, ["agent_suspend", "lock", "checkpoint", "criu_dump", "restore", "unlock", "agent_resume"]),
])
def test_the_guard_resumes_the_agent_when_the_dump_is_killed(world: World, phase: str, leave: bool, steps) -> None:
    pid = world.program()
    image = world.tmp / "image"
    rec = killed_at(world, phase, "dump", str(pid), str(image), phase, *(["leave"] if leave else []))
    assert world.calls() == steps
    assert rec["agent"] == {"socket": str(agent_criu.control.socket_path(pid)), "resumed": True}
    assert rec["state"] == "running" and "its agent resumed it" in rec["message"]
    assert ping(pid)["state"] == "running"
    assert (criu.image_state(image) == "complete") == (phase == "agent_resume")


def test_the_guard_resumes_the_agent_when_the_restore_is_killed(world: World) -> None:
    pid = world.program()
    image = world.tmp / "image"
    agent_criu.dump(world.ckpt(), pid, image)
    world.dumped_and_gone(pid, image, 2**22 + 9)
    rec = killed_at(world, "agent_resume", "restore", str(image), "agent_resume")
    assert world.calls()[4:] == ["criu_restore", "restore", "unlock", "agent_resume"]
    assert rec["agent"]["resumed"] is True and rec["state"] == "running" and ping(pid)["state"] == "running"


def test_the_guard_says_an_agent_that_does_not_resume_still_holds_the_program(world: World) -> None:
    pid = world.program(FAKE_AGENT_RESUME="refuse")
    rec = killed_at(world, "criu", "dump", str(pid), str(world.tmp / "image"), "criu")
    assert rec["agent"]["resumed"] is False and "could not map" in rec["agent"]["error"]
    assert f"`gpu-restore --agent {pid} --resume` resumes it" in rec["message"]
    assert world.driver.get_state(pid)[0] == "running"


# -- the commands ---------------------------------------------------------------------------------


def tool(name: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict], str]:
    from gpuos_tools.commands.cli import command
    from gpuos_tools.commands.cli import run as run_command
    from gpuos_tools.commands.registry import BY_PROG

    code = run_command(command(BY_PROG[name].app, name), name, args)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.strip()], err


@pytest.fixture
def file_driver(world: World, monkeypatch):
    """The commands' own Checkpointer on the world's fake driver."""
    from gpuos_tools.ckpt import driver

    monkeypatch.setattr(driver.Checkpointer, "api", property(lambda self: FileDriver(world.states)))
    monkeypatch.setattr(driver.Checkpointer, "usage", FileCheckpointer.usage)
    monkeypatch.setattr(driver.Checkpointer, "header_fields", FileCheckpointer.header_fields)
    return world


@pytest.mark.parametrize("opt_out", [False, True])
def test_gpu_ckpt_and_gpu_restore_take_the_agent_path_unless_told_not_to(file_driver: World, capsys,
                                                                         opt_out: bool) -> None:
    world = file_driver
    pid = world.program()
    image = world.tmp / "image"
    code, recs, err = tool("gpu-ckpt", ["--pid", str(pid), "--image", str(image),
                                        *(["--no-agent-suspend"] if opt_out else [])], capsys)
    assert code == 0, err
    assert recs[0]["type"] == "header" and recs[-1]["type"] == "ckpt_result" and recs[-1]["state"] == "dumped"
    assert ("agent_suspend" in [r["type"] for r in recs]) is not opt_out
    assert world.calls() == ([] if opt_out else ["agent_suspend"]) + ["lock", "checkpoint", "criu_dump"]
    world.dumped_and_gone(pid, image, 2**22 + 11)
    code, recs, err = tool("gpu-restore", ["--image", str(image), "--lazy"], capsys)
    if opt_out:  # no agent resume to make lazy: refused before CRIU runs
        assert code == ExitCode.USAGE and "did not suspend its program's agent" in err
        assert world.calls()[-1] == "criu_dump"
        code, recs, err = tool("gpu-restore", ["--image", str(image)], capsys)
    assert code == 0, err
    assert world.calls()[-3:] == (["criu_restore", "restore", "unlock"] if opt_out
                                  else ["restore", "unlock", "agent_resume_lazy"])
    assert (recs[-1]["type"] == "agent_resume") is not opt_out


@pytest.mark.parametrize("name,args,words", [
    ("gpu-ckpt", ["--pid", "1", "--no-agent-suspend"], "--no-agent-suspend goes with --pid PID --image DIR"),
    ("gpu-ckpt", ["--job", "1", "--image", "x", "--no-agent-suspend"], "--no-agent-suspend goes with --pid PID"),
    ("gpu-ckpt", ["--agent", "1", "--image", "x", "--no-agent-suspend"], "--no-agent-suspend goes with --pid PID"),
    ("gpu-restore", ["--pid", "1", "--lazy"], "--lazy goes with"),
    ("gpu-restore", ["--job", "1", "--image", "x", "--lazy"], "--lazy goes with"),
    ("gpu-restore", ["--pid", "1", "--output-to", "f"], "--output-to goes with --image DIR"),
    ("gpu-restore", ["--agent", "1", "--image", "x", "--output-to", "f"], "--output-to goes with --image DIR"),
    ("gpu-restore", ["--job", "1", "--image", "x", "--cut", "--output-to", "f"], "--output-to goes with --image"),
])
def test_the_new_options_are_refused_where_they_mean_nothing(name: str, args: list[str], words: str, capsys) -> None:
    code, _, err = tool(name, args, capsys)
    assert code == ExitCode.USAGE and words in err, err
