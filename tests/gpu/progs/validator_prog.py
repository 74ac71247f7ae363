"""Programs for `gpu-trace run --validate --validate-in validator` (tests/gpu/test_validator_gpu.py).

``validator_prog.py MODE``; every mode writes {"digest": {name: sha256 of a result}, "bufs": {...}}
to $GPUOS_TEST_REPORT, so that a plain run and a validated one can be compared byte for byte.

- kernels: CuPy raw kernels whose true accesses are known: copy (a right prediction), follow_write
  (through a pointer table copied from the host: followed), hidden_read and hidden_write (through a
  pointer the program stored on the GPU into a table: no prediction sees them; the target is a big
  buffer of its own, far from what the prediction names), oob_read (reads past the end of the array
  it is given, inside the same allocation); copy again, and twice, on 16 MiB arrays (a buffer
  only read, in granules of its own: the validator maps it read-only if the driver lets it; C++
  kernels, as the prediction reads const-ness from the mangled name).
  ``table`` holds a device address, which may differ from one run to the next: it is reported as
  whether it points at ``far`` (whose contents are digested), not digested itself;
- solve: cuSOLVER (getrf/getrs through cupy.linalg.solve, potrf through cholesky) and cuBLAS trsm;
- fft: cuFFT, complex 1-D and real 2-D;
- torch: PyTorch kernels with device-side asserts on their indices (EmbeddingBag, index_select,
  gather) and scatter_add (on integers held in floats, so that atomics add exactly);
- sparse: cuSPARSE through CuPy (CSR SpMV, SpMM, a transpose, a column sum), on small integers
  held in floats (the column sum adds with atomics);
- compiled: a torch.compile'd MLP's forward and backward (Triton kernels);
- timm: one SGD step of a timm ResNet-18 with random weights (cuDNN deterministic);
- gemm: cuBLAS GEMMs of 2048 x 2048 in half and single precision (Hopper kernels launched with a
  cluster shape);
- inplace: CuPy raw kernels that overwrite an operand: scale (x *= 2, reading what it overwrites),
  overwrite (x = y, reading none of x), partial (every other word of x, reading none of x); and
  PyTorch's a.add_(b) (a read and written in place).
"""

import hashlib
import json
import os
import sys


def digest(a) -> str:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    elif hasattr(a, "get"):
        a = a.get()
    return hashlib.sha256(a.tobytes()).hexdigest()


