"""`gpu-ckpt --job PID --image DIR` / `gpu-restore --image DIR` without CRIU: a stand-in `criu` on
PATH (it passes `criu check`, records its arguments, and dumps or fails as told) and the fake
driver of test_ckpt_job on a real process tree. What is checked: what CRIU is asked, that a
failed dump brings every rank back and leaves no image, that an interrupted dump waits for CRIU,
and that a restore that cannot work touches nothing."""

from __future__ import annotations

import _thread
import errno
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import child_env
from test_ckpt_job import FakeDriver, JobCheckpointer, launched_job

from gpuos_tools import procs
from gpuos_tools.ckpt import criu, criu_job
from gpuos_tools.ckpt.driver import CkptError
from gpuos_tools.errors import ExitCode
from gpuos_tools.stream.records import check_written

#: FAKE_CRIU_DUMP: "fail" (an error line in its log, exit 1) or "ok" (an inventory, exit 0);
#: FAKE_CRIU_SLEEP: seconds before it acts.
FAKE_CRIU = """#!/bin/sh
printf '%s\\n' "$*" >> "$FAKE_CRIU_CALLS"
case "$1" in
    --version) echo "Version: 4.2"; exit 0 ;;
    check) exit 0 ;;
esac
verb=$1; dir=; log=
while [ $# -gt 0 ]; do
    case "$1" in
        --images-dir) dir=$2; shift ;;
        --log-file) log=$2; shift ;;
    esac
    shift
done
sleep "${FAKE_CRIU_SLEEP:-0}"
if [ "${FAKE_CRIU_DUMP:-fail}" = ok ] && [ "$verb" = dump ]; then
    : > "$dir/inventory.img"; exit 0
fi
echo "Error (criu/sk-tcp.c:81): tcp: Failed to lock TCP connection 1234" > "$dir/$log"
echo "Error (criu/cr-dump.c:2128): Dumping FAILED." >> "$dir/$log"
exit 1
"""


@pytest.fixture
def fake_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in on PATH; the file its calls go to."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "criu"
    exe.write_text(FAKE_CRIU)
    exe.chmod(0o755)
    calls = tmp_path / "criu-calls"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CRIU_CALLS", str(calls))
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    return calls


def called(calls: Path, verb: str) -> list[list[str]]:
    if not calls.exists():
        return []
    return [line.split() for line in calls.read_text().splitlines() if line.split()[:1] == [verb]]


def test_a_failed_dump_brings_every_rank_back_and_leaves_no_image(tmp_path: Path, fake_criu: Path) -> None:
    with launched_job(tmp_path) as (launcher, kids):
        driver = FakeDriver(kids)
        ckpt = JobCheckpointer(driver)
        image = tmp_path / "images" / "job"
        with pytest.raises(CkptError) as e:
            criu_job.dump_job(ckpt, launcher.pid, image, timeout_ms=50)
        assert e.value.code == ExitCode.CRIU_FAILED and e.value.touched
        assert "Failed to lock TCP connection" in str(e.value) and "brought back to running" in str(e.value)
        assert driver.states == {p: "running" for p in kids}
        assert [c for c, _ in driver.calls].count("checkpoint") == 2  # they had been checkpointed
        assert not image.exists() and os.listdir(image.parent) == ["job.dump.log"]  # CRIU's log kept beside
        (dump,) = called(fake_criu, "dump")
        assert dump[dump.index("--tree") + 1] == str(launcher.pid)
        assert "--tcp-established" in dump and "--shell-job" in dump
        assert dump[dump.index("--network-lock") + 1] == "skip" and "--leave-running" not in dump
        last = ckpt.records[-1]
        assert last["type"] == "ckpt_result" and last["action"] == "dump" and not last["ok"]
        for rec in ckpt.records:
            assert check_written(rec) is None, rec


def test_a_network_lock_given_is_passed_instead_of_skip(tmp_path: Path, fake_criu: Path) -> None:
    assert criu_job.network_lock([]) == ["--network-lock", "skip"]
    assert criu_job.network_lock(["--network-lock=iptables"]) == []
    with launched_job(tmp_path) as (launcher, kids):
        ckpt = JobCheckpointer(FakeDriver(kids))
        with pytest.raises(CkptError):
            criu_job.dump_job(ckpt, launcher.pid, tmp_path / "img", 50, True, ["--network-lock", "iptables"])
        (dump,) = called(fake_criu, "dump")
        assert dump.count("--network-lock") == 1 and "iptables" in dump and "--leave-running" in dump


