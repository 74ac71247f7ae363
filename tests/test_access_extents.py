"""Extent granularity: pointers' bytes decoded from the launch arguments of framework kernels,
held to the validated traces recorded on an H100 (tests/data/recorded/README.md) and to the
shapes the recorded programs use (workloads/suite/torch_cnn.py, cupy_suite.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.access.layouts import divider_ok, template_args
from gpuos_tools.access.predict import Predictor
from gpuos_tools.access.report import compute_report
from gpuos_tools.stream import open_input

DATA = Path(__file__).resolve().parent / "data" / "recorded"

#: (program, scale) -> the most extra bytes extent granularity may predict, in percent of the
#: bytes the GPU showed written and read (validated launches). Range predicted 556-1315 %.
BOUNDS = {
    ("torch_cnn", 1): (1, 9),
    ("torch_cnn", 2): (10, 17),
    ("cupy_suite", 1): (3, 5),
    ("cupy_suite", 2): (4, 4),
}


def load(name: str) -> list[dict]:
    with open_input(str(DATA / name)) as reader:
        return list(reader)


def totals(rows) -> dict[str, int]:
    keys = ("validated", "missed_write_launches", "missed_read_launches", "missed_write_bytes", "missed_read_bytes",
            "extra_write_bytes", "written_bytes", "extra_read_bytes", "read_bytes")
    return {k: sum(getattr(r, k) for r in rows) for k in keys}


#: The same for the suite's four programs, validated out of process with read extents
#: (tests/data/recorded/README.md): (write bound,
#: read bound, bound on the extra reads outside the bytes each launch wrote or was predicted to
#: write), in percent. The CNN's extra bytes at size 2 are two cuDNN layout transforms that
#: rewrote identical values. The optimizer's traces saw the in-place updates of operands that
#: held zeros (its state at the first step) through the second bisection's non-zero poison: its
#: extra reads fell from 16-17 % to 5-6 %, all on bytes the launches wrote. Range predicted
#: 1363-10706 %.
VALIDATED_BOUNDS = {
    ("cupy_suite", 1): (3, 5, 0.1),
    ("cupy_suite", 2): (3, 4, 0.1),
    ("torch_cnn", 1): (1, 1, 0.1),
    ("torch_cnn", 2): (10, 7, 7),
    ("torch_optim", 1): (5, 5, 0.1),
    ("torch_optim", 2): (5, 7, 0.1),
    ("transformer_block", 1): (6, 2, 0.4),
    ("transformer_block", 2): (3, 2, 0.1),
}


@pytest.mark.parametrize(("program", "scale"), sorted(VALIDATED_BOUNDS))
def test_extent_on_the_validator_traces(program, scale):
    records = load(f"validator-suite-{program}.s{scale}.ndjson.zst")
    rows = compute_report(records, "extent")
    got = totals(rows)
    assert got["validated"] >= (28 if program == "cupy_suite" else 72)
    assert got["missed_write_launches"] == got["missed_read_launches"] == 0
    assert got["missed_write_bytes"] == got["missed_read_bytes"] == 0
    write_bound, read_bound, elsewhere = VALIDATED_BOUNDS[(program, scale)]
    assert 100 * got["extra_write_bytes"] <= write_bound * got["written_bytes"]
    in_place = sum(r.extra_read_written_bytes for r in rows)
    assert got["read_bytes"] > 0
    assert 100 * got["extra_read_bytes"] <= read_bound * got["read_bytes"]
    assert 100 * (got["extra_read_bytes"] - in_place) <= elsewhere * got["read_bytes"]
    # the target: extra bytes read and written together within 10 % of those the GPU showed
    assert 10 * (got["extra_write_bytes"] + got["extra_read_bytes"]) <= got["written_bytes"] + got["read_bytes"]


@pytest.mark.parametrize(("program", "scale"), sorted(BOUNDS))
def test_extent_misses_nothing_and_stays_within_its_bounds(program, scale):
    records = load(f"suite-{program}.s{scale}.ndjson.zst")
    got = totals(compute_report(records, "extent"))
    assert got["validated"] > 20
    assert got["missed_write_launches"] == got["missed_read_launches"] == 0
    assert got["missed_write_bytes"] == got["missed_read_bytes"] == 0
    write_bound, read_bound = BOUNDS[(program, scale)]
    assert 100 * got["extra_write_bytes"] <= write_bound * got["written_bytes"]
    assert 100 * got["extra_read_bytes"] <= read_bound * got["read_bytes"]
    ranged = totals(compute_report(records, "range"))
    assert got["extra_write_bytes"] * 3 < ranged["extra_write_bytes"]


def test_extent_misses_nothing_the_range_prediction_saw_on_the_validation_program():
    rows = compute_report(load("validate.ndjson.zst"), "extent")
    ranged = compute_report(load("validate.ndjson.zst"), "range")
    for key in ("missed_write_launches", "missed_read_launches"):
        assert totals(rows)[key] == totals(ranged)[key]  # the two misses by design (hidden pointers)


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.ndjson.zst")))
def test_extent_lies_inside_the_range_prediction(name):
    """Every decoded extent is clipped to its allocation and starts no lower than range's, and
    a launch is unknown exactly when it is at range granularity."""
    ext, rng = Predictor("extent"), Predictor("range")
    launches = 0
    for rec in load(name):
        if rec["type"] == "launch":
            launches += 1
            a, b = ext.launch(rec)[0], rng.launch(rec)[0]
            assert a["unknown"] == b["unknown"]
            for key in ("reads", "writes"):
                spans = {}
                for e in b[key]:
                    spans.setdefault(e["alloc"], []).append((e["offset"], e["offset"] + e["size"]))
                for e in a[key]:
                    assert any(s <= e["offset"] and e["offset"] + e["size"] <= t for s, t in spans[e["alloc"]]), e
        if rec["type"] != "validation":
            ext.feed(rec)
            rng.feed(rec)
    assert launches


def launch_with(records: list[dict], seq: int, granularity: str = "extent") -> tuple[Predictor, dict, dict]:
    """(predictor just before it, the launch record, its access record) of the launch ``seq``."""
    pred = Predictor(granularity)
    for rec in records:
        if rec["type"] == "launch" and rec["seq"] == seq:
            return pred, rec, pred.launch(rec)[0]
        pred.feed(rec)
    raise LookupError(seq)


def spans(pred: Predictor, rec: dict) -> dict:
    info = pred.info(rec)
    decoded = pred.decoders.decode(info.kernel, info.name, rec)
    assert decoded is not None
    return decoded.spans


@pytest.fixture(scope="module")
def torch2() -> list[dict]:
    return load("suite-torch_cnn.s2.ndjson.zst")


@pytest.fixture(scope="module")
def cupy2() -> list[dict]:
    return load("suite-cupy_suite.s2.ndjson.zst")


# batch 32 at size 2: conv1 gives 32x16x32x32 floats, conv2 32x32x32x32, the pool 32x32x16x16,
# the linear layer maps 32x8192 to 32x10 with a 10x8192 weight
B = 32


def test_vectorized_elementwise_add(torch2):
    pred, rec, _ = launch_with(torch2, 41)  # a bias's gradient accumulated in place: 432 floats
    assert spans(pred, rec) == {(2, 0): (None, (0, 1728)), (2, 8): ((0, 1728), None), (2, 16): ((0, 1728), None)}


def test_broadcast_add_through_the_offset_calculator(torch2):
    pred, rec, acc = launch_with(torch2, 4)  # conv1's bias added to its output: out += bias[None, :, None, None]
    s = spans(pred, rec)
    assert s[(1, 608)] == (None, (0, B * 16 * 32 * 32 * 4))
    assert s[(1, 624)] == ((0, 16 * 4), None)  # the bias: 16 floats, stride 0 over the rest
    assert all(e["how"] == "dptr:pytorch" or e["how"] == "scan:pytorch" for e in acc["reads"] + acc["writes"])


def test_reduction_and_garbage_words_in_its_struct(torch2):
    pred, rec, acc = launch_with(torch2, 36)  # batch norm's gradient summed over (N, H, W) of 32x32x32x32
    s = spans(pred, rec)
    assert s[(0, 984)] == ((0, B * 32 * 32 * 32 * 4), None)
    assert s[(0, 992)] == (None, (0, 32 * 4))
    # uninitialised dividers past `dims` hold words that point into an allocation: not pointers
    src = pred.allocs.find(0x7F0396000000)
    assert src is not None and src.id not in {e["alloc"] for e in acc["reads"] + acc["writes"]}
    # range takes the decoded layout too; only alloc, which reads no structure, names it
    rng = launch_with(torch2, 36, "range")[2]
    assert src.id not in {e["alloc"] for e in rng["reads"] + rng["writes"]}
    whole = launch_with(torch2, 36, "alloc")[2]
    assert src.id in {e["alloc"] for e in whole["reads"]}


def test_cublas_gemm_of_the_linear_layer(torch2):
    pred, rec, _ = launch_with(torch2, 14)  # y = x W^T + b
    s = spans(pred, rec)
    assert s[(0, 0)][0] == (0, B * 8192 * 4)  # x
    assert s[(0, 8)][0] == (0, 10 * 8192 * 4)  # W
    assert s[(0, 48)][1] == (0, B * 10 * 4)  # y
    assert s[(0, 24)][0] == (0, B * 4)  # the bias (10 floats), bounded by the larger side of y


def test_random_fill_through_its_store(torch2):
    pred, rec, _ = launch_with(torch2, 1)  # randn(32, 3, 32, 32): the input batch
    assert spans(pred, rec) == {(3, 0): (None, (0, B * 3 * 32 * 32 * 4))}


def test_small_n_gemm_of_the_linear_layer():
    pred, rec, _ = launch_with(load("suite-torch_cnn.s1.ndjson.zst"), 14)  # batch 16: y = x W^T + b
    s = spans(pred, rec)
    assert s[(0, 16)][0] == (0, 10 * 8192 * 4) and s[(0, 32)][0] == (0, 16 * 8192 * 4)
    assert s[(0, 64)][1] == (0, 16 * 10 * 4)


def test_max_pool_and_cudnn_batch_norm(torch2):
    pred, rec, _ = launch_with(torch2, 13)
    s = spans(pred, rec)
    assert s[(1, 0)] == ((0, B * 32 * 32 * 32 * 4), None)
    assert s[(15, 0)] == (None, (0, B * 32 * 16 * 16 * 4)) and s[(16, 0)] == (None, (0, B * 32 * 16 * 16 * 8))
    pred, rec, _ = launch_with(torch2, 6)  # batch norm after conv1: 16 channels
    s = spans(pred, rec)
    assert s[(1, 0)] == ((0, B * 16 * 32 * 32 * 4), None) and s[(3, 0)] == (None, (0, B * 16 * 32 * 32 * 4))
    assert s[(8, 0)] == ((0, 64), (0, 64))  # running mean: read and updated


def test_cublas_split_k_through_its_workspace(cupy2):
    # a GEMM of 96x32 by 32x64 (n x k by k x m) split along k into one slice: CUTLASS's Kernel2
    # reads A and B (the validator measured 12288 and 8192 bytes) and writes the partial product
    # into cuBLAS's 64 MiB workspace, splitKreduce reads it into C
    pred, rec, _ = launch_with(cupy2, 35)
    assert spans(pred, rec) == {(0, 280): ((0, 96 * 32 * 4), None), (0, 288): ((0, 32 * 64 * 4), None),
                                (0, 304): (None, (0, 96 * 64 * 4))}
    pred, rec, _ = launch_with(cupy2, 36)
    s = spans(pred, rec)
    assert s[(1, 0)] == ((0, 96 * 64 * 4), None) and s[(3, 0)] == (None, (0, 96 * 64 * 4))


def test_cupy_arrays_and_random_numbers(cupy2):
    n = 200006  # 100003 x 2
    pred, rec, acc = launch_with(cupy2, 4)  # z = x * y: a ufunc, inputs read, its output written
    s = spans(pred, rec)
    assert s == {(0, 0): ((0, n * 4), None), (1, 0): ((0, n * 4), None), (2, 0): (None, (0, n * 4))}
    pred, rec, acc = launch_with(cupy2, 5)  # x + 1.0: the scalar has no pointer
    assert spans(pred, rec) == {(0, 0): ((0, n * 4), None), (2, 0): (None, (0, n * 4))}
    # allclose on 6144 floats: isclose, an ElementwiseKernel, not a ufunc; the arrays before its
    # scalars are inputs, the bool output after them may be read by the kernel's code too
    pred, rec, acc = launch_with(cupy2, 37)
    assert spans(pred, rec) == {(0, 0): ((0, 24576), None), (1, 0): ((0, 24576), None), (5, 0): ((0, 6144), (0, 6144))}
    pred, rec, _ = launch_with(cupy2, 2)  # standard_normal(n) into a fresh array
    s = spans(pred, rec)
    assert s[(2, 0)] == (None, (0, n * 4)) and s[(0, 0)] == ((0, n * 48), (0, n * 48))


def test_cupy_directions_only_where_its_conventions_say():
    """A kernel named like a ufunc but with another arity, or a user's ElementwiseKernel
    without scalars, keeps every array read and written."""
    import struct

    from gpuos_tools.access.decode_cupy import plan_elementwise

    arr = struct.pack("<4q", 0x7000_0000_0000, 10, 10, 4)  # CArray<float, 1>: 10 floats
    index = struct.pack("<3q", 10, 10, 0)  # CIndexer<1>

    def directions(name: str, nparams: int) -> dict:
        plan = plan_elementwise(name, (32,) * nparams + (24,))
        assert plan is not None
        return plan([arr] * nparams + [index], {}).spans

    both = ((0, 40), (0, 40))
    assert directions("cupy_multiply__float32_float32_float32_float32", 4) == {(i, 0): both for i in range(4)}
    assert directions("cupy_my_kernel__float32_float32", 2) == {(0, 0): both, (1, 0): both}
    assert directions("cupy_sin__float32_float32", 2) == {(0, 0): ((0, 40), None), (1, 0): (None, (0, 40))}


def with_bytes(rec: dict, param: int, offset: int, data: bytes) -> dict:
    """The launch with ``data`` written over bytes of one parameter."""
    raw = bytearray.fromhex(rec["params"][param]["hex"])
    raw[offset : offset + len(data)] = data
    params = list(rec["params"])
    params[param] = {**params[param], "hex": raw.hex()}
    return {**rec, "params": params}


ONE = bytes.fromhex("0000803f")  # 1.0f


@pytest.mark.parametrize(
    ("seq", "param", "beta_at", "c", "size"),
    [
        (3, 11, 0, (5, 0), B * 16 * 32 * 32 * 4),  # implicit_convolve_sgemm: conv1 forward, y
        (8, 0, 132, (0, 16), B * 32 * 32 * 32 * 4),  # xmma fprop: conv2 forward, C
        (8, 0, 504, (0, 16), B * 32 * 32 * 32 * 4),  # the second copy of beta
        (8, 0, 136, (0, 16), B * 32 * 32 * 32 * 4),  # a word after beta (a scalar's pointer) set
        (21, 0, 476, (0, 16), B * 8192 * 4),  # xmma GEMM: the linear layer's input gradient
        (21, 0, 532, (0, 16), B * 8192 * 4),
    ],
)
def test_cudnn_and_cublas_outputs_are_read_only_when_beta_is_not_zero(torch2, seq, param, beta_at, c, size):
    pred, rec, _ = launch_with(torch2, seq)
    assert spans(pred, rec).get(c, (None, (0, size)))[0] is None  # beta 0: written, not read
    assert spans(pred, with_bytes(rec, param, beta_at, ONE))[c][0] == (0, size)


def test_xmma_scalars_that_are_not_the_pattern_read_off_keep_the_output_read(torch2):
    pred, rec, _ = launch_with(torch2, 8)  # xmma fprop, alpha 1.0 at 128 and 500
    out = B * 32 * 32 * 32 * 4
    two = bytes.fromhex("00000040")  # 2.0f
    assert spans(pred, with_bytes(rec, 0, 128, two))[(0, 16)][0] == (0, out)  # the copies differ
    zero_alpha = with_bytes(with_bytes(rec, 0, 128, bytes(4)), 0, 500, bytes(4))
    assert spans(pred, zero_alpha)[(0, 16)][0] == (0, out)


def test_cublas_serial_split_k_steps(cupy2):
    # A @ B of 512x384 by 384x256 split along k into 4 slices of 512x256 partial products
    a, b, slices, d = 512 * 384 * 4, 384 * 256 * 4, 4 * 512 * 256 * 4, 512 * 256 * 4
    pred, rec, _ = launch_with(cupy2, 13)  # execute_kernel on a grid 4 deep: the partials
    s = spans(pred, rec)
    assert s == {(0, 0): ((0, a), None), (0, 8): ((0, b), None), (0, 376): (None, (0, slices))}
    pred, rec, _ = launch_with(cupy2, 14)  # execute_split_k_kernel: their sum into D
    assert spans(pred, rec) == {(0, 376): ((0, slices), None), (0, 48): (None, (0, d))}
    # on a grid that is not the one recorded, every step may use A, B, D and the workspace
    s = spans(pred, {**rec, "grid": [16, 8, 2]})
    assert s[(0, 0)][0] == (0, a) and s[(0, 48)][1] == (0, d) and s[(0, 376)] == ((0, slices), (0, slices))


def test_cudnn_weight_gradients(torch2):
    pred, rec, _ = launch_with(torch2, 39)  # wgrad_alg0_engine: conv1's 16x3x3x3 filter
    x, dw = B * 3 * 32 * 32 * 4, 16 * 27 * 4
    assert spans(pred, rec) == {(3, 0): ((0, None), None), (5, 0): ((0, dw), (0, dw)), (6, 0): ((0, x), None)}
    pred, rec, _ = launch_with(torch2, 34)  # xmma wgrad split along k into 90 slices
    s = spans(pred, rec)
    assert s[(0, 328)] == (None, (0, 89 * 24576))  # partial products, summed by the same launch
    assert s[(0, 344)] == ((0, 2136), (0, 2136))  # its counters


def test_a_launch_whose_bytes_do_not_check_out_falls_back_to_range(torch2):
    pred, rec, _ = launch_with(torch2, 4)
    raw = bytearray.fromhex(rec["params"][1]["hex"])
    raw[8] ^= 1  # the first divider's magic number
    bad = {**rec, "params": [rec["params"][0], {**rec["params"][1], "hex": raw.hex()}]}
    info = pred.info(bad)
    assert pred.decoders.decode(info.kernel, info.name, bad) is None
    rng = launch_with(torch2, 4, "range")[0]
    assert pred.launch(bad)[0]["writes"] == rng.launch(bad)[0]["writes"]


def test_memo_and_pointer_key_at_extent_granularity(torch2):
    pred = Predictor("extent")
    assert pred.pointer_key("k", (8,), bytes(8)) is None  # decoders read scalars too
    direct = Predictor("extent")
    for rec in torch2:
        if rec["type"] == "validation":
            continue
        memoised = pred.feed(rec)  # training steps repeat launches: most come from the memo
        if rec["type"] == "launch":
            fresh = direct.launch(rec)[0]
            assert (memoised["reads"], memoised["writes"]) == (fresh["reads"], fresh["writes"])
        direct.feed(rec)


def test_template_arguments_and_dividers():
    name = "void k<4, at::native::BinaryFunctor<float, float, bool, {lambda(float, float)#1}>, std::array<char*, 3ul> >(int)"
    args, end = template_args(name, name.index("<"))
    assert args == ["4", "at::native::BinaryFunctor<float, float, bool, {lambda(float, float)#1}>", "std::array<char*, 3ul>"]
    assert name[end] == "("
    assert divider_ok(1024, 1, 10) and divider_ok(3, 1431655766, 2) and not divider_ok(3, 1431655765, 2)


def test_cli_extent_report():
    proc = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.predict_access", "--granularity", "extent",
                           "--report", str(DATA / "suite-torch_cnn.s2.ndjson.zst")],
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()[1:]]
    assert rows and all(r["granularity"] == "extent" for r in rows)
    v = [r["validation"] for r in rows if "validation" in r]
    assert sum(x["missed_write_launches"] + x["missed_read_launches"] for x in v) == 0


def test_explain_says_what_the_decoder_read(torch2):
    from gpuos_tools.access.report import explain

    ex = explain(iter(torch2), 36, "extent")
    decisions = {(w["param"], w["offset"]): w["decision"] for w in ex["words"]}
    assert decisions[(0, 984)] == f"decoded (pytorch): read [0, {B * 32 * 32 * 32 * 4})"
    assert decisions[(0, 992)] == "decoded (pytorch): write [0, 128)"
    assert decisions[(0, 120)].startswith("not a pointer")


@pytest.mark.parametrize("name", ["suite-torch_cnn.s2.ndjson.zst", "suite-cupy_suite.s2.ndjson.zst"])
def test_decoders_take_any_bytes(name):
    """Random bytes in a decoded kernel's arguments are rejected or decoded, never an error, and
    whatever is decoded stays inside the pointer's allocation."""
    import random

    rng = random.Random(7)
    pred = Predictor("extent")
    seen = set()
    for rec in load(name):
        if rec["type"] == "launch" and rec["kernel"] not in seen:
            seen.add(rec["kernel"])
            for _ in range(20):
                params = []
                for p in rec["params"]:
                    raw = bytearray.fromhex(p["hex"])
                    for _ in range(max(1, len(raw) // 16)):
                        raw[rng.randrange(len(raw))] = rng.randrange(256)
                    params.append({**p, "hex": raw.hex()})
                acc = pred.launch({**rec, "params": params})[0]
                for e in acc["reads"] + acc["writes"]:
                    assert e["offset"] >= 0 and e["offset"] + e["size"] <= pred.by_id[e["alloc"]].size
        if rec["type"] != "validation":
            pred.feed(rec)
    assert len(seen) > 10


def test_foreach_optimizer_step_reads_the_gradients_it_was_given():
    # tests/gpu/progs/torch_prog.py: Adam over Linear(256, 512) and Linear(512, 10); its report
    # names the parameters' last gradients. The last step's lerp_(exp_avg, grads, 1 - beta1)
    # reads both lists and writes the first.
    report = json.loads((DATA / "torch.report.json").read_text())
    numel = {"0.weight": 512 * 256, "0.bias": 512, "2.weight": 10 * 512, "2.bias": 10}
    records = load("torch.ndjson.zst")
    seq = [r["seq"] for r in records if r["type"] == "launch" and "TernaryOpScalarFunctor<float, 2, 2, 0>" in r["name"]][-1]
    pred, rec, _ = launch_with(records, seq)
    s = spans(pred, rec)
    raw = bytes.fromhex(rec["params"][0]["hex"])
    words = {int.from_bytes(raw[off : off + 8], "little"): (off, sp) for (_, off), sp in s.items()}
    for name, grad in report["grads"].items():
        off, (read, write) = words[grad]
        assert off >= 64 * 8 and read == (0, numel[name] * 4) and write is None  # list 1: read only
        state_read, state_write = s[(0, off - 64 * 8)]  # the same tensor in list 0 (exp_avg)
        assert state_read == state_write == (0, numel[name] * 4)


@pytest.mark.parametrize("functor, out", [
    # recorded in the optimizer and transformer suites on the H100: their outputs are the
    # inputs' type, which the lambdas' names do not show
    ("at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() "
     "const::{lambda()#2}::operator()() const::{lambda(float)#1}", 4),
    ("at::native::GeluBackwardCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::"
     "operator()() const::{lambda()#2}::operator()() const::{lambda(float, float)#1}", 4),
    ("at::native::(anonymous namespace)::masked_scale_kernel<bool, float, float>(at::Tensor&, at::Tensor const&, "
     "at::Tensor const&, float)::{lambda(float, bool)#1}", 4),
    # recorded in the transformer suite: tanh and the plain copy return their argument's type,
    # where its last parameter's
    ("at::native::tanh_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#2}::"
     "operator()() const::{lambda(float)#1}", 4),
    ("at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
     "{lambda()#7}::operator()() const::{lambda(float)#1}", 4),
    ("at::native::(anonymous namespace)::where_kernel_impl(at::TensorIterator&)::{lambda()#1}::operator()() const::"
     "{lambda()#11}::operator()() const::{lambda(bool, float, float)#1}", 4),
    ("at::native::(anonymous namespace)::where_kernel_impl(at::TensorIterator&)::{lambda()#1}::operator()() const::"
     "{lambda()#4}::operator()() const::{lambda(bool, long, long)#1}", 8),
    # any other lambda: bounded by the largest element
    ("at::native::something_else(at::TensorIteratorBase&)::{lambda(float, float)#1}", 16),
    ("at::native::tanh_backward_other(at::TensorIteratorBase&)::{lambda(float, double)#1}", 16),
])
def test_lambdas_known_to_return_their_first_parameters_type(functor, out):
    from gpuos_tools.access.decode_torch import operands

    assert operands(functor)[0] == out


@pytest.fixture(scope="module")
def optim2() -> list[dict]:
    return load("validator-suite-torch_optim.s2.ndjson.zst")


@pytest.fixture(scope="module")
def block1() -> list[dict]:
    return load("validator-suite-transformer_block.s1.ndjson.zst")


def test_cutlass_split_k_gemm_operands(optim2, block1):
    # workloads/suite/torch_optim.py at size 2: Linear(64, 256)'s weight gradient over a batch of
    # 64, split along k into two slices of 64 x 256 partial products; the validator measured A
    # read 64 x 64 floats (k contiguous) and B 64 x 256 (k strided), C not read
    pred, rec, _ = launch_with(optim2, 18)
    s = spans(pred, rec)
    assert s == {(0, 280): ((0, 64 * 64 * 4), None), (0, 288): ((0, 64 * 256 * 4), None),
                 (0, 304): (None, (0, 2 * 64 * 256 * 4))}
    # the GPT-2 block at size 1: a 64 x 128 by 128 x 128 product ("tn": both k contiguous)
    pred, rec, _ = launch_with(block1, 78)
    assert spans(pred, rec) == {(0, 280): ((0, 64 * 128 * 4), None), (0, 288): ((0, 128 * 128 * 4), None),
                                (0, 304): (None, (0, 4 * 64 * 128 * 4))}


def test_cutlass_split_k_gemm_keeps_what_it_cannot_read(optim2):
    pred, rec, _ = launch_with(optim2, 18)
    s = spans(pred, with_bytes(rec, 0, 252, ONE))  # beta 1.0: C is read, how far is not decoded
    assert s[(0, 296)] == ((0, None), None)
    s = spans(pred, with_bytes(rec, 0, 80, (64).to_bytes(8, "little")))  # A's k step matches neither layout
    assert s[(0, 280)] == s[(0, 288)] == ((0, None), (0, None))
    assert pred.decoders.decode(pred.info(rec).kernel, pred.info(rec).name, {**rec, "grid": [1, 4, 2]}) is None


def test_cublas_scal_before_a_split_k_sgemm(optim2):
    # C of the split-K SGEMM after it (m 64, n 64, ldc 64) scaled in place; the validator saw
    # its 16384 bytes written (the read of an operand updated in place it cannot see)
    pred, rec, _ = launch_with(optim2, 48)
    assert spans(pred, rec) == {(1, 0): ((0, 64 * 64 * 4), None), (2, 0): (None, (0, 64 * 64 * 4)),
                                (3, 0): ((0, 4), None)}
    pred, rec, _ = launch_with(optim2, 2)  # 256 x 64 on a grid of 64 x 32 tiles
    assert spans(pred, rec)[(2, 0)] == (None, (0, 256 * 64 * 4))
    info = pred.info(rec)
    assert pred.decoders.decode(info.kernel, info.name, {**rec, "grid": [2, 2, 1]}) is None
    other = {**rec, "params": [rec["params"][0], rec["params"][1], {**rec["params"][2], "hex": "00" * 8}, rec["params"][3]]}
    assert pred.decoders.decode(info.kernel, info.name, other) is None  # not in place: not the pattern read


def test_cublas_gemm_workspace_with_nothing_carved(block1):
    # the GPT-2 block's c_attn GEMM: no split-K, the three workspace pointers one address and
    # every region's size zero; the validator saw nothing written there
    pred, rec, _ = launch_with(block1, 18)
    s = spans(pred, rec)
    assert s[(0, 376)] == s[(0, 392)] == s[(0, 400)] == (None, None)
    assert s[(0, 48)][1] == (0, 64 * 384 * 4)
    sized = with_bytes(rec, 0, 384, (64).to_bytes(4, "little"))  # a region that is not empty
    assert spans(pred, sized)[(0, 376)] == ((0, None), (0, None))


def test_broadcast_comparison_writes_bools(block1):
    # the causal mask at size 1: two arange(32) of int64 compared with broadcasting into 32 x 32
    # bools (CompareFunctor<long> holds only its operation); the validator saw 1024 bytes written
    pred, rec, _ = launch_with(block1, 13)
    s = spans(pred, rec)
    assert sorted(s.values(), key=repr) == [((0, 32 * 8), None), ((0, 32 * 8), None), (None, (0, 32 * 32))]


def test_cat_through_its_input_metadata(block1):
    # the GPT-2 block at size 1 (batch 2, 32 positions, 4 heads of 32): a head-split view of
    # c_attn's output (strides 12288, 32, 384, 1) copied into a fresh 2 x 4 x 32 x 32 tensor
    pred, rec, _ = launch_with(block1, 19)
    s = spans(pred, rec)
    assert s[(0, 0)] == (None, (0, 2 * 4 * 32 * 32 * 4))
    assert s[(1, 8)] == ((0, (12288 + 3 * 32 + 31 * 384 + 31 + 1) * 4), None)
    # the attention's backward: three 2 x 32 x 128 gradients side by side along the last
    # dimension of a 2 x 32 x 384 output; each input at its offset, one through its transpose
    pred, rec, _ = launch_with(block1, 93)
    s = spans(pred, rec)
    assert s[(0, 0)] == (None, (0, 2 * 32 * 384 * 4))
    assert s[(1, 0)] == s[(1, 8)] == s[(1, 16)] == ((0, 2 * 32 * 128 * 4), None)
    assert (1, 24) not in s  # past the grid: the host's uninitialised stack


def test_cat_that_does_not_check_out_falls_back(block1):
    pred, rec, _ = launch_with(block1, 93)
    info = pred.info(rec)
    # input 1's element count no longer the product of its shape
    bad = with_bytes(rec, 1, 16 * 64 + 4, (8193).to_bytes(4, "little"))
    assert pred.decoders.decode(info.kernel, info.name, bad) is None
    assert pred.decoders.decode(info.kernel, info.name, {**rec, "grid": [264, 65, 1]}) is None


def test_extra_reads_on_bytes_written_are_told_apart():
    from gpuos_tools.access.score import score

    # a lerp_ in place: the validator measured the gradients read and exp_avg written, not
    # exp_avg's read (it zeroes the bytes it compares); a read elsewhere counts as elsewhere
    rec = {"seq": 1, "reads": [{"alloc": 1, "offset": 0, "size": 512}, {"alloc": 1, "offset": 1024, "size": 256}],
           "writes": [{"alloc": 1, "offset": 0, "size": 256}], "unknown": False}
    val = {"checked": True, "written": [[0x1000, 256]], "reads": "ok",
           "predicted": {"reads": [[0x1000, 512], [0x1400, 256]]},
           "extents": [{"ptr": 0x1100, "read": 256}]}

    class Alloc:
        addr, size = 0x1000, 4096

    v = score(rec, val, {1: Alloc()})
    assert v["extra_read_bytes"] == 512 and v["extra_read_written_bytes"] == 256


def test_split_k_reduce_with_the_bias_epilogue_reads_the_bias(block1):
    # the GPT-2 block at size 1: attention's c_proj (addmm, 128 outputs over 64 tokens) reduced
    # from 4 k slices with the bias epilogue (the word at 56 is 4, CUBLASLT_EPILOGUE_BIAS); the
    # bias comes as the 7th and the 9th pointer, and the validator saw only D written
    pred, rec, _ = launch_with(block1, 43)
    s = spans(pred, rec)
    assert s[(7, 0)] == s[(9, 0)] == ((0, 128 * 4), None)
    assert s[(3, 0)] == (None, (0, 64 * 128 * 4))
    # any other epilogue, or copies that are not one pointer: both keep range's read and write
    for kind in (1, 0x10 | 0x88, 256, 512):  # default, DRELU_BGRAD, BGRADA, BGRADB
        other = spans(pred, with_bytes(rec, 0, 56, kind.to_bytes(4, "little")))
        assert other[(7, 0)] == other[(9, 0)] == ((0, None), (0, None))
    moved = with_bytes(rec, 9, 0, (int.from_bytes(bytes.fromhex(rec["params"][9]["hex"]), "little") + 512).to_bytes(8, "little"))
    assert spans(pred, moved)[(9, 0)] == ((0, None), (0, None))
    aux = with_bytes(rec, 12, 0, bytes.fromhex(rec["params"][7]["hex"]))  # an epilogue buffer set
    assert spans(pred, aux)[(7, 0)] == ((0, None), (0, None))


def test_split_k_reduce_bias_on_a_validated_compiled_mlp():
    # torch.compile'd MLP: the same kernel, m 64, bias at the 7th and 9th pointers; the
    # validator saw D's 32 KiB written and nothing of the bias
    records = load("validator-compiled.ndjson.zst")
    pred, rec, acc = launch_with(records, 5)
    assert spans(pred, rec)[(7, 0)] == ((0, 64 * 4), None)
    rows = compute_report(records, "extent")
    assert totals(rows)["missed_write_bytes"] == 0
    bias = int.from_bytes(bytes.fromhex(rec["params"][7]["hex"]), "little")
    a = pred.allocs.find(bias)
    assert all(not (e["alloc"] == a.id and e["offset"] <= bias - a.addr < e["offset"] + e["size"]) for e in acc["writes"])


@pytest.fixture(scope="module")
def block2() -> list[dict]:
    return load("validator-suite-transformer_block.s2.ndjson.zst")


def fed_until(records: list[dict], seq: int) -> tuple[Predictor, dict, dict]:
    """(predictor, launch record, access record) of the launch ``seq``, fed in order."""
    pred = Predictor("extent")
    for rec in records:
        if rec["type"] == "validation":
            continue
        acc = pred.feed(rec)
        if rec["type"] == "launch" and rec["seq"] == seq:
            return pred, rec, acc
    raise LookupError(seq)


def test_embedding_backward_after_the_zeroed_gradient(block2):
    # the GPT-2 block at size 2: wte's gradient, 512 x 128 floats, zeroed by a fill of 65536
    # floats (seq 104) just before the embedding backward (seq 105) adds the rows of 128 token
    # gradients into it; the validator saw writes only inside those 256 KiB
    pred, rec, acc = fed_until(block2, 105)
    s = spans(pred, rec)
    assert s[(0, 0)] == ((0, 128 * 8), None) and s[(1, 0)] == ((0, 128 * 128 * 4), None)
    assert s[(2, 0)] == ((0, None), (0, None))  # alone, the rows are values in device memory
    grad_weight = int.from_bytes(bytes.fromhex(rec["params"][2]["hex"]), "little")
    a = pred.allocs.find(grad_weight)
    assert [e for e in acc["writes"]] == [{"alloc": a.id, "offset": grad_weight - a.addr, "size": 512 * 128 * 4,
                                           "how": "scan:pytorch"}]
    # the same launch without the fill just before it, or on another stream: to the allocation's end
    assert pred.launch(rec)[0]["writes"][0]["size"] == a.size - (grad_weight - a.addr)
    pred2, _, _ = fed_until(block2, 104)
    pred2.feed({"type": "memset", "dst": grad_weight, "bytes": 4, "stream": rec["stream"]})
    assert pred2.feed(rec)["writes"][0]["size"] == a.size - (grad_weight - a.addr)
    pred3, _, _ = fed_until(block2, 104)
    assert pred3.feed({**rec, "stream": 7})["writes"][0]["size"] == a.size - (grad_weight - a.addr)
    # the fill zeroes what it wrote; one of another value does not
    fill = next(r for r in block2 if r["type"] == "launch" and r["seq"] == 104)
    info = pred.info(fill)
    assert pred.decoders.decode(info.kernel, info.name, fill).zeroes == (2, 0, 65536 * 4)
    assert pred.decoders.decode(info.kernel, info.name, with_bytes(fill, 1, 0, ONE)).zeroes is None


def test_embedding_backward_that_does_not_check_out(block2):
    pred, rec, _ = fed_until(block2, 103)  # wpe's gradient: 64 positions, every row written
    info = pred.info(rec)
    assert pred.decoders.decode(info.kernel, info.name, {**rec, "grid": [2, 1, 1]}) is None
    assert pred.decoders.decode(info.kernel, info.name, {**rec, "smem": 4096}) is None
    # a zeroed block that is not whole rows does not bound it
    pred2, _, _ = fed_until(block2, 101)
    fill = next(r for r in block2 if r["type"] == "launch" and r["seq"] == 102)
    pred2.feed(with_bytes(fill, 0, 0, (8192 - 1).to_bytes(4, "little")))
    grad_weight = int.from_bytes(bytes.fromhex(rec["params"][2]["hex"]), "little")
    a = pred2.allocs.find(grad_weight)
    assert pred2.feed(rec)["writes"][0]["size"] == a.size - (grad_weight - a.addr)


def test_memo_keeps_apart_a_launch_after_a_zero_fill_and_the_same_launch_alone(block2):
    pred, rec, first = fed_until(block2, 105)
    fill = next(r for r in block2 if r["type"] == "launch" and r["seq"] == 104)
    pred.feed(fill)
    again = pred.feed(rec)  # the same pair repeated, as a training loop does: from the memo
    alone = pred.feed(rec)  # right after itself: nothing zeroed just before it
    assert again["writes"] == first["writes"] and again["writes"][0]["size"] == 512 * 128 * 4
    assert alone["writes"][0]["size"] > 512 * 128 * 4
    direct = Predictor("extent")
    for r in block2:  # every launch as the memo gives it and as predicted afresh agree
        if r["type"] == "validation":
            continue
        if r["type"] == "launch":
            fresh = direct.launch(r, direct.zeroed_before(r))[0]
            memoised = direct.feed(r)
            assert (memoised["reads"], memoised["writes"]) == (fresh["reads"], fresh["writes"])
        else:
            direct.feed(r)
