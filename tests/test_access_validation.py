"""Scoring predictions against `validation` records, and size templates, on traces recorded
with `gpu-trace run --validate` on an H100 (tests/data/recorded/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.access.predict import Predictor
from gpuos_tools.access.report import compute_report
from gpuos_tools.access.templates import Sample, Templates, evaluate, fit, learn, observed
from gpuos_tools.stream import open_input

DATA = Path(__file__).resolve().parent / "data" / "recorded"
ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> list[dict]:
    with open_input(str(DATA / name)) as reader:
        return list(reader)


def scored(records, granularity="range", templates=None) -> dict[str, dict]:
    """kernel -> the `validated` entry of its (only) validated launch."""
    out = {}
    for rec in Predictor(granularity, templates).annotate(records, validated=True):
        if rec["type"] == "access" and "validated" in rec:
            out[rec["kernel"]] = rec["validated"]
    return out


@pytest.mark.parametrize("granularity", ["range", "alloc"])
def test_validated_entries_say_what_the_gpu_showed(granularity):
    v = scored(load("validate.ndjson.zst"), granularity)
    copy = v["_Z4copyIfEvPKT_PS0_i"]
    assert copy["writes"] == "ok" and copy["reads"] == "ok"
    assert copy["written_bytes"] == 40064  # 10000 floats, rounded to 128-byte chunks
    # range: from y to the end of its allocation; alloc: all of it (3x as much)
    assert copy["extra_write_bytes"] >= 2 * 40000
    assert copy["missed_read_bytes"] == 0 and copy["read_bytes"] == 40064
    # a pointer written into device memory by a kernel: no prediction sees through it
    assert v["hidden_write"]["writes"] == "missed" and v["hidden_write"]["missed_write_bytes"] >= 40000
    assert v["hidden_read"]["reads"] == "missed"
    # a pointer array copied from the host is followed (the memcpy record carries its bytes)
    assert v["follow_write"]["writes"] == "ok" and v["follow_write"]["reads"] == "ok"
    assert v["stamp"]["reads"] == "nondeterministic"


def test_access_records_precede_their_validation_and_pass_everything_through():
    records = load("validate.ndjson.zst")
    out = list(Predictor("range").annotate(records, validated=True))
    assert [r for r in out if r["type"] != "access"] == records
    for i, rec in enumerate(out):
        if rec["type"] == "validation":
            assert out[i - 1]["type"] == "access" and out[i - 1]["seq"] == rec["seq"]
            assert out[i - 2]["type"] == "launch" and out[i - 2]["seq"] == rec["seq"]


def test_report_sums_validation_per_kernel():
    rows = {r.kernel: r for r in compute_report(load("validate.ndjson.zst"), "range") if r.kernel}
    assert rows["hidden_write"].validated == 1 and rows["hidden_write"].missed_write_launches == 1
    assert rows["hidden_read"].missed_read_launches == 1
    assert rows["stamp"].reads_unchecked == {"nondeterministic": 1}
    assert rows["_Z4copyIfEvPKT_PS0_i"].missed_write_bytes == 0


@pytest.mark.parametrize("program", ["cupy_suite", "torch_cnn"])
def test_suite_range_and_alloc_predictions_miss_nothing(program):
    """The speculation (no templates) held on every validated launch of the recorded suite."""
    for scale in (1, 2):
        records = load(f"suite-{program}.s{scale}.ndjson.zst")
        for granularity in ("range", "alloc"):
            rows = compute_report(records, granularity)
            assert sum(r.validated for r in rows) > 20
            assert sum(r.missed_write_launches + r.missed_read_launches for r in rows) == 0


def test_the_validator_run_of_cufft_follows_the_table_its_module_variables_point_to():
    """cuFFT reads a twiddle table through a variable of each of its JIT-linked modules, which it
    locates by name and fills from the host with the table's address. With the variables traced
    (symbol records) the prediction reads the table, the validator's copy of each module got the
    program's bytes, and every launch was checked without a missed read or write."""
    records = load("validator-fft.ndjson.zst")
    allocs = {r["addr"]: r for r in records if r["type"] == "alloc"}
    variables = {r["addr"]: r for r in records if r["type"] == "symbol" and r["of"] == "variable"}
    assert {v["name"] for v in variables.values()} == {"lut_sp"} and len(variables) == 4
    stored = [r for r in records if r["type"] == "memcpy" and r["dst"] in variables]
    assert len(stored) == 4 and all(r["dst"] not in allocs for r in stored)
    table = {int.from_bytes(bytes.fromhex(r["data"]), "little") for r in stored}
    assert len(table) == 1 and allocs[table.pop()]["size"] == 6967984  # the twiddle table
    # the launches' functions came from the library's private tables: the tracer asked the driver
    fft = {r["func"] for r in records if r["type"] == "launch" and "fft" in r["kernel"]}
    asked = {r["func"] for r in records if r["type"] == "symbol" and r["api"] == "cuFuncGetModule"}
    assert len(fft) == 4 and fft <= asked
    for granularity in ("alloc", "range", "extent"):
        rows = compute_report(records, granularity)
        assert sum(r.validated for r in rows) == 14, granularity
        assert sum(r.missed_read_launches + r.missed_write_launches for r in rows) == 0, granularity
        copies = next(r for r in rows if r.of == "memcpy")
        assert copies.unknown == 0  # the copies into the module variables are known by name
    # the table is in each cuFFT launch's prediction only through the variables
    pred = Predictor("range")
    through = [acc for r in records if (acc := pred.feed(r)) is not None and acc["of"] == "launch"
               and any("variable:lut_sp" in e["how"] for e in acc["reads"])]
    assert len(through) == 6


