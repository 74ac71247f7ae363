"""`gpu-ckpt --job` / `gpu-restore --job` on the CPU: the ranks of a job are found in a real
process tree (real processes that map a file named libcuda.so.1), and the driver steps go to a
fake driver that models what matters for a job: a rank whose collective is in flight cannot be
locked until the other ranks can run again."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAKE_CUDA

from gpuos_tools import procs
from gpuos_tools.ckpt import job as J
from gpuos_tools.ckpt import records as _schemas  # noqa: F401 -- registers the schemas check_written uses
from gpuos_tools.ckpt.driver import Checkpointer, CkptError
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream.records import check_written

LAUNCHER = """
import os, subprocess, sys
lib, code = sys.argv[1], sys.argv[2]
kids = [subprocess.Popen([sys.executable, '-c', code, lib], env={**os.environ, 'RANK': str(r), 'WORLD_SIZE': '2'},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in (1, 0)]
for k in kids:
    k.stdout.readline()
print(' '.join(str(k.pid) for k in kids), flush=True)
sys.stdin.read()
for k in kids:
    k.kill()
"""


@contextlib.contextmanager
def launched_job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """A launcher (no CUDA) with two ranks that map libcuda, started rank 1 first."""
    lib = tmp_path / "fakelib" / "libcuda.so.1"
    lib.parent.mkdir()
    lib.write_bytes(b"\0" * 4096)
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(lib), FAKE_CUDA], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        assert proc.stdout is not None
        kids = [int(p) for p in proc.stdout.readline().split()]
        yield proc, kids
    finally:
        for pid in [proc.pid, *kids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        proc.wait()


class FakeDriver:
    """The driver checkpoint API for the ranks: states, and a lock that times out for a rank
    while ``stuck`` says its collective is in flight (so many more tries)."""

    version = 13000

    def __init__(self, pids: list[int]):
        self.states = {p: "running" for p in pids}
        self.stuck: dict[int, int] = {}
        self.fail_checkpoint: set[int] = set()
        self.uninitialised: set[int] = set()  # map libcuda, no CUDA state (a launcher that imported torch)
        self.calls: list[tuple[str, int]] = []
        self.pairs: dict[int, object] = {}  # the GPU map each restore was given
        self.refuse_remap: set[int] = set()  # ranks whose restore onto other GPUs the driver refuses

    def get_state(self, pid: int) -> tuple[str | None, str | None]:
        if pid in self.uninitialised:
            return None, "CUDA_ERROR_NOT_INITIALIZED"
        return self.states.get(pid), None

    def lock(self, pid: int, timeout_ms: int) -> str | None:
        self.calls.append(("lock", pid))
        if self.stuck.get(pid, 0) > 0:
            self.stuck[pid] -= 1
            return "CUDA_ERROR_TIMEOUT"
        self.states[pid] = "locked"
        return None

    def checkpoint(self, pid: int) -> str | None:
        self.calls.append(("checkpoint", pid))
        if pid in self.fail_checkpoint:
            return "CUDA_ERROR_NOT_SUPPORTED"
        self.states[pid] = "checkpointed"
        return None

    def restore(self, pid: int, pairs=None) -> str | None:  # noqa: ANN001
        self.calls.append(("restore", pid))
        self.pairs[pid] = pairs
        if pid in self.refuse_remap and pairs:
            return "CUDA_ERROR_INVALID_VALUE"  # what the driver returns for a map it refuses
        self.states[pid] = "locked"
        return None

    def unlock(self, pid: int) -> str | None:
        self.calls.append(("unlock", pid))
        self.states[pid] = "running"
        return None


class JobCheckpointer(Checkpointer):
    def __init__(self, driver: FakeDriver):
        self.records: list[dict] = []
        super().__init__(emit=self.records.append)
        self._api = driver

    #: what NVML would say of each pid (default: nothing listed, 1 MiB)
    gpus: dict[int, tuple[list[dict], int | None]] = {}

    def usage(self, pid: int):  # noqa: ANN201 -- no NVML here
        return self.gpus.get(pid, ([], 1 << 20))

    def header_fields(self):  # noqa: ANN201
        return {}


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    with launched_job(tmp_path) as (launcher, kids):
        yield launcher, kids


def test_the_ranks_are_the_cuda_processes_of_the_tree_in_rank_order(job) -> None:
    launcher, kids = job
    ranks = J.job_ranks(launcher.pid)
    assert [r.info.pid for r in ranks] == [kids[1], kids[0]]  # rank 0 was started second
    assert [r.rank for r in ranks] == [0, 1]
    assert launcher.pid not in [r.info.pid for r in ranks]  # the launcher maps no libcuda
    assert [r.info.pid for r in J.job_ranks(kids[0])] == [kids[0]]  # a rank alone is its own job


def test_a_tree_without_cuda_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GpuosError) as e:
        J.job_ranks(os.getpid(), is_cuda=lambda pid: False)
    assert e.value.code == ExitCode.NOT_CUDA_PROCESS and "the job's launcher (torchrun)" in str(e.value)


def test_every_rank_is_locked_before_any_is_checkpointed_and_a_stuck_round_is_retried(job) -> None:
    launcher, kids = job
    ranks = sorted(kids)
    driver = FakeDriver(ranks)
    driver.stuck[kids[0]] = 1  # rank 1's collective is in flight in the first round
    ckpt = JobCheckpointer(driver)
    result = J.suspend_job(ckpt, launcher.pid, timeout_ms=50, pause_s=0.0)
    assert result["ok"] and result["rounds"] == 2 and driver.states == {p: "checkpointed" for p in ranks}
    # round one: the rank that was locked is given back (unlocked) before the retry
    first_round = driver.calls[:driver.calls.index(("unlock", kids[1])) + 1]
    assert ("lock", kids[1]) in first_round and ("checkpoint", kids[1]) not in first_round
    last_lock = max(i for i, c in enumerate(driver.calls) if c[0] == "lock")
    first_checkpoint = min(i for i, c in enumerate(driver.calls) if c[0] == "checkpoint")
    assert last_lock < first_checkpoint
    for rec in ckpt.records:
        assert check_written(rec) is None, rec
    assert [r["rank"] for r in result["ranks"]] == [0, 1]

    before = len(driver.calls)
    back = J.resume_job(ckpt, launcher.pid)
    assert back["ok"] and driver.states == {p: "running" for p in ranks}
    steps = [c[0] for c in driver.calls[before:]]
    assert sorted(steps) == ["restore", "restore", "unlock", "unlock"]
    assert steps.index("unlock") > max(i for i, s in enumerate(steps) if s == "restore")  # all back, then go
    assert check_written(back) is None


def test_a_process_whose_gpu_nvml_lists_without_bytes_is_written_with_memory_null(job) -> None:
    # as on a 2-GPU H100 under torchrun: the launcher has the GPU's device file open and a CUDA
    # state, and NVML gives it no memory; its record must still be one a reader accepts
    launcher, kids = job
    ranks = sorted(kids)
    ckpt = JobCheckpointer(FakeDriver(ranks))
    gpu = {"index": 0, "uuid": "GPU-1ab659e8-eaed-158f-2afe-0a6b9ee5628e", "name": "NVIDIA H100 80GB HBM3"}
    ckpt.gpus = {ranks[0]: ([{**gpu, "memory": None}], None), ranks[1]: ([{**gpu, "memory": 1935671296}], 1935671296)}
    assert J.suspend_job(ckpt, launcher.pid, timeout_ms=50, pause_s=0.0)["ok"]
    written = [r for r in ckpt.records if r["type"] == "ckpt_process"]
    assert [r["gpus"][0]["memory"] for r in written] in ([None, 1935671296], [1935671296, None])
    for rec in ckpt.records:
        assert check_written(rec) is None, rec
    assert J.resume_job(ckpt, launcher.pid)["ok"]


def test_a_rank_that_never_locks_leaves_the_whole_job_running(job) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    driver.stuck[kids[1]] = 99
    ckpt = JobCheckpointer(driver)
    started = time.monotonic()
    with pytest.raises(CkptError) as e:
        J.suspend_job(ckpt, launcher.pid, timeout_ms=50, rounds=3, pause_s=0.01)
    assert e.value.code == ExitCode.LOCK_TIMEOUT and "3 rounds" in str(e.value)
    assert driver.states == {p: "running" for p in kids} and time.monotonic() - started < 10
    assert ("checkpoint", kids[0]) not in driver.calls


def test_a_rank_the_driver_cannot_checkpoint_brings_every_rank_back(job) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    driver.fail_checkpoint.add(kids[0])
    ckpt = JobCheckpointer(driver)
    with pytest.raises(CkptError) as e:
        J.suspend_job(ckpt, launcher.pid, timeout_ms=50, pause_s=0.0)
    assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and e.value.state == "running"
    assert driver.states == {p: "running" for p in kids}


def test_a_job_not_all_running_is_not_touched(job) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    driver.states[kids[0]] = "checkpointed"
    ckpt = JobCheckpointer(driver)
    with pytest.raises(CkptError) as e:
        J.suspend_job(ckpt, launcher.pid, pause_s=0.0)
    assert e.value.code == ExitCode.WRONG_STATE and not driver.calls
    with pytest.raises(CkptError) as e:
        J.resume_job(ckpt, launcher.pid)
    assert e.value.code == ExitCode.WRONG_STATE and not driver.calls


#: two GPUs of one kind, as the two-H100 machine lists them
TWO_GPUS = [{"index": i, "uuid": u, "name": "NVIDIA H100 80GB HBM3", "memory_free": 80 << 30}
            for i, u in enumerate(("GPU-1ab659e8-eaed-158f-2afe-0a6b9ee5628e", "GPU-7c0f2d41-93be-11a2-c4d5-5e6f7a8b9c0d"))]


def test_device_map_moves_every_rank_the_same_way(job, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    ckpt = JobCheckpointer(driver)
    monkeypatch.setattr(JobCheckpointer, "machine_gpus", lambda self: TWO_GPUS)
    J.suspend_job(ckpt, launcher.pid, pause_s=0.0)
    back = J.resume_job(ckpt, launcher.pid, device_map="0=1,1=0")
    a, b = (g["uuid"] for g in TWO_GPUS)
    swap = [(a, b), (b, a)]
    assert back["ok"] and driver.pairs == {k: swap for k in kids}
    assert back["gpu_map"] == [list(p) for p in swap] and check_written(back) is None
    assert driver.states == {p: "running" for p in kids}


@pytest.mark.parametrize(("device_map", "code", "words"), [
    ("0=1", ExitCode.BAD_GPU, "permutation"),  # GPU 1 would receive two GPUs
    ("0=7,7=0", ExitCode.BAD_GPU, "no GPU with index 7"),
    ("0:1", ExitCode.USAGE, "not OLD=NEW"),
])
def test_a_bad_device_map_touches_no_rank(job, monkeypatch: pytest.MonkeyPatch, device_map: str, code: ExitCode,
                                          words: str) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    ckpt = JobCheckpointer(driver)
    monkeypatch.setattr(JobCheckpointer, "machine_gpus", lambda self: TWO_GPUS)
    J.suspend_job(ckpt, launcher.pid, pause_s=0.0)
    before = list(driver.calls)
    with pytest.raises(CkptError) as e:
        J.resume_job(ckpt, launcher.pid, device_map=device_map)
    assert e.value.code == code and words in str(e.value) and not e.value.touched
    assert driver.calls == before and driver.states == {p: "checkpointed" for p in kids}
    assert J.resume_job(ckpt, launcher.pid)["ok"]  # and the job comes back where it was


def test_a_job_only_locked_cannot_move(job, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    ckpt = JobCheckpointer(driver)
    monkeypatch.setattr(JobCheckpointer, "machine_gpus", lambda self: TWO_GPUS)
    driver.states = {k: "locked" for k in kids}  # their memory is still on their GPUs
    with pytest.raises(CkptError) as e:
        J.resume_job(ckpt, launcher.pid, device_map="0=1,1=0")
    assert e.value.code == ExitCode.WRONG_STATE and "no process of it is checkpointed" in str(e.value)
    assert not driver.calls and not e.value.touched


def test_a_refused_remap_unlocks_no_rank(job, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    driver.refuse_remap.add(kids[1])
    ckpt = JobCheckpointer(driver)
    monkeypatch.setattr(JobCheckpointer, "machine_gpus", lambda self: TWO_GPUS)
    J.suspend_job(ckpt, launcher.pid, pause_s=0.0)
    with pytest.raises(CkptError) as e:
        J.resume_job(ckpt, launcher.pid, device_map="0=1,1=0")
    assert e.value.code == ExitCode.BAD_GPU and "refused the GPU remapping" in str(e.value)
    assert not any(c == "unlock" for c, _ in driver.calls[-2:]) and driver.states[kids[1]] == "checkpointed"
    assert "--device-map 0=1,1=0` tries again" in str(e.value)  # the same map: no rank left behind
    driver.refuse_remap.clear()
    assert J.resume_job(ckpt, launcher.pid, device_map="0=1,1=0")["ok"]
    assert driver.states == {p: "running" for p in kids}


def test_a_job_on_nccl_transports_the_driver_cannot_restore_is_refused_untouched(job) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    ckpt = JobCheckpointer(driver)
    lacks = {kids[1]: ["NCCL_P2P_DISABLE=1"]}
    with pytest.raises(CkptError) as e:
        J.suspend_job(ckpt, launcher.pid, pause_s=0.0, unrestorable=lambda p: lacks.get(p, []))
    assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and not e.value.touched and e.value.state == "running"
    assert "NCCL_P2P_DISABLE=1" in str(e.value) and "--force" in str(e.value) and not driver.calls
    result = J.suspend_job(ckpt, launcher.pid, pause_s=0.0, unrestorable=lambda p: lacks.get(p, []), force=True)
    assert result["ok"] and result["unrestorable"] == [kids[1]] and check_written(result) is None
    assert J.resume_job(ckpt, launcher.pid)["ok"]


def test_the_nccl_check_reads_the_maps_and_the_environment(tmp_path: Path) -> None:
    """A process that maps a file named like NCCL's library, started with some of the variables."""
    lib = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0" * 4096)
    code = ("import mmap,sys,time; f=open(sys.argv[1],'rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); "
            "print('ready',flush=True); time.sleep(60)")
    for env, lacking in (({"NCCL_P2P_DISABLE": "1"}, ["NCCL_SHM_DISABLE=1", "NCCL_CUMEM_ENABLE=0"]),
                         (J.NCCL_RESTORABLE, [])):
        proc = subprocess.Popen([sys.executable, "-c", code, str(lib)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, **env})
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            assert J.nccl_unrestorable(proc.pid) == lacking
        finally:
            proc.kill()
            proc.wait()
    assert J.nccl_unrestorable(os.getpid()) == []  # no NCCL mapped here


@pytest.mark.parametrize(("command", "args"), [
    ("ckpt", ["--job", "1", "--pid", "2"]),
    ("ckpt", ["--job", "1", "--profile", "p"]),
    ("ckpt", ["--job", "1", "--agent", "2", "--image", "d"]),
    ("ckpt", ["--pid", "1", "--force"]),
    ("restore", ["--job", "1", "--device", "0"]),
    ("restore", ["--job", "1", "--device", "0", "--device-map", "0=1,1=0"]),
    ("restore", ["--job", "1", "--pid", "2"]),
])
def test_job_usage_errors(command: str, args: list[str], tmp_path: Path) -> None:
    from helpers import child_env

    done = subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{command}", *args], env=child_env(
        GPUOS_CKPT_STATE_DIR=str(tmp_path)), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert done.stdout == "" and done.stderr.strip()