def kernels():
    import cupy as cp

    src = r"""
    extern "C" __global__ void set_table(unsigned long long* table, unsigned long long p) { table[0] = p; }
    extern "C" __global__ void hidden_read(const unsigned long long* table, float* out, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) out[i] = ((const float*)table[0])[i] + 1.0f;
    }
    extern "C" __global__ void hidden_write(const unsigned long long* table, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) ((float*)table[0])[i] = 2.0f * i;
    }
    extern "C" __global__ void follow_write(const unsigned long long* table, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) ((float*)table[0])[i] = 3.0f * i;
    }
    extern "C" __global__ void oob_read(const float* x, float* out, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) out[i] = x[i + n];
    }
    template <typename T> __global__ void twice(const T* x, T* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] + x[i];
    }
    template <typename T> __global__ void copy(const T* x, T* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i];
    }
    """
    mod = cp.RawModule(code=src, options=("-std=c++17",), name_expressions=("copy<float>", "twice<float>"))
    n = 10000
    x = cp.arange(3 * n, dtype=cp.float32)
    y = cp.zeros(3 * n, dtype=cp.float32)
    far = cp.arange(8 << 20, dtype=cp.float32)  # 32 MiB of its own, reached only through `table`
    table = cp.zeros(1, dtype=cp.uint64)
    followed = cp.zeros(n, dtype=cp.float32)
    host_table = cp.array([followed.data.ptr], dtype=cp.uint64)
    out = cp.zeros(n, dtype=cp.float32)
    wide = cp.arange(2 * n, dtype=cp.float32)
    oob = cp.zeros(n, dtype=cp.float32)
    big_x = cp.arange(4 << 20, dtype=cp.float32)  # 16 MiB: granules of its own, only read
    big_y = cp.zeros(4 << 20, dtype=cp.float32)
    big_z = cp.zeros(4 << 20, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    blocks = ((n + 255) // 256,)
    mod.get_function("copy<float>")(blocks, (256,), (x, y, cp.int32(n)))
    mod.get_function("set_table")((1,), (1,), (table, cp.uint64(far.data.ptr)))
    mod.get_function("hidden_read")(blocks, (256,), (table, out, cp.int32(n)))
    mod.get_function("hidden_write")(blocks, (256,), (table, cp.int32(n)))
    mod.get_function("follow_write")(blocks, (256,), (host_table, cp.int32(n)))
    mod.get_function("oob_read")(blocks, (256,), (wide[:n], oob, cp.int32(n)))
    mod.get_function("copy<float>")((big_x.size // 256,), (256,), (big_x, big_y, cp.int32(big_x.size)))
    cp.cuda.Device().synchronize()
    assert float(y[n - 1]) == n - 1 and float(big_y[-1]) == big_x.size - 1
    mod.get_function("twice<float>")((big_x.size // 256,), (256,), (big_x, big_z, cp.int32(big_x.size)))
    cp.cuda.Device().synchronize()
    assert float(big_z[-1]) == 2 * (big_x.size - 1)
    assert float(out[3]) == 4.0 and float(far[3]) == 6.0
    assert float(followed[3]) == 9.0 and float(oob[0]) == n
    bufs = {"x": x, "y": y, "big_x": big_x, "big_y": big_y, "big_z": big_z, "far": far, "table": table,
            "followed": followed, "out": out, "oob": oob, "wide": wide}
    digests = {k: digest(v) for k, v in bufs.items() if k != "table"}
    digests["table"] = "points at far" if int(table.get()[0]) == far.data.ptr else "does not point at far"
    return digests, {k: [v.data.ptr, v.nbytes] for k, v in bufs.items()}


def solve():
    import cupy as cp
    import cupyx.scipy.linalg as cla

    rng = cp.random.RandomState(1)
    n = 256
    a = rng.standard_normal((n, n), dtype=cp.float64) + n * cp.eye(n)
    b = rng.standard_normal((n, 4), dtype=cp.float64)
    spd = a @ a.T
    low = cp.tril(a)
    res = {
        "solve": cp.linalg.solve(a, b),
        "cholesky": cp.linalg.cholesky(spd),
        "trsm": cla.solve_triangular(low, b, lower=True),
        "trsv": cla.solve_triangular(low, b[:, 0], lower=True),
    }
    cp.cuda.Device().synchronize()
    return {k: digest(v) for k, v in res.items()}, {}


def fft():
    import cupy as cp

    rng = cp.random.RandomState(2)
    z = (rng.standard_normal(1 << 16) + 1j * rng.standard_normal(1 << 16)).astype(cp.complex64)
    r = rng.standard_normal((512, 512), dtype=cp.float32)
    res = {"fft": cp.fft.fft(z), "ifft": cp.fft.ifft(z), "rfft2": cp.fft.rfft2(r)}
    cp.cuda.Device().synchronize()
    return {k: digest(v) for k, v in res.items()}, {}


def torch_kernels():
    import torch

    torch.manual_seed(3)
    dev = "cuda"
    bag = torch.nn.EmbeddingBag(1000, 64, mode="sum").to(dev)
    with torch.no_grad():
        bag.weight.copy_(torch.randint(-8, 8, (1000, 64), device=dev).float())
    idx = torch.randint(0, 1000, (4096,), device=dev)
    offsets = torch.arange(0, 4096, 16, device=dev)
    table = torch.randint(-8, 8, (1000, 32), device=dev).float()
    with torch.no_grad():
        res = {
            "embedding_bag": bag(idx, offsets),
            "index_select": table.index_select(0, idx),
            "gather": table.gather(0, idx[:1024].view(32, 32)),
            "scatter_add": torch.zeros(1000, 32, device=dev).scatter_add_(
                0, idx[:512].view(512, 1).expand(512, 32), table[:512]),
        }
    torch.cuda.synchronize()
    return {k: digest(v) for k, v in res.items()}, {}


def sparse():
    import cupy as cp
    import cupyx.scipy.sparse as sp

    rng = cp.random.RandomState(4)
    a = sp.random(2048, 1024, density=0.01, format="csr", dtype=cp.float32, random_state=rng)
    # small integers held in floats: the sums come out exact in any order (the column sum adds
    # with atomics), so that a plain run and a validated one agree byte for byte
    a.data = cp.floor(a.data * 16)
    x = rng.randint(-8, 8, 1024).astype(cp.float32)
    b = rng.randint(-8, 8, (1024, 8)).astype(cp.float32)
    res = {"spmv": a @ x, "spmm": a @ b, "transpose": a.T.tocsr().data, "sum": a.sum(axis=0)}
    cp.cuda.Device().synchronize()
    return {k: digest(cp.asarray(v)) for k, v in res.items()}, {}


def compiled():
    import torch

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                torch.nn.Linear(512, 64)).cuda()
    step = torch.compile(lambda x: model(x).square().mean())
    x = torch.randn(128, 256, device="cuda")
    loss = step(x)
    loss.backward()
    torch.cuda.synchronize()
    res = {"loss": loss.detach(), **{f"grad{i}": p.grad for i, p in enumerate(model.parameters())}}
    return {k: digest(v) for k, v in res.items()}, {}


def timm_step():
    import timm
    import torch

    torch.manual_seed(6)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    res = {"loss": loss.detach(), "fc": model.fc.weight.detach(), "conv1": model.conv1.weight.detach()}
    return {k: digest(v) for k, v in res.items()}, {}


def gemm():
    import cupy as cp

    rng = cp.random.RandomState(7)
    a = rng.standard_normal((2048, 2048), dtype=cp.float32)
    b = rng.standard_normal((2048, 2048), dtype=cp.float32)
    res = {"half": a.astype(cp.float16) @ b.astype(cp.float16), "single": a @ b}
    cp.cuda.Device().synchronize()
    return {k: digest(v) for k, v in res.items()}, {}


def inplace():
    import cupy as cp
    import torch

    src = r"""
    template <typename T> __global__ void scale(T* x, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] *= 2;
    }
    template <typename T> __global__ void overwrite(T* x, const T* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] = y[i];
    }
    template <typename T> __global__ void partial(T* x, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[2 * i] = i + 0.5f;
    }
    """
    names = ("scale<float>", "overwrite<float>", "partial<float>")
    mod = cp.RawModule(code=src, options=("-std=c++17",), name_expressions=names)
    n = 1 << 14  # 64 KiB of floats: an allocation of its own each, whole chunks
    blocks = ((n + 255) // 256,)
    # no zero among the values, and y none of x's: every byte a kernel writes changes
    scaled = cp.arange(1, n + 1, dtype=cp.float32)
    over = cp.arange(1, n + 1, dtype=cp.float32)
    y = cp.arange(n + 1, 2 * n + 1, dtype=cp.float32)
    part = cp.arange(1, 2 * n + 1, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    mod.get_function(names[0])(blocks, (256,), (scaled, cp.int32(n)))
    mod.get_function(names[1])(blocks, (256,), (over, y, cp.int32(n)))
    mod.get_function(names[2])(blocks, (256,), (part, cp.int32(n)))
    a = torch.arange(1, n + 1, device="cuda", dtype=torch.float32)
    b = torch.full((n,), 3.0, device="cuda")
    torch.cuda.synchronize()
    a.add_(b)
    torch.cuda.synchronize()
    assert float(scaled[-1]) == 2 * n and float(over[0]) == n + 1 and float(part[2]) == 1.5 and float(part[1]) == 2
    assert float(a[-1]) == n + 3
    bufs = {"scaled": scaled, "over": over, "y": y, "part": part}
    out = {k: [v.data.ptr, v.nbytes] for k, v in bufs.items()}
    out.update(a=[a.data_ptr(), 4 * n], b=[b.data_ptr(), 4 * n])
    digests = {k: digest(v) for k, v in bufs.items()}
    digests.update(a=digest(a), b=digest(b))
    return digests, out


MODES = {"kernels": kernels, "solve": solve, "fft": fft, "torch": torch_kernels, "sparse": sparse,
         "compiled": compiled, "timm": timm_step, "gemm": gemm, "inplace": inplace}

if __name__ == "__main__":
    digests, bufs = MODES[sys.argv[1]]()
    report = os.environ.get("GPUOS_TEST_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"digest": digests, "bufs": bufs}, f)
