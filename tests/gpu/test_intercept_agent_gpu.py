"""The agent on driver-API interception on a real GPU (pytest -m gpu): `gpu-trace run --agent
--mechanism intercept` sees the same kernel launches as the agent on CUPTI callbacks (by name and
count; where they differ, which driver call CUPTI saw launch what was missed) in a CuPy job, a
PyTorch training job, a ResNet-18 trained on cuDNN, a torch.compile'd model (Triton kernels), bf16
and fp16 matmuls with bias and GELU epilogues (cuBLASLt), and CuPy's cuFFT, cuSOLVER, cuSPARSE and
cuRAND calls; each ends bit-identical to its untraced run and loads no CUPTI; the agent's
snapshots of a job on interception equal a stop-the-world twin's; the driver's checkpoint (`gpu-ckpt --pid`, `gpu-restore --pid`) takes a job under the interposer agent
and the job ends bit-identical, while under the CUPTI agent it is refused and told why; and a
suspended job on interception moves to another GPU (`gpu-restore --agent PID --resume --device
1`, skipped on one GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from gpu_jobs import TORCH_MLP

from test_suspend_gpu import Job, plain  # noqa: F401 -- the stopped job and its untraced twin

from gpuos_tools.injection import intercept
from gpuos_tools.stream import open_input
from workloads.snapshot_trials import trials

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
NOT_CHECKPOINTABLE = 84

CUPY_PROG = """
import hashlib, json, sys
import cupy as cp
x = cp.arange(1 << 20, dtype=cp.float32) / (1 << 20)
for i in range(int(sys.argv[1])):
    x = cp.sin(x) * cp.float32(1.0001) + cp.float32(i % 7) / 100
    total = x.sum()
a = x[: 512 * 512].reshape(512, 512)
b = a @ a.T
h = hashlib.sha256(x.get().tobytes() + b.get().tobytes() + total.get().tobytes()).hexdigest()
print(json.dumps({"digest": h, "cupti": "libcupti" in open("/proc/self/maps").read()}))
"""

# cuDNN: a ResNet-18 with random weights (torchvision's, else timm's, else a small conv net) trained
# in fp32 with cuDNN on, deterministic and not benchmarking, so that every run picks the same
# algorithms (global pooling is a mean; max pooling's backward gathers)
CUDNN_PROG = """
import hashlib, json, os, sys
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
from torch import nn
assert torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled, "cuDNN is off"
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
torch.manual_seed(0)
try:
    import torchvision
    model, which = torchvision.models.resnet18(weights=None, num_classes=10), "torchvision resnet18"
except Exception:  # not there, or built for another torch (its import raises then)
    try:
        import timm
        model, which = timm.create_model("resnet18", pretrained=False, num_classes=10), "timm resnet18"
    except Exception:
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                layers, cin = [], 3
                for cout in (32, 64, 128):
                    layers += [nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
                    cin = cout
                self.body, self.head = nn.Sequential(*layers), nn.Linear(cin, 10)
            def forward(self, x):
                return self.head(self.body(x).mean(dim=(2, 3)))
        model, which = Net(), "small conv net"
model = model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
gen = torch.Generator().manual_seed(1)
x = torch.randn(16, 3, 64, 64, generator=gen).cuda(); y = torch.randint(0, 10, (16,), generator=gen).cuda()
for _ in range(int(sys.argv[1])):
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
h = hashlib.sha256()
for t in [*model.parameters(), *model.buffers()]:
    h.update(t.detach().float().cpu().numpy().tobytes())
print(json.dumps({"digest": h.hexdigest(), "cupti": "libcupti" in open("/proc/self/maps").read(), "model": which,
                  "cudnn": torch.backends.cudnn.version()}))
"""

# Triton: torch.compile (Inductor, default mode: no CUDA graphs) of a small MLP with a layer norm
# and GELU, trained; the matmuls stay cuBLAS's, the rest is Triton kernels Inductor generated.
# Nothing is benchmarked (a benchmark's launches depend on timing): deterministic algorithms make
# Inductor pick its configurations without timing them (pointwise ones too). The test also gives
# every run one cache directory, so that the traced runs load what the untraced one compiled.
TRITON_PROG = """
import hashlib, json, os, sys
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
import torch._inductor.config as inductor
inductor.compile_threads = 1  # no compile workers: in-process, the same every run
torch.use_deterministic_algorithms(True, warn_only=True)
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)
    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))) * torch.sigmoid(x[:, :1]))
