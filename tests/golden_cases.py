"""Golden fixtures in the style of jc's tests: an input from the traces recorded on the GPU
machines, the command run on it, and the output it must give, kept as files.

- ``GOOD``: commands run on recorded traces; the expected output is the records the command
  makes (for a filter, the records it adds: its pass-through is checked to be the input itself),
  with the header's host and version left out.
- ``BAD``: recorded traces with one record broken the way the fuzzers and an attacker broke
  them; the expected output is each command's exit status and its message.

tests/test_golden.py compares; ``scripts/make-golden`` writes the fixtures (the bad inputs once,
derived from the recorded traces as below, and every expected file).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
import zstandard

REPO = Path(__file__).resolve().parent.parent
RECORDED = Path("tests/data/recorded")  # relative: messages name files as a user would type them
GOLDEN = Path("tests/data/golden")
BAD_DIR = GOLDEN / "bad"


@contextlib.contextmanager
def in_repo() -> Iterator[None]:
    old = os.getcwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(old)


def call(command: str, args: list[str]) -> tuple[int, bytes, str]:
    """Run a gpuos command in this process, as its entry point would: (status, stdout, stderr).
    Standard output is a file (not a terminal), so commands write records."""
    from gpuos_tools.commands.cli import run
    from gpuos_tools.commands import predict_access, prefetch_sched, trace

    app = {"gpu-predict-access": predict_access.app, "gpu-trace": trace.app,
           "gpu-prefetch-sched": prefetch_sched.app}[command]
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    err = io.StringIO()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = run(typer.main.get_command(app), command, args)
        out.flush()
    finally:
        sys.stdout, sys.stderr = old
    return int(code), out.buffer.getvalue(), err.getvalue()  # type: ignore[attr-defined]


def records(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines()]


def read_stream(path: Path) -> list[dict[str, Any]]:
    from gpuos_tools.stream import open_input

    with open_input(path) as reader:
        return list(reader)


def normal(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records as kept in a fixture: the header without what depends on the machine."""
    out = []
    for r in recs:
        if r.get("type") == "header":
            r = {k: v for k, v in r.items() if k not in ("host", "version")}
        out.append(r)
    return out


def added(output: list[dict[str, Any]], source: list[dict[str, Any]], kinds: set[str]) -> list[dict[str, Any]]:
    """The records a filter added (of ``kinds``), after checking that the rest is its input."""
    rest = [r for r in output[1:] if r.get("type") not in kinds]
    if rest != source[1:]:
        raise AssertionError("the filter did not pass its input through unchanged")
    return [output[0], *(r for r in output if r.get("type") in kinds)]


# -- the good cases: (name, how to get the records to compare) ------------------------------------


def _predict(trace: str, *opts: str) -> Callable[[], list[dict[str, Any]]]:
    def run_case() -> list[dict[str, Any]]:
        path = RECORDED / f"{trace}.ndjson.zst"
        code, out, err = call("gpu-predict-access", [*opts, str(path)])
        assert code == 0, err
        return added(records(out), read_stream(path), {"access"})

    return run_case


def _whole(command: str, *args: str) -> Callable[[], list[dict[str, Any]]]:
    def run_case() -> list[dict[str, Any]]:
        code, out, err = call(command, list(args))
        assert code == 0, err
        return records(out)

    return run_case


def _simulate(trace: str, *opts: str) -> Callable[[], list[dict[str, Any]]]:
    def run_case() -> list[dict[str, Any]]:
        import tempfile

        code, acc, err = call("gpu-predict-access", [str(RECORDED / f"{trace}.ndjson.zst")])
        assert code == 0, err
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{trace}.acc"
            path.write_bytes(acc)
            code, out, err = call("gpu-prefetch-sched", ["--simulate", *opts, str(path)])
        assert code == 0, err
        return records(out.replace(json.dumps(str(path)).encode(), json.dumps(f"{trace}.acc").encode()))

    return run_case


GOOD: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "predict-cupy": _predict("cupy"),
    "predict-apis-graph": _predict("apis-graph"),
    "predict-range-validate": _predict("validate", "--granularity", "range"),
    "report-validate": _whole("gpu-predict-access", "--report", str(RECORDED / "validate.ndjson.zst")),
    "learn-suite-cupy": _whole("gpu-predict-access", "--learn", str(RECORDED / "suite-cupy_suite.s1.ndjson.zst")),
    "stats-torch": _whole("gpu-trace", "stats", str(RECORDED / "torch.ndjson.zst")),
    "stats-apis-graph": _whole("gpu-trace", "stats", str(RECORDED / "apis-graph.ndjson.zst")),
    "simulate-torch": _simulate("torch", "--budget", "50%", "--schedule", "none"),
}


def expected_good(name: str) -> Path:
    return GOLDEN / f"{name}.expected.ndjson"


# -- the bad cases: each a recorded trace with one thing broken -----------------------------------

#: every command that reads a trace: the bad line must stop each the same way
COMMANDS: dict[str, list[str]] = {
    "gpu-predict-access": [],
    "gpu-trace": ["stats"],
    "gpu-prefetch-sched": ["--simulate", "--budget", "50%"],
}


def _lines(trace: str) -> list[str]:
    """A recorded trace's lines, less its module and library records (large lists of kernel
    names that no case here is about)."""
    with zstandard.open(REPO / RECORDED / f"{trace}.ndjson.zst", "rt") as f:
        return [line for line in f.read().splitlines()
                if not line.startswith(('{"type":"module"', '{"type":"library"'))]


