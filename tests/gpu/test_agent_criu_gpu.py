"""Full-process images of a job under the agent on interception, on a real GPU (pytest -m gpu;
`criu` 4 or later on PATH, root): an owned CuPy job (GPUOS_AGENT_OWN=1, `gpu-trace run --agent
--mechanism intercept`) dumped with `gpu-ckpt --pid PID --image DIR` -- its agent suspends it (owned
memory to pinned host memory at link speed), then the driver's checkpoint of the rest and `criu
dump` -- ended, restored with `gpu-restore --image DIR` (CRIU, the driver's restore, the agent's
resume) and finishing bit-identical to an uninterrupted run; the same job dumped without the
agent's suspend (`--no-agent-suspend`) in the same test, for a side-by-side figure: suspend time,
driver checkpoint time and bytes, CRIU dump time, whole command, restore.

The job and its launcher write to files (CRIU restores a file by path, not a pipe to this test);
the launcher ends with the job when CRIU ends it, and the restored job, nobody's child here, is
followed through its files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_jobs import FIGURES, end_process, keep_guard_log, skip_without_criu

from gpuos_tools import procs
from gpuos_tools.ckpt import criu
from gpuos_tools.ckpt import records as _schemas  # noqa: F401 -- registers the schemas check_written uses
from gpuos_tools.stream.records import check_written

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
#: long enough that the job is still mid-run when the dump comes (the tool starts in a second or two)
JOB = ("--framework", "cupy", "--gib", "1.0", "--iters", "4000")


@pytest.fixture(autouse=True)
def need_criu_and_cupy() -> None:
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("needs cupy")
    skip_without_criu()


@pytest.fixture(autouse=True)
def guard_log(tmp_path: Path, request):
    yield
    keep_guard_log(tmp_path / "state", request.node.name)


def env_for(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               GPUOS_CKPT_STATE_DIR=str(tmp / "state"), CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1",
               PYTHONWARNINGS="ignore")  # a warning would grow the job's stderr file, which CRIU checks
    for k in ("GPUOS_AGENT_OWN", "GPUOS_AGENT_MECHANISM", "GPUOS_AGENT_BACKEND", "LD_PRELOAD"):
        env.pop(k, None)
    env.update(extra)
    return env


#: The program: criu_job.py with its standard output and error on a file of its own. The launcher's
#: (which the program inherits) would grow when the launcher ends with the dumped program and says
#: so, and CRIU restores an open regular file only at the size it had at the dump.
OWN_STDERR = ("import os, runpy, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); "
              "os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd); sys.argv = sys.argv[2:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")


class AgentJob:
    """tests/gpu/progs/criu_job.py under `gpu-trace run --agent --mechanism intercept`, its
    allocations owned; its pid is the program's (not the launcher's)."""

    def __init__(self, tmp: Path, name: str):
        self.dir = tmp / name
        self.dir.mkdir()
        cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--mechanism", "intercept",
               "--no-images", "-o", str(self.dir / "trace.ndjson.zst"), "--",
               sys.executable, "-c", OWN_STDERR, str(self.dir / "stderr"), str(PROGS / "criu_job.py"),
               "--dir", str(self.dir), *JOB]
        with open(self.dir / "launcher.out", "w") as out, open(self.dir / "launcher.err", "w") as err:
            self.launcher: subprocess.Popen | None = subprocess.Popen(
                cmd, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                env=env_for(tmp, GPUOS_AGENT_OWN="1"))
        deadline = time.monotonic() + 180
        while not (self.dir / "ready.json").exists():
            if self.launcher.poll() is not None or time.monotonic() > deadline:
                self.fail("never got ready")
            time.sleep(0.05)
        self.pid = int(json.loads((self.dir / "ready.json").read_text())["pid"])

    def fail(self, what: str) -> None:
        said = {n: (self.dir / n).read_text(errors="replace")[-3000:] for n in ("stderr", "launcher.err")
                if (self.dir / n).exists()}
        pytest.fail(f"agent job {self.dir.name}: {what}\n{said}")

    def wait_iter(self, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if int((self.dir / "progress").read_text().split()[1]) >= n:
                    return
            except (OSError, IndexError, ValueError):
                pass
            if (self.dir / "done.json").exists():
                self.fail(f"ended before iteration {n}: make it longer")
            time.sleep(0.05)
        self.fail(f"no iteration {n} within {timeout} s")

    def reap_launcher(self) -> None:
        """CRIU ended the program; its launcher then ends too (and frees nothing the restore needs)."""
        if self.launcher is not None:
            self.launcher.wait(timeout=120)
            self.launcher = None

    def finish(self, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while not (self.dir / "done.json").exists() or procs.exists(self.pid):
            if time.monotonic() > deadline:
                self.fail(f"not done within {timeout} s")
            if not procs.exists(self.pid) and not (self.dir / "done.json").exists():
                self.fail("ended without a result")
            time.sleep(0.05)
        return json.loads((self.dir / "done.json").read_text())

    def kill(self) -> None:
        end_process(self.pid, self.launcher)


def cli(tmp: Path, command: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict], float]:
    t = time.monotonic()
    done = subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{command}", *args], cwd=ROOT,
                          env=env_for(tmp), capture_output=True, text=True, timeout=600, check=False)
    return done, [json.loads(x) for x in done.stdout.splitlines() if x.strip()], time.monotonic() - t


def figures(records: list[dict]) -> dict:
    """What the dump's records say: the agent's suspend, the driver's checkpoint, CRIU's dump."""
    suspend = next((r for r in records if r["type"] == "agent_suspend"), {})
    checkpoint = next((r for r in records if r["type"] == "ckpt_result" and r["action"] == "checkpoint"), {})
    steps = {r["step"]: r for r in records if r["type"] == "ckpt_step"}
    return {"suspend_s": suspend.get("suspend_s"), "suspend_gbps": suspend.get("save_gbps"),
            "agent_released_bytes": suspend.get("released_bytes"), "staging_s": suspend.get("staging_s"),
            "driver_checkpoint_s": checkpoint.get("checkpoint_s"), "driver_bytes": checkpoint.get("bytes"),
            "criu_dump_s": steps.get("criu_dump", {}).get("duration_s")}


def dump_and_restore(tmp: Path, name: str, *dump_args: str) -> dict:
    job = AgentJob(tmp, name)
    try:
        job.wait_iter(300)
        image = tmp / f"image-{name}"
        done, records, dump_s = cli(tmp, "ckpt", "--pid", str(job.pid), "--image", str(image), *dump_args)
        assert done.returncode == 0, (done.stderr, records[-3:])
        result = [r for r in records if r["type"] == "ckpt_result"][-1]
        assert result["action"] == "dump" and result["state"] == "dumped", result
        assert criu.image_state(image) == "complete"
        job.reap_launcher()
        deadline = time.monotonic() + 60
        while procs.exists(job.pid):  # CRIU ended it
            assert time.monotonic() < deadline, "the dumped job is still there"
            time.sleep(0.05)
        meta = json.loads((image / criu.METADATA).read_text())
        done, back, restore_s = cli(tmp, "restore", "--image", str(image))
        assert done.returncode == 0, (done.stderr, back[-3:])
        finished = job.finish()
        return {"records": records, "back": back, "meta": meta, "finished": finished,
                **figures(records), "dump_s": round(dump_s, 3), "restore_s": round(restore_s, 3)}
    finally:
        job.kill()


def test_an_agent_job_dumped_through_its_agent_and_criu_ends_bit_identical(tmp_path: Path) -> None:
    ref = tmp_path / "reference"
    ref.mkdir()
    plain = subprocess.run([sys.executable, str(PROGS / "criu_job.py"), "--dir", str(ref), *JOB],
                           capture_output=True, text=True, env=env_for(tmp_path), timeout=900, check=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    expected = json.loads((ref / "done.json").read_text())

    agent = dump_and_restore(tmp_path, "agent")
    kinds = [r["type"] for r in agent["records"]]
    assert kinds.index("agent_suspend") < kinds.index("ckpt_step"), kinds  # the agent before the driver
    assert [(r["step"], r["ok"]) for r in agent["records"] if r["type"] == "ckpt_step"] == [
        ("lock", True), ("checkpoint", True), ("criu_dump", True)]
    assert agent["meta"]["agent"]["suspended_by_dump"] is True and agent["meta"]["agent"]["mechanism"] == "intercept"
    assert agent["meta"]["trace_pipe"]["pipe"].startswith("pipe:[")
    assert agent["agent_released_bytes"] >= 1 << 30  # the job's GiB went through the agent
    answers = [r for r in agent["records"] + agent["back"] if r["type"] in ("agent_suspend", "agent_resume")]
    assert all(check_written(r) is None for r in answers), answers  # the agent's real answers
    resumed = [r for r in agent["back"] if r["type"] == "agent_resume"]
    assert resumed and resumed[-1]["bytes"] == agent["agent_released_bytes"], agent["back"]
    assert agent["finished"]["digest"] == expected["digest"] and agent["finished"]["iters"] == expected["iters"]

    plain_way = dump_and_restore(tmp_path, "plain", "--no-agent-suspend")
    assert "agent_suspend" not in [r["type"] for r in plain_way["records"]]
    assert plain_way["meta"]["agent"]["suspended_by_dump"] is False
    assert not [r for r in plain_way["back"] if r["type"] == "agent_resume"]
    assert plain_way["finished"]["digest"] == expected["digest"]

    keys = ("suspend_s", "suspend_gbps", "staging_s", "agent_released_bytes", "driver_checkpoint_s", "driver_bytes",
            "criu_dump_s", "dump_s", "restore_s")
    rows = {"through the agent": {k: agent[k] for k in keys}, "--no-agent-suspend": {k: plain_way[k] for k in keys}}
    print("\n" + json.dumps({"test": "agent_criu", "job": " ".join(JOB), **rows}, indent=1))
    if FIGURES:
        with open(FIGURES, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": "agent_criu", "job": " ".join(JOB), **rows}) + "\n")
    # the point of it: the driver copies less when the agent took the owned memory off the GPU
    assert agent["driver_bytes"] is None or plain_way["driver_bytes"] is None \
        or agent["driver_bytes"] < plain_way["driver_bytes"], rows