def test_a_job_that_cannot_be_locked_is_not_dumped(tmp_path: Path, fake_criu: Path) -> None:
    with launched_job(tmp_path) as (launcher, kids):
        driver = FakeDriver(kids)
        driver.stuck[kids[0]] = 99
        with pytest.raises(CkptError) as e:
            criu_job.dump_job(JobCheckpointer(driver), launcher.pid, tmp_path / "img", timeout_ms=10)
        assert e.value.code == ExitCode.LOCK_TIMEOUT and driver.states == {p: "running" for p in kids}
        assert called(fake_criu, "dump") == [] and os.listdir(tmp_path).count("img") == 0
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_an_image_directory_in_use_is_refused_untouched(tmp_path: Path, fake_criu: Path) -> None:
    with launched_job(tmp_path) as (launcher, kids):
        driver = FakeDriver(kids)
        (tmp_path / "img").mkdir()
        (tmp_path / "img" / "notes").write_text("mine")
        with pytest.raises(CkptError) as e:
            criu_job.dump_job(JobCheckpointer(driver), launcher.pid, tmp_path / "img")
        assert e.value.code == ExitCode.USAGE and not e.value.touched and not driver.calls


@pytest.mark.parametrize(("outcome", "state"), [("fail", "running"), ("ok", "dumped")])
def test_an_interrupted_dump_waits_for_criu(tmp_path: Path, fake_criu: Path, monkeypatch: pytest.MonkeyPatch,
                                            outcome: str, state: str) -> None:
    """Ctrl-C while CRIU runs: CRIU (in a session of its own) finishes; a failed dump brings every
    rank back, a finished one is kept as the image."""
    monkeypatch.setenv("FAKE_CRIU_DUMP", outcome)
    monkeypatch.setenv("FAKE_CRIU_SLEEP", "1")
    with launched_job(tmp_path) as (launcher, kids):
        driver = FakeDriver(kids)
        image = tmp_path / "img"
        timer = threading.Timer(0.5, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(CkptError) as e:
                criu_job.dump_job(JobCheckpointer(driver), launcher.pid, image, timeout_ms=50)
        finally:
            timer.cancel()
        assert e.value.code == ExitCode.INTERRUPTED and e.value.state == (None if outcome == "fail" else state)
        assert len(called(fake_criu, "dump")) == 1
        if outcome == "fail":
            assert driver.states == {p: "running" for p in kids} and not image.exists()
        else:
            assert criu.image_state(image) == "complete" and "finished" in str(e.value)
            assert driver.states == {p: "checkpointed" for p in kids}


def _job_image(directory: Path, pid: int, pids: list[int]) -> Path:
    directory.mkdir()
    (directory / "inventory.img").write_bytes(b"")
    meta = {"kind": "job", "pid": pid, "pids": pids, "tids": pids, "ranks": [],
            "criu_args": ["--shell-job", "--tcp-established", "--network-lock", "skip"]}
    (directory / criu.METADATA).write_text(json.dumps(meta))
    return directory


def test_a_restore_over_a_running_job_is_refused_untouched(tmp_path: Path, fake_criu: Path) -> None:
    with launched_job(tmp_path) as (launcher, kids):
        image = _job_image(tmp_path / "img", launcher.pid, [launcher.pid, *kids])
        assert criu_job.is_job_image(image)
        with pytest.raises(CkptError) as e:
            criu_job.restore_job(JobCheckpointer(FakeDriver(kids)), image)
        assert e.value.code == ExitCode.WRONG_STATE and not e.value.touched
        assert f"gpu-restore --job {launcher.pid}" in str(e.value)
        assert called(fake_criu, "restore") == []


def test_a_restore_that_criu_refuses_leaves_the_image(tmp_path: Path, fake_criu: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid free now (reaped)
    image = _job_image(tmp_path / "img", gone.pid, [gone.pid])
    with pytest.raises(CkptError) as e:
        criu_job.restore_job(JobCheckpointer(FakeDriver([])), image)
    assert e.value.code == ExitCode.CRIU_FAILED and "image is intact" in str(e.value) and not e.value.touched
    (restore,) = called(fake_criu, "restore")
    assert "--tcp-established" in restore and restore[restore.index("--network-lock") + 1] == "skip"
    assert "--restore-detached" in restore and criu.image_state(image) == "complete"


def test_a_restore_whose_listeners_port_a_live_socket_holds_is_refused_untouched(tmp_path: Path,
                                                                                  fake_criu: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    image = _job_image(tmp_path / "img", gone.pid, [gone.pid])
    with socket.socket() as taker:  # someone else listening on the port the job's listener had
        taker.bind(("127.0.0.1", 0))
        taker.listen()
        port = taker.getsockname()[1]
        meta = json.loads((image / criu.METADATA).read_text())
        meta["listeners"] = [{"family": "ipv4", "address": "0.0.0.0", "port": port, "pid": gone.pid}]
        (image / criu.METADATA).write_text(json.dumps(meta))
        ckpt = JobCheckpointer(FakeDriver([]))
        with pytest.raises(CkptError) as e:
            criu_job.restore_job(ckpt, image, port_wait_s=30)
    assert e.value.code == ExitCode.WRONG_STATE and not e.value.touched
    assert f"port {port}" in str(e.value) and f"PID {os.getpid()}" in str(e.value)
    assert called(fake_criu, "restore") == [] and criu.image_state(image) == "complete"
    assert ckpt.records[-1]["type"] == "ckpt_result" and ckpt.records[-1]["ok"] is False


def test_an_image_whose_listeners_ports_are_free_goes_to_criu_and_a_bad_listeners_field_does_not(
        tmp_path: Path, fake_criu: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    image = _job_image(tmp_path / "img", gone.pid, [gone.pid])
    meta = json.loads((image / criu.METADATA).read_text())
    with socket.socket() as probe:  # a port nothing holds
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    meta["listeners"] = [{"family": "ipv4", "address": "127.0.0.1", "port": port}]
    (image / criu.METADATA).write_text(json.dumps(meta))
    with pytest.raises(CkptError) as e:  # the stand-in CRIU fails the restore itself, after the wait
        criu_job.restore_job(JobCheckpointer(FakeDriver([])), image)
    assert e.value.code == ExitCode.CRIU_FAILED and len(called(fake_criu, "restore")) == 1
    meta["listeners"][0]["port"] = 0
    (image / criu.METADATA).write_text(json.dumps(meta))
    with pytest.raises(CkptError) as e:
        criu_job.restore_job(JobCheckpointer(FakeDriver([])), image)
    assert e.value.code == ExitCode.IMAGE_CORRUPT and "listeners[0].port" in str(e.value)
    assert len(called(fake_criu, "restore")) == 1


def test_a_single_process_image_is_not_a_job_image(tmp_path: Path, fake_criu: Path) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "inventory.img").write_bytes(b"")
    (d / criu.METADATA).write_text(json.dumps({"pid": 1}))
    assert not criu_job.is_job_image(d)
    with pytest.raises(CkptError) as e:
        criu_job.restore_job(JobCheckpointer(FakeDriver([])), d)
    assert e.value.code == ExitCode.NO_INPUT and called(fake_criu, "restore") == []


@pytest.mark.parametrize("args", [
    ["ckpt", "--job", "1", "--leave-running"],
    ["ckpt", "--job", "1", "--criu-arg", "--tcp-close"],
    ["ckpt", "--job", "1", "--pid", "2", "--image", "d"],
    ["restore", "--image", "{job}", "--device", "0"],
    ["restore", "--image", "{job}", "--job", "1"],
])
def test_job_image_usage_errors(args: list[str], tmp_path: Path) -> None:
    image = _job_image(tmp_path / "img", 2**22 - 3, [2**22 - 3])
    args = [a.replace("{job}", str(image)) for a in args]
    done = subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{args[0]}", *args[1:]],
                          env=child_env(GPUOS_CKPT_STATE_DIR=str(tmp_path / "state")), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert done.stdout == "" and done.stderr.strip()


#: Sets up an io_uring (as libuv does in torchrun's TCPStore) and says what io_uring_setup gave.
URING = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(425, 8, ctypes.create_string_buffer(120))
print(fd if fd >= 0 else -ctypes.get_errno(), os.getpid(), flush=True)
sys.stdin.read()
"""


def _uring(prefix: list[str]) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-c", URING], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def test_a_job_holding_io_uring_is_refused_untouched(tmp_path: Path, fake_criu: Path) -> None:
    proc = _uring([])
    try:
        assert proc.stdout is not None
        fd = int(proc.stdout.readline().split()[0])
        if fd < 0:
            pytest.skip(f"io_uring_setup is refused here (errno {-fd}): no process can hold one")
        assert criu_job.io_uring_holders([proc.pid, os.getpid()]) == [proc.pid]
        driver = FakeDriver([proc.pid])
        with pytest.raises(CkptError) as e:
            criu_job.dump_job(JobCheckpointer(driver), proc.pid, tmp_path / "img")
        assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and not e.value.touched and e.value.state == "running"
        assert "gpuos_tools.ckpt.no_io_uring" in str(e.value) and str(proc.pid) in str(e.value)
        assert not driver.calls and called(fake_criu, "dump") == [] and not (tmp_path / "img").exists()
    finally:
        proc.kill()
        proc.wait()


def test_no_io_uring_runs_the_command_in_its_place_without_io_uring() -> None:
    from gpuos_tools.ckpt import no_io_uring

    try:
        no_io_uring._libseccomp()
    except OSError as e:
        pytest.skip(str(e))
    proc = _uring([sys.executable, "-m", "gpuos_tools.ckpt.no_io_uring"])
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if not line:
            proc.kill()
            err = proc.communicate()[1]
            pytest.skip(f"the kernel refuses the filter here: {err.strip()}")
        answer, pid = int(line[0]), int(line[1])
        assert answer == -errno.ENOSYS and pid == proc.pid  # denied, and the same process (exec)
        assert criu_job.io_uring_holders([proc.pid]) == []
    finally:
        proc.kill()
        proc.wait()
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.ckpt.no_io_uring", "/no/such/command"],
                          capture_output=True, text=True, env=child_env(), timeout=60, check=False)
    assert done.returncode == 127 and "/no/such/command" in done.stderr


def test_the_ghost_limit_covers_the_largest_deleted_file_the_tree_holds(tmp_path: Path) -> None:
    """A deleted file mapped by a process (NCCL's /dev/shm segment) is carried in CRIU's image
    only below its ghost limit: the dump asks for one large enough, unless the caller chose one."""
    prog = ("import mmap, os, sys, time\n"
            "f = open(sys.argv[1], 'w+b'); f.write(b'x' * ((3 << 20) - 100)); f.flush()\n"
            "m = mmap.mmap(f.fileno(), 0); f.close(); os.unlink(sys.argv[1])\n"
            # shared anonymous memory shows as '/dev/zero (deleted)': memory to CRIU, no deleted file
            "a = mmap.mmap(-1, 8 << 20); a[0] = 1\n"
            "print('ready', flush=True); time.sleep(60)\n")
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path  # where NCCL puts it
    child = subprocess.Popen([sys.executable, "-c", prog, str(shm / f"gpuos-test-{os.getpid()}")],
                             stdout=subprocess.PIPE, text=True)
    # a process that maps no deleted file (not this one: earlier tests may have left a memfd mapped here)
    bare = subprocess.Popen(["sleep", "60"])
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert procs.largest_deleted_file([child.pid]) == 3 << 20  # the pages it takes, not its size
        assert procs.largest_deleted_file([bare.pid]) < 1 << 20
        assert criu.ghost_limit([child.pid], []) == ["--ghost-limit", str(procs.largest_deleted_file([child.pid]))]
        assert criu.ghost_limit([child.pid], ["--ghost-limit", "64M"]) == []
        assert criu.ghost_limit([child.pid], ["--ghost-limit=64M"]) == []
        assert criu.ghost_limit([bare.pid], []) == []  # CRIU's default suffices
    finally:
        for p in (child, bare):
            p.kill()
            p.wait()
