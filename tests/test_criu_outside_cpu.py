"""A program whose output goes to a process outside its image (`prog | tee log`), dumped and
restored with the real CRIU (the GPU side faked as in test_criu_cpu.py): CRIU alone brings it back
writing to a pipe nobody reads, and it dies; gpu-restore gives it its output file, or its reader
again while that reader lives, and nothing it prints is lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_criu_cpu import Fake, criu_env, kill  # noqa: F401 -- the fixture: a usable CRIU, else skip

from gpuos_tools import procs
from gpuos_tools.ckpt import criu, outside

#: Prints 1, 2, 3... one line a write, and its last number into a file (so the test sees it go on
#: without its output), written in place: a file it held open and a restored copy renamed away would
#: not be there for the next restore of the same image.
PRINTER = """import os, sys, time
progress = os.open(os.environ["JOB_DIR"] + "/progress", os.O_RDWR | os.O_CREAT, 0o644)
i = 0
while True:
    i += 1
    print(i, flush=True)
    os.pwrite(progress, b"%012d" % i, 0)
    time.sleep(0.005)
"""


def start_printer(d: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """The printer, its stdout a pipe whose read end (returned) only this test holds."""
    d.mkdir()
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", PRINTER], stdin=subprocess.DEVNULL, stdout=w,
                         stderr=subprocess.DEVNULL, env={**env, "JOB_DIR": str(d)}, cwd=d)
    os.close(w)
    deadline = time.monotonic() + 30
    while not (d / "progress").exists() or not (d / "progress").read_bytes():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.01)
    return p, r


def read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 65536):
        out += chunk
    return out


def progress(d: Path) -> int:
    return int((d / "progress").read_text())


def goes_on(d: Path, pid: int) -> bool:
    n = progress(d)
    deadline = time.monotonic() + 10
    while progress(d) <= n + 5:
        if time.monotonic() > deadline or not procs.exists(pid):
            return False
        time.sleep(0.01)
    return True


def gone(pid: int, timeout: float = 30) -> None:
    """Wait until ``pid`` is free again (a restored process that died is reaped by init)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"PID {pid} is still there"
        time.sleep(0.05)


def numbers(data: bytes) -> list[int]:
    return [int(x) for x in data.split()]


def test_a_program_whose_reader_is_gone_goes_on_into_a_file(tmp_path: Path, criu_env, monkeypatch) -> None:
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    d = tmp_path / "job"
    p, r = start_printer(d, criu_env)
    image = tmp_path / "image"
    try:
        criu.dump(Fake(), p.pid, image)
        assert p.wait(timeout=30) == -signal.SIGKILL
        before = read_all(r)  # the writer is gone: everything it printed up to the dump, then EOF
        os.close(r)  # and the reader (`tee`) with it
        r = -1
        meta = json.loads((image / criu.METADATA).read_text())
        pipe = meta[outside.KEY]
        assert [(e["kind"], e["end"], e["fds"]) for e in pipe] == [("pipe", "write", [{"pid": p.pid, "fd": 1}])]
        # CRIU alone (on a copy of the image) brings it back writing to a pipe nobody reads: it dies
        plain = tmp_path / "plain"
        shutil.copytree(image, plain)
        done = subprocess.run([criu.find_criu().path, "restore", "--images-dir", str(plain), "--log-file",
                               "restore.log", "--shell-job", "--restore-detached"], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=120, env=criu_env, check=False)
        if done.returncode == 0:
            assert not goes_on(d, p.pid), "restored by CRIU alone, the program went on writing to no reader"
        gone(p.pid)
        said: list[str] = []
        back = criu.restore(Fake(), image, warn=said.append)
        assert back["pid"] == p.pid and goes_on(d, p.pid)
        log = tmp_path / f"image.restored-{p.pid}-fd1.log"
        assert back["outside"][0]["how"] == "file" and back["outside"][0]["to"] == str(log)
        assert len(said) == 1 and str(log) in said[0]
        kill(p.pid)
        gone(p.pid)
        # nothing lost, nothing twice: the pipe's lines, then the file's, count on from 1
        got = numbers(before) + numbers(log.read_bytes())
        assert got[:1] == [1] and got == list(range(1, len(got) + 1)) and len(got) > len(numbers(before)) + 5
    finally:
        if r >= 0:
            os.close(r)
        kill(p.pid)


