"""gpu-kinfer-bridge's GPU path on a real GPU (pytest -m gpu): the fused kernel and the cuBLAS path
against numpy, the daemon answering on the GPU, a hot swap that uploads new weights, NVML load
sampling, and calibrate writing a GPU curve into a profile."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer import policy as P
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import server as S

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _x(n: int, n_inputs: int = 31, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 10, (n, n_inputs)).astype(np.float32)


@pytest.mark.parametrize("mode", ["fused", "matmul"])
@pytest.mark.parametrize("batch", [1, 7, 8, 9, 1000, 4096, 65536])
def test_gpu_forward_matches_numpy(mode: str, batch: int) -> None:
    from gpuos_tools.kinfer.gpu import GpuMlp

    model = M.Mlp.random(seed=11)
    g = GpuMlp(model, mode=mode)
    assert g.mode == mode
    x = _x(batch, seed=batch)
    got, want = g.forward(x), model.forward(x)
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-4, atol=1e-3)
    assert np.array_equal(np.argmax(got, 1)[np.abs(want[:, 0] - want[:, 1]) > 1e-2],
                          np.argmax(want, 1)[np.abs(want[:, 0] - want[:, 1]) > 1e-2])


def test_fused_kernel_takes_other_shapes_and_refuses_odd_ones() -> None:
    from gpuos_tools.kinfer.gpu import GpuMlp

    small = M.Mlp.random(5, 64, 3, seed=2)
    g = GpuMlp(small)
    assert g.mode == "fused" and not g.note
    x = _x(333, 5)
    assert np.allclose(g.forward(x), small.forward(x), rtol=1e-4, atol=1e-3)
    odd = M.Mlp.random(31, 100, 2, seed=3)
    g = GpuMlp(odd)
    assert g.mode == "matmul"
    assert np.allclose(g.forward(_x(50)), odd.forward(_x(50)), rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError):
        GpuMlp(odd, mode="fused")


def test_daemon_answers_on_the_gpu_and_swaps_weights(tmp_path: Path) -> None:
    name = f"kinfer-gpu-{uuid.uuid4().hex[:8]}"
    a, b = M.Mlp.random(seed=1), M.Mlp.random(seed=2)
    try:
        srv = S.RingServer.open(name, R.Geometry(16, 8), a, P.Policy(cpu_below=8),
                            S.ServeOptions(use_gpu="on", model_dirs=(str(tmp_path),)), recreate=True, log=lambda m: None)
    except BaseException:
        R.ring_path(name).unlink(missing_ok=True)
        raise
    sampler, srv.gpu_load = srv.gpu_load, None  # another job on a shared GPU must not make this a CPU test
    try:
        assert srv.gpu_ready and srv.models[0].gpu is not None
        x = _x(64, seed=5)

        def ask(model: M.Mlp) -> None:
            for i in range(64):
                srv.ring.state[i] = R.WRITING
                m = srv.ring.meta[i : i + 1]
                m["version"], m["model_id"], m["n_inputs"], m["seq"] = R.ENTRY_VERSION, 0, 31, i
                srv.ring.inputs[i, :31] = x[i]
                srv.ring.state[i] = R.READY
            srv.process(np.array(srv.ready_slots()))
            assert (srv.ring.meta["where"][:64] == R.GPU).all()
            assert np.allclose(srv.ring.outputs[:64, :2], model.forward(x), rtol=1e-4, atol=1e-3)

        ask(a)
        b.save(tmp_path / "b.npz")
        srv._start_load(1, 0, str(tmp_path / "b.npz"))
        deadline = time.monotonic() + 60
        while srv._pending_swap is None and time.monotonic() < deadline:
            time.sleep(0.01)
        srv._apply_swap()
        assert srv.models[0].gpu is not None and srv.models[0].model is not a
        ask(b)
        assert srv.ring.counter_values()["gpu_batches"] == 2
    finally:
        if sampler is not None:
            sampler.stop()
        srv.close()
        R.ring_path(name).unlink(missing_ok=True)


def test_nvml_load_sampling() -> None:
    load = P.GpuLoad(P.Policy())
    assert load.start(), load.error
    try:
        assert 0 <= load.util <= 100 and load.others >= 0
    finally:
        load.stop()


def test_calibrate_writes_the_gpu_curve(tmp_path: Path) -> None:
    profile = tmp_path / "linnos.toml"
    profile.write_text((ROOT / "gpuos_tools" / "profiles" / "linnos.toml").read_text())
    done = subprocess.run(
        [sys.executable, str(ROOT / "cmd" / "gpu-kinfer-bridge"), "calibrate", "--profile", str(profile),
         "--batches", "1,8,64,1024,4096", "--reps", "10"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rec = json.loads(done.stdout.splitlines()[-1])
    assert rec["gpu_error"] is None and len(rec["gpu_us"]) == 5 and rec["gpu_mode"] == "fused"
    pol = P.load_profile(str(profile)).policy()
    assert pol.calibrated and pol.gpu_us == rec["gpu_us"]
    assert pol.cpu_below == (rec["crossover"] if rec["crossover"] is not None else 4097)


def _serve_in_thread(srv: S.RingServer):  # noqa: ANN202
    import threading

    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("gpu_wins", [True, False])
def test_measured_delay_and_native_loop_on_a_real_gpu(gpu_wins: bool) -> None:
    """The daemon probes the real GPU (no measurement yet), feeds the delay estimate from its
    own GPU batches, and its native loop leaves to Python exactly the batches the policy gives the
    GPU. The calibration is made one-sided on purpose so the right side is known whatever the
    GPU's load: with the CPU calibrated at 1 s per batch the GPU always wins, at 1 ns never."""
    name = f"kinfer-gpu-{uuid.uuid4().hex[:8]}"
    cpu = 1e6 if gpu_wins else 1e-3
    pol = P.Policy(batches=[1, 4096], cpu_us=[cpu, cpu], gpu_us=[30.0, 80.0])
    model = M.Mlp.random(seed=6)
    try:
        srv = S.RingServer.open(name, R.Geometry(16, 8), model, pol, S.ServeOptions(use_gpu="on", native="auto"), recreate=True,
                            log=lambda m: None)
    except BaseException:
        R.ring_path(name).unlink(missing_ok=True)
        raise
    try:
        assert srv.gpu_ready and srv.native is not None, "needs the GPU and a C compiler"
        thread = _serve_in_thread(srv)
        try:
            deadline = time.monotonic() + 60
            while srv.speed.probes == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.speed.probes >= 1 and srv.speed.last_probe_us > 0  # nothing measured yet: probed at once
            x = _x(40, seed=9)
            with R.RingClient(name) as client:
                answers = [client.infer(row) for row in x]
        finally:
            srv.stop.set()
            thread.join(timeout=30)
        want_where = R.GPU if gpu_wins else R.CPU
        assert all(a.ok and a.where == want_where for a in answers)
        assert np.allclose(np.array([a.outputs for a in answers]), model.forward(x), rtol=1e-4, atol=1e-3)
        stats = srv.native.stats()
        if gpu_wins:
            assert stats["native_served"] == 0 and stats["handed_batches"] >= 1
            assert len(srv.speed.samples) >= 2  # the probe and the GPU batches themselves
        else:
            assert stats["native_served"] == 40
    finally:
        srv.close()
        R.ring_path(name).unlink(missing_ok=True)


