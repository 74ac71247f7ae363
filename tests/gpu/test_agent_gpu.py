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

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"


#: the trial programs: random work on several streams while snapshots are taken (same protocol)
PROGRAMS = {"cupy": PROGS / "snapshot_prog.py", "torch": PROGS / "snapshot_prog_torch.py"}


def traced_run(tmp: Path, name: str, env_extra: dict, program: str = "cupy") -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
         str(tmp / f"{name}.ndjson.zst"), "--", sys.executable, str(PROGRAMS[program])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def trials(tmp: Path, seed: int, snapshots: int, ops: int = 3000, stats: list | None = None,
           program: str = "cupy") -> tuple[int, list[str]]:
    """(snapshots compared, mismatches) for one seed of ``program`` (a key of PROGRAMS): a run
    with snapshots, then its twin. ``stats`` collects each compared snapshot's answer (without
    digests)."""
    tag = "" if program == "cupy" else f"{program}-"
    env = {"GPUOS_TRIAL_SEED": str(seed), "GPUOS_TRIAL_OPS": str(ops)}
    report = tmp / f"{tag}a{seed}.json"
    a = traced_run(tmp, f"{tag}a{seed}", {**env, "GPUOS_TRIAL_SNAPSHOTS": str(snapshots),
                                          "GPUOS_TEST_REPORT": str(report)}, program)
    assert a.returncode == 0, a.stderr[-3000:]
    answers = json.loads(report.read_text())["answers"]
    assert answers, "no snapshot was taken"
    refs = tmp / f"{tag}b{seed}.refs"
    refs.unlink(missing_ok=True)  # the agent appends
    b = traced_run(tmp, f"{tag}b{seed}", {**env, "GPUOS_TRIAL_SNAPSHOTS": "0", "GPUOS_AGENT_REFERENCE_OUT": str(refs),
                                          "GPUOS_AGENT_REFERENCE_AT": ",".join(str(x["ops_before"]) for x in answers)},
                   program)
    assert b.returncode == 0, b.stderr[-3000:]
    by_ops = {}
    for line in refs.read_text().splitlines():
        r = json.loads(line)
        by_ops[r["ops_before"]] = r
    bad = []
    compared = 0
    for x in answers:
        ref = by_ops.get(x["ops_before"])
        if ref is None:
            continue  # taken after the last operation: no reference point in the twin
        compared += 1
        if stats is not None:
            stats.append({k: v for k, v in x.items() if k not in ("digests", "allocations")})
        if x["digests"] != ref["digests"]:
            diff = [i for i, (p, q) in enumerate(zip(x["digests"], ref["digests"])) if p != q]
            bad.append(f"{program} seed {seed} ops_before {x['ops_before']}: buffers {diff} differ "
                       f"(cow {x['cow']}, host saves {x['host_saves']}, waits {x['stream_waits']})")
    return compared, bad


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


def test_snapshot_images_full_then_incremental(tmp_path):
    """Snapshots of a running job written as images: every buffer read back from the image (and
    through the incremental chain) equals the snapshot's own digest; the chain verifies and
    compacts into an equal full image."""
    import hashlib
    import signal
    import time

    from gpuos_tools.agent.control import request, socket_path
    from gpuos_tools.ckpt.image import compact, open_image, verify

    env = dict(os.environ, GPU_JOB_GIB="0.5", GPUOS_JOB_STOP=str(tmp_path / "stop"),
               GPUOS_JOB_LOG=str(tmp_path / "log"), GPUOS_JOB_READY=str(tmp_path / "ready"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o", os.devnull,
         "--", sys.executable, str(PROGS / "agent_job.py")], cwd=ROOT, env=env, start_new_session=True)
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
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
