"""Seeded fuzzers for what gpuos tools read from others: streams, checkpoint images and TOML
profiles. tests/test_fuzz.py runs them in CI; run this file directly for a longer campaign:

    python3 tests/fuzz.py stream 20000 [SEED]

Each case starts from data recorded on the GPU machines (the traces and images in tests/data)
or shipped (the profiles), changes it the way a damaged disk, a careless edit or an attacker
would, and runs what the commands run on it. A case passes when the code either works or
refuses the input with a clean error of the expected kind; any other exception, a hang, or an
image that verifies while giving other bytes than were written, fails it. A failing case is
shrunk (lines, then fields) so that it can be kept as a regression fixture under
tests/data/fuzz/.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import random
import shutil
import stat
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpuos_tools.errors import ExitCode, GpuosError  # noqa: E402

RECORDED = REPO / "tests" / "data" / "recorded"
FIXTURES = REPO / "tests" / "data" / "fuzz"

#: values that broke tools before: wrong types, out of range, huge, not finite, deep
NASTY: list[Any] = [
    -1, 0, 1, 7, 2**31, 2**48 + 1, 2**63, 2**64, -(2**64), 10**15, 10**400, 1.5, -0.0, 1e300, math.nan, math.inf,
    -math.inf, "", "x", "0", "4096", "/etc/hostname", "../x", "\u0000", "é" * 3, None, True, False, [], [1],
    [[1, 2, "device"]], [1, 2, 3], ["a"] * 3, {}, {"a": 1}, {"const": 5}, [[[[[[[[[[[]]]]]]]]]]],
]


def nasty(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(NASTY))


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path (keys and indices) inside a JSON value, the value itself first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):
            yield from _paths(v, (*prefix, i))


def _get(value: Any, path: tuple) -> Any:
    for p in path:
        value = value[p]
    return value


def mutate_json(value: Any, rng: random.Random, protect: tuple = ()) -> Any:
    """One random change somewhere inside a JSON value: a value replaced (by a nasty one, or
    nudged), a key dropped or added, a list shortened or grown."""
    paths = [p for p in _paths(value) if p and p[: len(protect)] != protect or not protect and p]
    if not paths:
        return value
    path = rng.choice(paths)
    parent = _get(value, path[:-1])
    key = path[-1]
    old = parent[key]
    r = rng.random()
    if r < 0.35:
        parent[key] = nasty(rng)
    elif r < 0.65 and isinstance(old, (int, bool, str)):
        parent[key] = nudge(old, rng)
    elif r < 0.75 and isinstance(parent, dict):
        del parent[key]
    elif r < 0.85 and isinstance(parent, list):
        if rng.random() < 0.5:
            del parent[key]
        else:
            parent.insert(key, copy.deepcopy(old))
    elif isinstance(parent, dict):
        parent[rng.choice(["type", "id", "size", "x", "n", "seq", "addr"])] = nasty(rng)
    else:
        parent[key] = nasty(rng)
    return value


#: strings that are valid somewhere: a value valid for one field put into another
WORDS = ["launch", "memcpy", "memset", "graph_launch", "device", "host", "managed", "HtoD", "DtoH", "DtoD",
         "create", "destroy", "capture_begin", "capture_end", "instantiate", "ok", "missed", "none", "R", "W",
         "nv.info", "sha256:" + "0" * 64, "00" * 8, "ff" * 24, "0000803f0000803f", "_Z5twicePf"]


def nudge(old: Any, rng: random.Random) -> Any:
    """A value of the same type that readers accept but tools may not expect: zero, one more or
    less, a random size or address, another valid word."""
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return rng.choice([0, 1, old + 1, max(0, old - 1), old * 2, rng.randrange(1 << 48),
                           rng.randrange(1 << 64), rng.randrange(1 << 12), old + 8, (1 << 48) - rng.randrange(9)])
    return rng.choice(WORDS)


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- streams --------------------------------------------------------------------------------------


def _trace_lines(name: str) -> list[str]:
    import zstandard

    with zstandard.open(RECORDED / name, "rt") as f:
        lines = f.read().splitlines()
    out = []
    for line in lines:
        rec = json.loads(line)
        if rec["type"] == "module":  # keep modules, but not their thousands of kernel names
            rec["kernels"] = rec.get("kernels", [])[:3]
            line = dumps(rec)
        out.append(line)
    return out


_BASES: dict[str, list[str]] | None = None


def stream_bases() -> dict[str, list[str]]:
    """Recorded streams to start from: traces, what gpu-predict-access makes of one, learned
    templates, and a synthetic block-I/O trace of gpu-kinfer-bridge."""
    global _BASES
    if _BASES is None:
        from gpuos_tools.access.predict import Predictor
        from gpuos_tools.access.templates import learn
        from gpuos_tools.kinfer.traces import synthesize
        from gpuos_tools.stream import make_header

        bases = {n: _trace_lines(f"{n}.ndjson.zst") for n in ("cupy", "apis-graph", "validate", "suite-cupy_suite.s1")}
        recs = [json.loads(line) for line in bases["cupy"]]
        bases["cupy.acc"] = [dumps(r) for r in Predictor("range").annotate(recs)]
        suite = [json.loads(line) for line in bases["suite-cupy_suite.s1"]]
        bases["templates"] = [dumps(make_header("fuzz"))] + [dumps(t.record()) for t in learn(suite)]
        io_recs = synthesize(40, seed=3)
        bases["io"] = [dumps(make_header("fuzz", trace="synthetic"))] + [
            dumps({k: (float(v) if hasattr(v, "dtype") and v.dtype.kind == "f" else
                       int(v) if hasattr(v, "dtype") else v) for k, v in r.items()}) for r in io_recs]
        _BASES = bases
    return _BASES


def stream_case(rng: random.Random) -> bytes:
    """A window of a recorded stream, its header first (mostly), with 1 to 3 changes."""
    bases = stream_bases()
    lines = bases[rng.choice(sorted(bases))]
    start = rng.randrange(1, max(2, len(lines) - 5))
    window = lines[start:start + rng.randrange(3, 40)]
    if rng.random() < 0.9:
        window = [lines[0], *window]
    recs: list[Any] = [json.loads(line) for line in window]
    raw_tail = None
    for _ in range(rng.randrange(1, 4)):
        r = rng.random()
        i = rng.randrange(len(recs))
        if r < 0.7:
            recs[i] = mutate_json(recs[i], rng)
        elif r < 0.75:
            recs.insert(i, copy.deepcopy(recs[0]))  # a second header, or a duplicate
        elif r < 0.8 and isinstance(recs[i], dict):
            recs[i]["type"] = rng.choice(["alloc", "free", "launch", "memcpy", "memset", "graph", "graph_launch",
                                          "validation", "access", "access_template", "header", "io", "stream"])
        elif r < 0.85:
            recs[i] = nasty(rng)
        elif r < 0.9 and isinstance(recs[0], dict):
            recs[0]["schema"] = rng.choice(["gpuos/2", "gpuos/99", None, 1, ""])
        else:
            raw_tail = rng.choice(["cut", "nonl", "utf8", "blank", "deep"])
    text = "".join((dumps(r) if not isinstance(r, str) else json.dumps(r)) + "\n" for r in recs)
    data = text.encode("utf-8", "surrogatepass")
    if raw_tail == "cut":
        data = data[: rng.randrange(1, len(data))]
    elif raw_tail == "nonl":
        data = data.rstrip(b"\n")
    elif raw_tail == "utf8":
        at = rng.randrange(len(data))
        data = data[:at] + b"\xff\xc3" + data[at:]
    elif raw_tail == "blank":
        data = data.replace(b"\n", b"\n\n  \n", 1)
    elif raw_tail == "deep":
        data += b'{"type":"launch","seq":1,"params":' + b"[" * 5000 + b"]" * 5000 + b"}\n"
    return data


STREAM_CODES = {ExitCode.BAD_INPUT, ExitCode.TRUNCATED}


def _read(data: bytes, on_error: str = "raise") -> list[dict[str, Any]]:
    from gpuos_tools.stream.reader import Reader

    buf = io.BytesIO(data)
    mode: Any = on_error
    with Reader("fuzz.ndjson", buf.read, None, compressed_by_name=False, on_error=mode) as reader:
        return list(reader)


def run_stream(data: bytes) -> None:
    """What the commands do with a stream: read it, then stats, prediction (both granularities,
    report, explain), templates, the simulator and the I/O trace reader. Raises what they raise."""
    from rich.console import Console

    from gpuos_tools.access.predict import Predictor
    from gpuos_tools.access.report import compute_report, explain, render_explain, render_report, report_records
    from gpuos_tools.access.templates import Templates, learn
    from gpuos_tools.kinfer.traces import device_reads, io_records
    from gpuos_tools.sched.schedule import write_schedule
    from gpuos_tools.sched.simulate import Config, simulate
    from gpuos_tools.sched.workload import Chunks, interleave, load_job
    from gpuos_tools.trace.stats import compute_stats, render_stats, stats_records

    _read(data, on_error="emit")
    recs = _read(data)
    console = Console(file=io.StringIO(), width=100)
    stats = compute_stats(copy.deepcopy(recs))
    list(stats_records(stats))
    render_stats(stats, console, top=5)
    validated = bool(recs and recs[0].get("type") == "header" and recs[0].get("validate"))
    acc: list[dict[str, Any]] = []
    for gran in ("alloc", "range"):
        acc = list(Predictor(gran).annotate(copy.deepcopy(recs), validated))
        rows = compute_report(copy.deepcopy(recs), gran)
        list(report_records(rows, gran))
        render_report(rows, console, gran)
    seq = next((r.get("seq") for r in recs if r.get("type") == "launch"), None)
    if seq is not None:
        ex = explain(copy.deepcopy(recs), seq, "range")
        if ex is not None:
            render_explain(ex, console)
    templates = Templates([t.record() for t in learn(copy.deepcopy(recs))] +
                          [r for r in recs if r.get("type") == "access_template"])
    if templates:
        list(Predictor("range", templates).annotate(copy.deepcopy(recs), validated))
    chunks = Chunks(64 << 10)
    job = load_job(copy.deepcopy(acc + [r for r in recs if r.get("type") == "access"]), chunks)
    if job.steps:
        work = interleave(chunks, [job], 1e-3)
        cfg = Config(max(1, work.footprint // 2))
        simulate(work, "demand", cfg)
        write_schedule(work, "belady", cfg, lambda r: None)
    device_reads(list(io_records(recs)))


def _stream_ok(e: BaseException) -> bool:
    if isinstance(e, GpuosError) and e.code in STREAM_CODES:
        return True
    # io_records reports a bad io record as ValueError, which the command turns into BAD_INPUT
    return isinstance(e, ValueError) and "not a valid io record" in str(e)


# -- images ---------------------------------------------------------------------------------------

IMAGE_CODES = {ExitCode.IMAGE_CORRUPT, ExitCode.NO_INPUT, ExitCode.BAD_INPUT}


def sealed_chain(directory: Path) -> tuple[Path, dict[int, bytes]]:
    """The recorded agent images compacted into a sealed full image, with an incremental image on
    it that rewrites buffer 2 (as the recorded incremental did), at a 64 KiB chunk size so that
    buffers span several chunks; and what each buffer holds at the head."""
    from gpuos_tools.image import ImageWriter, compact, open_image

    directory.mkdir(parents=True, exist_ok=True)
    compact(RECORDED / "agent-image" / "full", directory / "full", chunk_size=64 << 10)
    inc = open_image(RECORDED / "agent-image" / "inc")
    with ImageWriter(directory / "inc", {"source": "fuzz"}, parent=directory / "full", chunk_size=64 << 10,
                     compress=True, checksum="sha256") as w:
        b = inc.buffer(2)
        w.add(2, b["addr"], b["size"], inc.read(2))
        w.commit()
    head = open_image(directory / "inc")
    return directory / "inc", {b["id"]: head.read(b["id"]) for b in head.buffers}


def image_case(rng: random.Random, base: Path, work: Path) -> tuple[Path, bool]:
    """A copy of the sealed chain with 1 to 2 changes; (head, resealed: the manifest's own sum was
    recomputed after the change, as someone who knows the format but not a key would)."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(base.parent, work, symlinks=True)
    head = work / base.name
    resealed = False
    for _ in range(rng.randrange(1, 3)):
        target = head if rng.random() < 0.7 else work / "full"
        r = rng.random()
        folder = target / "chunks"
        # only regular files, never through a link: a change made earlier may have left a FIFO or
        # a link to a system file there, which must not be read or written
        chunks = sorted(c for c in folder.iterdir() if stat.S_ISREG(c.lstat().st_mode)) \
            if folder.is_dir() and not folder.is_symlink() else []
        if r < 0.55:
            path = target / "manifest.json"
            try:
                m = json.loads(path.read_text())
            except ValueError:
                continue
            if not isinstance(m, dict):
                continue
            mutate_json(m, rng)
            if rng.random() < 0.7:
                from gpuos_tools.image.manifest import manifest_sum

                m.pop("manifest_sum", None)
                try:
                    m["manifest_sum"] = manifest_sum(m)
                    resealed = True
                except (TypeError, ValueError):
                    pass
            path.write_text(json.dumps(m))
        elif r < 0.65 and chunks:
            c = rng.choice(chunks)
            data = bytearray(c.read_bytes())
            if data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            c.write_bytes(bytes(data))
        elif r < 0.72 and chunks:
            c = rng.choice(chunks)
            c.write_bytes(c.read_bytes()[: rng.randrange(max(1, c.stat().st_size))])
        elif r < 0.78 and chunks:
            c = rng.choice(chunks)
            c.unlink()
            rng.choice([lambda: os.symlink("/dev/zero", c), lambda: os.symlink("/etc/hostname", c),
                        lambda: os.mkfifo(c), lambda: c.mkdir(), lambda: None])()
        elif r < 0.83 and chunks:
            (folder / rng.choice(["9-0", "1-0.zst.bak", "x"])).write_bytes(b"extra")
        elif r < 0.88 and chunks:
            shutil.rmtree(folder)
            if rng.random() < 0.5:
                os.symlink("/etc", target / "chunks")
        elif r < 0.94 and stat.S_ISREG((target / "manifest.json").lstat().st_mode):
            (target / "manifest.json").write_bytes(
                rng.choice([b"", b"{", b"\xff\xfe", b"[]", b"null", (target / "manifest.json").read_bytes()[:-9]]))
        else:
            try:
                m = json.loads((head / "manifest.json").read_text())
            except ValueError:
                continue
            if isinstance(m, dict) and isinstance(m.get("parent"), dict):
                m["parent"]["path"] = rng.choice([head.name, "/etc", "..", "full/..", "../" + work.name + "/full"])
                m.pop("manifest_sum", None)
                (head / "manifest.json").write_text(json.dumps(m))
    return head, resealed


