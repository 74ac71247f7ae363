"""gpu-ckpt / gpu-restore on a real GPU (pytest -m gpu): CuPy and PyTorch children suspended in
the middle of their work and resumed with bit-identical results, `gpu-ckpt status`, the error
paths against real processes, a deterministic lock timeout, and a move onto the second GPU.

Every child is resumed (or unlocked) and killed in `finally`, whatever happened.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuos_tools.ckpt.driver import Checkpointer, CkptError
from gpuos_tools.cuda.nvml import nvml_session
from gpuos_tools.errors import ExitCode

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
GIB = 1 << 30


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt-state"


def cli(command: str, *args: str, state_dir: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess, list]:
    env = os.environ.copy()
    env["GPUOS_CKPT_STATE_DIR"] = str(state_dir)
    done = subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{command}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return done, records


def last_result(records: list[dict]) -> dict:
    results = [r for r in records if r["type"] == "ckpt_result"]
    assert results, records
    return results[-1]


def steps(records: list[dict]) -> list[tuple[str, bool, str | None]]:
    return [(r["step"], r["ok"], r["state_after"]) for r in records if r["type"] == "ckpt_step"]


def child_env() -> dict[str, str]:
    env = os.environ.copy()
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA device 0 is nvidia-smi's GPU 0
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """A test program on the GPU, read line by line in a thread (so waits can time out)."""

    def __init__(self, prog: str, *args: str):
        self.proc = subprocess.Popen([sys.executable, str(PROGS / prog), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=child_env())
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append), daemon=True).start()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def expect(self, prefix: str, timeout: float = 300) -> str:
        """The rest of the first line starting with ``prefix``; fails if the program ends first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{prefix!r} not seen from PID {self.pid} within {timeout} s")
            if line is None:
                self.proc.wait(timeout=30)
                pytest.fail(f"PID {self.pid} ended (status {self.proc.returncode}) before {prefix!r}:\n"
                            + "\n".join(self.err[-30:]))
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def drain(self) -> None:
        """Forget the lines printed so far."""
        while True:
            try:
                if self.lines.get_nowait() is None:
                    self.lines.put(None)
                    return
            except queue.Empty:
                return

    def done(self, timeout: float = 600) -> dict:
        result = json.loads(self.expect("done", timeout))
        assert self.proc.wait(timeout=60) == 0, "\n".join(self.err[-30:])
        return result

    def stop(self) -> None:
        """Resume or unlock it if it is suspended, then kill it: never leave one behind."""
        if self.proc.poll() is None:
            ckpt = Checkpointer()
            try:
                state = ckpt.state(self.pid)
                if state in ("checkpointed", "locked"):
                    ckpt.resume(self.pid)
            except CkptError:
                pass
            self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def children():
    started: list[Child] = []

    def start(prog: str, *args: str) -> Child:
        child = Child(prog, *args)
        started.append(child)
        return child

    try:
        yield start
    finally:
        for child in started:
            child.stop()