def test_a_reader_still_alive_keeps_reading_the_restored_program(tmp_path: Path, criu_env, monkeypatch) -> None:
    """The reader outlived the dump (say, a launcher's): the restored program writes into the same
    pipe, and the reader reads on, the numbers counting on; --output-to replaces even that pipe."""
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    d = tmp_path / "job"
    p, r = start_printer(d, criu_env)
    image = tmp_path / "image"
    try:
        criu.dump(Fake(), p.pid, image, leave_running=True)  # then ended by hand: the dumped state is older
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        read_all(r)  # drained to EOF, the pipe stays open here
        gone(p.pid)
        back = criu.restore(Fake(), image)
        assert back["outside"][0]["how"] == "reconnected" and back["outside"][0]["to"] == f"/proc/{os.getpid()}/fd/{r}"
        assert goes_on(d, p.pid)
        data = os.read(r, 4096)  # the pipe was drained: the restored program's first line comes first
        first = numbers(data[:data.rindex(b"\n") + 1])
        assert first and first == list(range(first[0], first[0] + len(first)))
        kill(p.pid)
        gone(p.pid)
        read_all(r)
        chosen = tmp_path / "chosen.log"
        back = criu.restore(Fake(), image, output_to=str(chosen))
        assert back["outside"][0]["how"] == "file" and goes_on(d, p.pid)
        kill(p.pid)
        gone(p.pid)
        # the same dumped state again: the file counts on from the same number
        again = numbers(chosen.read_bytes())
        assert len(again) > 5 and again == list(range(first[0], first[0] + len(again)))
    finally:
        os.close(r)
        kill(p.pid)


def test_a_program_writing_to_a_fifo_whose_reader_is_gone_goes_on_into_a_file(
        tmp_path: Path, criu_env, monkeypatch) -> None:
    """`prog > FIFO` with `cat FIFO` outside: the dump ends the writer, so cat reads end-of-file and
    ends too. The restore hands the FIFO's write end a file beside the image, as for a pipe, and the
    numbers count on across the reader's output and the file."""
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    d = tmp_path / "job"
    d.mkdir()
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with open(tmp_path / "cat.out", "wb") as sink:
        reader = subprocess.Popen(["cat", str(fifo)], stdin=subprocess.DEVNULL, stdout=sink)
    with open(fifo, "wb", buffering=0) as w:  # opened once the reader is there
        p = subprocess.Popen([sys.executable, "-c", PRINTER], stdin=subprocess.DEVNULL, stdout=w,
                             stderr=subprocess.DEVNULL, env={**criu_env, "JOB_DIR": str(d)}, cwd=d)
    image = tmp_path / "image"
    try:
        deadline = time.monotonic() + 30
        while not (d / "progress").exists() or not (d / "progress").read_bytes():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.01)
        criu.dump(Fake(), p.pid, image)
        assert p.wait(timeout=30) == -signal.SIGKILL
        assert reader.wait(timeout=30) == 0  # end-of-file: its only writer is gone
        meta = json.loads((image / criu.METADATA).read_text())
        assert [(e["kind"], e["pipe"], e["end"]) for e in meta[outside.KEY]] == [("fifo", str(fifo), "write")]
        gone(p.pid)
        said: list[str] = []
        back = criu.restore(Fake(), image, warn=said.append)
        assert back["pid"] == p.pid and goes_on(d, p.pid)
        log = tmp_path / f"image.restored-{p.pid}-fd1.log"
        assert [(e["kind"], e["how"], e["to"]) for e in back["outside"]] == [("fifo", "file", str(log))]
        assert len(said) == 1 and f"the FIFO {fifo}" in said[0] and str(log) in said[0]
        kill(p.pid)
        gone(p.pid)
        got = numbers((tmp_path / "cat.out").read_bytes()) + numbers(log.read_bytes())
        assert got[:1] == [1] and got == list(range(1, len(got) + 1)), got[-20:]
    finally:
        reader.kill()
        reader.wait()
        kill(p.pid)