def run_image(head: Path, truth: dict[int, bytes], out: Path) -> None:
    """verify, open, read every buffer, diff against itself and compact: an image that verifies
    must give the bytes written for every buffer it still has at the same place, and so must
    its compacted copy. Raises AssertionError for wrong content."""
    from gpuos_tools.image import compact, diff, open_image, verify

    problems = verify(head)
    try:
        image = open_image(head)
    except GpuosError:
        assert problems, "open_image refused an image that verify passed"
        raise
    original = {b["id"]: (b["addr"], b["size"]) for b in open_image(REPO / "tests" / "data" / "recorded" /
                                                                       "agent-image" / "full").buffers}
    for b in image.buffers:
        data = image.read(b["id"])  # raises on damage; when verify passed, it must not
        if not problems and original.get(b["id"]) == (b["addr"], b["size"]):
            assert data == truth[b["id"]], f"buffer {b['id']} verified but reads other bytes"
    diff(image, image)
    if out.exists():
        shutil.rmtree(out)
    compact(head, out)  # it may fold a chain with damage it does not need (an extra file, an
    flat = open_image(out)  # unused chunk of a parent); what it writes must still be right
    for b in flat.buffers:
        if original.get(b["id"]) == (b["addr"], b["size"]):
            assert flat.read(b["id"]) == truth[b["id"]], f"compacted buffer {b['id']} holds other bytes"


