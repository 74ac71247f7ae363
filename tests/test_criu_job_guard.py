"""SIGKILL of `gpu-ckpt --job PID --image DIR` and of `gpu-restore --image DIR` (a job's image) at
chosen moments, with the real CRIU on the CPU-only TCP job of test_criu_job_cpu.py: the guard that
the killed tool started leaves the job running again (every rank restored, then every rank
unlocked) or a complete image that restores, never ranks checkpointed with no image.

The tool runs in a process of its own, killed with SIGKILL, so the driver steps go to a fake whose
states live in files (file_driver.py), seen alike by this test, the tool and the guard. A tool
stops where it is to be killed: at a phase it tells its guard, in the fake driver's first call of
a step, or (during CRIU) in an action script CRIU runs, which may also make CRIU fail. Skipped
where no CRIU >= 4 passes `criu check`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from file_driver import FileCheckpointer, FileDriver
from helpers import REPO
from test_criu_cpu import criu_env  # noqa: F401 -- the fixture: a usable CRIU, else skip
from test_criu_job_cpu import going_on, subreaper, tcp_job, wait_gone

from gpuos_tools import procs
from gpuos_tools.ckpt import criu, criu_job
from gpuos_tools.ckpt import records as _schemas  # noqa: F401 -- registers the schemas check_written uses
from gpuos_tools.stream.records import check_written

TESTS = Path(__file__).resolve().parent

#: The killed tool: ``dump STATES LAUNCHER IMAGE`` or ``restore STATES IMAGE``, then the phase to
#: stop at ("" for none), the driver step to stop in ("" for none), and CRIU's extra arguments.
TOOL = """import sys
from pathlib import Path
from file_driver import FileCheckpointer, FileDriver, stop_at_phase
from gpuos_tools.ckpt import criu_job
what, states, *rest = sys.argv[1:]
if what == "dump":
    launcher, image, phase, step, *criu_args = rest
else:
    image, phase, step, *criu_args = rest
stop_at_phase(states, phase)
ckpt = FileCheckpointer(FileDriver(states, pause=step or None))
if what == "dump":
    criu_job.dump_job(ckpt, int(launcher), Path(image), timeout_ms=100, criu_args=criu_args)
else:
    criu_job.restore_job(ckpt, Path(image), criu_args=criu_args)
"""

#: CRIU's action script: at the action $GPUOS_TEST_CRIU_AT, says so in a file, waits, and makes
#: CRIU fail when $GPUOS_TEST_CRIU_FAIL is 1.
ACTION = """#!/bin/sh
if [ "$CRTOOLS_SCRIPT_ACTION" = "$GPUOS_TEST_CRIU_AT" ]; then
    : > "$GPUOS_TEST_CRIU_MARK"
    sleep 1.5
    exit "$GPUOS_TEST_CRIU_FAIL"
fi
exit 0
"""


def run_killed(tmp: Path, env: dict[str, str], states: Path, args: list[str], mark: str,
               criu_at: str | None = None, criu_fail: bool = False) -> int:
    """Start the tool, SIGKILL it once ``states/mark`` exists, wait for its guard to end; the
    number of driver calls made before the kill."""
    extra: list[str] = []
    tool_env = {**env, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])}
    if criu_at:
        script = tmp / "action.sh"
        script.write_text(ACTION)
        script.chmod(0o755)
        extra = ["--action-script", str(script)]
        tool_env.update(GPUOS_TEST_CRIU_AT=criu_at, GPUOS_TEST_CRIU_MARK=str(states / mark),
                        GPUOS_TEST_CRIU_FAIL="1" if criu_fail else "0")
    (states / "guard.pid").unlink(missing_ok=True)
    with open(tmp / "tool.log", "ab") as log:
        tool = subprocess.Popen([sys.executable, "-c", TOOL, *args, *extra], env=tool_env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while not (states / mark).exists():
        assert tool.poll() is None, f"the tool ended before {mark}: {(tmp / 'tool.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the tool never reached {mark}"
        time.sleep(0.01)
    time.sleep(0.2)  # the other rank's call, made at the same time, completes
    tool.send_signal(signal.SIGKILL)
    tool.wait()
    calls = len(FileDriver(states).calls())
    gpid = int((states / "guard.pid").read_text())
    deadline = time.monotonic() + 120
    while procs.exists(gpid):
        assert time.monotonic() < deadline, "the guard did not finish"
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(gpid, 0)  # ours as subreaper, once its tool died
    (states / mark).unlink()
    return calls


def outcome(state_dir: Path) -> dict:
    """The guard's record of what it did (one killed tool per state directory at a time)."""
    found = sorted(state_dir.glob("guard-*.json"), key=lambda p: p.stat().st_mtime)
    assert found, "the guard wrote no outcome"
    rec = json.loads(found[-1].read_text())
    found[-1].unlink()
    assert check_written(rec) is None, rec
    return rec


