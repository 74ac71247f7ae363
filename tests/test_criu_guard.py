"""The guard of full-process dumps and restores (gpuos_tools/ckpt/guard.py) on the CPU: what it
does when its tool dies in each phase (the driver faked, processes and directories real), and the
guard process itself: nothing when told done, an outcome file when its tool was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import child_env

from gpuos_tools.ckpt import driver, guard


class FakeDriver:
    """Checkpointer's driver side: a state per pid, and what was asked."""

    def __init__(self, states: dict[int, str]):
        self.states = states
        self.calls: list[tuple] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        def _state(self, pid):  # noqa: ANN001
            return fake.states.get(pid)

        def bring_back(self, pid, restore=True):  # noqa: ANN001
            fake.calls.append(("bring_back", pid))
            fake.states[pid] = "running"
            return "running"

        def resume(self, pid, device=None, device_map=None, source_gpus=None):  # noqa: ANN001
            fake.calls.append(("resume", pid, device))
            fake.states[pid] = "running"
            return {"state": "running"}

        monkeypatch.setattr(driver.Checkpointer, "_state", _state)
        monkeypatch.setattr(driver.Checkpointer, "bring_back", bring_back)
        monkeypatch.setattr(driver.Checkpointer, "resume", resume)
        monkeypatch.setattr(guard, "SETTLE_S", 0.05)


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def complete_dump(d: Path) -> None:
    d.mkdir()
    (d / "inventory.img").write_bytes(b"x")
    (d / "gpuos-ckpt.json").write_text("{}")
    (d / "criu-dump.rc").write_text("0\n")


def test_a_complete_dump_becomes_the_image_when_the_tool_died(tmp_path: Path, monkeypatch) -> None:
    fake = FakeDriver({})
    fake.install(monkeypatch)
    temp, image = tmp_path / ".img.1.x.tmp", tmp_path / "img"
    complete_dump(temp)
    image.mkdir()  # the empty directory the user named
    out = guard.recover({"action": "dump", "pid": 2**22 + 7, "image": str(image), "temp": str(temp)},
                        {"phase": "criu"})
    assert out["image_ok"] and (image / "inventory.img").exists() and not temp.exists()
    assert out["state"] is None and fake.calls == []


def test_a_process_left_checkpointed_is_brought_back(tmp_path: Path, monkeypatch, sleeper) -> None:
    fake = FakeDriver({sleeper.pid: "checkpointed"})
    fake.install(monkeypatch)
    temp = tmp_path / ".img.1.x.tmp"
    temp.mkdir()
    (temp / "gpuos-ckpt.json").write_text("{}")  # CRIU never finished
    out = guard.recover({"action": "dump", "pid": sleeper.pid, "image": str(tmp_path / "img"), "temp": str(temp)},
                        {"phase": "gpu"})
    assert fake.calls == [("bring_back", sleeper.pid)] and out["state"] == "running"
    assert not out["image_ok"] and not temp.exists() and not (tmp_path / "img").exists()


def test_leave_running_keeps_both_the_image_and_the_process(tmp_path: Path, monkeypatch, sleeper) -> None:
    fake = FakeDriver({sleeper.pid: "checkpointed"})
    fake.install(monkeypatch)
    temp = tmp_path / ".img.1.x.tmp"
    complete_dump(temp)
    out = guard.recover({"action": "dump", "pid": sleeper.pid, "image": str(tmp_path / "img"), "temp": str(temp)},
                        {"phase": "finalize"})
    assert out["image_ok"] and out["state"] == "running" and (tmp_path / "img" / "inventory.img").exists()


def test_a_restored_process_gets_its_gpu_back(tmp_path: Path, monkeypatch, sleeper) -> None:
    fake = FakeDriver({sleeper.pid: "checkpointed"})
    fake.install(monkeypatch)
    image = tmp_path / "img"
    complete_dump(image)
    (image / "restored.pid").write_text(f"{sleeper.pid}\n")
    out = guard.recover({"action": "restore", "pid": 1, "image": str(image), "device": "1"}, {"phase": "criu"})
    assert fake.calls == [("resume", sleeper.pid, "1")] and out["state"] == "running" and out["pid"] == sleeper.pid


def test_a_restore_that_never_happened_leaves_the_image(tmp_path: Path, monkeypatch) -> None:
    fake = FakeDriver({})
    fake.install(monkeypatch)
    image = tmp_path / "img"
    complete_dump(image)
    out = guard.recover({"action": "restore", "pid": 2**22 + 9, "image": str(image)}, {"phase": "criu"})
    assert "intact" in out["message"] and fake.calls == [] and (image / "inventory.img").exists()


