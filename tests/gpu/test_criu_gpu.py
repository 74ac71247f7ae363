"""Full-process images with CRIU on a real GPU (pytest -m gpu; `criu` 4 or later on PATH, root):
CuPy and PyTorch jobs dumped with `gpu-ckpt --pid P --image DIR`, the original gone, restored with
`gpu-restore --image DIR` and finishing bit-identical to an uninterrupted run; gpu-ckpt and
gpu-restore killed with SIGKILL at random moments, leaving a complete image or a running job;
the refusals; `--leave-running`; `gpu-ckpt periodic` taking full-process images with retention.

The jobs write to a file (CRIU restores a file by path; a pipe to this test could not be) and are
children of this test until CRIU ends them: each is reaped at once, so that its pid is free for
the restore. Every job is killed in `finally`, restored or not.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_jobs import FIGURES, end_process, keep_guard_log, skip_without_criu

from gpuos_tools.ckpt import criu
from gpuos_tools import procs
from gpuos_tools.ckpt.driver import Checkpointer, CkptError
from gpuos_tools.errors import ExitCode

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"

CUPY = ("--framework", "cupy", "--gib", "0.5", "--iters", "1200")
TORCH = ("--framework", "torch", "--gib", "0.5", "--iters", "900")
SMALL = ("--framework", "cupy", "--gib", "0.25", "--iters", "800")
#: SMALL paced to run on for about 9 s after its dump at iteration 200: the restore refused while it
#: runs must find it running (unpaced, an H100 finished it before the refusal was asked for)
PACED = (*SMALL, "--pause", "0.15")


@pytest.fixture(autouse=True)
def need_criu() -> None:
    skip_without_criu()


@pytest.fixture(autouse=True)
def guard_log(tmp_path: Path, request):
    yield
    keep_guard_log(tmp_path / "state", request.node.name)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = os.environ.copy()
    e["GPUOS_CKPT_STATE_DIR"] = str(tmp_path / "state")
    e["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    e["PYTHONUNBUFFERED"] = "1"
    e["PYTHONWARNINGS"] = "ignore"  # a warning would grow the job's stderr file, which CRIU checks
    return e


def record(**fields) -> None:
    if FIGURES:
        with open(FIGURES, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": "criu", **fields}) + "\n")


class Job:
    """tests/gpu/progs/criu_job.py in a directory of its own; after a restore only its pid and its
    files are left to follow it (the restored process is not our child)."""

    def __init__(self, directory: Path, args: tuple[str, ...], env: dict[str, str]):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "stderr", "w") as err:  # stays empty unless the job fails
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, str(PROGS / "criu_job.py"), "--dir", str(directory), *args],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=directory)
        self.pid = self.proc.pid

    @classmethod
    def follow(cls, other: "Job") -> "Job":
        """The same job brought back by a restore."""
        job = cls.__new__(cls)
        job.dir, job.proc, job.pid = other.dir, None, other.pid
        return job

    def _gone(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is not None
        return not procs.exists(self.pid)

    def _fail(self, what: str) -> None:
        err = (self.dir / "stderr").read_text(errors="replace")[-3000:]
        pytest.fail(f"job {self.pid}: {what}\n{err}")

    def wait_iter(self, n: int, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = int((self.dir / "progress").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                got = 0
            if got >= n:
                return got
            if self._gone() and not (self.dir / "done.json").exists():
                self._fail(f"ended before iteration {n}")
            time.sleep(0.05)
        self._fail(f"no iteration {n} within {timeout} s")
        return 0

    def reap(self) -> int | None:
        """After CRIU ended it: collect the zombie so that its pid is free again."""
        if self.proc is None:
            return None
        code = self.proc.wait(timeout=60)
        self.proc = None
        return code

    def ended(self) -> bool:
        """Whether the job wrote its result (it ran to its end, wherever it was restored)."""
        return (self.dir / "done.json").exists()

    def finish(self, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while not (self.dir / "done.json").exists() or not self._gone():
            if time.monotonic() > deadline:
                self._fail(f"not done within {timeout} s")
            if self._gone() and not (self.dir / "done.json").exists():
                self._fail("ended without a result")
            time.sleep(0.05)
        if self.proc is not None:
            code = self.proc.wait(timeout=60)
            self.proc = None
            if code != 0:
                self._fail(f"exit status {code}")
        return json.loads((self.dir / "done.json").read_text())

    def kill(self) -> None:
        end_process(self.pid, self.proc)


@pytest.fixture
def jobs(tmp_path: Path, env: dict[str, str]):
    started: list[Job] = []

    def start(args: tuple[str, ...]) -> Job:
        job = Job(tmp_path / f"job-{len(started)}", args, env)
        started.append(job)
        return job

    try:
        yield start
    finally:
        for job in started:
            job.kill()


_references: dict[tuple[str, ...], dict] = {}


def reference(args: tuple[str, ...], env: dict[str, str], tmp_path: Path) -> dict:
    """The job's result when nothing interrupts it (once per arguments: it is deterministic)."""
    if args not in _references:
        _references[args] = _reference(args, env, tmp_path)
    return _references[args]


