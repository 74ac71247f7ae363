"""The in-process side's configuration: one typed `BootConfig`.

The launcher (gpuos_tools/trace/run.py) builds it from its options, writes it as JSON into one
environment variable, GPUOS_BOOT, and starts the program; in the program the bootstrap
(injection/boot/sitecustomize.py) removes the variable, so that programs the traced one starts are
not traced into the same pipe, parses it once (`BootConfig.from_json`) and hands the result to
injection/start.py. Everything in the program takes its settings from that object, none from
the environment. Parsing refuses what does not fit: an unknown or missing field, a value of the
wrong type or out of range (`ConfigError`).

A few settings have variables documented for users, set in the environment of the command that
starts the program (GPUOS_AGENT_OWN, GPUOS_AGENT_EXIT_WAIT, GPUOS_AGENT_EXIT_MAX, GPUOS_IMAGE_KEY,
the residency engine's GPUOS_ENGINE_* switches), two for tests (GPUOS_AGENT_REFERENCE_AT,
GPUOS_AGENT_REFERENCE_OUT) and one for developers (GPUOS_AGENT_PROFILE_OUT: where the native
agent writes a cProfile of its upcalls): `overrides_from_environment` reads them, in the launcher, into the
config, and `boot_environment` leaves them out of the program's environment.
"""

from __future__ import annotations

import json
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any

from gpuos_tools.agent.durable import EXIT_MAX_ENV, EXIT_MAX_S, EXIT_WAIT_ENV, EXIT_WAIT_S
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image.manifest import KEY_ENV, load_key
from gpuos_tools.memory import owned
from gpuos_tools.memory.settings import VARIABLES as ENGINE_VARIABLES
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.sched.online import PLANS, POLICIES, SLACK_MAX

#: how the agent sees the program's driver calls: CUPTI callbacks, or the interposer (injection/intercept.py)
MECHANISMS = ("cupti", "intercept")
#: the agent's mechanism when neither --mechanism nor GPUOS_AGENT_MECHANISM names one: the one place
#: that decides it (the launcher, the config's field and the help texts read it from here). A
#: default of "intercept" gives way to "cupti" where interception cannot run (trace/run.py).
DEFAULT_MECHANISM = "intercept"
#: the one variable the launcher sets for the program (besides PYTHONPATH); the bootstrap names it too
ENV = "GPUOS_BOOT"
REFERENCE_AT_ENV = "GPUOS_AGENT_REFERENCE_AT"
REFERENCE_OUT_ENV = "GPUOS_AGENT_REFERENCE_OUT"
PROFILE_OUT_ENV = "GPUOS_AGENT_PROFILE_OUT"
#: variables of the launcher's environment that go into the config, not to the program
OVERRIDES = (owned.ENV, EXIT_WAIT_ENV, EXIT_MAX_ENV, REFERENCE_AT_ENV, REFERENCE_OUT_ENV, PROFILE_OUT_ENV, KEY_ENV,
             *ENGINE_VARIABLES)


