"""Rough edges a new user hits, each kept fixed: a stream predicted twice, `simulate` named,
empty traces, kernel names in tables, sizes in messages, a budget against its footprint, NaN in
`infer`, and `collect` leaving a device without reads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, child_env
from rich.console import Console

from gpuos_tools.errors import ExitCode
from gpuos_tools.names import abbreviate, short_name, short_names
from gpuos_tools.stream import open_input

TRACE = REPO / "examples" / "torch-train-step.ndjson.zst"
PREDICT = [sys.executable, str(REPO / "cmd" / "gpu-predict-access")]
SCHED = [sys.executable, str(REPO / "cmd" / "gpu-prefetch-sched")]
TRACE_CMD = [sys.executable, str(REPO / "cmd" / "gpu-trace")]


def _run(args: list[str], cwd: Path | None = None, **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run(args, capture_output=True, text=True, env=child_env(), cwd=cwd, timeout=300, check=False, **kw)


def _types(text: str) -> list[str]:
    return [json.loads(line)["type"] for line in text.splitlines()]


# -- a stream predicted twice -------------------------------------------------------------------


def test_predicting_twice_gives_one_access_record_per_operation(tmp_path: Path) -> None:
    once = _run([*PREDICT, str(TRACE), "-o", str(tmp_path / "a.acc")])
    assert once.returncode == 0 and once.stderr == "", once.stderr
    twice = _run([*PREDICT, str(tmp_path / "a.acc")])
    assert twice.returncode == 0
    assert "already had 100 access records" in twice.stderr
    first = (tmp_path / "a.acc").read_text().splitlines()
    second = twice.stdout.splitlines()
    assert _types("\n".join(second)).count("access") == _types("\n".join(first)).count("access") == 100
    assert second == first  # the same stream again, record for record
    # and the plan is the plan of the stream predicted once
    plans = [_run([*SCHED, "--simulate", "--budget", "66%", "--schedule", "none"], input=text)
             for text in ("\n".join(first) + "\n", twice.stdout)]
    assert plans[0].returncode == plans[1].returncode == 0
    assert plans[0].stdout.splitlines()[1:] == plans[1].stdout.splitlines()[1:]


def test_a_doubled_stream_is_refused_by_simulate(tmp_path: Path) -> None:
    once = _run([*PREDICT, str(TRACE)]).stdout.splitlines()
    doubled = []
    for line in once:
        doubled.append(line)
        if json.loads(line)["type"] == "access":
            doubled.append(line)  # what the predictor wrote before it replaced its input's
    path = tmp_path / "doubled.acc"
    path.write_text("\n".join(doubled) + "\n")
    done = _run([*SCHED, "--simulate", "--budget", "66%", str(path)])
    assert done.returncode == ExitCode.BAD_INPUT and "two access records in a row" in done.stderr


# -- simulate named -------------------------------------------------------------------------


def test_simulate_named_needs_no_flag(tmp_path: Path) -> None:
    acc = tmp_path / "a.acc"
    assert _run([*PREDICT, str(TRACE), "-o", str(acc)]).returncode == 0
    named = _run([*SCHED, "simulate", "--budget", "66%", "--schedule", "none", str(acc)])
    flagged = _run([*SCHED, "--simulate", "--budget", "66%", "--schedule", "none", str(acc)])
    assert named.returncode == flagged.returncode == 0, named.stderr
    assert named.stdout.splitlines()[1:] == flagged.stdout.splitlines()[1:]
    bare = _run([*SCHED, "--budget", "66%", str(acc)])  # no command named: the flag is required
    assert bare.returncode == ExitCode.USAGE and "--simulate" in bare.stderr


# -- empty traces ----------------------------------------------------------------------------


def _header_only(tmp_path: Path) -> Path:
    with open_input(str(TRACE)) as reader:
        header = reader.header
    path = tmp_path / "header.ndjson"
    path.write_text(json.dumps(header) + "\n")
    return path


@pytest.mark.parametrize("args", [[*TRACE_CMD, "stats"], PREDICT, [*PREDICT, "--report"]],
                         ids=["stats", "predict", "report"])
def test_an_empty_input_is_an_error(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "empty.ndjson").write_bytes(b"")
    done = _run([*args, "empty.ndjson"], cwd=tmp_path)
    assert done.returncode == ExitCode.BAD_INPUT and "empty: no records" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("args", [[*TRACE_CMD, "stats"], PREDICT, [*PREDICT, "--report"]],
                         ids=["stats", "predict", "report"])
def test_a_trace_without_gpu_work_says_so(tmp_path: Path, args: list[str]) -> None:
    done = _run([*args, str(_header_only(tmp_path))])
    assert done.returncode == 0
    assert "warning:" in done.stderr and ("no launch" in done.stderr or "no allocation" in done.stderr)


# -- kernel names ---------------------------------------------------------------------------


def _kernel_names() -> list[str]:
    names: list[str] = []
    with open_input(str(TRACE)) as reader:
        for rec in reader:
            if rec["type"] == "launch" and rec["name"] not in names:
                names.append(rec["name"])
    return names


def test_short_names_fit_and_stay_apart() -> None:
    names = _kernel_names()
    assert max(map(len, names)) > 5000  # the recorded PyTorch names are that long
    for width in (40, 60, 100):
        short = short_names(names, width)
        assert all(len(s) <= width for s in short)
        assert len(set(short)) == len(names), width  # rows never look identical


def test_short_names_keep_what_fits() -> None:
    assert short_name("twice(float*)") == "twice(float*)"
    assert abbreviate("void at::native::k<4, at::native::F<float>, std::array<char*, 1ul> >(int, float*)", 0) == \
        "at::native::k<…>"
    assert abbreviate("void at::native::k<4, at::native::F<float>, std::array<char*, 1ul> >(int, float*)", 1) == \
        "at::native::k<4, F<…>, array<…>>"
    assert abbreviate("void (anonymous namespace)::softmax<float, 4>(float*)", 1) == "softmax<float, 4>"
    assert short_names(["k<1>(int)", "k<1>(int)", "k<2>(int)"], 4) == ["k<1>", "k<1>", "k<2>"]


def test_stats_table_rows_are_short_and_distinct() -> None:
    from gpuos_tools.trace.stats import compute_stats, render_stats

    with open_input(str(TRACE)) as reader:
        stats = compute_stats(reader)
    buf = Console(width=120, color_system=None, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    render_stats(stats, buf, top=30)
    text = buf.export_text()
    table = text.split("Top kernels", 1)[1].split("Copies", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert len(rows) == 26  # one line per kernel, none folded over many
    assert len({r.split("│")[2].strip() for r in rows}) == 26
    assert len(text.splitlines()) < 80


def test_report_rows_are_distinct() -> None:
    from gpuos_tools.access.report import compute_report, render_report

    with open_input(str(TRACE)) as reader:
        rows = compute_report(reader)
    console = Console(width=120, color_system=None, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    render_report(rows, console, "alloc")
    lines = [line for line in console.export_text().splitlines() if line.startswith("│")]
    names = [line.split("│")[1].strip() for line in lines]
    assert len(names) == len(rows) and len(set(names)) == len(names)


# -- sizes and budgets in words -------------------------------------------------------------


def test_budget_is_told_against_its_footprint() -> None:
    from gpuos_tools.sched.report import render_summaries

    summary = {"policy": "belady", "budget": 4 << 30, "footprint": 40_000_000, "chunk": 2 << 20, "jobs": 1,
               "steps": 100, "unknown": 0, "in_memory_s": 0.01, "bytes_in": 0, "bytes_out": 0, "faults": 0,
               "stalls": 0, "stall_s": 0.0, "est_s": 0.01, "floor_s": 0.01, "speed_vs_in_memory": 1.0,
               "over_budget": 0}
    console = Console(width=200, color_system=None, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    render_summaries([summary], console)
    text = " ".join(console.export_text().split())
    assert "budget 4.0 GiB for a footprint of 38.1 MiB (all of it fits" in text and "used at peak" not in text
    console = Console(width=200, color_system=None, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    render_summaries([{**summary, "budget": 26_400_000}], console)
    assert "(66% of it: 152% oversubscribed)" in " ".join(console.export_text().split())


def test_no_fixed_gib_in_messages() -> None:
    """Sizes in messages go through format_size: 22 KB is never "0.00 GiB"."""
    from gpuos_tools.units import format_size

    assert format_size(22_000) == "21.5 KiB"
    for path in (REPO / "gpuos_tools").rglob("*.py"):
        assert "/ 2**30:.2f} GiB" not in path.read_text(), path


# -- infer: JSON, not NaN -------------------------------------------------------------------


def test_infer_writes_strict_json_for_nan_input() -> None:
    """A request with NaN or an infinity is refused by the daemon (bad_value); the record passed
    through and the answer are still JSON (NaN and Infinity are not), the bad values null."""
    import signal
    import uuid

    from gpuos_tools.kinfer import ring as R

    bridge = [sys.executable, str(REPO / "cmd" / "gpu-kinfer-bridge")]
    name = f"kinfer-nan-{uuid.uuid4().hex[:8]}"
    daemon = subprocess.Popen([*bridge, "serve", "--ring", name, "--gpu", "off", "--random-model", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    try:
        assert _run([*bridge, "status", "--ring", name, "--wait", "60s"]).returncode == 0
        digits = list(range(10)) * 3
        text = (json.dumps({"type": "q", "x": [float("nan"), *digits]}) + "\n"
                + json.dumps({"type": "q", "x": [*digits, float("inf")]}) + "\n")
        done = _run([*bridge, "infer", "--ring", name], input=text)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        R.ring_path(name).unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr

    def strict(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    recs = [json.loads(line, parse_constant=strict) for line in done.stdout.splitlines()]
    assert [r["type"] for r in recs] == ["header", "q", "kinfer_answer", "q", "kinfer_answer"]
    assert recs[1]["x"][0] is None and recs[3]["x"][-1] is None and recs[1]["x"][1:] == digits
    assert recs[2]["status"] == recs[4]["status"] == "bad_value"


def test_infer_answers_are_json_numbers_or_null() -> None:
    from gpuos_tools.commands.kinfer import _json_number

    assert _json_number(0.1234567) == 0.123457
    assert _json_number(float("nan")) is None and _json_number(float("inf")) is None
    # what the writer then produces is strict JSON
    text = json.dumps({"outputs": [_json_number(v) for v in (1.0, math.nan, -math.inf)]}, allow_nan=False)
    assert text == '{"outputs": [1.0, null, null]}'


# -- collect: every device gets reads ------------------------------------------------------


def test_collect_gives_every_device_its_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 1's reads are made slow: before, device 0's threads could do every read before
    device 1 finished its first, leaving it none (and `replay` refused the trace)."""
    import time

    from gpuos_tools.kinfer import traces as T

    real = os.preadv
    slow_fd: list[int] = []

    def preadv(fd: int, buffers, offset: int) -> int:  # type: ignore[no-untyped-def]
        if fd in slow_fd:
            time.sleep(0.02)
        return real(fd, buffers, offset)

    opened: list[int] = []
    real_open = os.open

    def track_open(path, flags, *args):  # type: ignore[no-untyped-def]
        fd = real_open(path, flags, *args)
        if str(path).endswith("-1.bin") and flags & os.O_DIRECT:
            slow_fd.append(fd)
        return fd

    monkeypatch.setattr(os, "open", track_open)
    monkeypatch.setattr(os, "preadv", preadv)
    try:
        recs = T.collect(tmp_path, 40, devices=2, depth=2, file_size=4 << 20, write_fraction=0.0)
    except OSError as e:
        pytest.skip(f"O_DIRECT refused here: {e}")
    reads = [r["dev"] for r in recs if r["op"] == "R"]
    assert reads.count(0) >= 20 and reads.count(1) >= 20
    assert not list(tmp_path.glob("kinfer-io-*"))