def test_the_launcher_reads_only_what_it_may(job) -> None:
    """Another user's process: its environment is unreadable, and the rank is then unknown (None),
    not an error; our own processes give theirs."""
    launcher, kids = job
    assert procs.environ_values(kids[0], ("RANK",)) == {"RANK": "1"}
    assert procs.environ_values(2**22 + 12345, ("RANK",)) == {}


def test_status_names_each_ranks_job_and_rank(job, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, kids = job
    ckpt = JobCheckpointer(FakeDriver(kids))
    monkeypatch.setattr(JobCheckpointer, "machine_gpus", lambda self: [])
    rows = {r["pid"]: r for r in ckpt.list_processes(kids)}
    assert {rows[k]["rank"] for k in kids} == {0, 1}
    assert all(rows[k]["job"] == launcher.pid for k in kids)
    for rec in rows.values():
        assert check_written(rec) is None, rec


def test_a_process_that_never_initialised_cuda_is_no_rank(job) -> None:
    launcher, kids = job
    driver = FakeDriver(kids)
    driver.uninitialised.add(kids[0])
    ckpt = JobCheckpointer(driver)
    result = J.suspend_job(ckpt, launcher.pid, pause_s=0.0)
    assert [r["pid"] for r in result["ranks"]] == [kids[1]] and driver.states[kids[0]] == "running"
    assert all(pid == kids[1] for _, pid in driver.calls)
    driver.uninitialised.add(kids[1])
    with pytest.raises(CkptError) as e:
        J.resume_job(ckpt, launcher.pid)
    assert e.value.code == ExitCode.NOT_CUDA_PROCESS and not e.value.touched


def test_one_rank_of_a_job_alone_is_refused_untouched_unless_forced(job) -> None:
    """A rank's PID instead of the launcher's: its tree holds one of WORLD_SIZE=2 ranks, and a
    checkpoint of it alone would leave the other rank waiting in its collectives."""
    launcher, kids = job
    driver = FakeDriver(kids)
    ckpt = JobCheckpointer(driver)
    with pytest.raises(CkptError) as e:
        J.suspend_job(ckpt, kids[0], pause_s=0.0)
    assert e.value.code == ExitCode.NOT_CHECKPOINTABLE and not e.value.touched
    assert "holds 1 of the job's 2 ranks" in str(e.value) and "--force" in str(e.value)
    assert driver.calls == [] and driver.states == {p: "running" for p in kids}
    result = J.suspend_job(ckpt, kids[0], pause_s=0.0, force=True)
    assert result["ok"] and driver.states[kids[0]] == "checkpointed" and driver.states[kids[1]] == "running"
    assert J.resume_job(ckpt, kids[0])["ok"]
    assert J.suspend_job(ckpt, launcher.pid, pause_s=0.0)["ok"]  # the whole job: no question asked
