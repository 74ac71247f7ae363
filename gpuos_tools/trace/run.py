"""`gpu-trace run`: start a Python program with the tracer injected and write its stream.

The program is started with our bootstrap first on PYTHONPATH (gpuos_tools/injection/boot) and the
write end of a pipe in GPUOS_TRACE_FD; the tracer inside sends wire frames, this process decodes
them into records. The program's stdin/stdout/stderr are its own, its exit status is ours.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import gpuos_tools
from gpuos_tools.model import wire
from gpuos_tools.errors import ExitCode, GpuosError

BOOT_DIR = Path(gpuos_tools.__file__).resolve().parent / "agent" / "boot"
PACKAGE_ROOT = Path(gpuos_tools.__file__).resolve().parent.parent


def resolve_program(cmd: list[str]) -> str:
    """The executable that will run, or raise PROGRAM_NOT_FOUND / NOT_PYTHON."""
    if not cmd:
        raise GpuosError("no program given: gpu-trace run [-o FILE] -- PROGRAM [ARGS...]", ExitCode.USAGE)
    exe = shutil.which(cmd[0])
    if exe is None:
        raise GpuosError(f"{cmd[0]}: program not found or not executable", ExitCode.PROGRAM_NOT_FOUND)
    if not is_python_program(exe):
        raise GpuosError(
            f"{cmd[0]} is not a Python program: gpu-trace injects its tracer through the Python "
            f"interpreter (run a script as `gpu-trace run -- python3 script.py`)",
            ExitCode.NOT_PYTHON,
        )
    return exe


def is_python_program(path: str) -> bool:
    """A Python interpreter, or a script whose #! line names one."""
    name = os.path.basename(os.path.realpath(path))
    if name.startswith(("python", "pypy")):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def default_images_dir(output: str) -> Path:
    """Side directory for module images: beside the output file, or ./gpu-trace-images for stdout."""
    env = os.environ.get("GPUOS_IMAGES")
    if env:
        return Path(env)
    if output == "-":
        return Path("gpu-trace-images")
    p = Path(output)
    name = p.name
    for suffix in (".zst", ".ndjson", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return p.with_name(name + ".images")


@dataclass
class RunSummary:
    code: int
    signal: str | None
    complete: bool
    records: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def _built(backend: str, warn, build, what: str, fallback: str) -> str | None:
    """``build()``'s library path for ``backend`` (auto|native|python): None for python, and under
    auto when it cannot be built (said through ``warn``); under native that is an error."""
    from gpuos_tools import cbuild

    if backend == "python":
        return None
    try:
        return str(build())
    except (cbuild.BuildError, OSError) as exc:
        if backend == "native":
            raise GpuosError(f"cannot build {what}: {exc}", ExitCode.FAILURE) from exc
        warn(f"{what} is unavailable ({exc}); {fallback} through Python callbacks (slower)")
        return None


def native_library(backend: str, warn) -> str | None:
    """The native tracer's library for ``backend`` (auto|native|python), or None for Python."""
    from gpuos_tools.injection import tracelib

    return _built(backend, warn, tracelib.tracer_library, "the native tracer", "tracing")


def native_agent_library(backend: str, warn) -> str | None:
    """The agent's native core (tracer and core in one library) for ``backend``, or None for the
    Python agent (``python``, GPUOS_AGENT_BACKEND=python, or no compiler under ``auto``)."""
    from gpuos_tools.injection import core

    if os.environ.get("GPUOS_AGENT_BACKEND") == "python":
        return None
    return _built(backend, warn, core.build, "the agent's native core", "running it")


def trace_program(
    cmd: list[str], writer, images_dir: Path | None, flush_ms: float = 20.0, check_pointers: bool = False,
    backend: str = "auto", warn=lambda message: None, output_path: str = "-",
    validate: tuple[int, int, bool] | None = None, agent: bool = False, cow_budget: int | None = None,
    stage_ahead: bool = False,
) -> RunSummary:
    """Run ``cmd`` traced, writing header, records and an exit record to ``writer``.

    ``validate``: (samples per kernel, max live bytes, measure extents) for --validate.
    ``agent``: with the agent; ``cow_budget`` and ``stage_ahead`` are its options.
    """
    from gpuos_tools.model.binary import parse_records
    from gpuos_tools.cuda.driver import probe_driver
    from gpuos_tools.stream import make_header
    from gpuos_tools.model.decode import Decoder

    exe = resolve_program(cmd)
    driver = probe_driver()
    library = native_library(backend, warn)
    if images_dir is not None:
        images_dir.mkdir(parents=True, exist_ok=True)

    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    added = os.pathsep.join([str(BOOT_DIR), str(PACKAGE_ROOT)])
    env["PYTHONPATH"] = added + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["GPUOS_TRACE_PYTHONPATH_ADDED"] = str(PACKAGE_ROOT)
    env["GPUOS_TRACE_FD"] = str(write_fd)
    env["GPUOS_TRACE_FAIL_CODE"] = str(int(ExitCode.NO_CUPTI))
    env["GPUOS_TRACE_FLUSH_MS"] = str(flush_ms)
    env["GPUOS_TRACE_CHECK_POINTERS"] = "1" if check_pointers else "0"
    env["GPUOS_TRACE_NATIVE"] = library or ""
    if validate is not None:
        env["GPUOS_TRACE_VALIDATE"] = f"{validate[0]}:{validate[1]}:{int(validate[2])}"
    if agent:
        env["GPUOS_TRACE_AGENT"] = "1"
        env["GPUOS_AGENT_NATIVE"] = native_agent_library(backend, warn) or ""
        if cow_budget is not None:
            env["GPUOS_AGENT_COW_BUDGET"] = str(cow_budget)
        if stage_ahead:
            env["GPUOS_AGENT_STAGE_AHEAD"] = "1"

    decoder = Decoder(images_dir)
    started = time.monotonic()
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the program gets ^C and decides
    try:
        proc = subprocess.Popen([exe, *cmd[1:]], env=env, pass_fds=(write_fd,))
    except OSError as exc:
        signal.signal(signal.SIGINT, old_int)
        os.close(read_fd)
        os.close(write_fd)
        raise GpuosError(f"{cmd[0]}: cannot start: {exc}", ExitCode.PROGRAM_NOT_FOUND) from exc
    os.close(write_fd)
    old_term = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))

    def header() -> dict:
        hello = decoder.hello
        return make_header(
            "gpu-trace", pid=proc.pid, argv=list(cmd), gpus=driver.gpus,
            driver=driver.release, cuda=driver.version,
            python=hello[2] if hello else None, cupti=hello[3] if hello else None,
            backend=hello[6] if hello else None,
            images=_images_ref(images_dir, output_path),
            **({"validate": {"samples": validate[0], "max_bytes": validate[1], "extents": validate[2]}}
               if validate else {}),
            **({"agent": {"socket": str(_agent_socket(proc.pid))}} if agent else {}),
        )

    wrote_header = False
    truncated = None
    try:
        try:
            for frame in wire.read_frames(read_fd, native=lambda data: parse_records(data, check_pointers)):
                if not wrote_header:
                    # the first frame starts with the tracer's HELLO
                    records = list(decoder.feed(frame))
                    writer.write(header())
                    wrote_header = True
                    for rec in records:
                        writer.write(rec)
                    continue
                for rec in decoder.feed(frame):
                    writer.write(rec)
        except wire.TruncatedWire as exc:
            truncated = str(exc)
        except Exception:
            # e.g. the reader of our output left (`| head`, BrokenPipeError) or the disk is full:
            # closing the pipe stops the tracer inside; the program itself runs to its end
            os.close(read_fd)
            read_fd = -1
            proc.wait()
            raise
        rc = proc.wait()
    finally:
        if read_fd >= 0:
            os.close(read_fd)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)

    if decoder.hello is None and rc == int(ExitCode.NO_CUPTI):
        raise GpuosError(
            "the tracer could not start inside the program (see the message above); "
            "install the CUDA extra in the program's interpreter: pip install 'gpuos-tools[cuda]'",
            ExitCode.NO_CUPTI,
        )
    if not wrote_header:
        writer.write(header())
    summary = RunSummary(
        code=rc if rc >= 0 else 128 - rc,
        signal=signal.Signals(-rc).name if rc < 0 else None,
        complete=decoder.end is not None,
        records=dict(decoder.counts),
        wall_s=round(time.monotonic() - started, 6),
        errors=decoder.errors + ([f"tracer pipe: {truncated}"] if truncated else []),
    )
    exit_rec = {"type": "exit", "ts": time.monotonic_ns(), "code": rc if rc >= 0 else None,
                "complete": summary.complete, "records": summary.records, "wall_s": summary.wall_s}
    if summary.signal:
        exit_rec["signal"] = summary.signal
    if decoder.end:
        exit_rec["tracer"] = decoder.end
    if truncated:
        exit_rec["truncated"] = truncated
    writer.write(exit_rec)
    return summary


def _agent_socket(pid: int):
    from gpuos_tools.agent.control import socket_path

    return socket_path(pid)


def _images_ref(images_dir: Path | None, output_path: str) -> str | None:
    """The header's images entry: relative to the trace file's directory when there is one."""
    if images_dir is None:
        return None
    if output_path == "-":
        return str(images_dir.resolve())
    return os.path.relpath(images_dir.resolve(), Path(output_path).resolve().parent)


def describe(summary: RunSummary) -> str:
    """One line for stderr on a terminal."""
    parts = [f"{n:,} {t}" for t, n in sorted(summary.records.items(), key=lambda kv: -kv[1])]
    status = f"signal {summary.signal}" if summary.signal else f"exit {summary.code}"
    tail = "" if summary.complete else " (tracer ended without its final flush: the last records may be missing)"
    return f"traced {', '.join(parts) or 'nothing'}; program {status} after {summary.wall_s:.1f}s{tail}"
