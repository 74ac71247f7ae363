"""The hardened daemon with its GPU path on (pytest -m gpu): a ring cut short, a header rewritten
and a planted model, while batches run on the GPU, change nothing the producers see."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer import policy as P
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import server as S

pytestmark = pytest.mark.gpu


def test_gpu_batches_survive_truncation_rewrites_and_a_planted_model(tmp_path: Path) -> None:
    name = f"kinfer-gpu-hard-{uuid.uuid4().hex[:8]}"
    models = tmp_path / "models"
    models.mkdir(mode=0o700)
    a = M.Mlp.random(seed=1)
    planted = tmp_path / "planted.npz"
    M.Mlp.random(seed=666).save(planted)
    srv = S.RingServer.open(name, R.Geometry(16, 8), a, P.Policy(cpu_below=1), S.ServeOptions(use_gpu="on", native="off",
                        model_dirs=(str(models),)), recreate=True, log=lambda m: None)
    sampler, srv.gpu_load = srv.gpu_load, None  # another job on a shared GPU must not make this a CPU test
    try:
        assert srv.gpu_ready
        x = np.random.default_rng(5).integers(0, 10, (64, 31)).astype(np.float32)

        def ask() -> None:
            for i in range(64):
                srv.ring.state[i] = R.WRITING
                m = srv.ring.meta[i : i + 1]
                m["version"], m["model_id"], m["n_inputs"], m["seq"], m["producer_pid"] = R.ENTRY_VERSION, 0, 31, i, os.getpid()
                srv.ring.inputs[i, :31] = x[i]
                srv.ring.state[i] = R.READY
            srv.process(np.array(srv.ready_slots()))
            assert (srv.ring.meta["where"][:64] == R.GPU).all() and (srv.ring.meta["status"][:64] == R.OK).all()
            assert np.allclose(srv.ring.outputs[:64, :2], a.forward(x), rtol=1e-4, atol=1e-3)

        ask()
        os.truncate(srv.ring.path, 0)
        srv.ring.header["magic"] = 0  # faults, and the guard gives the file its length back
        srv.housekeeping()
        assert R.check_header(bytes(srv.ring.mm[: R.HEADER_SIZE]), srv.ring.size) is None and srv.repairs >= 1
        ask()
        h = srv.ring.header
        h["control_path"] = str(planted).encode()
        h["control_seq"] = int(h["control_seq"]) + 1
        srv.housekeeping()
        assert int(h["control_ack"]) == int(h["control_seq"]) and int(h["control_status"]) == R.CONTROL_NOT_ALLOWED
        ask()
    finally:
        if sampler is not None:
            sampler.stop()
        srv.close()
        R.ring_path(name).unlink(missing_ok=True)