def test_the_guard_waits_for_criu_still_running(tmp_path: Path) -> None:
    path = str(tmp_path / ".img.1.x.tmp")
    # a stand-in whose command line reads like `criu dump ... --images-dir PATH`
    exe = tmp_path / "bin" / "criu"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nsleep 1\n")
    exe.chmod(0o755)
    fake = subprocess.Popen([str(exe), "dump", "--images-dir", path])
    try:
        deadline = time.monotonic() + 5
        while not guard.criu_running(path, "dump") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert guard.criu_running(path, "dump")
    finally:
        fake.wait()
    assert guard.wait_criu(path, "dump", timeout=5) and guard.criu_running(path, "dump") == []


def run_guard(tmp_path: Path, messages: list[dict], kill_owner: bool) -> tuple[subprocess.Popen, Path]:
    """An owner process that starts a Guard, sends ``messages``, then is killed or says done."""
    code = (
        "import json, sys, time; from pathlib import Path; from gpuos_tools.ckpt.guard import Guard; "
        f"g = Guard('dump', 2**22 + 11, Path({str(tmp_path / 'img')!r}), Path({str(tmp_path / '.t.tmp')!r})); "
        f"[g.phase(**m) for m in {messages!r}]; print(g.proc.pid, flush=True); "
        + ("time.sleep(300)" if kill_owner else "g.done()")
    )
    env = child_env(GPUOS_CKPT_STATE_DIR=str(tmp_path / "state"))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    gpid = int(owner.stdout.readline())
    if kill_owner:
        owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{gpid}").exists() and time.monotonic() < deadline:
        if (Path(f"/proc/{gpid}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z":
            break
        time.sleep(0.05)
    return owner, tmp_path / "state" / f"guard-{owner.pid}.json"


def test_the_guard_takes_over_when_its_tool_is_killed(tmp_path: Path) -> None:
    _, outcome = run_guard(tmp_path, [], kill_owner=True)  # killed before anything was touched
    rec = json.loads(outcome.read_text())
    assert rec["type"] == "ckpt_guard" and rec["phase"] == "start" and "nothing had been done" in rec["message"]
    log = (tmp_path / "state" / "guard.log").read_text()
    assert "ended during phase 'start'" in log


def test_the_guard_does_nothing_once_told_done(tmp_path: Path) -> None:
    owner, outcome = run_guard(tmp_path, [{"name": "gpu"}], kill_owner=False)
    assert owner.returncode == 0 and not outcome.exists()


class NoGpu(driver.Checkpointer):
    """A CPU-only process: nothing to lock or copy on the GPU side."""

    api = property(lambda self: None)

    def suspend(self, pid, timeout_ms=0):  # noqa: ANN001
        return {"bytes": 0, "checkpoint_s": 0.0}

    def bring_back(self, pid, restore=True):  # noqa: ANN001
        return "running"

    def _state(self, pid):  # noqa: ANN001
        return "running"

    def header_fields(self):
        return {}


FAILING_CRIU = """#!/bin/sh
case "$1" in
  --version) echo "Version: 4.2"; exit 0 ;;
  check) echo "Looks good."; exit 0 ;;
  dump) shift; while [ "$1" != "--images-dir" ]; do shift; done
        printf '(00.01) Dumping\\n(00.02) Error (criu/cr-dump.c:2093): Dumping FAILED.\\n' > "$2/dump.log"
        exit 1 ;;
esac
exit 2
"""


def test_a_failed_dump_says_what_criu_logged(tmp_path: Path, monkeypatch, sleeper) -> None:
    """CRIU prints nothing on a failed dump: the message carries the error lines of its log, which is
    kept beside the image that was not written."""
    from gpuos_tools.ckpt import criu

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "criu").write_text(FAILING_CRIU)
    (bindir / "criu").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    with pytest.raises(driver.CkptError) as e:
        criu.dump(NoGpu(), sleeper.pid, tmp_path / "image")
    assert "Error (criu/cr-dump.c:2093): Dumping FAILED." in str(e.value)
    assert (tmp_path / "image.dump.log").exists() and not (tmp_path / "image").exists()
    assert sleeper.poll() is None


def test_log_errors_reads_the_last_error_lines(tmp_path: Path) -> None:
    from gpuos_tools.ckpt import criu

    log = tmp_path / "x.log"
    log.write_text("".join(f"(0.{i}) Error (a.c:{i}): e{i}\n(0.{i}) fine\n" for i in range(6)))
    assert criu.log_errors(log, lines=2) == "(0.4) Error (a.c:4): e4 | (0.5) Error (a.c:5): e5"
    log.write_text("all well\n")
    assert criu.log_errors(log) == "(no error line in the log)"
    assert criu.log_errors(tmp_path / "missing") == "(no log)"