@pytest.mark.parametrize("program, validated", [("sparse", 65), ("compiled", 14)])
def test_the_validator_runs_of_cusparse_and_triton_miss_nothing(program, validated):
    """cuSPARSE through CuPy and a torch.compile'd MLP (Triton), replayed in the validator on an
    H100: every launch checked read and wrote only what its prediction named, at every
    granularity (CUB's merge sort inside cuSPARSE launches with programmatic stream serialization,
    which the replay drops)."""
    records = load(f"validator-{program}.ndjson.zst")
    for granularity in ("alloc", "range", "extent"):
        rows = compute_report(records, granularity)
        assert sum(r.validated for r in rows) == validated, granularity
        assert sum(r.missed_read_launches + r.missed_write_launches for r in rows) == 0, granularity


def test_pointer_array_batched_gemm_is_followed():
    records = load("suite-cupy_suite.s1.ndjson.zst")
    accs = [r for r in Predictor("alloc").annotate(records) if r["type"] == "access" and r["of"] == "launch"]
    stored = [a for a in accs if any("stored" in e["how"] for e in a["writes"])]
    assert stored and not any(a["unknown"] for a in stored)


def test_templates_reproduce_the_samples_they_were_fitted_on():
    records = load("suite-torch_cnn.s1.ndjson.zst")
    learned = learn(records)
    assert len(learned) > 50
    templates = Templates(t.record() for t in learned)
    with_t = compute_report(records, "range", templates)
    plain = compute_report(records, "range")
    assert sum(r.missed_write_launches for r in with_t) == 0
    assert sum(r.missed_read_bytes for r in with_t) == 0
    assert sum(r.extra_write_bytes for r in with_t) * 2 < sum(r.extra_write_bytes for r in plain)


def test_fit_finds_a_product_of_scalar_arguments():
    # a pooling kernel's input: N*C*H*W floats, with N varying between samples
    def sample(n):
        ints = {(2, 0, 4): n, (3, 0, 4): 32, (4, 0, 4): 16, (5, 0, 4): 16, (6, 0, 4): 2}
        return Sample(ints, frozenset(ints), 0x10000, 1 << 24, observed(0x10000, 1 << 24, 4 * n * 32 * 16 * 16), 0)

    expr, _ = fit([sample(16), sample(8)], "read")
    assert evaluate(expr, sample(32).ints) == 4 * 32 * 32 * 16 * 16
    assert fit([sample(16)], "written")[0] == {"const": 0}


def test_observed_rounds_to_chunks_within_the_span():
    assert observed(0x1000, 1000, 0) == 0
    assert observed(0x1000, 1000, 1) == 128
    assert observed(0x1000, 1000, 999) == 1000  # clipped at the span's end
    assert observed(0x1040, 4096, 64) == 64  # to the next absolute chunk boundary


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gpuos_tools.commands.predict_access", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_learn_then_templates(tmp_path):
    tpl = tmp_path / "cnn.templates"
    proc = run_cli("--learn", str(DATA / "suite-torch_cnn.s1.ndjson.zst"), "-o", str(tpl))
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(line) for line in tpl.read_text().splitlines()]
    assert recs[0]["type"] == "header" and all(r["type"] == "access_template" for r in recs[1:])
    proc = run_cli("--templates", str(tpl), "--report", str(DATA / "suite-torch_cnn.s2.ndjson.zst"))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()[1:]]
    assert rows[0]["granularity"] == "range" and any("validation" in r for r in rows)
    proc = run_cli("--templates", str(tpl), "--granularity", "alloc", str(DATA / "validate.ndjson.zst"))
    assert proc.returncode != 0 and "range" in proc.stderr