def test_probe_measures_the_gpu_against_its_calibration() -> None:
    """GpuSpeed.probe on the real GpuMlp: one run, timed (no warm-up run before it, even on a GPU
    left alone), recorded against a curve calibrated here; a second probe right after is one
    run too."""
    from gpuos_tools.kinfer import calibrate as C
    from gpuos_tools.kinfer.gpu import GpuMlp

    res = C.measure(P.load_profile("linnos"), [1, 64, 1024], 10)
    pol = P.Policy(batches=res["batches"], cpu_us=res["cpu_us"], gpu_us=res["gpu_us"], probe_batch=64)
    speed = P.GpuSpeed(pol)
    g = GpuMlp(M.Mlp.random(seed=0))
    calls = []

    def forward(x: np.ndarray) -> np.ndarray:
        calls.append(len(x))
        return g.forward(x)

    time.sleep(0.2)  # the GPU left alone, as between idle probes
    us = speed.probe(forward)
    assert calls == [64] and us > 0 and speed.slowdown() > 0
    assert speed.fresh()[-1] == pytest.approx(us / pol.estimate("gpu", 64))
    assert speed.delay_us() == pytest.approx(us - pol.estimate("gpu", 64))
    speed.probe(forward)
    assert calls == [64, 64] and len(speed.samples) == 2 and speed.probes == 2
