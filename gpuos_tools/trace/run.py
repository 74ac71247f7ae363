"""The launcher: start a Python program with the in-process side injected, and write its stream.

`run_program` is what `gpu-trace run` (and `gpu-ckpt run`, `gpu-prefetch-sched run`) does with its
options; `trace_program` starts the program with our bootstrap first on PYTHONPATH
(gpuos_tools/injection/boot) and one variable, GPUOS_BOOT: the `BootConfig`
(gpuos_tools/injection/config.py), whose trace part names the write end of a pipe. The tracer
inside sends wire frames, this process decodes them into records. The program's
stdin/stdout/stderr are its own, its exit status is ours. Problems are `GpuosError`s with the
toolkit's exit codes (USAGE for options that do not fit together).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import gpuos_tools
from gpuos_tools import cbuild
from gpuos_tools.agent.control import socket_path
from gpuos_tools.cuda.driver import probe_driver
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection import config as boot_config
from gpuos_tools.injection import core, intercept, tracelib
from gpuos_tools.injection.config import (
    MECHANISMS, VALIDATE_IN, AgentConfig, BootConfig, OnlineConfig, TraceConfig, ValidateConfig, boot_environment,
    overrides_from_environment,
)
from gpuos_tools.model import wire
from gpuos_tools.model.binary import parse_records
from gpuos_tools.model.decode import Decoder
from gpuos_tools.stream import make_header, open_output
from gpuos_tools.units import parse_size

BOOT_DIR = Path(gpuos_tools.__file__).resolve().parent / "injection" / "boot"
PACKAGE_ROOT = Path(gpuos_tools.__file__).resolve().parent.parent
BACKENDS = ("auto", "native", "python")
#: the agent's mechanism for commands that have no --mechanism (gpu-ckpt run, gpu-prefetch-sched run);
#: without it and the option, injection/config.py's DEFAULT_MECHANISM
MECHANISM_ENV = "GPUOS_AGENT_MECHANISM"
BACKEND_ENV = "GPUOS_AGENT_BACKEND"
TRACER_MECHANISM = "cupti"  #: the tracer alone (no --agent) sees the driver calls through CUPTI only


@dataclass(frozen=True)
class Mechanism:
    """How the agent is to see the driver calls: ``name`` (cupti or intercept) and ``source``, the
    option or variable that asked for it; None when it is the default, which gives way to CUPTI
    where interception cannot run (`agent_front_end`), where one asked for is refused instead."""

    name: str
    source: str | None = None

    @property
    def explicit(self) -> bool:
        return self.source is not None


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


def _not_a_file(output: str) -> bool:
    """Whether ``output`` is standard output or something other than a regular file (a pipe,
    a terminal, /dev/stdout), beside which no directory belongs."""
    if output == "-":
        return True
    try:
        return not stat.S_ISREG(os.stat(output).st_mode)
    except OSError:
        return False  # not there yet: a file to be written


def default_images_dir(output: str) -> Path | None:
    """Side directory for module images: beside the output file, or ./gpu-trace-images for stdout
    (or a pipe, a terminal); None for /dev/null (the trace referring to them is thrown away)."""
    env = os.environ.get("GPUOS_IMAGES")
    if env:
        return Path(env)
    if output != "-" and os.path.realpath(output) == os.devnull:
        return None
    if _not_a_file(output):
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
    mechanism: str | None = None  #: the agent's mechanism as it ran (None: no agent)

    def describe(self) -> str:
        """One line for stderr on a terminal."""
        parts = [f"{n:,} {t}" for t, n in sorted(self.records.items(), key=lambda kv: -kv[1])]
        status = f"signal {self.signal}" if self.signal else f"exit {self.code}"
        tail = "" if self.complete else " (tracer ended without its final flush: the last records may be missing)"
        return f"traced {', '.join(parts) or 'nothing'}; program {status} after {self.wall_s:.1f}s{tail}"


def _silent(message: str) -> None:
    pass


def run_program(
    program: list[str], *, output: str = "-", images: Path | None = None, no_images: bool = False,
    flush_ms: float = 20.0, unbuffered: bool = False, backend: str = "auto", check_pointers: bool = False,
    validate: bool = False, validate_samples: int = 3, validate_max: str = "8GiB", validate_extents: bool = True,
    validate_in: str | None = None, agent: bool = False, cow_budget: str | None = None, stage_ahead: bool = False,
    online: OnlineConfig | None = None, own: tuple[str, ...] | None = None, mechanism: str | None = None,
    warn: Callable[[str], None] = _silent,
) -> RunSummary:
    """`gpu-trace run` with its options (`gpu-ckpt run` is `gpu-trace run --agent`;
    `gpu-prefetch-sched run` adds ``online`` and owns every framework's allocations): check them,
    trace PROGRAM into ``output`` (module images beside it unless ``no_images``), say what the
    caller should know through ``warn``; the summary holds the program's own exit status.
    ``own``: the frameworks whose allocations are owned (None: as GPUOS_AGENT_OWN says).
    ``mechanism``: how the agent sees the driver calls, cupti or intercept (None: as
    GPUOS_AGENT_MECHANISM says, else the default, `agent_mechanism`); the summary says which ran."""
    if program and program[0].startswith("-") and program[0] != "-":
        # an option this command does not have: the command line takes it for the program
        word = program[0].partition("=")[0]
        hint = (f"; this command has none: set {MECHANISM_ENV}=cupti|intercept instead" if word == "--mechanism"
                else ": -h lists the options, which go before `-- PROGRAM`")
        raise GpuosError(f"no such option: {word}{hint}", ExitCode.USAGE)
    if backend not in BACKENDS:
        raise GpuosError(f"--backend: must be {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}", ExitCode.USAGE)
    validation = None
    if validate:
        if backend == "native":
            raise GpuosError("--backend native: --validate runs in the python backend", ExitCode.USAGE)
        if agent:
            raise GpuosError("--agent and --validate exclude each other", ExitCode.USAGE)
        validate_in = validate_in or VALIDATE_IN[0]  # the validator process
        if validate_in not in VALIDATE_IN:
            raise GpuosError(f"--validate-in: must be {' or '.join(VALIDATE_IN)}, not {validate_in!r}", ExitCode.USAGE)
        try:
            validation = ValidateConfig(validate_samples, parse_size(validate_max),
                                        validate_extents, validate_in)
        except ValueError as exc:
            raise GpuosError(f"--validate-max: {exc}", ExitCode.USAGE) from None
        backend = "python"  # the validating launch handler is the Python tracer's
        if validate_in == "validator":
            validation = replace(validation, zygote=validator_zygote(warn))
    elif validate_in is not None:
        raise GpuosError("--validate-in is an option of --validate", ExitCode.USAGE)
    choice = agent_mechanism(mechanism, agent, backend)
    if stage_ahead and not agent:
        raise GpuosError("--stage-ahead is an option of --agent", ExitCode.USAGE)
    if online is not None and not agent:
        raise GpuosError("the online scheduler runs in the agent", ExitCode.USAGE)
    budget = None
    if agent and cow_budget is not None:
        try:
            budget = parse_size(cow_budget)
        except ValueError as exc:
            raise GpuosError(f"--cow-budget: {exc}", ExitCode.USAGE) from None
    images_dir = None if no_images else (images or default_images_dir(output))
    with open_output(output, unbuffered=unbuffered or None) as writer:
        return trace_program(
            program, writer, images_dir, flush_ms=flush_ms, check_pointers=check_pointers, backend=backend,
            warn=warn, output_path=output, validate=validation, agent=agent, cow_budget=budget,
            stage_ahead=stage_ahead, online=online, own=own, mechanism=choice,
        )


def agent_mechanism(mechanism: str | None, agent: bool, backend: str) -> Mechanism:
    """The mechanism asked for (the option, else GPUOS_AGENT_MECHANISM, else the default), checked:
    interception is the agent's, on its native core, so asking for it with the Python backend is
    refused; the default is not refused here (`agent_front_end` decides what it can run on)."""
    if mechanism is not None and not agent:
        raise GpuosError("--mechanism goes with --agent: it says how the agent sees the driver calls (the tracer "
                         "alone uses CUPTI)", ExitCode.USAGE)
    if not agent:  # the variable is the agent's: the tracer alone runs on CUPTI whatever it says
        return Mechanism(TRACER_MECHANISM)
    if mechanism is not None:
        source = "--mechanism"
    elif os.environ.get(MECHANISM_ENV):
        mechanism, source = os.environ[MECHANISM_ENV], MECHANISM_ENV
    else:
        return Mechanism(boot_config.DEFAULT_MECHANISM)
    if mechanism not in MECHANISMS:
        raise GpuosError(f"{source}: must be {' or '.join(MECHANISMS)}, not {mechanism!r}", ExitCode.USAGE)
    if mechanism == "intercept" and python_agent(backend):
        raise GpuosError(f"{source} intercept needs the agent's native core; the Python agent runs on CUPTI",
                         ExitCode.USAGE)
    return Mechanism(mechanism, source)


def python_agent(backend: str) -> bool:
    """Whether the Python agent is asked for: --backend python or GPUOS_AGENT_BACKEND=python."""
    return backend == "python" or os.environ.get(BACKEND_ENV) == "python"


def _built(backend: str, warn, build, what: str, fallback: str) -> str | None:
    """``build()``'s library path for ``backend`` (auto|native|python): None for python, and under
    auto when it cannot be built (said through ``warn``); under native that is an error."""
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
    return _built(backend, warn, tracelib.tracer_library, "the native tracer", "tracing")


def native_agent_library(backend: str, warn) -> str | None:
    """The agent's native core on CUPTI (front end, recorder and core in one library) for
    ``backend``, or None for the Python agent (``python``, GPUOS_AGENT_BACKEND=python, or no
    compiler under ``auto``). Interception's library: `interposer_library`."""
    if os.environ.get(BACKEND_ENV) == "python":
        return None
    return _built(backend, warn, core.build, "the agent's native core", "running it")


class InterceptUnavailable(Exception):
    """Interception cannot run here; the message says why."""


def interposer_library(backend: str) -> str:
    """The agent's interposer, built and loadable, for ``backend``: InterceptUnavailable when the
    Python agent is asked for, or the library cannot be built (no C compiler, a failed build) or
    loaded."""
    if python_agent(backend):
        why = "--backend python" if backend == "python" else f"{BACKEND_ENV}=python"
        raise InterceptUnavailable(f"{why} asks for the Python agent, which runs on CUPTI only")
    try:
        library = intercept.build_agent()
    except (cbuild.BuildError, OSError) as exc:
        raise InterceptUnavailable(f"the agent's interposer cannot be built: {exc}") from exc
    try:
        intercept.entry_names(library)  # loaded here without being interposed (RTLD_LOCAL)
    except (OSError, AttributeError) as exc:
        raise InterceptUnavailable(f"the agent's interposer cannot be loaded: {exc}") from exc
    return str(library)


def agent_front_end(choice: Mechanism, backend: str, warn) -> tuple[str, str | None]:
    """The mechanism the agent runs on and its library (None: the Python agent), for ``choice``.

    Interception asked for (option or variable) and unavailable is an error. The default
    interception unavailable gives way to CUPTI, with one warning that says why and how to choose;
    should the native core not build either, that warning says the Python agent runs instead."""
    if choice.name != "intercept":
        return choice.name, native_agent_library(backend, warn)
    try:
        return "intercept", interposer_library(backend)
    except InterceptUnavailable as exc:
        if choice.explicit:
            raise GpuosError(f"{choice.source} intercept: {exc}; the agent can run on CUPTI callbacks instead "
                             f"(cupti)", ExitCode.FAILURE) from exc
        why = str(exc)
    also: list[str] = []
    library = native_agent_library(backend, also.append)
    how = "the native core" if library else "the Python agent" + (" (its native core is unavailable too)"
                                                                  if also else "")
    warn(f"the default mechanism, intercept, cannot run here: {why}; the agent sees the driver calls through "
         f"CUPTI callbacks instead, on {how} (the driver's checkpoint API and CRIU refuse such a job). "
         f"Choose explicitly with {MECHANISM_ENV}=cupti|intercept (or gpu-trace run --agent --mechanism)")
    return "cupti", library


def validator_zygote(warn: Callable[[str], None]) -> str | None:
    """The interposer that forks the validators' zygote in the program's first cuInit
    (agent/zygote.py), or None, said through ``warn``, when it cannot be built: each validator
    then starts as a fresh process, which gets fewer of the program's addresses."""
    try:
        return str(intercept.build())
    except (cbuild.BuildError, OSError) as exc:
        warn(f"the validators start as fresh processes, which get fewer of the program's addresses: "
             f"the interposer that forks them from the program could not be built ({exc})")
        return None


def trace_program(
    cmd: list[str], writer, images_dir: Path | None, flush_ms: float = 20.0, check_pointers: bool = False,
    backend: str = "auto", warn: Callable[[str], None] = _silent, output_path: str = "-",
    validate: ValidateConfig | None = None, agent: bool = False, cow_budget: int | None = None,
    stage_ahead: bool = False, online: OnlineConfig | None = None, own: tuple[str, ...] | None = None,
    mechanism: Mechanism | None = None,
) -> RunSummary:
    """Run ``cmd`` traced, writing header, records and an exit record to ``writer``.

    ``validate``: for --validate. ``agent``: with the agent; ``cow_budget``, ``stage_ahead`` and
    ``online`` (gpu-prefetch-sched run's scheduler) are its options. ``own``: as in `run_program`;
    ``mechanism``: `agent_mechanism`'s choice (None: the default), run on as `agent_front_end` says.
    """
    exe = resolve_program(cmd)
    overrides = overrides_from_environment(own=own is None)  # a bad value is refused before anything starts
    driver = probe_driver()
    library = native_library(backend, warn)
    agent_cfg = None
    if agent:
        used, agent_library = agent_front_end(mechanism or agent_mechanism(None, True, backend), backend, warn)
        agent_cfg = AgentConfig(
            native=agent_library, mechanism=used,
            cow_budget=cow_budget, stage_ahead=stage_ahead,
            exit_wait_s=overrides.exit_wait_s, exit_max_s=overrides.exit_max_s,
            reference_at=overrides.reference_at, reference_out=overrides.reference_out,
            profile_out=overrides.profile_out, online=online,
            engine=overrides.engine, image_key=overrides.image_key)
    if images_dir is not None:
        images_dir.mkdir(parents=True, exist_ok=True)

    read_fd, write_fd = os.pipe()
    try:
        config = BootConfig(
            trace=TraceConfig(fd=write_fd, flush_ms=flush_ms, native=library, check_pointers=check_pointers,
                              fail_code=int(ExitCode.NO_CUPTI)),
            validate=validate, agent=agent_cfg, own=overrides.own if own is None else own,
            pythonpath=(str(BOOT_DIR), str(PACKAGE_ROOT)))
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    env = boot_environment(os.environ, config)
    if agent_cfg is not None and agent_cfg.mechanism == "intercept":
        env[intercept.PRELOAD] = intercept.preload(env, agent_cfg.native)
    if validate is not None and validate.zygote is not None:
        env[intercept.PRELOAD] = intercept.preload(env, validate.zygote)

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
            mechanism=(hello[7] if len(hello) > 7 else "cupti") if hello else None,
            images=_images_ref(images_dir, output_path),
            **({"validate": {"samples": validate.samples, "max_bytes": validate.max_bytes,
                             "extents": validate.extents, "in": validate.where}} if validate else {}),
            **({"agent": {"socket": str(socket_path(proc.pid)), "mechanism": agent_cfg.mechanism}}
               if agent_cfg is not None else {}),
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

    if decoder.hello is None and rc == config.trace.fail_code:
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
        mechanism=agent_cfg.mechanism if agent_cfg is not None else None,
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


def _images_ref(images_dir: Path | None, output_path: str) -> str | None:
    """The header's images entry: relative to the trace file's directory when there is one."""
    if images_dir is None:
        return None
    if _not_a_file(output_path):
        return str(images_dir.resolve())
    return os.path.relpath(images_dir.resolve(), Path(output_path).resolve().parent)
