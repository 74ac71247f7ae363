"""``gpu-kinfer-bridge calibrate``: CPU and GPU latency of the profile's model against batch size,
and the profile updated with them (the policy then picks by these numbers)."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import numpy as np

from gpuos_tools.kinfer.gpu import GpuMlp
from gpuos_tools.kinfer.model import Mlp
from gpuos_tools.kinfer.policy import DEFAULTS, Profile, crossover, steady_curve

PROFILE_COMMENT = (
    "gpu-kinfer-bridge profile (see gpu-kinfer-bridge(1), PROFILE).\n"
    "[calibration] and policy.cpu_below are written by `gpu-kinfer-bridge calibrate`, which\n"
    "rewrites this whole file: comments added by hand are not kept."
)


def _inputs(batch: int, n_inputs: int, seed: int = 0) -> np.ndarray:
    """Digits, as LinnOS inputs are (never time on zeros)."""
    return np.random.default_rng(seed).integers(0, 10, (batch, n_inputs)).astype(np.float32)


def measure(profile: Profile, batches: list[int], reps: int, device: int = 0) -> dict[str, Any]:
    """Latency (µs) per batch on the CPU and, when it can run, the GPU (``steady_curve``: the
    lowest median of three warmed-up sweeps)."""
    shape = profile.section("model")
    model = Mlp.random(int(shape["inputs"]), int(shape["hidden"]), int(shape["outputs"]))
    cpu = steady_curve(lambda b: (lambda x=_inputs(b, model.n_inputs): model.forward(x)), batches, reps)
    gpu_us: list[float] = []
    gpu_name = None
    error = None
    mode = None
    try:
        g = GpuMlp(model, device)
        mode = g.mode
        gpu_name = g.cp.cuda.runtime.getDeviceProperties(device)["name"].decode()
        gpu_us = steady_curve(lambda b: (lambda x=_inputs(b, model.n_inputs): g.forward(x)), batches, reps, warmup=10)
    except Exception as e:  # ImportError (no CuPy), CUDA errors: the CPU curve still stands
        error = f"{type(e).__name__}: {e}"
    return {
        "batches": batches,
        "cpu_us": cpu,
        "gpu_us": gpu_us,
        "crossover": crossover(batches, cpu, gpu_us) if gpu_us else None,
        "gpu": gpu_name,
        "gpu_mode": mode,
        "gpu_error": error,
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "reps": reps,
    }


def updated_profile(profile: Profile, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The profile's tables with [calibration] replaced and policy.cpu_below set to the crossover
    (one past the largest batch when the GPU never wins)."""
    data = {table: profile.section(table) for table in DEFAULTS}
    for table, keys in profile.data.items():
        if table not in data and table != "calibration":
            data[table] = dict(keys)
    cross = result["crossover"]
    data["policy"]["cpu_below"] = int(cross if cross is not None else result["batches"][-1] + 1)
    data["calibration"] = {
        "batches": result["batches"], "cpu_us": result["cpu_us"], "gpu_us": result["gpu_us"],
        "crossover": int(cross) if cross is not None else -1,
        "host": result["host"], "gpu": result["gpu"] or "", "date": result["date"],
    }
    return data
