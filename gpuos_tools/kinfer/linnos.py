"""LinnOS on a block-I/O trace: the training set, training, and the hedging replay.

Training: every read of every device becomes one sample (its 31 inputs from that device's
history, or as the kernel computed them when the trace carries them, ``x``; its label slow/fast
by the trace-wide threshold). The first ``1 - holdout`` of the
reads in time train the model, the rest measure it.

Replay: each read is sent through the bridge (the daemon decides, as it would for a kernel).
A read predicted slow is sent to the replica instead (device ``(dev + 1) % devices``) and
costs what the replica's nearest read in time cost, plus ``reroute_us``. Three columns:
no prediction (every read on its device), LinnOS (the model's decisions, each read also
charged the measured inference time), oracle (exactly the reads that were slow rerouted, at no
inference cost). ``linnos_uncharged`` is the LinnOS column without the inference charge: what
the decisions alone are worth, whatever the machine's round trip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer.traces import device_reads


@dataclass
class Dataset:
    x: np.ndarray  # (n, 31) float32
    lat_us: np.ndarray
    t_us: np.ndarray
    dev: np.ndarray
    index: np.ndarray  # position of each read within its device's reads

    def labels(self, threshold_us: float) -> np.ndarray:
        return (self.lat_us > threshold_us).astype(np.int64)


def dataset(records: list[dict[str, Any]]) -> tuple[Dataset, dict[int, dict[str, np.ndarray]]]:
    per = device_reads(records)
    if not per:
        raise ValueError("the trace has no reads")
    parts = []
    for dev, d in sorted(per.items()):
        if "x" in d:  # the inputs the kernel computed at issue (an eBPF trace)
            x = d["x"]
        else:
            complete = d["t_us"] + d["lat_us"]
            x = M.features_from_reads(d["pending"], d["lat_us"], complete, d["t_us"])
        n = len(d["t_us"])
        parts.append((x, d["lat_us"], d["t_us"], np.full(n, dev), np.arange(n)))
    cat = [np.concatenate(p) for p in zip(*parts)]
    order = np.argsort(cat[2], kind="stable")
    return Dataset(*(c[order] for c in cat)), per


#: The feature-store schema LinnOS captures into: the 31 inputs, then the read's latency (the label).
FEATURE_FIELDS = [f"in{i}" for i in range(M.N_INPUTS)] + ["latency_us"]


def capture(records: list[dict[str, Any]], store: Any) -> int:
    """Record every read of a trace into a feature store (``FEATURE_FIELDS``), in issue order;
    return how many. This is LAKE's capture step: what a kernel hook would record per I/O."""
    if store.fields != FEATURE_FIELDS:
        raise ValueError(f"the store's schema is not LinnOS's ({len(store.fields)} fields; register one with FEATURE_FIELDS)")
    data, _ = dataset(records)
    for row in np.concatenate([data.x, data.lat_us[:, None].astype(np.float32)], axis=1):
        store.record(row)
    return len(data.lat_us)


def train_trace(
    records: list[dict[str, Any]],
    **kwargs: Any,
) -> tuple[M.Mlp, dict[str, Any]]:
    data, _ = dataset(records)
    return train_arrays(data.x, data.lat_us, **kwargs)


def train_arrays(
    x: np.ndarray,
    lat_us: np.ndarray,
    *,
    label: str = "inflection",
    percentile: float = 90.0,
    epochs: int = 20,
    holdout: float = 0.2,
    slow_weight: float = 5.0,
    seed: int = 0,
) -> tuple[M.Mlp, dict[str, Any]]:
    """Train on reads in time order: inputs ``x`` (n, 31) and latencies; the last ``holdout``
    of them measure the model."""
    if len(lat_us) == 0:
        raise ValueError("no reads to train on")
    thr = M.threshold(lat_us, label, percentile)
    y = (np.asarray(lat_us) > thr).astype(np.int64)
    cut = int(len(y) * (1 - holdout))
    if cut < 1:
        raise ValueError("too few reads to train on")
    model, losses = M.train(x[:cut], y[:cut], epochs=epochs, slow_weight=slow_weight, seed=seed)
    model.meta = {
        "name": "linnos", "threshold_us": thr, "label": label, "percentile": percentile if label == "percentile" else None,
        "slow_weight": slow_weight, "epochs": epochs, "train_reads": cut, "seed": seed,
    }
    report = {
        "type": "kinfer_train",
        "reads": int(len(y)),
        "train_reads": cut,
        "threshold_us": thr,
        "label": label,
        "slow_fraction": float(y.mean()),
        "loss": [round(v, 5) for v in losses],
        "train": M.evaluate(model, x[:cut], y[:cut]),
        "holdout": M.evaluate(model, x[cut:], y[cut:]) if cut < len(y) else None,
    }
    return model, report


def replay(
    records: list[dict[str, Any]],
    decide: Callable[[np.ndarray], np.ndarray],
    threshold_us: float,
    *,
    inference_us: float = 0.0,
    reroute_us: float = 0.0,
    replica: str = "next",
) -> dict[str, Any]:
    """Replay the reads of ``records`` with hedging; ``decide(x)`` gives 1 (slow) per row.

    ``replica``: ``next``, the next device of the trace serves a rerouted read (its read
    nearest in time); ``shifted``, for a trace of one disk, a replica modelled as an identical
    disk independent of this one: its read nearest to half the trace's span later (wrapping
    around). Shifted is a model, not a measurement; say so wherever its figures go.
    """
    data, per = dataset(records)
    devices = sorted(per)
    if replica not in ("next", "shifted"):
        raise ValueError(f"unknown replica {replica!r} (next or shifted)")
    if replica == "next" and len(devices) < 2:
        raise ValueError("hedging needs reads on at least two devices (the trace has one; --replica shifted models a second)")
    pred = np.asarray(decide(data.x)).astype(np.int64)
    truth = data.labels(threshold_us)
    replica_lat = np.empty_like(data.lat_us)
    for k, dev in enumerate(devices):
        mine = data.dev == dev
        if replica == "next":
            other = per[devices[(k + 1) % len(devices)]]
            when = data.t_us[mine]
        else:
            other = per[dev]
            t0, span = float(other["t_us"][0]), float(other["t_us"][-1] - other["t_us"][0]) or 1.0
            when = t0 + (data.t_us[mine] - t0 + span / 2) % span
        pos = np.clip(np.searchsorted(other["t_us"], when), 0, len(other["t_us"]) - 1)
        replica_lat[mine] = other["lat_us"][pos]
    base = data.lat_us
    linnos = np.where(pred == M.SLOW, replica_lat + reroute_us, base) + inference_us
    oracle = np.where(truth == M.SLOW, replica_lat + reroute_us, base)
    slow = truth == M.SLOW
    return {
        "type": "kinfer_replay",
        "reads": int(len(base)),
        "devices": len(devices),
        "threshold_us": threshold_us,
        "slow_fraction": float(slow.mean()),
        "inference_us": inference_us,
        "reroute_us": reroute_us,
        "replica": replica,
        "rerouted": float(pred.mean()),
        "accuracy": float(np.mean(pred == truth)),
        "always_fast_accuracy": float(np.mean(truth == M.FAST)),
        "false_fast": float(np.mean(pred[slow] == M.FAST)) if slow.any() else 0.0,
        "false_slow": float(np.mean(pred[~slow] == M.SLOW)) if (~slow).any() else 0.0,
        "none": M.summary(base),
        "linnos": M.summary(linnos),
        "linnos_uncharged": M.summary(linnos - inference_us),  # the decisions alone, inference free
        "oracle": M.summary(oracle),
    }
