"""The agent's concurrent snapshots on a real GPU (pytest -m gpu): randomised trials against a
twin run's stop-the-world references."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_jobs import kill_group

from workloads.snapshot_trials import trials

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "workloads"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_snapshots_equal_the_state_at_t0(tmp_path, seed):
    compared, bad = trials(tmp_path, seed, snapshots=25)
    assert not bad, bad
    assert compared >= 5


@pytest.mark.parametrize("seed", [1, 2])
def test_snapshots_of_pytorch_work_equal_the_state_at_t0(tmp_path, seed):
    """The same with PyTorch: library kernels (cuBLAS, cuDNN, index and reduction kernels), the
    caching allocator's segments with their freed temporaries, driver memsets and copies."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no PyTorch")
    compared, bad = trials(tmp_path, seed, snapshots=25, ops=4000, program="torch")
    assert not bad, bad
    assert compared >= 5


def test_snapshots_of_buffers_across_staging_pieces_equal_the_state_at_t0(tmp_path):
    """Buffers of odd sizes up to 80 MB, so that copies into the pinned staging are cut at its
    64 MiB pieces in the middle of buffers (and of the copy-on-write saves to host)."""
    stats: list = []
    # a snapshot with digests of ~400 MB takes about a second: enough operations to overlap several
    compared, bad = trials(tmp_path, 4, snapshots=6, ops=6000, stats=stats, env_extra={"GPUOS_TRIAL_BIG": "1"})
    assert compared >= 3 and not bad, bad
    assert max(a["bytes"] for a in stats) > 3 * (64 << 20), "the buffers did not span several staging pieces"


def test_stage_ahead_pins_the_staging_before_the_first_snapshot(tmp_path):
    """`gpu-trace run --agent --stage-ahead`: a background thread pins the staging as the program
    allocates, so the first snapshot finds it ready; the snapshot is still a sound image."""
    import time

    from gpuos_tools.agent.control import request
    from gpuos_tools.image import verify

    proc, sock = start_job(tmp_path / "job", gib="1", extra=["--stage-ahead"])
    try:
        ans = request(sock, "ping", timeout=30)
        time.sleep(6.0)  # pinning 1 GiB a piece at a time at a quarter duty: ~2 s
        first = request(sock, "snapshot", digest=False, image=str(tmp_path / "img"), timeout=120)
        assert first["staging_s"] < 0.05, first
        assert first["bytes"] == ans["bytes"]
        assert verify(tmp_path / "img") == []
    finally:
        (tmp_path / "job" / "stop").touch()
        try:
            proc.wait(timeout=60)
        finally:
            kill_group(proc)


def test_snapshot_images_full_then_incremental(tmp_path):
    """Snapshots of a running job written as images: every buffer read back from the image (and
    through the incremental chain) equals the snapshot's own digest; the chain verifies and
    compacts into an equal full image."""
    import hashlib
    import time

    from gpuos_tools.agent.control import request, socket_path
    from gpuos_tools.image import compact, open_image, verify

    env = dict(os.environ, GPU_JOB_GIB="0.5", GPUOS_JOB_STOP=str(tmp_path / "stop"),
               GPUOS_JOB_LOG=str(tmp_path / "log"), GPUOS_JOB_READY=str(tmp_path / "ready"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o", os.devnull,
         "--", sys.executable, str(WORKLOADS / "agent_job.py")], cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.time() < deadline, "the job did not start"
            time.sleep(0.1)
        sock = socket_path(int((tmp_path / "ready").read_text()))
        images = []
        for k in range(3):
            parent = str(images[-1]) if images else None
            path = tmp_path / f"img{k}"
            ans = request(sock, "snapshot", digest=True, image=str(path), parent=parent)
            assert ans["image"]["incremental"] == (parent is not None), ans["image"]
            assert verify(path) == []
            img = open_image(path)
            ids = [a[0] for a in ans["allocations"]]
            for buffer_id, want in zip(ids, ans["digests"]):
                assert hashlib.sha256(img.read(buffer_id)).hexdigest() == want, (k, buffer_id)
            images.append(path)
            time.sleep(0.2)
        full = tmp_path / "compacted"
        compact(images[-1], full)
        assert verify(full) == []
        a, b = open_image(images[-1]), open_image(full)
        for entry in b.buffers:
            assert a.read(entry["id"]) == b.read(entry["id"])
        (tmp_path / "stop").touch()
        assert proc.wait(timeout=120) == 0
    finally:
        kill_group(proc)


def start_job(tmp: Path, gib: str = "0.5", extra: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
    """workloads/agent_job.py under `gpu-trace run --agent`, in its own process group:
    (the process, its agent's socket) once its arrays are ready."""
    import time

    from gpuos_tools.agent.control import socket_path

    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GPU_JOB_GIB=gib, GPUOS_JOB_STOP=str(tmp / "stop"), GPUOS_JOB_LOG=str(tmp / "log"),
               GPUOS_JOB_READY=str(tmp / "ready"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", *(extra or []), "--no-images",
         "-o", os.devnull, "--", sys.executable, str(WORKLOADS / "agent_job.py")], cwd=ROOT, env=env,
        start_new_session=True)
    deadline = time.time() + 120
    while not (tmp / "ready").exists():
        if proc.poll() is not None or time.time() > deadline:
            kill_group(proc)
            raise AssertionError("the job did not start")
        time.sleep(0.1)
    return proc, socket_path(int((tmp / "ready").read_text()))


def _wait_for(cond, timeout: float, what: str) -> None:
    import time

    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.001)


