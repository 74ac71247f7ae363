"""The validators' zygote (gpuos_tools/agent/zygote.py): forked from this process, it forks each
validator asked of it, with the stdin, stdout and stderr it is handed, reports its exit status,
holds none of the files this process had open, and ends when this process lets go of it; the
program's side of validation puts its validators first (tests/fake_validator.py stands in for
the validator)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuos_tools.agent import replay, zygote
from gpuos_tools.agent.offload import ZYGOTE, Link

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_validator.py"


def gone(pid: int, within: float = 10.0) -> bool:
    """``pid`` (a child of this process) exited within the time; it is reaped (or was already)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def forked():
    made: list[zygote.Zygote] = []

    def fork(on_child=None) -> zygote.Zygote:
        made.append(zygote.Zygote.fork(on_child))
        return made[-1]

    yield fork
    for z in made:
        z.close()
        assert gone(z.pid), "the zygote outlived its socket"


def test_a_validator_it_forks_serves_on_the_pipes_it_was_handed_and_its_status_is_known(forked, tmp_path):
    z = forked()
    err = tmp_path / "validator.log"
    proc = z.spawn([sys.executable, str(FAKE), str(tmp_path), "crash"], err)
    assert replay.read_frame(proc.stdout) == {"ready": True, "granularity": 4096}
    assert proc.poll() is None
    replay.write_frame(proc.stdin, {"seq": 1})
    assert replay.read_frame(proc.stdout) is None  # it exited after reading
    assert proc.wait(timeout=10) == 7 and proc.poll() == 7
    assert "Segmentation fault (pretend)" in err.read_text()


def test_a_validator_it_forks_is_killed_through_its_pidfd(forked, tmp_path):
    z = forked()
    proc = z.spawn([sys.executable, str(FAKE), str(tmp_path), "hang"])
    assert replay.read_frame(proc.stdout)["ready"]
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_it_runs_modules_as_python_m_does_and_refuses_anything_else(forked, tmp_path):
    z = forked()
    proc = z.spawn([sys.executable, "-m", "json.tool"], tmp_path / "err")
    proc.stdin.write(b'{"a": [1]}')
    proc.stdin.close()
    assert b'"a"' in proc.stdout.read()
    assert proc.wait(timeout=10) == 0
    with pytest.raises(ValueError, match="runs"):
        z.spawn([sys.executable, "-c", "print(1)"])


def test_it_holds_none_of_the_files_open_when_it_was_forked_and_ends_with_its_socket(forked):
    r, w = os.pipe()
    z = forked()
    os.close(w)
    try:
        assert select.select([r], [], [], 10)[0] and os.read(r, 1) == b"", "the zygote kept the pipe open"
    finally:
        os.close(r)
    assert os.getsid(z.pid) == z.pid  # its own session: the terminal's signals are the program's
    z.close()
    assert gone(z.pid)
    with pytest.raises(OSError, match="closed"):
        z.spawn([sys.executable, str(FAKE), ".", "ok"])


def test_on_child_runs_in_the_zygote_first(forked, tmp_path):
    mark = tmp_path / "mark"
    z = forked(lambda: mark.write_text(str(os.getpid())))
    deadline = time.monotonic() + 10
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mark.read_text() == str(z.pid)


class FakeInterposer:
    """The interposer's registration, as ctypes would find it: keeps the hook it is handed."""

    def __init__(self) -> None:
        self.hooks: list = []

        def register(fn) -> None:
            self.hooks.append(fn)

        self.gpuos_intercept_before_init = register


def test_arm_registers_a_hook_that_forks_the_zygote_when_the_driver_starts(monkeypatch):
    monkeypatch.setattr(zygote, "_current", None)
    lib = FakeInterposer()
    assert zygote.arm(None, lib) and len(lib.hooks) == 1
    assert zygote.current() is None  # nothing until the program's first cuInit
    lib.hooks[0]()  # what the interposer does there
    z = zygote.current()
    try:
        assert z is not None and z.pid != os.getpid() and "json" not in z.frameworks
    finally:
        z.close()
        assert gone(z.pid)
    assert zygote.current() is None
    assert not zygote.arm(None, object())  # no interposer loaded: nothing armed


def test_a_child_the_program_forks_before_the_driver_starts_is_disarmed(monkeypatch):
    """The hook stays the program's: in a child it forks, the registration is cleared (a NULL hook)."""
    monkeypatch.setattr(zygote, "_current", None)
    lib = FakeInterposer()
    assert zygote.arm(None, lib)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what its registration holds now
        os.close(r)
        os.write(w, b"null" if not lib.hooks[-1] else b"armed")
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 16) == b"null"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert lib.hooks[-1]  # this process is still armed


def test_the_link_starts_its_validators_from_the_zygote(forked, tmp_path):
    z = forked()
    link = Link([sys.executable, str(FAKE), str(tmp_path), "crash"], dict(os.environ), timeout_s=10,
                stderr=tmp_path / "log", spawn=z.spawn)
    assert link.request({"seq": 1}) == {}
    assert isinstance(link.proc, zygote.ZygoteProcess) and link.hello["ready"]
    why = link.answer()
    assert isinstance(why, str) and "status 7" in why and "pretend" in why
    assert link.proc is None