model = Net().cuda()
compiled = torch.compile(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
gen = torch.Generator().manual_seed(1)
x = torch.randn(128, 256, generator=gen).cuda(); y = torch.randint(0, 10, (128,), generator=gen).cuda()
for _ in range(int(sys.argv[1])):
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(compiled(x), y).backward()
    opt.step()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().float().cpu().numpy().tobytes())
print(json.dumps({"digest": h.hexdigest(), "cupti": "libcupti" in open("/proc/self/maps").read()}))
"""

# cuBLASLt: bf16 linear layers with a bias (addmm with a 1-D bias goes to cuBLASLt's bias
# epilogue) trained by hand, and an fp16 torch._addmm_activation (the GELU epilogue) each step
CUBLASLT_PROG = """
import hashlib, json, os, sys
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
import torch.nn.functional as F
torch.manual_seed(0)
bf = dict(device="cuda", dtype=torch.bfloat16)
w1 = (torch.randn(1024, 512, **bf) / 32).requires_grad_(); b1 = torch.zeros(1024, **bf).requires_grad_()
w2 = (torch.randn(16, 1024, **bf) / 32).requires_grad_(); b2 = torch.zeros(16, **bf).requires_grad_()
x = torch.randn(256, 512, **bf); y = torch.randint(0, 16, (256,), device="cuda")
a = torch.randn(128, 256, device="cuda", dtype=torch.half); b = torch.randn(256, 384, device="cuda", dtype=torch.half)
bias = torch.randn(384, device="cuda", dtype=torch.half); acc = torch.zeros(128, 384, device="cuda", dtype=torch.half)
for _ in range(int(sys.argv[1])):
    F.cross_entropy(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2).float(), y).backward()
    with torch.no_grad():
        for p in (w1, b1, w2, b2):
            p -= 0.01 * p.grad
            p.grad = None
        acc += torch._addmm_activation(bias, a, b, use_gelu=True) / 64
h = hashlib.sha256()
for t in (w1, b1, w2, b2, acc):
    h.update(t.detach().float().cpu().numpy().tobytes())
print(json.dumps({"digest": h.hexdigest(), "cupti": "libcupti" in open("/proc/self/maps").read()}))
"""

# cuFFT, cuSOLVER, cuSPARSE (and cuRAND) through CuPy; the sparse matrices hold small integers, so
# their sums are exact whatever order a library adds in
CUPY_LIBS_PROG = """
import hashlib, json, sys
import cupy as cp
import cupyx.scipy.sparse as sparse
rs = cp.random.RandomState(0)
a = rs.standard_normal((256, 256), dtype=cp.float64)
spd = a @ a.T + 256 * cp.eye(256)
d = (rs.randint(0, 4, (1024, 1024)) * (rs.random_sample((1024, 1024)) < 0.01)).astype(cp.float32)
m = sparse.csr_matrix(d)
v = rs.randint(-3, 4, 1024).astype(cp.float32)
out = []
for i in range(int(sys.argv[1])):
    out.append(cp.fft.fft2(a + i))
    out.append(cp.fft.irfft(cp.fft.rfft(a * (i + 1), axis=1), n=256, axis=1))
    out.append(cp.linalg.solve(spd, a[:, i]))
    out.append(cp.linalg.eigh(spd + i)[0])
    out.append(cp.linalg.qr(a + i)[1])
    out.append(cp.linalg.svd(a + i, compute_uv=False))
    out.append(m @ (v + i))
    mm = (m @ m).tocsr()
    mm.sort_indices()
    out += [mm.data, mm.indices, mm.indptr, m.T.tocsr().data]
h = hashlib.sha256()
for t in out:
    h.update(cp.ascontiguousarray(t).get().tobytes())