def test_cli_learn_without_validation_records_fails_clearly():
    proc = run_cli("--learn", str(DATA / "cupy.ndjson.zst"))
    assert proc.returncode == 1 and "gpu-trace run --validate" in proc.stderr


def test_plot_draws_an_access_map(tmp_path):
    from gpuos_tools.access.plot import READ, UNKNOWN, WRITE, access_matrix

    records = load("suite-torch_cnn.s2.ndjson.zst")
    m, ids, seqs = access_matrix(records)
    assert m.shape == (len(ids), len(seqs)) and len(seqs) > 100
    assert (m == WRITE).any() and (m == READ).any() and not (m == UNKNOWN).any()
    png = tmp_path / "map.png"
    proc = run_cli("--plot", str(png), str(DATA / "suite-torch_cnn.s2.ndjson.zst"))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_graph_launch_runs_what_was_captured():
    records = load("apis-graph.ndjson.zst")
    events = [r for r in records if r["type"] == "graph"]
    assert [e["event"] for e in events][:3] == ["capture_begin", "capture_end", "instantiate"]
    captured = [r for r in records if r["type"] == "launch" and r.get("captured")]
    pred = Predictor("range")
    graphs = [a for a in map(pred.feed, records) if a and a["of"] == "graph_launch"]
    assert len(graphs) == 2
    for g in graphs:
        assert not g["unknown"] and g["launches"] == len(captured)
        # the captured kernel reads x and writes y: the same allocations as when it was captured
        first = Predictor("range")
        caps = [a for a in map(first.feed, records) if a and a.get("captured")]
        assert {e["alloc"] for e in g["writes"]} == {e["alloc"] for a in caps for e in a["writes"]}


def test_access_records_carry_their_source_records_time():
    records = load("suite-torch_cnn.s2.ndjson.zst")
    pred = Predictor("range")
    pairs = [(r, pred.feed(r)) for r in records]
    pairs = [(r, a) for r, a in pairs if a is not None]
    assert pairs and all(a["ts"] == r["ts"] for r, a in pairs)


def test_the_validator_checks_every_launch_of_a_timm_resnet_moving_what_its_driver_keeps():
    """A timm ResNet-18 step under the validator on an H100: the validator's own driver kept
    most of the program's addresses for itself, so 102 of the 111 launches were replayed with
    those spans moved and the pointers to them moved with them; none missed a read or a write
    at any granularity."""
    records = load("validator-timm.ndjson.zst")
    vals = [r for r in records if r["type"] == "validation"]
    assert len(vals) == 111 and all(v["checked"] for v in vals)
    moved = [v for v in vals if "relocated" in v]
    assert len(moved) == 102
    for v in moved:  # why each was moved: every strategy's refusal, the last naming the address
        assert v["address_fallback"][-1]["why"].startswith("unvalidated: address unavailable")
        assert all(to not in range(a, a + n) for a, n, to in v["relocated"]["spans"])
    assert sum(v["relocated"]["pointers"]["parameters"] for v in moved) == 575
    for granularity in ("alloc", "range", "extent"):
        rows = compute_report(records, granularity)
        assert sum(r.validated for r in rows) == 111, granularity
        assert sum(r.missed_read_launches + r.missed_write_launches for r in rows) == 0, granularity