class ConfigError(GpuosError):
    """A boot configuration (or a variable that goes into one) that cannot be used."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ExitCode.USAGE)


def _check(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {what}")


@dataclass(frozen=True)
class TraceConfig:
    """The tracer: where its frames go and how."""

    fd: int  #: the write end of the launcher's pipe
    flush_ms: float = 20.0  #: how often the Python tracer's drain thread ships frames
    native: str | None = None  #: the native tracer's library (None: cupti-python callbacks)
    check_pointers: bool = False  #: ask the driver which argument words are device pointers
    fail_code: int = int(ExitCode.NO_CUPTI)  #: the program's status when the tracer cannot start

    def __post_init__(self) -> None:
        _check(self.fd >= 0, "trace.fd", f"{self.fd} is not a file descriptor")
        _check(self.flush_ms > 0, "trace.flush_ms", f"{self.flush_ms} is not more than 0")
        _check(0 < self.fail_code < 256, "trace.fail_code", f"{self.fail_code} is not an exit status (1-255)")


#: where `--validate` replays a sampled launch (gpu-trace run --validate-in), the default first:
#: a validator process, where a replay that faults cannot reach the program
VALIDATE_IN = ("validator", "process")


@dataclass(frozen=True)
class ValidateConfig:
    """`gpu-trace run --validate`: which launches the validator checks."""

    samples: int  #: the first N launches of each kernel, then its 2^k-th ones
    max_bytes: int  #: skip launches while more device memory than this is live
    extents: bool  #: also measure how far past each pointer a kernel reads
    #: where the sampled launch is replayed: in the program's own context, or in a validator process
    where: str = VALIDATE_IN[0]
    timeout_s: float = 60.0  #: with the validator: the longest the program waits for one verdict
    #: with the validator: the preloaded interposer whose hook forks the validators' zygote in the
    #: program's first cuInit (agent/zygote.py); None: every validator starts as a fresh process
    zygote: str | None = None

    def __post_init__(self) -> None:
        _check(self.samples >= 1, "validate.samples", f"{self.samples} is not 1 or more")
        _check(self.max_bytes >= 0, "validate.max_bytes", f"{self.max_bytes} is negative")
        _check(self.where in VALIDATE_IN, "validate.where", f"{self.where!r}: expected {' or '.join(VALIDATE_IN)}")
        _check(self.timeout_s > 0, "validate.timeout_s", f"{self.timeout_s} is not more than 0")


@dataclass(frozen=True)
class ServeConfig:
    """A job of `gpu-prefetch-sched serve`: its coordinator's address and its number."""

    socket: str
    job: int
    overlap: bool = False
    ledger: str | None = None  #: the shared byte ledger's file

    def __post_init__(self) -> None:
        _check(bool(self.socket), "serve.socket", "empty")
        _check(self.job >= 0, "serve.job", f"{self.job} is negative")