def test_collect_refuses_fewer_reads_than_devices(tmp_path: Path) -> None:
    from gpuos_tools.kinfer import traces as T

    with pytest.raises(ValueError, match="each of 3 devices"):
        T.collect(tmp_path, 2, devices=3)
    done = _run([sys.executable, str(REPO / "cmd" / "gpu-kinfer-bridge"), "collect", "--dir", str(tmp_path),
                 "--reads", "1", "--devices", "2"])
    assert done.returncode == ExitCode.USAGE and "at least one read per device" in done.stderr


# -- progress on long inputs ----------------------------------------------------------------


def _drain(master: int) -> str:
    """Everything written to a pty whose other end is closed: the kernel hands it over in pieces
    (a single read can return the first frame alone), and reading ends with EIO once it is all read."""
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the other end is closed and nothing is left
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def test_long_inputs_show_a_count_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuos_tools.commands.cli import with_progress

    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=True) as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            records = [{"type": "n", "i": i} for i in range(64)]
            assert list(with_progress(iter(records), "reading x", every=16)) == records
        shown = _drain(master)
    finally:
        os.close(master)
    assert "reading x: 48 records" in shown or "reading x: 64 records" in shown


def test_no_progress_when_not_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuos_tools.commands.cli import with_progress

    with open(tmp_path / "err", "w") as err:
        monkeypatch.setattr(sys, "stderr", err)
        assert list(with_progress(iter(range(100)), "x", every=4)) == list(range(100))
    assert (tmp_path / "err").read_text() == ""