def _image_ok(e: BaseException) -> bool:
    return isinstance(e, GpuosError) and e.code in IMAGE_CODES


# -- TOML profiles --------------------------------------------------------------------------------

PROFILE_CODES = {ExitCode.BAD_INPUT, ExitCode.NO_INPUT, ExitCode.PERMISSION, ExitCode.IO_ERROR}

TOML_VALUES = ["-1", "0", "1.5", "1e400", "nan", "inf", "-inf", '""', "'x'", "[]", "[1, 'a']", "{}", "{a = 1}",
               "1979-05-27", "07:32:00", "1979-05-27T07:32:00Z", "true", "9223372036854775807", "0x7f", '"\\u0000"',
               '"64MiB"', '"1e400GiB"', '"7d"', '"(("', '"python3? .*train"', "[[1]]", '"' + "a" * 300 + '"',
               "[" * 50 + "]" * 50]


def profile_bases() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (REPO / "gpuos_tools" / "profiles" / "maintenance.toml", REPO / "gpuos_tools" / "profiles" /
                                             "ckpt-periodic.toml")}


def toml_case(rng: random.Random) -> tuple[str, bytes]:
    name, text = rng.choice(sorted(profile_bases().items()))
    lines = text.split(b"\n")
    for _ in range(rng.randrange(1, 4)):
        r = rng.random()
        i = rng.randrange(len(lines))
        if r < 0.5 and b"=" in lines[i] and not lines[i].lstrip().startswith(b"#"):
            key = lines[i].split(b"=", 1)[0]
            lines[i] = key + b"= " + rng.choice(TOML_VALUES).encode()
        elif r < 0.6:
            del lines[i]
        elif r < 0.7:
            lines.insert(i, lines[rng.randrange(len(lines))])
        elif r < 0.8:
            lines.insert(i, rng.choice([b"[nope]", b"[select]", b"[images]", b"x = 1", b"[agent]\npid = 1",
                                        b"[chain]\nlength = 3", b"all = true", b"users = ['root', 0]"]))
        elif r < 0.9 and lines[i]:
            at = rng.randrange(len(lines[i]))
            lines[i] = lines[i][:at] + bytes([rng.randrange(256)]) + lines[i][at + 1:]
        else:
            lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
    return name, b"\n".join(lines)