def back_in_order(fake: FileDriver, since: int, ranks: list[int]) -> None:
    """Every rank running, and since call ``since`` every restore made before any unlock."""
    assert fake.states(ranks) == {p: "running" for p in ranks}, fake.states(ranks)
    steps = [s for s, _ in fake.calls()[since:]]
    assert "unlock" in steps
    if "restore" in steps:
        assert max(i for i, s in enumerate(steps) if s == "restore") < steps.index("unlock"), steps


#: Where the dump is killed, and what must be left: (phase, driver step, CRIU action, CRIU fails,
#: the outcome). CRIU's "post-dump" action runs once every image is written, before the tree ends.
DUMP_KILLS = {
    "while_locking": ("", "lock", None, False, "running"),
    "while_checkpointing": ("", "checkpoint", None, False, "running"),
    "ranks_checkpointed_before_criu": ("criu", "", None, False, "running"),
    "during_criu": ("", "", "post-dump", False, "image"),
    "during_criu_which_fails": ("", "", "post-dump", True, "running"),
    "after_criu_before_the_rename": ("finalize", "", None, False, "image"),
}
#: Where the restore of the image then made is killed (the outcome is always the job running).
RESTORE_KILLS = {"during_criu": ("", "", "post-restore"), "before_the_gpu_state": ("gpu", "", None),
                 "while_restoring_the_ranks": ("", "restore", None)}


@pytest.mark.parametrize("where", DUMP_KILLS)
def test_a_job_dump_killed_leaves_the_job_running_or_an_image(where: str, tmp_path: Path, criu_env,  # noqa: F811
                                                              monkeypatch) -> None:
    phase, step, criu_at, criu_fail, expected = DUMP_KILLS[where]
    state_dir = tmp_path / "state"
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(state_dir))
    env = {**criu_env, "GPUOS_CKPT_STATE_DIR": str(state_dir)}
    states = tmp_path / "driver"
    states.mkdir()
    fake = FileDriver(states)
    image = tmp_path / "image"
    with subreaper(), tcp_job(tmp_path / "job", env) as (launcher, ranks):
        for p in ranks:
            fake.set(p, "running")
        mark = f"at-{phase or step}" if not criu_at else "at-criu-action"
        since = run_killed(tmp_path, env, states, ["dump", str(states), str(launcher.pid), str(image), phase, step],
                           mark, criu_at, criu_fail)
        rec = outcome(state_dir)
        assert rec["job"] and rec["pid"] == launcher.pid, rec
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == [], "a temp directory was left"
        if expected == "running":
            assert procs.exists(launcher.pid) and not rec["image_ok"], rec
            assert criu.image_state(image) == "empty"
            back_in_order(fake, since, ranks)
            assert rec["state"] == "running" and sorted(r["pid"] for r in rec["ranks"]) == sorted(ranks), rec
            going_on(tmp_path / "job")
            return
        assert rec["image_ok"] and criu.image_state(image) == "complete" and criu_job.is_job_image(image), rec
        assert launcher.wait(timeout=30) == -signal.SIGKILL  # CRIU ended the tree after the dump
        wait_gone([launcher.pid, *ranks])
        assert fake.states(ranks) == {p: "checkpointed" for p in ranks}
        ckpt = FileCheckpointer(fake)
        back = criu_job.restore_job(ckpt, image)
        assert back["ok"] and back["pid"] == launcher.pid and sorted(back["ranks"]) == sorted(ranks), back
        assert fake.states(ranks) == {p: "running" for p in ranks}
        going_on(tmp_path / "job")