@dataclass(frozen=True)
class OnlineConfig:
    """`gpu-prefetch-sched run`: the online scheduler in front of the agent (sched/executor.py)."""

    policy: str = "belady"
    lookahead: int = 2
    budget: int | None = None  #: bytes; or
    fraction: float | None = None  #: of the owned bytes at each decision
    summary: str | None = None  #: where the executor writes its summary at the end (JSON)
    timeline: str | None = None  #: where it writes its event log at the end (JSON)
    serve: ServeConfig | None = None
    #: how far ahead to prefetch: "count" (lookahead launches), "time", or "fixed" (a plan repeated every period)
    plan: str = "count"
    bw: tuple[float, float] | None = None  #: the time plan's (H2D, D2H) bytes/s (None: the policy's default)
    proactive: bool = False  #: the time plan evicts Belady's next victims right after their last use
    #: the count plan, once it must prefetch, prefetches lookahead x batch launches (online.py)
    batch: int = 1
    #: the fixed plan is made at this share of the budget less (0 to 0.5): evictions still in
    #: flight may hold that much while the plan's loads go ahead (online.py, ``_make_fixed``)
    slack: float = 0.0

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, "online.policy", f"{self.policy!r} is not one of {', '.join(POLICIES)}")
        _check(self.plan in PLANS, "online.plan", f"{self.plan!r} is not one of {', '.join(PLANS)}")
        _check(not self.proactive or self.plan == "time", "online.proactive", "only with the time plan")
        _check(self.bw is None or (len(self.bw) == 2 and min(self.bw) > 0), "online.bw",
               f"{self.bw!r} is not two bandwidths above 0")
        _check(self.lookahead >= 0, "online.lookahead", f"{self.lookahead} is negative")
        _check(self.batch >= 1, "online.batch", f"{self.batch} is not 1 or more")
        _check(0 <= self.slack <= SLACK_MAX, "online.slack", f"{self.slack} is not from 0 to {SLACK_MAX}")
        _check(not self.slack or self.plan == "fixed", "online.slack", "only with the fixed plan")
        _check(self.plan != "fixed" or self.policy == "belady", "online.plan", "the fixed plan is made with belady only")
        _check((self.budget is None) != (self.fraction is None), "online", "give one of budget and fraction")
        _check(self.budget is None or self.budget > 0, "online.budget", f"{self.budget} is not more than 0 bytes")
        _check(self.fraction is None or self.fraction > 0, "online.fraction", f"{self.fraction} is not more than 0")
        _check(self.serve is None or self.budget is not None, "online", "a job served takes a budget in bytes")

    def executor_config(self) -> dict[str, Any]:
        """The dict `sched.executor.Executor` takes: the fields that are set."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class AgentConfig:
    """The agent (`--agent`): snapshots, rollback, suspend, and the scheduler's hooks."""

    native: str | None = None  #: the agent's native core library (None: the Python agent)
    #: how it sees the program's driver calls: "cupti" (callbacks) or "intercept" (``native`` is
    #: then the interposer, preloaded by the launcher; CUPTI is never loaded). The launcher always
    #: writes the one it chose; this default is for a config made without it
    mechanism: str = DEFAULT_MECHANISM
    cow_budget: int | None = None  #: device bytes for copy-on-write slots (None: chosen per snapshot)
    stage_ahead: bool = False  #: pin host staging in the background as the program allocates
    exit_wait_s: float = EXIT_WAIT_S  #: how long the exit waits for an image in flight (agent/durable.py)
    exit_max_s: float = EXIT_MAX_S  #: ... and in all
    reference_at: tuple[int, ...] = ()  #: tests: operation counts after which the state is dumped
    reference_out: str | None = None  #: tests: the file the dumps are appended to
    #: developers: the file the native agent writes a profile of its upcalls to at the exit
    profile_out: str | None = None
    online: OnlineConfig | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)  #: the residency engine's switches
    image_key: str | None = None  #: the file holding the MAC key of the agent's images (None: unsigned)

    def __post_init__(self) -> None:
        _check(self.mechanism in MECHANISMS, "agent.mechanism",
               f"{self.mechanism!r} is not one of {', '.join(MECHANISMS)}")
        _check(self.mechanism == "cupti" or self.native is not None, "agent.mechanism",
               "intercept needs the native core (the Python agent runs on CUPTI)")
        _check(self.image_key is None or os.path.isabs(self.image_key), "agent.image_key",
               f"{self.image_key!r} is not an absolute path")
        _check(self.cow_budget is None or self.cow_budget >= 0, "agent.cow_budget", f"{self.cow_budget} is negative")
        _check(self.exit_wait_s >= 0, "agent.exit_wait_s", f"{self.exit_wait_s} is negative")
        _check(self.exit_max_s >= 0, "agent.exit_max_s", f"{self.exit_max_s} is negative")
        _check(all(k >= 0 for k in self.reference_at), "agent.reference_at", "a negative operation count")
        _check(not self.reference_at or bool(self.reference_out), "agent.reference_out",
               "needed with reference_at")
        _check(self.profile_out is None or os.path.isabs(self.profile_out), "agent.profile_out",
               f"{self.profile_out!r} is not an absolute path")


@dataclass(frozen=True)
class BootConfig:
    """Everything the in-process side is told, in one object."""

    trace: TraceConfig
    validate: ValidateConfig | None = None
    agent: AgentConfig | None = None
    #: frameworks whose allocations go through the owned allocator (memory/owned.py): cupy, torch
    own: tuple[str, ...] = ()
    #: the entries the launcher put first on PYTHONPATH (the bootstrap's directory, the package's
    #: parent), taken off again at boot
    pythonpath: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(self.validate is None or self.agent is None, "boot", "validate and agent exclude each other")
        _check(all(f in owned.FRAMEWORKS for f in self.own), "own",
               f"{list(self.own)}: expected some of {', '.join(owned.FRAMEWORKS)}")

    def program_pythonpath(self, value: str | None) -> str | None:
        """The program's PYTHONPATH once booted: ``value`` without the launcher's entries (the
        first occurrence of each), None when nothing is left; so that programs the traced one
        starts run plain."""
        parts = [p for p in (value or "").split(os.pathsep) if p]
        for added in self.pythonpath:
            if added in parts:
                parts.remove(added)
        return os.pathsep.join(parts) or None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BootConfig:
        """Parse what `to_json` wrote; `ConfigError` naming the variable and the field otherwise."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{ENV}: not JSON: {exc}") from None
        try:
            return _decode(cls, data, "")
        except ConfigError as exc:
            raise ConfigError(f"{ENV}: {exc}") from None


def _decode(cls: type, data: Any, where: str) -> Any:
    """An instance of the dataclass ``cls`` from a JSON object, every field's type checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'}: expected an object, got {json.dumps(data)[:60]}")
    prefix = f"{where}." if where else ""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in known.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{prefix}{name}: missing")
            continue
        values[name] = _value(hints[name], data[name], prefix + name)
    try:
        return cls(**values)
    except ValueError as exc:  # the checks of a class from a lower layer (EngineSettings)
        raise ConfigError(f"{where or 'the config'}: {exc}") from None