def test_moved_replays_still_catch_reads_through_a_pointer_stored_on_the_gpu():
    """The CuPy kernels program, five of its eleven launches moved: the two that reach a buffer
    through a pointer a kernel stored on the GPU still fault in the validator (the buffer is
    not mapped there), and the pointer table copied from the host was moved with its span."""
    records = load("validator-kernels.ndjson.zst")
    vals = {v["kernel"]: v for v in records if v["type"] == "validation"}
    assert all(v["checked"] for v in vals.values()) and len(vals) == 8  # 11 launches, 8 kernels
    for name in ("hidden_read", "hidden_write"):
        assert vals[name]["reads"] == "missed" and vals[name]["fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert "relocated" in vals["hidden_write"]
    assert vals["follow_write"]["relocated"]["pointers"]["memory"] == 1
    assert vals["follow_write"]["reads"] == "ok" and vals["follow_write"]["missed_writes"] == []
    copy = vals["_Z4copyIfEvPKT_PS0_i"]
    assert any(e["read"] for e in copy["extents"])


def test_read_extents_measured_in_the_validator_score_the_reads():
    """The optimizer program under the validator with read extents: the scorer has read bytes
    to compare (it had none without them), nothing missed at range, extent or alloc, and
    templates learned at size 1 are scored at size 2."""
    s1, s2 = load("validator-suite-torch_optim.s1.ndjson.zst"), load("validator-suite-torch_optim.s2.ndjson.zst")
    vals = [r for r in s2 if r["type"] == "validation"]
    assert len(vals) == 83 and all(v["checked"] and v.get("mode") == "validator" for v in vals)
    for granularity in ("alloc", "range", "extent"):
        rows = compute_report(s2, granularity)
        assert sum(r.read_measured for r in rows) > 60, granularity
        assert sum(r.read_bytes for r in rows) > 0
        assert sum(r.missed_read_launches + r.missed_write_launches for r in rows) == 0, granularity
    learned = learn(s1)
    assert len(learned) > 50


@pytest.mark.parametrize("size", [1, 2])
def test_layer_norm_and_split_k_gemm_extents_match_what_the_validator_measured(size):
    """PyTorch's layer-norm kernels and fused AdamW step, cuBLAS's split-K SGEMM and cuBLASLt's
    bias epilogue, decoded from their arguments and grid: at both sizes of the optimizer suite, nothing missed and not
    a byte written past what the GPU showed (C, updated in place, is read: the measurement cannot
    see a read of what the kernel overwrites)."""
    records = load(f"validator-suite-torch_optim.s{size}.ndjson.zst")
    names = ("layer_norm", "sgemm_largek", "epilogue4impl", "fused_adamw")
    rows = [r for r in compute_report(records, "extent") if any(n in (r.kernel or "") for n in names)]
    assert len(rows) == 6 and sum(r.validated for r in rows) == 19
    for r in rows:
        assert r.missed_read_launches == r.missed_write_launches == 0, r.kernel
        assert r.extra_write_bytes == 0 and r.written_bytes > 0, r.kernel
    norms = [r for r in rows if "layer_norm" in r.kernel]
    assert sum(r.extra_read_bytes for r in norms) == 256  # LayerNorm's bias, all zeros: zeroing it shows nothing


@pytest.mark.parametrize("size", [1, 2])
def test_embedding_gathers_and_dropout_write_exactly_what_the_validator_saw(size):
    """The GPT-2 block's token and position lookups (vectorized_gather_kernel), decoded from
    their count, slice size and strides, and its dropouts: every byte written and no byte more,
    at both sizes; nothing in the program missed at extent."""
    records = load(f"validator-suite-transformer_block.s{size}.ndjson.zst")
    rows = compute_report(records, "extent")
    assert sum(r.missed_read_launches + r.missed_write_launches for r in rows) == 0
    gather = [r for r in rows if "vectorized_gather_kernel" in (r.kernel or "")]
    assert len(gather) == 1 and gather[0].validated == 2
    assert gather[0].extra_write_bytes == 0 and gather[0].written_bytes == 49152 * size
    # dropout's contiguous case (ADims 1): its output and mask, exactly
    dropout = [r for r in rows if "fused_dropout_kernel_vec" in (r.kernel or "")]
    assert len(dropout) == 1 and dropout[0].validated == 3 and dropout[0].extra_write_bytes == 0
    # arange's positions: N elements of a type its name does not show, bounded by 8 bytes each
    # (arange dispatches on no complex type); the int64 positions fill exactly that, and the
    # 16 bytes left are a launch of two positions whose values were already there
    arange = [r for r in rows if "elementwise_kernel_with_index" in (r.kernel or "")]
    assert len(arange) == 1 and arange[0].validated == 3
    assert arange[0].extra_write_bytes == 16
    # tanh's output (GELU's) and the plain copies are their input's type: exactly what was written
    for kernel in ("tanh_kernel_cuda", "direct_copy_kernel_cuda"):
        hit = [r for r in rows if kernel in (r.kernel or "") and r.validated]
        assert hit and all(r.extra_write_bytes == 0 and r.written_bytes for r in hit), kernel
