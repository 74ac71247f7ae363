"""No snapshot lost after T0 (gpuos_tools/agent/durable.py), on the CPU: a child process serves
the agent's control socket and writes an "image" of bytes it made, its chunk writes slowed by a
fake, and ends (returns from its main) while the image is written. The exit waits for it, or hands
it over as a memfd that the requester (snapshot_to_image, as gpu-ckpt --agent) finishes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import child_env

from gpuos_tools.agent import control, durable
from gpuos_tools.agent.snapshot import snapshot_to_image
from gpuos_tools.image import open_image, verify

CHILD = r"""
import atexit, os, random, sys, time
from pathlib import Path
from gpuos_tools.agent import control, durable
from gpuos_tools.image import chunkio
from gpuos_tools.injection import config

real = chunkio.write_chunk_file
def slow(path, data, *, sync, direct):  # the fake: a slow disk
    time.sleep(float(os.environ["SLOW_S"]))
    return real(path, data, sync=sync, direct=direct)
chunkio.write_chunk_file = slow

sizes = [int(x) for x in os.environ["SIZES"].split(",")]
data = [bytearray(random.Random(i).randbytes(n)) for i, n in enumerate(sizes)]

def handler(request):
    entries = [(i + 1, 0x7f0000000000 + (i << 24), len(d), memoryview(d)) for i, d in enumerate(data)]
    summary = durable.write_image(request["image"], {"source": "test", "pid": os.getpid()}, entries,
                                  chunk_size=int(os.environ["CHUNK"]), checksum=request["checksum"], threads=1)
    return {"ok": True, "t0_ns": 1, "buffers": len(entries), "bytes": sum(sizes), "image": summary}

server = control.ControlServer(handler, Path(sys.argv[1]))
server.start()
# as Agent.stop_background does at exit, with GPUOS_AGENT_EXIT_WAIT/MAX read as the launcher reads
# them into the boot config
o = config.overrides_from_environment()
atexit.register(durable.finish_at_exit, server, o.exit_wait_s, o.exit_max_s)
print("ready", flush=True)
sys.stdin.readline()  # then the program ends, the image still being written
print("exiting", flush=True)
"""

SIZES = [3 << 20, 1 << 20, (2 << 20) + 12345]
CHUNK = 256 << 10


def expected(i: int) -> bytes:
    return random.Random(i).randbytes(SIZES[i])


class Child:
    def __init__(self, tmp: Path, **env: str):
        self.sock = tmp / "agent.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(self.sock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env=child_env(SIZES=",".join(map(str, SIZES)), CHUNK=str(CHUNK), **env))
        assert self.proc.stdout.readline().strip() == "ready", self.proc.stderr.read()

    def end(self) -> None:
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()

    def finish(self) -> str:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        err = self.proc.stderr.read()
        assert self.proc.returncode == 0, err
        return err


def wait_for_temp(directory: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(n.endswith(".tmp") for n in os.listdir(directory)):
        assert time.monotonic() < deadline, "the image write never started"
        time.sleep(0.01)


def snapshot_in_thread(sock: Path, image: Path) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["answer"] = snapshot_to_image(sock, str(image), checksum="crc32", timeout=120)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def check_image(image: Path) -> None:
    assert verify(image) == []
    im = open_image(image)
    for i in range(len(SIZES)):
        assert im.read(i + 1) == expected(i)


def test_the_exit_waits_for_an_image_in_flight(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    child = Child(tmp_path, SLOW_S="0.05")
    t, out = snapshot_in_thread(child.sock, images / "im")
    wait_for_temp(images)
    child.end()
    t.join(120)
    err = child.finish()
    assert "error" not in out, out
    summary = out["answer"]["image"]
    assert summary["during_exit"] is True and not summary.get("handover")
    assert "exiting during a checkpoint request" in err and "finished after" in err
    check_image(images / "im")


def test_past_the_wait_the_image_is_handed_over(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    child = Child(tmp_path, SLOW_S="0.3", GPUOS_AGENT_EXIT_WAIT="0.2")
    t, out = snapshot_in_thread(child.sock, images / "im")
    wait_for_temp(images)
    child.end()
    t.join(120)
    err = child.finish()
    assert "error" not in out, out
    summary = out["answer"]["image"]
    assert summary["handover"] is True and summary["during_exit"] is True
    assert summary["bytes"] == sum(SIZES) and summary["copy_s"] >= 0
    assert "handing" in err and "over to gpu-ckpt" in err
    assert [n for n in os.listdir(images)] == ["im"]  # the agent's temp is gone, the image is whole
    check_image(images / "im")


def test_with_the_requester_gone_the_exit_writes_the_image_itself(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    child = Child(tmp_path, SLOW_S="0.1", GPUOS_AGENT_EXIT_WAIT="0")
    requester = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gpuos_tools.agent.snapshot import snapshot_to_image as s; "
         "s(sys.argv[1], sys.argv[2], checksum='crc32')", str(child.sock), str(images / "im")], env=child_env())
    wait_for_temp(images)
    requester.kill()  # gpu-ckpt killed: nobody to hand over to
    requester.wait()
    child.end()
    err = child.finish()
    assert "cannot be handed over" in err and "no longer connected" in err
    check_image(images / "im")


def test_past_the_hard_limit_the_loss_is_said(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    child = Child(tmp_path, SLOW_S="1.0", GPUOS_AGENT_EXIT_WAIT="0", GPUOS_AGENT_EXIT_MAX="0.5")
    requester = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gpuos_tools.agent.snapshot import snapshot_to_image as s; "
         "s(sys.argv[1], sys.argv[2], checksum='crc32')", str(child.sock), str(images / "im")],
        env=child_env(), stderr=subprocess.DEVNULL)
    wait_for_temp(images)
    requester.kill()
    requester.wait()
    child.end()
    err = child.finish()
    assert "giving up after 0.5 s" in err and "is lost" in err
    assert not (images / "im").exists()  # nothing partial under the image's name


def test_an_idle_server_does_not_wait() -> None:
    class Idle:
        busy = 0

    t = time.monotonic()
    durable.finish_at_exit(Idle())
    durable.finish_at_exit(None)
    assert time.monotonic() - t < 0.1


def test_a_handover_with_the_wrong_descriptors_is_refused() -> None:
    r, w = os.pipe()
    summary = {"path": "/nonexistent/x", "handover": {"bytes": 0, "buffers": [], "options": {}, "manifest": {}}}
    with pytest.raises(RuntimeError, match="2 descriptors"):
        durable.finish_handover(summary, [r, w])
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)  # closed


def test_fds_travel_with_an_answer(tmp_path: Path) -> None:
    def handler(request: dict) -> dict:
        fd = os.memfd_create("t")
        os.write(fd, b"hello")
        control.attach_fds([fd])
        return {"ok": True}

    srv = control.ControlServer(handler, tmp_path / "s.sock")
    srv.start()
    try:
        answer = control.request(srv.path, "x")
        (fd,) = answer["_fds"]
        assert os.pread(fd, 5, 0) == b"hello"
        os.close(fd)
        assert srv.wait_idle(5) and srv.busy == 0
    finally:
        srv.close()