def _value(tp: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if v is None:
            return None
        (tp,) = args
        origin = typing.get_origin(tp)
    if origin is tuple:
        item = typing.get_args(tp)[0]
        if not isinstance(v, list):
            raise ConfigError(f"{where}: expected a list, got {json.dumps(v)[:60]}")
        return tuple(_value(item, x, f"{where}[{i}]") for i, x in enumerate(v))
    if is_dataclass(tp):
        return _decode(tp, v, where)
    if tp is bool:
        ok = isinstance(v, bool)
    elif tp is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif tp is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        v = float(v) if ok else v
    elif tp is str:
        ok = isinstance(v, str)
    else:  # a type this module does not use
        raise TypeError(f"{where}: cannot decode {tp}")
    if not ok:
        raise ConfigError(f"{where}: expected {'a number' if tp is float else tp.__name__}, got {json.dumps(v)[:60]}")
    return v


# -- the launcher's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Overrides:
    """The settings of the documented variables (module docstring), as the launcher read them."""

    own: tuple[str, ...] = ()
    exit_wait_s: float = EXIT_WAIT_S
    exit_max_s: float = EXIT_MAX_S
    reference_at: tuple[int, ...] = ()
    reference_out: str | None = None
    profile_out: str | None = None  #: an absolute path
    engine: EngineSettings = field(default_factory=EngineSettings)
    image_key: str | None = None  #: an absolute path, its key checked readable and private


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name}={text!r}: expected a number of seconds, 0 or more")
    return value


def overrides_from_environment(environ: Mapping[str, str] | None = None, *, own: bool = True) -> Overrides:
    """Read the variables (module docstring) from the launcher's environment; `ConfigError`
    for a value that does not parse. ``own``: False when the caller decides what is owned
    (GPUOS_AGENT_OWN is then not read)."""
    env = os.environ if environ is None else environ
    try:
        owning = (owned.parse_option(env.get(owned.ENV)) or ()) if own else ()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    at_text = env.get(REFERENCE_AT_ENV, "")
    try:
        at = tuple(int(x) for x in at_text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{REFERENCE_AT_ENV}={at_text!r}: expected operation counts, comma-separated") from None
    try:
        engine = EngineSettings.from_environment(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    key_path = env.get(KEY_ENV) or None
    if key_path is not None:
        key_path = os.path.abspath(key_path)
        load_key(key_path)  # unreadable, too open or too short: refused before the program starts
    profile_out = env.get(PROFILE_OUT_ENV) or None
    return Overrides(own=owning, exit_wait_s=_seconds(env, EXIT_WAIT_ENV, EXIT_WAIT_S),
                     exit_max_s=_seconds(env, EXIT_MAX_ENV, EXIT_MAX_S), reference_at=at,
                     reference_out=env.get(REFERENCE_OUT_ENV) or None,
                     profile_out=os.path.abspath(profile_out) if profile_out else None,
                     engine=engine, image_key=key_path)


def boot_environment(environ: Mapping[str, str], config: BootConfig) -> dict[str, str]:
    """The program's environment: ``environ`` with the config in GPUOS_BOOT and its
    ``pythonpath`` first on PYTHONPATH, and without the variables the config took in."""
    env = {k: v for k, v in environ.items() if k not in OVERRIDES}
    env["PYTHONPATH"] = os.pathsep.join([*config.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    env[ENV] = config.to_json()
    return env