print(json.dumps({"digest": h.hexdigest(), "cupti": "libcupti" in open("/proc/self/maps").read()}))
"""

#: name: (source, steps, modules it needs, what CUPTI's launches must show it exercised)
PROGRAMS = {
    "cupy": (CUPY_PROG, 40, ("cupy",), None),
    "torch": (TORCH_MLP, 30, ("torch",), None),
    "cudnn": (CUDNN_PROG, 4, ("torch",), None),
    "triton": (TRITON_PROG, 6, ("torch", "triton"), "triton_"),
    "cublaslt": (CUBLASLT_PROG, 10, ("torch",), None),
    "cupy_libs": (CUPY_LIBS_PROG, 3, ("cupy",), None),
}


def env_for(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **extra)
    for k in ("GPUOS_AGENT_OWN", "GPUOS_AGENT_MECHANISM", "GPUOS_AGENT_BACKEND", "LD_PRELOAD", "GPUOS_INTERCEPT_OUT"):
        if k not in extra:
            env.pop(k, None)
    return env


def records(path: Path) -> list[dict]:
    with open_input(str(path)) as r:
        return list(r)


def kernels(recs: list[dict]) -> Counter:
    return Counter(r["kernel"] for r in recs if r["type"] == "launch" and not r.get("captured"))


def missed_launches(mine: list[dict], theirs: list[dict]) -> dict:
    """Where the interposer's records (``mine``) differ from CUPTI's (``theirs``): per kernel
    whose count differs, both counts and the driver calls CUPTI saw launch it (cuLaunchKernelEx,
    a per-thread-stream variant...); the same for kernels captured into graphs; graph launches
    by driver call; the totals. Empty when they agree. Launches CUPTI gave no name are only
    counted: the interposer may name them (cuFuncGetName), so they are held against its
    kernels CUPTI does not know through the totals."""
    def per_kernel(recs: list[dict], captured: bool) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for r in recs:
            if r["type"] == "launch" and bool(r.get("captured")) == captured:
                out.setdefault(r.get("kernel") or "", Counter())[r.get("api") or "?"] += 1
        return out

    diff: dict = {}
    for captured in (False, True):
        a, b = per_kernel(mine, captured), per_kernel(theirs, captured)
        for k in sorted(set(a) | set(b)):
            n, m = sum(a.get(k, Counter()).values()), sum(b.get(k, Counter()).values())
            if not k or (not m and "" in b):  # CUPTI's unnamed launches: only in the totals
                continue
            if n != m:
                diff.setdefault("captured" if captured else "launched", {})[k or "(no name)"] = {
                    "intercept": n, "cupti": m, "cupti_calls": dict(b.get(k, {})),
                    "intercept_calls": dict(a.get(k, {}))}
    graphs = [Counter(r.get("api") for r in recs if r["type"] == "graph_launch") for recs in (mine, theirs)]
    if graphs[0] != graphs[1]:
        diff["graph_launch"] = {"intercept": dict(graphs[0]), "cupti": dict(graphs[1])}
    totals = [sum(1 for r in recs if r["type"] == "launch") for recs in (mine, theirs)]
    if totals[0] != totals[1]:
        diff["launches"] = {"intercept": totals[0], "cupti": totals[1]}
    return diff


def interposer_counts(tmp: Path, pid: int) -> dict | None:
    """The interposer's own count file of the traced process (GPUOS_INTERCEPT_OUT): its launches
    by route (direct, dlsym, cuGetProcAddress) and the entry points it was asked for but does not wrap."""
    path = tmp / f"counts-{pid}.json"
    if not path.exists():
        return None
    c = intercept.read_counts(path)
    return {"launches_by_route": c.by_route(), "calls": {n: c.total(n) for n in c.calls},
            "getproc": {k: v for k, v in c.getproc.items() if k != "requested"},
            "slots_full": c.raw.get("slots_full"), "kernels_dropped": c.raw.get("kernels_dropped")}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_interception_sees_the_launches_cupti_sees_and_the_job_ends_bit_identical(tmp_path, name):
    source, steps, modules, marker = PROGRAMS[name]
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    prog = tmp_path / "prog.py"
    prog.write_text(source)
    extra = {}
    if name == "triton":  # one cache for every run: the untraced run compiles, the traced ones load it
        extra = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                 "TORCHINDUCTOR_DETERMINISTIC": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    untraced = subprocess.run([sys.executable, str(prog), str(steps)], capture_output=True, text=True, timeout=300,
                              env=env_for(**extra))
    assert untraced.returncode == 0, untraced.stderr[-4000:]
    want = json.loads(untraced.stdout.splitlines()[-1])
    runs = {}
    for mechanism in ("cupti", "intercept"):
        trace = tmp_path / f"{mechanism}.ndjson"
        counts = {"GPUOS_INTERCEPT_OUT": str(tmp_path / "counts-%p.json")} if mechanism == "intercept" else {}
        run = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--mechanism",
                              mechanism, "--no-images", "-o", str(trace), "--", sys.executable, str(prog), str(steps)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300, env=env_for(**extra, **counts))
        assert run.returncode == 0, f"{mechanism}: {run.stderr[-4000:]}"
        runs[mechanism] = (json.loads(run.stdout.splitlines()[-1]), records(trace))
    got, recs = runs["intercept"]
    header = recs[0]
    mine, theirs = kernels(recs), kernels(runs["cupti"][1])
    routes = interposer_counts(tmp_path, header["pid"])
    print(json.dumps({"program": name, "untraced": want, "launches": sum(theirs.values()), "kernels": len(theirs),
                      "cupti_calls": Counter(r.get("api") for r in runs["cupti"][1] if r["type"] == "launch"),
                      "interposer": routes}))
    assert got["digest"] == want["digest"]  # bit-identical to the untraced run
    assert runs["cupti"][0]["digest"] == want["digest"]
    # interception adds no CUPTI: the program maps it only if it loads it itself (PyTorch's profiler does)
    assert got["cupti"] == want["cupti"] and runs["cupti"][0]["cupti"] is True
    assert header["mechanism"] == "intercept" and header["backend"] == "native-agent" and header["cupti"] is None
    assert not [r for r in recs if r["type"] == "error"], [r for r in recs if r["type"] == "error"][:5]
    assert sum(theirs.values()) > steps
    if marker:  # the program did go through the path it is here for
        assert any(k.startswith(marker) for k in theirs), sorted(theirs)[:20]
    # every launch CUPTI recorded, by name and count, and which driver call launched what was missed
    diff = missed_launches(recs, runs["cupti"][1])
    assert not diff, json.dumps({"differences": diff, "interposer": routes})[-6000:]
    assert sum(mine.values()) == sum(theirs.values())
    launches = [r for r in recs if r["type"] == "launch"]
    unknown = sum(1 for r in launches if r["layout"] == "none")
    assert unknown <= sum(1 for r in runs["cupti"][1] if r["type"] == "launch" and r["layout"] == "none")
    core = recs[-1]["tracer"]["core"]
    assert core["ops"] >= len(launches)


def test_agent_snapshots_on_interception_equal_the_twins(tmp_path):
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("needs cupy")
    compared, bad = trials(tmp_path, 17, snapshots=15, env_extra={"GPUOS_AGENT_MECHANISM": "intercept"})
    assert compared > 0 and not bad, bad
    assert records(tmp_path / "a17.ndjson.zst")[0]["mechanism"] == "intercept"


def test_the_driver_checkpoints_a_job_under_the_interposer_agent(tmp_path, plain):  # noqa: F811
    job = Job(tmp_path, own=False, mechanism="intercept")
    try:
        ck = job.cli("ckpt", "--pid", str(job.pid))
        rs = job.cli("restore", "--pid", str(job.pid))
    finally:
        report = job.finish()
    assert ck.returncode == 0, ck.stderr
    assert rs.returncode == 0, rs.stderr
    print(json.dumps({"checkpoint": ck.stdout[-2000:], "restore": rs.stdout[-2000:]}))
    assert report["digests"] == plain["digests"]  # ended as the untraced run, bit for bit


def test_the_driver_refuses_a_job_under_the_cupti_agent_and_says_why(tmp_path, plain):  # noqa: F811
    if importlib.util.find_spec("cupti") is None:
        pytest.skip("needs cupti-python")
    job = Job(tmp_path, own=False, mechanism="cupti")
    try:
        ck = job.cli("ckpt", "--pid", str(job.pid))
    finally:
        report = job.finish()
    assert ck.returncode == NOT_CHECKPOINTABLE and "CUPTI loaded" in ck.stderr, ck.stderr
    assert report["digests"] == plain["digests"]  # left running, untouched


def gpu_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except OSError:
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def test_a_suspended_job_on_interception_moves_to_another_gpu(tmp_path, plain):  # noqa: F811
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    job = Job(tmp_path, own=True, mechanism="intercept")
    try:
        s = job.cli("ckpt", "--agent", str(job.pid), "--suspend", "--partial")
        r = job.cli("restore", "--agent", str(job.pid), "--resume", "--device", "1") if s.returncode == 0 else None
    finally:
        report = job.finish()
    assert s.returncode == 0, s.stderr
    assert r is not None and r.returncode == 0, r.stderr if r else None
    kinds = [json.loads(line)["type"] for line in r.stdout.splitlines() if line.strip()]
    assert "agent_resume" in kinds, kinds
    assert report["scratch_ok"] and report["digests"] == plain["digests"]