@pytest.mark.parametrize("where", RESTORE_KILLS)
def test_a_job_restore_killed_leaves_the_job_running(where: str, tmp_path: Path, criu_env,  # noqa: F811
                                                     monkeypatch) -> None:
    phase, step, criu_at = RESTORE_KILLS[where]
    state_dir = tmp_path / "state"
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(state_dir))
    env = {**criu_env, "GPUOS_CKPT_STATE_DIR": str(state_dir)}
    states = tmp_path / "driver"
    states.mkdir()
    fake = FileDriver(states)
    image = tmp_path / "image"
    with subreaper(), tcp_job(tmp_path / "job", env) as (launcher, ranks):
        for p in ranks:
            fake.set(p, "running")
        criu_job.dump_job(FileCheckpointer(fake), launcher.pid, image, timeout_ms=100)
        assert launcher.wait(timeout=30) == -signal.SIGKILL
        wait_gone([launcher.pid, *ranks])
        mark = f"at-{phase or step}" if not criu_at else "at-criu-action"
        since = run_killed(tmp_path, env, states, ["restore", str(states), str(image), phase, step], mark, criu_at)
        rec = outcome(state_dir)
        assert rec["job"] and rec["action"] == "restore" and rec["state"] == "running", rec
        assert all(procs.exists(p) for p in [launcher.pid, *ranks])
        back_in_order(fake, since, ranks)
        going_on(tmp_path / "job")


def test_a_job_half_locked_or_half_restored_comes_back_restores_first(tmp_path: Path, monkeypatch) -> None:
    """What the guard finds when its tool died mid-action, with the in-memory fake: a rank still
    running beside a checkpointed one (restored, then unlocked, and the running one untouched);
    a rank whose restore fails keeps every other rank locked."""
    from test_ckpt_job import FakeDriver, JobCheckpointer, launched_job

    from gpuos_tools.ckpt.job import bring_back_job

    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    with launched_job(tmp_path) as (launcher, kids):
        fake = FakeDriver(kids)
        fake.states[kids[1]] = "checkpointed"
        said, states = bring_back_job(JobCheckpointer(fake), launcher.pid)
        assert states == {p: "running" for p in kids} and "running" in said
        assert fake.calls == [("restore", kids[1]), ("unlock", kids[1])]

        fake.states.update({kids[0]: "locked", kids[1]: "checkpointed"})
        fake.calls.clear()
        monkeypatch.setattr(fake, "restore", lambda pid, pairs=None: "CUDA_ERROR_OUT_OF_MEMORY")
        said, states = bring_back_job(JobCheckpointer(fake), launcher.pid)
        assert states == {kids[0]: "locked", kids[1]: "checkpointed"} and f"gpu-restore --job {launcher.pid}" in said
        assert ("unlock", kids[0]) not in fake.calls  # no rank runs while another has no GPU


def test_the_guard_of_a_job_restore_follows_the_device_map(tmp_path: Path, monkeypatch) -> None:
    """A job restore killed after CRIU: its guard moves every rank by the map asked; if the driver
    refuses it half-way, the ranks already moved are not joined by the others on the old GPUs."""
    from test_ckpt_job import TWO_GPUS, FakeDriver, JobCheckpointer, launched_job

    from gpuos_tools.ckpt import guard

    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(guard, "SETTLE_S", 0.05)
    monkeypatch.setattr(JobCheckpointer, "machine_gpus", lambda self: TWO_GPUS)
    with launched_job(tmp_path) as (launcher, kids):
        fake = FakeDriver(kids)
        fake.states = {k: "checkpointed" for k in kids}
        outcome: dict = {}
        state, said = guard._job_back(JobCheckpointer(fake), launcher.pid, outcome, {"device_map": "0=1,1=0"})
        assert state == "running" and fake.states == {k: "running" for k in kids}, said
        assert all(fake.pairs[k] for k in kids)  # every rank moved
        assert sorted(r["pid"] for r in outcome["ranks"]) == sorted(kids)

        fake.states = {k: "checkpointed" for k in kids}
        fake.refuse_remap.add(kids[1])
        state, said = guard._job_back(JobCheckpointer(fake), launcher.pid, outcome, {"device_map": "0=1,1=0"})
        assert state is None and "--device-map 0=1,1=0` tries again" in said
        assert fake.states == {kids[0]: "locked", kids[1]: "checkpointed"}  # none runs, none went back


def test_a_dump_killed_before_its_first_phase_leaves_no_temp_directory(tmp_path: Path) -> None:
    """The guard starts before the dump's temp directory is made: a tool killed between the two
    leaves nothing behind (a complete dump there, which cannot be at that phase, would be kept)."""
    from gpuos_tools.ckpt import guard

    temp = tmp_path / ".image.1.x.tmp"
    temp.mkdir()
    out = guard.recover({"action": "dump", "pid": 2**22 + 5, "image": str(tmp_path / "image"), "temp": str(temp),
                         "job": True}, {"phase": "start"})
    assert "nothing had been done" in out["message"] and not temp.exists() and out["job"]