def run_profile(name: str, path: Path) -> None:
    from gpuos_tools.ckpt import periodic as per
    from gpuos_tools import procs
    from gpuos_tools.ckpt import profile as prof

    if name.startswith("maintenance"):
        p = prof.load_profile(path)
        for info in (procs.ProcInfo(1234, 0, (0, 0, 0, 0), "root", "python3", ["python3", "train.py"], 1, "S"),
                     procs.ProcInfo(99, 1000, (1000,) * 4, "x", "jupyter", ["jupyter"], 2, "S")):
            p.matches(info)
    else:
        p = per.load_periodic_profile(path)
        images = per.list_images(p)
        per.plan_next(p, images, 1.7e9)
        per.retention(p, images, 1.7e9)


def _profile_ok(e: BaseException) -> bool:
    return isinstance(e, GpuosError) and e.code in PROFILE_CODES


# -- running, shrinking ---------------------------------------------------------------------------


def failure(run: Callable[[], None], ok: Callable[[BaseException], bool]) -> str | None:
    """None when ``run`` works or fails cleanly; else the traceback of how it failed."""
    try:
        run()
    except BaseException as e:  # noqa: BLE001 (the fuzzer judges every exception)
        if isinstance(e, KeyboardInterrupt):
            raise
        if ok(e):
            return None
        return "".join(traceback.format_exception(e)[-6:])
    return None


