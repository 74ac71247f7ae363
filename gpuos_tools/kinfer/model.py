"""Models the bridge serves: a two-layer perceptron (LinnOS's 31→256→2), its file format, and the
LinnOS feature encoding, labels and training.

A model file is a numpy ``.npz`` with ``w1`` (inputs×hidden), ``b1``, ``w2`` (hidden×outputs),
``b2`` (float32) and ``meta`` (a JSON string: name, threshold_us, how it was labelled). It is
written atomically (temp file + rename) so a daemon reloading it never sees half a file.

LinnOS encoding (31 inputs, one decimal digit each, most significant first): the pending I/Os
(in 4 KiB units) when the read is issued (3 digits), the pending I/Os when each of the last 4
completed reads was issued (4×3 digits) and those 4 reads' latencies in µs (4×4 digits).
Values above 999 and 9999 are clamped.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuos_tools.stream import atomic

N_INPUTS = 31
HIDDEN = 256
N_OUTPUTS = 2
HISTORY = 4
FAST, SLOW = 0, 1
#: Largest sum of a model file's arrays, unpacked (a small archive could unpack to gigabytes).
MAX_UNPACKED = 1 << 30


@dataclass
class Mlp:
    """inputs → hidden (ReLU) → outputs, float32; ``forward`` is the CPU path of the daemon."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.w1 = np.ascontiguousarray(self.w1, dtype=np.float32)
        self.b1 = np.ascontiguousarray(self.b1, dtype=np.float32).ravel()
        self.w2 = np.ascontiguousarray(self.w2, dtype=np.float32)
        self.b2 = np.ascontiguousarray(self.b2, dtype=np.float32).ravel()
        nh = self.w1.shape[1]
        if self.b1.shape != (nh,) or self.w2.shape[0] != nh or self.b2.shape != (self.w2.shape[1],):
            raise ValueError(f"inconsistent layer shapes {self.w1.shape} {self.b1.shape} {self.w2.shape} {self.b2.shape}")

    @property
    def n_inputs(self) -> int:
        return int(self.w1.shape[0])

    @property
    def n_outputs(self) -> int:
        return int(self.w2.shape[1])

    @classmethod
    def random(cls, n_inputs: int = N_INPUTS, hidden: int = HIDDEN, n_outputs: int = N_OUTPUTS, seed: int = 0) -> Mlp:
        """He-initialised weights (the start of training, and a stand-in model for benchmarks)."""
        rng = np.random.default_rng(seed)
        return cls(
            rng.normal(0, np.sqrt(2 / n_inputs), (n_inputs, hidden)),
            np.zeros(hidden),
            rng.normal(0, np.sqrt(2 / hidden), (hidden, n_outputs)),
            np.zeros(n_outputs),
            {"name": "random", "seed": seed},
        )

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = x @ self.w1
        h += self.b1
        np.maximum(h, 0, out=h)
        y = h @ self.w2
        y += self.b2
        return y

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(self.forward(np.asarray(x, dtype=np.float32)), axis=1)

    def save(self, path: str | os.PathLike[str]) -> None:
        buf = io.BytesIO()
        np.savez(buf, w1=self.w1, b1=self.b1, w2=self.w2, b2=self.b2, meta=np.array(json.dumps(self.meta)))
        atomic.replace(os.fspath(path), buf.getvalue(), fsync=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Mlp:
        """Read a model file; ValueError names what is wrong with a bad one."""
        return cls._read(path, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Mlp:
        """A model from a file's bytes (read by the caller, who checked the file); ``name`` for messages."""
        return cls._read(io.BytesIO(data), name)

    @classmethod
    def _read(cls, source: Any, name: str) -> Mlp:
        try:
            with np.load(source, allow_pickle=False) as z:
                missing = {"w1", "b1", "w2", "b2"} - set(z.files)
                if missing:
                    raise ValueError(f"{name}: not a model file (missing {', '.join(sorted(missing))})")
                unpacked = sum(info.file_size for info in z.zip.infolist())
                if unpacked > MAX_UNPACKED:
                    raise ValueError(f"{name}: its arrays unpack to {unpacked} bytes, more than a model may ({MAX_UNPACKED})")
                meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
                if not isinstance(meta, dict):
                    raise ValueError(f"{name}: not a model file (meta is not a JSON object)")
                model = cls(z["w1"], z["b1"], z["w2"], z["b2"], meta)
        except (OSError, EOFError) as e:
            raise ValueError(f"{name}: cannot read model: {e}") from e
        except Exception as e:  # zipfile.BadZipFile, pickle refusal, bad JSON, bad shapes...
            if isinstance(e, ValueError) and str(e).startswith(name):
                raise
            raise ValueError(f"{name}: not a model file ({type(e).__name__}: {e})") from e
        if model.w1.ndim != 2 or model.w2.ndim != 2 or min(model.w1.shape + model.w2.shape) < 1:
            raise ValueError(f"{name}: not a model file (layers of shape {model.w1.shape} and {model.w2.shape})")
        if not all(np.isfinite(a).all() for a in (model.w1, model.b1, model.w2, model.b2)):
            raise ValueError(f"{name}: weights contain NaN or infinity")
        return model


# -- LinnOS features --------------------------------------------------------------------------


def digits(values: np.ndarray, width: int) -> np.ndarray:
    """Each value clamped to [0, 10**width - 1] as ``width`` decimal digits, most significant first."""
    v = np.clip(np.asarray(values, dtype=np.int64), 0, 10**width - 1)
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((v[..., None] // powers) % 10).astype(np.float32)


def encode(pending_now: np.ndarray, hist_pending: np.ndarray, hist_latency_us: np.ndarray) -> np.ndarray:
    """LinnOS inputs for n reads: pending_now (n,), hist_pending (n, 4), hist_latency_us (n, 4)."""
    pending_now = np.asarray(pending_now)
    n = pending_now.shape[0]
    return np.concatenate(
        [
            digits(pending_now, 3).reshape(n, 3),
            digits(hist_pending, 3).reshape(n, 3 * HISTORY),
            digits(hist_latency_us, 4).reshape(n, 4 * HISTORY),
        ],
        axis=1,
    )


def features_from_reads(pending: np.ndarray, latency_us: np.ndarray, complete_us: np.ndarray, issue_us: np.ndarray) -> np.ndarray:
    """The 31 inputs of every read of one device, in issue order.

    The history of a read is the last 4 reads *completed* before it was issued (what a kernel
    sees at issue time), not the last 4 issued: a read still in flight has no latency yet.
    Missing history (the first reads) counts as zero.
    """
    n = len(issue_us)
    order = np.argsort(complete_us, kind="stable")
    done_at = complete_us[order]
    # for read i: how many reads had completed strictly before its issue
    k = np.searchsorted(done_at, issue_us, side="left")
    hist_p = np.zeros((n, HISTORY), dtype=np.int64)
    hist_l = np.zeros((n, HISTORY), dtype=np.int64)
    for j in range(HISTORY):
        idx = k - 1 - j
        ok = idx >= 0
        src = order[np.where(ok, idx, 0)]
        hist_p[:, j] = np.where(ok, pending[src], 0)
        hist_l[:, j] = np.where(ok, np.rint(latency_us[src]), 0)
    return encode(pending, hist_p, hist_l)


# -- labels -----------------------------------------------------------------------------------


def inflection_threshold(latency_us: np.ndarray) -> float:
    """The knee of the latency CDF: the latency farthest below the chord from the 50th to the
    99.9th percentile of the (percentile, latency) curve, both axes scaled to [0, 1].

    Below the knee latencies grow slowly with the percentile, above it they shoot up: the
    reads past it are the "slow" ones LinnOS wants to avoid.
    """
    lat = np.sort(np.asarray(latency_us, dtype=np.float64))
    if lat.size < 10 or lat[-1] == lat[0]:
        return float(lat[-1]) if lat.size else 0.0
    p = np.linspace(0.5, 0.999, 500)
    q = np.quantile(lat, p)
    y = (q - q[0]) / max(q[-1] - q[0], 1e-12)
    x = (p - p[0]) / (p[-1] - p[0])
    return float(q[int(np.argmax(x - y))])


def threshold(latency_us: np.ndarray, how: str = "inflection", percentile: float = 90.0) -> float:
    if how == "percentile":
        return float(np.percentile(latency_us, percentile))
    if how == "inflection":
        return inflection_threshold(latency_us)
    raise ValueError(f"unknown labelling {how!r} (percentile or inflection)")


# -- training ---------------------------------------------------------------------------------


@dataclass
class TrainReport:
    epochs: int
    samples: int
    slow_fraction: float
    threshold_us: float
    loss: list[float]
    accuracy: float
    false_fast: float  # slow reads predicted fast (the costly mistake), fraction of slow reads
    false_slow: float  # fast reads predicted slow, fraction of fast reads


def weighted_hinge(scores: np.ndarray, y: np.ndarray, slow_weight: float) -> tuple[float, np.ndarray]:
    """Hinge loss on the margin between the true class's score and the other's, each sample
    weighted ``slow_weight`` when it is slow (so predicting a slow read fast costs that much
    more). Returns (mean loss, gradient with respect to the scores)."""
    n = scores.shape[0]
    rows = np.arange(n)
    margin = scores[rows, y] - scores[rows, 1 - y]
    w = np.where(y == SLOW, slow_weight, 1.0).astype(np.float32)
    active = margin < 1.0
    loss = float(np.sum(w * np.maximum(0.0, 1.0 - margin)) / n)
    g = np.zeros_like(scores)
    coef = (w * active) / n
    g[rows, y] = -coef
    g[rows, 1 - y] = coef
    return loss, g


def train(
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int = 20,
    batch: int = 256,
    lr: float = 1e-3,
    slow_weight: float = 5.0,
    hidden: int = HIDDEN,
    seed: int = 0,
    init: Mlp | None = None,
) -> tuple[Mlp, list[float]]:
    """Mini-batch Adam on ``weighted_hinge``; returns the model and the mean loss of each epoch."""
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.int64)
    model = init or Mlp.random(x.shape[1], hidden, N_OUTPUTS, seed)
    params = [model.w1, model.b1, model.w2, model.b2]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    b1_, b2_, eps = 0.9, 0.999, 1e-8
    rng = np.random.default_rng(seed)
    step = 0
    losses = []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        total = 0.0
        for start in range(0, len(x), batch):
            idx = order[start : start + batch]
            xb, yb = x[idx], y[idx]
            pre = xb @ model.w1 + model.b1
            h = np.maximum(pre, 0)
            scores = h @ model.w2 + model.b2
            loss, gs = weighted_hinge(scores, yb, slow_weight)
            total += loss * len(idx)
            gh = (gs @ model.w2.T) * (pre > 0)
            grads = [xb.T @ gh, gh.sum(0), h.T @ gs, gs.sum(0)]
            step += 1
            for p, g, mi, vi in zip(params, grads, m, v):
                mi *= b1_
                mi += (1 - b1_) * g
                vi *= b2_
                vi += (1 - b2_) * g * g
                p -= lr * (mi / (1 - b1_**step)) / (np.sqrt(vi / (1 - b2_**step)) + eps)
        losses.append(total / len(x))
    return model, losses


def evaluate(model: Mlp, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    pred = model.predict(x)
    slow = y == SLOW
    return {
        "accuracy": float(np.mean(pred == y)) if len(y) else 0.0,
        "false_fast": float(np.mean(pred[slow] == FAST)) if slow.any() else 0.0,
        "false_slow": float(np.mean(pred[~slow] == SLOW)) if (~slow).any() else 0.0,
    }


def summary(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """avg, p50, p99, p99.9 and max of latencies."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {
        "n": int(a.size),
        "avg": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "p99.9": float(np.percentile(a, 99.9)),
        "max": float(a.max()),
    }