def test_the_programs_side_puts_the_zygotes_validators_first_and_falls_back_to_fresh_ones(monkeypatch, forked):
    """Without strategies of its own, the first validator comes from the zygote (strategy
    ``zygote``, started with the validator's ``bare``); a zygote that is gone gives way to the
    fresh validators' strategies."""
    import test_validator_offload as t

    z = forked()
    monkeypatch.setattr(zygote, "_current", z)
    v = t.OffloadValidator(samples=3, image_for=lambda name, sizes: b"cubin", timeout_s=20, copier=t.FakeCopier())
    try:
        v._command = [sys.executable, str(FAKE), str(v.dir), "ok"]
        for addr in (t.X, t.Y, t.Z):
            v.on_alloc(addr, 4 * t.N, "device")
        rec = t.launch(v)
        assert rec["checked"] and rec["addresses"] == ZYGOTE, rec
        assert v.strategies[0] == ZYGOTE and v.link.command[-2:] == ["--strategy", "bare"]
        assert isinstance(v.link.proc, zygote.ZygoteProcess)
        assert v.addresses()["zygote"] == {"frameworks": z.frameworks}
        v.link.kill()
        z.close()  # the zygote goes: the next validator is a fresh one of the next strategy
        rec = t.launch(v, tid=2)
        assert rec["checked"] and rec["addresses"] == "whole", rec
        assert [f["strategy"] for f in rec["address_fallback"]] == [ZYGOTE]
        assert isinstance(v.link.proc, subprocess.Popen)
    finally:
        v.close()


def test_a_launch_the_kept_strategy_loses_is_tried_by_the_zygotes_validator(monkeypatch, forked):
    """As on an H100: the zygote's validator cannot have the program's first allocation (its
    own driver sits there), so ``whole`` gets the first launch and is kept; a later launch
    ``whole`` loses goes to the zygote's validator, which gets it; ``whole`` answers the next."""
    import struct

    import test_validator_offload as t

    z = forked()
    monkeypatch.setattr(zygote, "_current", z)
    w = t.X + (1 << 30)
    v = t.OffloadValidator(samples=3, image_for=lambda name, sizes: b"cubin", timeout_s=20, copier=t.FakeCopier())
    try:
        v._command = [sys.executable, str(FAKE), str(v.dir), f"taken:bare={t.X:x},whole={w:x}"]
        for addr in (t.X, t.Y, t.Z, w):
            v.on_alloc(addr, 4 * t.N, "device")
        v.copier.mem[w] = v.copier.mem[t.X].copy()

        def copy(src: int, tid: int) -> dict:
            v.enter(tid, "cuLaunchKernel", ("cuLaunchKernel", ()), 1, t.COPY, (8, 8, 4),
                    struct.pack("<QQi", src, t.Y, t.N), t.GEOMETRY)
            return v.exit(tid, 0)

        first = copy(t.X, 1)
        assert first["checked"] and first["addresses"] == "whole", first
        assert [f["strategy"] for f in first["address_fallback"]] == [ZYGOTE]
        lost = copy(w, 2)
        assert lost["checked"] and lost["reads"] == "ok" and lost["addresses"] == ZYGOTE, lost
        assert [f["strategy"] for f in lost["address_fallback"]] == ["whole"]
        assert lost["address_fallback"][0]["why"].startswith("unvalidated: address unavailable")
        again = copy(t.X, 3)
        assert again["checked"] and again["addresses"] == "whole" and "address_fallback" not in again, again
        assert v.link.command[-2:] == ["--strategy", "whole"]
        assert v.addresses() == {"strategy": "whole", "kept": True, "lost": {ZYGOTE: 1, "whole": 1}, "retried": 1,
                                 "zygote": {"frameworks": z.frameworks}}
    finally:
        v.close()


def test_a_zygote_that_died_is_said_to_be_gone(forked):
    z = forked()
    os.kill(z.pid, signal.SIGKILL)
    assert gone(z.pid)
    with pytest.raises(OSError, match="gone"):
        z.spawn([sys.executable, str(FAKE), ".", "ok"])
    assert z.closed and z.status(1) is None


def test_a_validator_that_rebinds_sys_stdout_still_writes_on_the_pipe(forked, tmp_path):
    """As replay.main does (frames on the pipe, messages on stderr): the file object it took
    before must stay open."""
    script = tmp_path / "rebind.py"
    script.write_text("import gc, sys\n"
                      "out = sys.stdout.buffer\n"
                      "sys.stdout = sys.stderr\n"
                      "gc.collect()\n"
                      "out.write(b'framed\\n')\n"
                      "out.flush()\n")
    z = forked()
    proc = z.spawn([sys.executable, str(script)], tmp_path / "err")
    assert proc.stdout.read() == b"framed\n", (tmp_path / "err").read_text()
    assert proc.wait(timeout=10) == 0