def _reference(args: tuple[str, ...], env: dict[str, str], tmp_path: Path) -> dict:
    d = tmp_path / f"reference-{time.monotonic_ns()}"
    d.mkdir()
    done = subprocess.run([sys.executable, str(PROGS / "criu_job.py"), "--dir", str(d), *args],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((d / "done.json").read_text())


def cli(command: str, *args: str, env: dict[str, str], timeout: float = 600) -> tuple[subprocess.CompletedProcess, list]:
    done = subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{command}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    return done, [json.loads(x) for x in done.stdout.splitlines() if x.strip()]


def result_of(records: list) -> dict:
    return [r for r in records if r["type"] == "ckpt_result"][-1]


def guards_of(owner: int) -> list[int]:
    out = []
    for pid in procs.all_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gpuos_tools.ckpt.guard" in argv and str(owner).encode() in argv and procs.exists(pid):
            out.append(pid)
    return out


def wait_guard(owner: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while guards_of(owner):
        assert time.monotonic() < deadline, f"the guard of {owner} still runs after {timeout} s"
        time.sleep(0.1)


def driver_state(pid: int) -> str | None:
    try:
        return Checkpointer().state(pid)
    except CkptError:
        return None


@pytest.mark.parametrize("name", ["cupy", "torch"])
def test_dump_the_job_end_it_and_restore_it_bit_identical(name: str, jobs, tmp_path: Path, env) -> None:
    if name == "torch":
        pytest.importorskip("torch")
    prog = CUPY if name == "cupy" else TORCH
    expected = reference(prog, env, tmp_path)
    job = jobs(prog)
    job.wait_iter(300)
    image = tmp_path / "image"
    t = time.monotonic()
    done, records = cli("ckpt", "--pid", str(job.pid), "--image", str(image), env=env)
    dump_s = time.monotonic() - t
    assert done.returncode == 0, done.stderr
    result = result_of(records)
    assert result["state"] == "dumped" and result["image"] == str(image)
    assert [(r["step"], r["ok"]) for r in records if r["type"] == "ckpt_step"] == [
        ("lock", True), ("checkpoint", True), ("criu_dump", True)]
    assert criu.image_state(image) == "complete"
    assert job.reap() is not None  # CRIU ended the original
    assert not procs.exists(job.pid)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    t = time.monotonic()
    done, records = cli("restore", "--image", str(image), env=env)
    restore_s = time.monotonic() - t
    assert done.returncode == 0, done.stderr
    assert result_of(records)["state"] == "running" and result_of(records)["pid"] == job.pid
    finished = job.finish()
    assert finished["digest"] == expected["digest"] and finished["iters"] == expected["iters"]
    record(job=name, dump_s=round(dump_s, 3), restore_s=round(restore_s, 3), bytes=result.get("bytes"))


def test_leave_running_and_restore_the_image_after_the_job_ended(jobs, tmp_path: Path, env) -> None:
    expected = reference(SMALL, env, tmp_path)  # (the pauses change nothing it computes)
    job = jobs(PACED)
    job.wait_iter(200)
    image = tmp_path / "image"
    done, records = cli("ckpt", "--pid", str(job.pid), "--image", str(image), "--leave-running", env=env)
    assert done.returncode == 0, done.stderr
    assert result_of(records)["state"] == "running" and criu.image_state(image) == "complete"
    # the original is still there: a restore would need its pid, and is refused untouched
    done, records = cli("restore", "--image", str(image), env=env)
    assert done.returncode == ExitCode.WRONG_STATE and "taken by a running process" in done.stderr
    assert driver_state(job.pid) == "running"
    assert job.finish()["digest"] == expected["digest"]
    # and once it has ended, the image brings it back at the dump's moment; it finishes the same
    (job.dir / "done.json").unlink()
    done, records = cli("restore", "--image", str(image), env=env)
    assert done.returncode == 0, done.stderr
    assert Job.follow(job).finish()["digest"] == expected["digest"]


def test_refusals_touch_nothing(jobs, tmp_path: Path, env) -> None:
    job = jobs(("--framework", "cupy", "--gib", "0.25", "--iters", "100000"))
    job.wait_iter(50)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("someone's file")
    done, records = cli("ckpt", "--pid", str(job.pid), "--image", str(busy), env=env)
    assert done.returncode == ExitCode.USAGE and "not empty" in done.stderr and "nothing was touched" in done.stderr
    assert result_of(records)["touched"] is False and driver_state(job.pid) == "running"
    assert (busy / "x").read_text() == "someone's file"
    done, _ = cli("restore", "--image", str(tmp_path / "nothing-here"), env=env)
    assert done.returncode == ExitCode.NO_INPUT, done.stderr
    done, _ = cli("ckpt", "--pid", "999999999", "--image", str(tmp_path / "x"), env=env)
    assert done.returncode == ExitCode.NO_SUCH_PROCESS, done.stderr
    assert not (tmp_path / "x").exists()
    job.wait_iter(job.wait_iter(50) + 100)  # still computing


def test_kill_9_of_gpu_ckpt_and_gpu_restore_never_strands_the_job(jobs, tmp_path: Path, env) -> None:
    """SIGKILL at random moments: during the dump, a complete image or a running job; during the
    restore, a running job or an intact image. Either way the job finishes bit-identical."""
    seed = int(os.environ.get("GPUOS_KILL_SEED", str(int(time.time()))))
    rng = random.Random(seed)
    expected = reference(SMALL, env, tmp_path)
    outcomes = []
    for i, (lo, hi) in enumerate([(0.0, 0.6), (0.6, 1.6), (1.6, 3.5)]):
        delay = rng.uniform(lo, hi)
        job = jobs(SMALL)
        job.wait_iter(100)
        image = tmp_path / f"image-{i}"
        tool = subprocess.Popen([sys.executable, "-m", "gpuos_tools.commands.ckpt", "--pid", str(job.pid),
                                 "--image", str(image)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        tool.send_signal(signal.SIGKILL)
        tool.wait()
        wait_guard(tool.pid)
        guard = json.loads(p.read_text()) if (p := tmp_path / "state" / f"guard-{tool.pid}.json").exists() else {}
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")], "a temp directory was left"
        state = criu.image_state(image)
        if procs.exists(job.pid):  # (a job CRIU ended is our zombie until reaped: not "existing")
            assert driver_state(job.pid) == "running", f"kill {i} at {delay:.2f} s stranded the job: {guard}"
            outcome = "running"
        elif job.ended():  # killed before the dump began, and the short job ran to its end
            assert state == "empty", f"kill {i} at {delay:.2f} s: the job ended and left an image"
            outcome = "ran to the end"
        else:
            assert state == "complete", f"kill {i} at {delay:.2f} s: job gone and no image ({guard})"
            job.reap()
            done, _ = cli("restore", "--image", str(image), env=env)
            assert done.returncode == 0, done.stderr
            outcome = "image"
        assert job.finish()["digest"] == expected["digest"], f"kill {i} at {delay:.2f} s ({outcome})"
        outcomes.append({"tool": "gpu-ckpt", "delay_s": round(delay, 3), "outcome": outcome,
                         "guard_phase": guard.get("phase")})

    for i, (lo, hi) in enumerate([(0.0, 0.5), (0.5, 1.5), (1.5, 3.0)]):
        delay = rng.uniform(lo, hi)
        job = jobs(SMALL)
        job.wait_iter(100)
        image = tmp_path / f"restore-{i}"
        done, _ = cli("ckpt", "--pid", str(job.pid), "--image", str(image), env=env)
        assert done.returncode == 0, done.stderr
        job.reap()
        tool = subprocess.Popen([sys.executable, "-m", "gpuos_tools.commands.restore", "--image", str(image)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        tool.send_signal(signal.SIGKILL)
        tool.wait()
        wait_guard(tool.pid)
        guard = json.loads(p.read_text()) if (p := tmp_path / "state" / f"guard-{tool.pid}.json").exists() else {}
        if procs.exists(job.pid):
            assert driver_state(job.pid) == "running", f"restore kill {i} at {delay:.2f} s stranded it: {guard}"
            outcome = "running"
        elif job.ended():
            # restored before the kill and already finished: its pid stays taken while it is a
            # zombie nobody reaps (a container's init), so it must not be restored again
            outcome = "restored and ran to the end"
        else:
            assert criu.image_state(image) == "complete", f"restore kill {i}: the image is damaged"
            done, _ = cli("restore", "--image", str(image), env=env)
            assert done.returncode == 0, done.stderr
            outcome = "restored again"
        assert job.finish()["digest"] == expected["digest"], f"restore kill {i} at {delay:.2f} s ({outcome})"
        outcomes.append({"tool": "gpu-restore", "delay_s": round(delay, 3), "outcome": outcome,
                         "guard_phase": guard.get("phase")})
    record(kill_seed=seed, kills=outcomes)
    print(json.dumps({"seed": seed, "kills": outcomes}))


def test_periodic_full_process_images_with_retention(jobs, tmp_path: Path, env) -> None:
    # long enough that the job is still mid-run after the third dump (800 iterations end within it)
    prog = ("--framework", "cupy", "--gib", "0.25", "--iters", "5000")
    expected = reference(prog, env, tmp_path)
    job = jobs(prog)
    job.wait_iter(100)
    images = tmp_path / "images"
    profile = tmp_path / "periodic.toml"
    profile.write_text(f"""
[images]
directory = "{images}"
name = "job"
kind = "process"

[retention]
keep = 2

[process]
pid = {job.pid}
""")
    made = []
    for _ in range(3):
        done, records = cli("ckpt", "periodic", "--profile", str(profile), "-o", "-", env=env)
        assert done.returncode == 0, done.stderr
        rec = [r for r in records if r["type"] == "ckpt_periodic"][-1]
        assert rec["kind"] == "process"
        made.append(rec["image"])
        assert not (job.dir / "done.json").exists(), "the job ended during the dumps: make it longer"
        assert driver_state(job.pid) == "running"
        time.sleep(0.3)
    names = sorted(n for n in os.listdir(images) if n.startswith("job-"))
    assert names == sorted(made[-2:]), (names, made)  # retention kept the newest two
    assert all(criu.image_state(images / n) == "complete" for n in names)
    assert job.finish()["digest"] == expected["digest"]  # three dumps did not change its result
    (job.dir / "done.json").unlink()
    done, _ = cli("restore", "--image", str(images / made[-1]), env=env)  # the newest brings it back
    assert done.returncode == 0, done.stderr
    assert Job.follow(job).finish()["digest"] == expected["digest"]
    shutil.rmtree(images)