def test_kill9_of_the_job_while_it_writes_an_image_leaves_no_loadable_corrupt_image(tmp_path):
    """kill -9 of the program (its agent inside) at random moments while the agent writes images,
    full and incremental, back to back: every image in the directory verifies clean, the rest
    are dot-named temp directories, which clean_stale_temps removes once the writer is dead."""
    import random
    import shutil
    import threading
    import time

    from helpers import image_dir_problems  # tests/ is on sys.path under pytest

    from gpuos_tools.agent.control import request
    from gpuos_tools.image import clean_stale_temps, is_image
    from gpuos_tools.image.layout import _pid_alive

    rng = random.Random(6)
    outcomes = []
    for point in range(4):
        images = tmp_path / f"images{point}"
        images.mkdir()
        proc, sock = start_job(tmp_path / f"job{point}")
        errors: list[str] = []

        def snapshots(images=images, sock=sock, errors=errors) -> None:
            parent = None
            for k in range(50):
                path = images / f"img{k}"
                try:
                    ans = request(sock, "snapshot", digest=False, image=str(path), parent=parent, timeout=120)
                except Exception as exc:  # the job was killed: the answer never comes
                    errors.append(f"{type(exc).__name__}: {exc}")
                    return
                parent = ans["image"]["path"]

        thread = threading.Thread(target=snapshots, daemon=True)
        try:
            after = rng.choice([0, 1, 2])  # images committed before the kill
            delay = rng.uniform(0.0, 0.25)  # after the next image's writer has started
            thread.start()

            def committed() -> int:
                return sum(1 for p in images.iterdir() if not p.name.startswith(".") and is_image(p))

            def writing() -> bool:
                return any(p.name.startswith(".") for p in images.iterdir())

            _wait_for(lambda: errors or committed() >= after, 120, f"point {point}: {after} images were not written")
            _wait_for(lambda: errors or writing(), 60, f"point {point}: no image writer started")
            assert not errors, f"point {point}: a snapshot failed before the kill: {errors}"
            time.sleep(delay)
        finally:
            kill_group(proc)
        job = int((tmp_path / f"job{point}" / "ready").read_text())
        _wait_for(lambda: not _pid_alive(job), 120, f"point {point}: the killed job {job} is still there")
        thread.join(timeout=60)
        assert not thread.is_alive(), "a request to the killed agent did not end"
        assert errors, "the snapshots went on after the kill"
        problems = image_dir_problems(images)
        assert problems == [], (point, problems)
        temps = sorted(p for p in images.iterdir() if p.name.startswith("."))
        assert sorted(map(Path, clean_stale_temps(images))) == temps
        outcomes.append({"point": point, "after": after, "delay_s": round(delay, 3), "temps": len(temps),
                         "images": sorted(p.name for p in images.iterdir())})
        shutil.rmtree(images)  # 0.5 GiB an image: keep the disk free
    print(json.dumps(outcomes))
    assert any(o["temps"] for o in outcomes), f"no kill landed inside an image write: {outcomes}"


def test_kill9_of_gpu_ckpt_leaves_the_agent_serving_and_no_corrupt_image(tmp_path):
    """kill -9 of `gpu-ckpt --agent PID --image DIR` at random moments while the job runs: the
    agent finishes (or never starts) each image, still answers, and takes a good image after."""
    import hashlib
    import random
    import shutil
    import signal
    import time

    from helpers import image_dir_problems  # tests/ is on sys.path under pytest

    from gpuos_tools.agent.control import request
    from gpuos_tools.image import is_image, open_image, verify

    rng = random.Random(7)
    images = tmp_path / "images"
    images.mkdir()
    proc, sock = start_job(tmp_path / "job")
    pid = int((tmp_path / "job" / "ready").read_text())
    try:
        killed = []
        for k in range(6):
            ckpt = subprocess.Popen([sys.executable, "-m", "gpuos_tools.commands.ckpt", "--agent", str(pid),
                                     "--image", str(images / f"img{k}"), "-o", os.devnull], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if k % 2:  # anywhere in the command's life, its start-up included
                delay = rng.uniform(0.0, 2.0)
            else:  # while the agent writes the image it asked for
                _wait_for(lambda k=k: any(p.name.startswith(f".img{k}.") for p in images.iterdir())
                          or ckpt.poll() is not None, 120, f"the agent never started img{k}")
                delay = rng.uniform(0.0, 0.2)
            time.sleep(delay)
            ckpt.send_signal(signal.SIGKILL)
            rc = ckpt.wait(timeout=60)
            killed.append((k, round(delay, 3), rc))
            assert proc.poll() is None, f"the job died after gpu-ckpt was killed: {killed}"
        ping = request(sock, "ping", timeout=300)  # after any image still being written
        assert ping["ok"] and ping["pid"] == pid
        assert image_dir_problems(images) == [], killed
        # a request whose client was killed mid-way still made its image
        assert all(is_image(images / f"img{k}") for k, _, _ in killed if k % 2 == 0), killed
        assert any(rc == -signal.SIGKILL for k, _, rc in killed if k % 2 == 0), f"no kill landed mid-request: {killed}"
        good = images / "good"
        ans = request(sock, "snapshot", digest=True, image=str(good), timeout=300)
        assert verify(good) == []
        img = open_image(good)
        for (buffer_id, *_), want in zip(ans["allocations"], ans["digests"]):
            assert hashlib.sha256(img.read(buffer_id)).hexdigest() == want, buffer_id
        assert image_dir_problems(images) == [], killed
        print(json.dumps({"killed": killed, "left": sorted(p.name for p in images.iterdir())}))
        (tmp_path / "job" / "stop").touch()
        assert proc.wait(timeout=120) == 0
        shutil.rmtree(images)  # 0.5 GiB an image: keep the disk free
    finally:
        kill_group(proc)