def reference(prog: str, *args: str) -> dict:
    """The program's result when nothing interrupts it."""
    done = subprocess.run([sys.executable, str(PROGS / prog), *args], capture_output=True, text=True,
                          env=child_env(), timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    last = [line for line in done.stdout.splitlines() if line.startswith("done ")][-1]
    return json.loads(last[5:])


def nvml_processes() -> dict[int, list[dict]]:
    with nvml_session() as nv:
        assert nv is not None, "the GPU tests need nvidia-ml-py"
        return nv.processes()


def nvml_gpus() -> list[dict]:
    with nvml_session() as nv:
        assert nv is not None, "the GPU tests need nvidia-ml-py"
        return nv.gpus()


def used_bytes() -> int:
    return sum(g["memory_used"] for g in nvml_gpus())


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def status_of(pid: int, state_dir: Path) -> dict:
    done, records = cli("ckpt", "status", "--pid", str(pid), "--json", state_dir=state_dir)
    assert done.returncode == 0, done.stderr
    assert records[0]["type"] == "header" and records[0]["gpus"]
    mine = [r for r in records if r["type"] == "ckpt_status" and r["pid"] == pid]
    assert len(mine) == 1, records
    return mine[0]


PROGRAMS = {
    "cupy": ("ckpt_cupy.py", "--gib", "1", "--iters", "2000"),
    "torch": ("ckpt_torch.py", "--gib", "1", "--iters", "1500"),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_suspend_and_resume_mid_run_is_bit_identical(name: str, children, state_dir: Path) -> None:
    if name == "torch":
        pytest.importorskip("torch")
    prog, *args = PROGRAMS[name]
    expected = reference(prog, *args)
    child = children(prog, *args)
    ready = json.loads(child.expect("ready"))
    child.expect("iter 300")  # in the middle of its loop
    seen_by_nvml = child.pid in nvml_processes()
    running = status_of(child.pid, state_dir)
    assert running["state"] == "running" and "maps" in running["seen_by"]
    if seen_by_nvml:
        assert "nvml" in running["seen_by"] and running["memory"] >= GIB
    before = used_bytes()

    done, records = cli("ckpt", "--pid", str(child.pid), state_dir=state_dir)
    assert done.returncode == 0, done.stderr
    header = records[0]
    assert header["type"] == "header" and header["tool"] == "gpu-ckpt" and header["driver"]["cuda"]
    assert steps(records) == [("lock", True, "locked"), ("checkpoint", True, "checkpointed")]
    process = next(r for r in records if r["type"] == "ckpt_process")
    result = last_result(records)
    assert result["ok"] and result["state"] == "checkpointed" and result["checkpoint_s"] > 0
    if seen_by_nvml:
        assert process["bytes"] >= GIB and result["bytes"] == process["bytes"]
        assert [g["uuid"] for g in process["gpus"]] == [ready["uuid"]]
        assert wait_for(lambda: child.pid not in nvml_processes()), "NVML still lists the checkpointed process"
    assert wait_for(lambda: used_bytes() <= before - int(0.9 * GIB)), (before, used_bytes())
    assert child.proc.poll() is None
    suspended = status_of(child.pid, state_dir)
    assert suspended["state"] == "checkpointed" and suspended["memory"] == 0
    assert "gpu-ckpt" in suspended["seen_by"] and "maps" in suspended["seen_by"]

    done, records = cli("restore", "--pid", str(child.pid), state_dir=state_dir)
    assert done.returncode == 0, done.stderr
    assert steps(records) == [("restore", True, "locked"), ("unlock", True, "running")]
    assert last_result(records)["state"] == "running"
    finished = child.done()
    assert finished["digest"] == expected["digest"]
    assert finished["iters"] == expected["iters"]
    assert finished["uuid"] == ready["uuid"]  # restored where it was


def test_error_paths_against_real_processes(children, state_dir: Path) -> None:
    # a PID that is no more
    gone = subprocess.Popen(["true"])
    gone.wait()
    done, records = cli("ckpt", "--pid", str(gone.pid), state_dir=state_dir)
    assert done.returncode == ExitCode.NO_SUCH_PROCESS, done.stderr
    # a process that is not a CUDA program
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        time.sleep(0.2)
        done, records = cli("ckpt", "--pid", str(sleeper.pid), state_dir=state_dir)
        assert done.returncode == ExitCode.NOT_CUDA_PROCESS, done.stderr
        assert last_result(records)["touched"] is False
    finally:
        sleeper.kill()
        sleeper.wait()

    child = children("ckpt_cupy.py", "--gib", "0.25", "--iters", "100000")
    child.expect("ready")
    # restore of a running process
    done, records = cli("restore", "--pid", str(child.pid), state_dir=state_dir)
    assert done.returncode == ExitCode.WRONG_STATE, done.stderr
    assert "nothing to restore" in done.stderr
    assert last_result(records)["state"] == "running" and steps(records) == []
    # double checkpoint
    done, _ = cli("ckpt", "--pid", str(child.pid), state_dir=state_dir)
    assert done.returncode == 0, done.stderr
    done, records = cli("ckpt", "--pid", str(child.pid), state_dir=state_dir)
    assert done.returncode == ExitCode.WRONG_STATE, done.stderr
    assert "already checkpointed" in done.stderr
    assert last_result(records)["state"] == "checkpointed" and steps(records) == []
    # and it is still restorable
    done, records = cli("restore", "--pid", str(child.pid), state_dir=state_dir)
    assert done.returncode == 0, done.stderr
    assert status_of(child.pid, state_dir)["state"] == "running"
    # a process left locked (by an interrupted tool): gpu-ckpt refuses, gpu-restore unlocks it
    ckpt = Checkpointer()
    assert ckpt.api.lock(child.pid, 0) is None
    try:
        assert ckpt.state(child.pid) == "locked"
        done, records = cli("ckpt", "--pid", str(child.pid), state_dir=state_dir)
        assert done.returncode == ExitCode.WRONG_STATE and "is locked" in done.stderr
        assert last_result(records)["state"] == "locked"
        done, records = cli("restore", "--pid", str(child.pid), "--device", "0", state_dir=state_dir)
        assert done.returncode == ExitCode.WRONG_STATE and "cannot move" in done.stderr
        done, records = cli("restore", "--pid", str(child.pid), state_dir=state_dir)
        assert done.returncode == 0, done.stderr
        assert steps(records) == [("unlock", True, "running")]
        assert "unlocked" in last_result(records)["message"]
    finally:
        if child.proc.poll() is None and ckpt.state(child.pid) == "locked":
            ckpt.api.unlock(child.pid)
    child.drain()
    count = int(child.expect("iter"))  # it goes on computing
    assert int(child.expect("iter")) == count + 50


def test_lock_timeout_leaves_the_process_running(children, state_dir: Path) -> None:
    child = children("ckpt_cupy.py", "--gib", "0.25", "--spin", "20")
    child.expect("ready")
    child.expect("spinning")
    time.sleep(1.0)  # it is now inside cudaDeviceSynchronize, waiting for a 20 s kernel
    t = time.monotonic()
    done, records = cli("ckpt", "--pid", str(child.pid), "--timeout", "1", state_dir=state_dir)
    assert done.returncode == ExitCode.LOCK_TIMEOUT, (done.returncode, done.stderr)
    assert "could not be locked within 1 ms" in done.stderr and "left running" in done.stderr
    result = last_result(records)
    assert result["state"] == "running" and result["error"] == "LOCK_TIMEOUT"
    assert steps(records)[0][:2] == ("lock", False)
    assert time.monotonic() - t < 60
    assert Checkpointer().state(child.pid) == "running"
    assert child.proc.poll() is None


def test_restore_onto_the_second_gpu(children, state_dir: Path) -> None:
    gpus = nvml_gpus()
    if len(gpus) < 2:
        pytest.skip(f"one GPU here ({gpus[0]['name']}): moving a process needs two (nvidia-h200-x2)")
    if gpus[0]["name"] != gpus[1]["name"]:
        pytest.skip(f"GPUs 0 and 1 are different chips ({gpus[0]['name']}, {gpus[1]['name']})")
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        pytest.skip("CUDA_VISIBLE_DEVICES is set: the child must see every GPU")
    args = ("--gib", "1", "--iters", "2000")
    expected = reference("ckpt_cupy.py", *args)
    child = children("ckpt_cupy.py", *args)
    ready = json.loads(child.expect("ready"))
    assert ready["uuid"] == gpus[0]["uuid"]
    child.expect("iter 300")
    done, records = cli("ckpt", "--pid", str(child.pid), state_dir=state_dir)
    assert done.returncode == 0, done.stderr
    process = next(r for r in records if r["type"] == "ckpt_process")
    assert [g["uuid"] for g in process["gpus"]] == [gpus[0]["uuid"]], "gpu-ckpt must know the source GPU"

    done, records = cli("restore", "--pid", str(child.pid), "--device", "1", state_dir=state_dir)
    if done.returncode == ExitCode.BAD_GPU and "CUDA_ERROR_INVALID_VALUE" in done.stderr:
        assert last_result(records)["state"] == "checkpointed", "a refused move leaves it checkpointed"
        back, _ = cli("restore", "--pid", str(child.pid), state_dir=state_dir)
        assert back.returncode == 0, back.stderr
        assert child.done()["digest"] == expected["digest"]
        pytest.skip(f"the driver refused to move the process: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    result = last_result(records)
    assert result["device"] == gpus[1]["uuid"]
    pairs = {tuple(p) for p in result["gpu_map"]}
    assert {(gpus[0]["uuid"], gpus[1]["uuid"]), (gpus[1]["uuid"], gpus[0]["uuid"])} <= pairs
    assert len(pairs) == len(gpus) and all(a == b for a, b in pairs - {(gpus[0]["uuid"], gpus[1]["uuid"]),
                                                                     (gpus[1]["uuid"], gpus[0]["uuid"])})
    on_gpu = nvml_processes().get(child.pid)
    if on_gpu is not None:
        assert [g["index"] for g in on_gpu] == [1]
    finished = child.done()
    assert finished["uuid"] == gpus[1]["uuid"]
    assert finished["digest"] == expected["digest"]