def _edit(trace: str, pick: Callable[[dict[str, Any]], bool], change: Callable[[dict[str, Any]], Any],
          keep: int = 60) -> str:
    """The first ``keep`` lines of a trace with the first record ``pick`` chooses changed."""
    lines = _lines(trace)[:keep]
    for i, line in enumerate(lines):
        rec = json.loads(line)
        if pick(rec):
            change(rec)
            lines[i] = json.dumps(rec, separators=(",", ":"))
            return "\n".join(lines) + "\n"
    raise AssertionError(f"nothing to change in {trace}")


def _raw(trace: str, pick: Callable[[dict[str, Any]], bool], text: Callable[[str], str], keep: int = 60) -> str:
    lines = _lines(trace)[:keep]
    for i, line in enumerate(lines):
        if pick(json.loads(line)):
            lines[i] = text(line)
            return "\n".join(lines) + "\n"
    raise AssertionError(f"nothing to change in {trace}")


def _is(kind: str, key: str | None = None) -> Callable[[dict[str, Any]], bool]:
    return lambda r: r.get("type") == kind and (key is None or key in r)


BAD: dict[str, Callable[[], str]] = {
    "type-is-a-number": lambda: _raw("cupy", _is("alloc"), lambda line: '{"type":5}'),
    "type-is-empty": lambda: _raw("cupy", _is("alloc"), lambda line: '{"type":""}'),
    "dptrs-index-out-of-range": lambda: _edit("cupy", _is("launch", "dptrs"),
                                              lambda r: r["dptrs"][0].__setitem__(0, 99)),
    "dptrs-past-the-parameter": lambda: _edit("cupy", _is("launch", "dptrs"),
                                              lambda r: r["dptrs"][0].__setitem__(1, 30)),
    "alloc-without-size": lambda: _edit("cupy", _is("alloc"), lambda r: r.pop("size")),
    "alloc-size-negative": lambda: _edit("cupy", _is("alloc"), lambda r: r.update(size=-4096)),
    "alloc-size-1e300": lambda: _edit("cupy", _is("alloc"), lambda r: r.update(size=1e300)),
    "alloc-size-1e15": lambda: _edit("cupy", _is("alloc"), lambda r: r.update(size=10**15)),
    "alloc-size-nan": lambda: _raw("cupy", _is("alloc"), lambda line: line.replace('"size":', '"size":NaN,"was":')),
    "alloc-id-is-a-list": lambda: _edit("cupy", _is("alloc"), lambda r: r.update(id=[1])),
    "alloc-past-64-bits": lambda: _edit("cupy", _is("alloc"), lambda r: r.update(addr=(1 << 64) - 16)),
    "params-is-a-string": lambda: _edit("cupy", _is("launch"), lambda r: r.update(params="abc")),
    "params-hex-not-hex": lambda: _edit("cupy", _is("launch"), lambda r: r["params"][0].update(hex="zz" * 4)),
    "params-hex-longer-than-size": lambda: _edit("cupy", _is("launch"), lambda r: r["params"][0].update(size=1)),
    "launch-grid-of-two": lambda: _edit("cupy", _is("launch"), lambda r: r.update(grid=[1, 1])),
    "launch-seq-missing": lambda: _edit("cupy", _is("launch"), lambda r: r.pop("seq")),
    "memcpy-bytes-string": lambda: _edit("cupy", _is("memcpy"), lambda r: r.update(bytes="4096")),
    "memcpy-2d-span-past-256TiB": lambda: _edit("apis", _is("memcpy", "height"), lambda r: r.update(height=1 << 44),
                                                keep=200),
    "graph-stream-is-a-list": lambda: _edit("apis-graph", _is("graph", "stream"), lambda r: r.update(stream=[1]),
                                            keep=200),
    "free-addr-null": lambda: _edit("torch", _is("free"), lambda r: r.update(addr=None), keep=30),
    "schema-gpuos-99": lambda: _edit("cupy", _is("header"), lambda r: r.update(schema="gpuos/99")),
    "header-without-schema": lambda: _edit("cupy", _is("header"), lambda r: r.pop("schema")),
    "header-twice": lambda: "\n".join(_lines("cupy")[:5] + _lines("cupy")[:5]) + "\n",
    "truncated-mid-record": lambda: "\n".join(_lines("cupy")[:20]) + "\n" + _lines("cupy")[20][:57],
    "object-without-type": lambda: _raw("cupy", _is("alloc"), lambda line: line.replace('"type":"alloc",', "")),
}


def bad_input(name: str) -> Path:
    return BAD_DIR / f"{name}.ndjson"


def bad_expected(name: str) -> Path:
    return BAD_DIR / f"{name}.expected.json"


def run_bad(path: Path) -> dict[str, list[Any]]:
    """{command: [status, the last line of its standard error, records written]}."""
    out: dict[str, list[Any]] = {}
    for command, args in COMMANDS.items():
        code, data, err = call(command, [*args, str(path)])
        lines = err.strip().splitlines()
        out[command] = [code, lines[-1] if lines else "", len(data.decode().splitlines())]
    return out


#: Inputs that are not streams at all, with what each command must say.
FOREIGN = {
    "json-without-final-newline": RECORDED / "cupy.report.json",
}