def shrink_stream(data: bytes) -> bytes:
    """A smaller stream that still fails: drop lines, then fields of the remaining records."""
    def fails(d: bytes) -> bool:
        return failure(lambda: run_stream(d), _stream_ok) is not None

    lines = data.split(b"\n")
    i = 0
    while i < len(lines):
        trial = lines[:i] + lines[i + 1:]
        if fails(b"\n".join(trial)):
            lines = trial
        else:
            i += 1
    for n, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        for key in list(rec):
            if key == "type":
                continue
            trial_rec = {k: v for k, v in rec.items() if k != key}
            trial = lines[:n] + [dumps(trial_rec).encode()] + lines[n + 1:]
            if fails(b"\n".join(trial)):
                rec, lines = trial_rec, trial
    return b"\n".join(lines)


def fuzz_streams(cases: int, seed: int) -> list[tuple[int, str, bytes]]:
    out = []
    for i in range(cases):
        data = stream_case(random.Random(seed * 1_000_003 + i))
        why = failure(lambda: run_stream(data), _stream_ok)
        if why is not None:
            out.append((i, why, data))
    return out


def fuzz_images(cases: int, seed: int, tmp: Path) -> list[tuple[int, str, bytes]]:
    base, truth = sealed_chain(tmp / "base")
    out = []
    for i in range(cases):
        head, _ = image_case(random.Random(seed * 1_000_003 + i), base, tmp / "case")
        why = failure(lambda: run_image(head, truth, tmp / "out"), _image_ok)
        if why is not None:
            out.append((i, why, (head / "manifest.json").read_bytes() if (head / "manifest.json").is_file() else b""))
    return out


def fuzz_profiles(cases: int, seed: int, tmp: Path) -> list[tuple[int, str, bytes]]:
    out = []
    for i in range(cases):
        name, text = toml_case(random.Random(seed * 1_000_003 + i))
        path = tmp / name
        path.write_bytes(text)
        why = failure(lambda: run_profile(name, path), _profile_ok)
        if why is not None:
            out.append((i, why, text))
    return out


def main() -> int:
    import tempfile

    surface, cases = sys.argv[1], int(sys.argv[2])
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    with tempfile.TemporaryDirectory() as tmp:
        if surface == "stream":
            found = fuzz_streams(cases, seed)
        elif surface == "image":
            found = fuzz_images(cases, seed, Path(tmp))
        else:
            found = fuzz_profiles(cases, seed, Path(tmp))
        for i, why, data in found[:20]:
            small = shrink_stream(data) if surface == "stream" else data
            print(f"--- case {i}\n{why}\n{small[:2000]!r}\n")
    print(f"{len(found)} failing of {cases}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
