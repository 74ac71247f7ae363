"""The in-process side's one boot config (gpuos_tools/injection/config.py), without a GPU: its JSON
round trip and what it refuses; the variables the launcher reads into it; and, end to end through
a real child interpreter, that the launcher hands the program one variable (besides PYTHONPATH)
and the bootstrap parses it, cleans the environment and starts with the same config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
from helpers import REPO

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection import config
from gpuos_tools.injection.config import (
    AgentConfig, BootConfig, ConfigError, OnlineConfig, ServeConfig, TraceConfig, ValidateConfig,
)
from gpuos_tools.injection.tracer import make_agent
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.trace import run as launcher

FULL = BootConfig(
    trace=TraceConfig(fd=7, flush_ms=5.0, native=None, check_pointers=True, fail_code=99),
    agent=AgentConfig(native="/cache/libgpuos_agent.so", cow_budget=1 << 30, stage_ahead=True, exit_wait_s=0.5,
                      exit_max_s=10.0, reference_at=(3, 40), reference_out="/tmp/refs",
                      engine=EngineSettings(digest=False, conserve=False, digest_off_after=2, yield_to_demand=False,
                                            park=False, drop_dead=False),
                      image_key="/keys/images.key",
                      online=OnlineConfig(policy="lru", lookahead=1, budget=1 << 28, summary="/tmp/s.json",
                                          timeline="/tmp/t.json",
                                          serve=ServeConfig(socket="/tmp/serve.sock", job=2, overlap=True,
                                                            ledger="/tmp/serve.ledger"))),
    own=("cupy", "torch"), pythonpath=("/boot", "/pkg"),
)


@pytest.mark.parametrize("cfg", [
    BootConfig(trace=TraceConfig(fd=3)),
    BootConfig(trace=TraceConfig(fd=3, native="/cache/libgpuos_trace.so"), own=("torch",)),
    BootConfig(trace=TraceConfig(fd=4), validate=ValidateConfig(samples=3, max_bytes=8 << 30, extents=True)),
    BootConfig(trace=TraceConfig(fd=4), agent=AgentConfig(mechanism="cupti", online=OnlineConfig(fraction=0.66))),
    BootConfig(trace=TraceConfig(fd=4), agent=AgentConfig(mechanism="cupti", online=OnlineConfig(fraction=0.5, plan="time", bw=(4e10, 3.5e10), proactive=True))),
    BootConfig(trace=TraceConfig(fd=4), agent=AgentConfig(mechanism="cupti", online=OnlineConfig(fraction=0.66, plan="fixed", lookahead=8))),
    FULL,
])
def test_round_trip(cfg):
    text = cfg.to_json()
    assert BootConfig.from_json(text) == cfg
    assert json.loads(text)["trace"]["fd"] == cfg.trace.fd  # plain JSON, one object


def test_the_online_part_is_the_executors_dict():
    """sched/executor.py takes the dict gpu-prefetch-sched run wrote before the config was typed."""
    assert FULL.agent.online.executor_config() == {
        "policy": "lru", "lookahead": 1, "budget": 1 << 28, "summary": "/tmp/s.json", "timeline": "/tmp/t.json",
        "serve": {"socket": "/tmp/serve.sock", "job": 2, "overlap": True, "ledger": "/tmp/serve.ledger"},
        "plan": "count", "proactive": False, "batch": 1, "slack": 0.0}
    assert OnlineConfig(fraction=0.5).executor_config() == {"policy": "belady", "lookahead": 2, "fraction": 0.5,
                                                           "plan": "count", "proactive": False, "batch": 1, "slack": 0.0}
    assert OnlineConfig(fraction=0.5, plan="time", bw=(4e10, 4e10)).executor_config()["bw"] == (4e10, 4e10)


def _edit(path: str, value) -> str:
    """FULL's JSON with one field (dotted path) set to ``value`` (or removed, for ...)."""
    data = json.loads(FULL.to_json())
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return json.dumps(data)


@pytest.mark.parametrize("text, says", [
    ("", "not JSON"),
    ("{", "not JSON"),
    ("[1]", "expected an object"),
    ("{}", "trace: missing"),
    (_edit("trace.fd", ...), "trace.fd: missing"),
    (_edit("trace.fd", "7"), "trace.fd: expected int"),
    (_edit("trace.fd", 7.0), "trace.fd: expected int"),
    (_edit("trace.fd", -1), "trace.fd: -1 is not a file descriptor"),
    (_edit("trace.check_pointers", 1), "trace.check_pointers: expected bool"),
    (_edit("trace.flush_ms", 0), "trace.flush_ms: 0.0 is not more than 0"),
    (_edit("trace.flush_ms", "NaN").replace('"NaN"', "NaN"), "trace.flush_ms: expected a number"),
    (_edit("trace.fail_code", 0), "trace.fail_code: 0 is not an exit status"),
    (_edit("trace.colour", "blue"), "trace.colour: unknown field"),
    (_edit("tracer", {}), "tracer: unknown field"),
    (_edit("agent.cow_budget", -1), "agent.cow_budget: -1 is negative"),
    (_edit("agent.reference_at", "3,40"), "agent.reference_at: expected a list"),
    (_edit("agent.reference_at", [3, "x"]), "agent.reference_at[1]: expected int"),
    (_edit("agent.reference_out", None), "agent.reference_out: needed with reference_at"),
    (_edit("agent.profile_out", "p.txt"), "agent.profile_out: 'p.txt' is not an absolute path"),
    (_edit("agent.online.policy", "fifo"), "online.policy: 'fifo' is not one of"),
    (_edit("agent.online.plan", "launches"), "online.plan: 'launches' is not one of"),
    (_edit("agent.online.bw", [1.0]), "online.bw: (1.0,) is not two bandwidths"),
    (_edit("agent.online.proactive", True), "online.proactive: only with the time plan"),
    (_edit("agent.online.plan", "fixed"), "online.plan: the fixed plan is made with belady only"),
    (_edit("agent.online.slack", 0.6), "online.slack: 0.6 is not from 0 to 0.5"),
    (_edit("agent.online.slack", 0.1), "online.slack: only with the fixed plan"),
    (_edit("agent.online.fraction", 0.5), "online: give one of budget and fraction"),
    (_edit("agent.online.budget", None), "online: give one of budget and fraction"),
    (_edit("agent.online.serve.job", None), "agent.online.serve.job: expected int"),
    (_edit("agent.online.serve", "sock"), "agent.online.serve: expected an object"),
    (_edit("validate", {"samples": 3, "max_bytes": 1, "extents": False}), "validate and agent exclude each other"),
    (_edit("own", ["jax"]), "own: ['jax']: expected some of cupy, torch"),
    (_edit("own", "cupy"), "own: expected a list"),
])
def test_bad_input_is_refused_naming_the_field(text, says):
    with pytest.raises(ConfigError) as e:
        BootConfig.from_json(text)
    assert str(e.value).startswith(f"{config.ENV}: ") and says in str(e.value), str(e.value)
    assert e.value.code == ExitCode.USAGE


def test_overrides_are_read_from_the_launchers_environment():
    o = config.overrides_from_environment({})
    assert o == config.Overrides(own=(), exit_wait_s=30.0, exit_max_s=600.0, reference_at=(), reference_out=None)
    o = config.overrides_from_environment({"GPUOS_AGENT_OWN": "1", "GPUOS_AGENT_EXIT_WAIT": "0",
                                           "GPUOS_AGENT_EXIT_MAX": " 2.5 ", "GPUOS_AGENT_REFERENCE_AT": "5, 9",
                                           "GPUOS_AGENT_REFERENCE_OUT": "/tmp/r", "GPUOS_AGENT_PROFILE_OUT": "p.txt"})
    assert o == config.Overrides(own=("cupy", "torch"), exit_wait_s=0.0, exit_max_s=2.5, reference_at=(5, 9),
                                 reference_out="/tmp/r", profile_out=os.path.abspath("p.txt"))
    # the caller decides what is owned (gpu-prefetch-sched run): the variable is not read
    assert config.overrides_from_environment({"GPUOS_AGENT_OWN": "jax"}, own=False).own == ()


@pytest.mark.parametrize("env, says", [
    ({"GPUOS_AGENT_OWN": "jax"}, "GPUOS_AGENT_OWN='jax'"),
    ({"GPUOS_AGENT_EXIT_WAIT": "soon"}, "GPUOS_AGENT_EXIT_WAIT='soon': expected a number of seconds"),
    ({"GPUOS_AGENT_EXIT_MAX": "-1"}, "GPUOS_AGENT_EXIT_MAX='-1'"),
    ({"GPUOS_AGENT_EXIT_MAX": "inf"}, "GPUOS_AGENT_EXIT_MAX='inf'"),
    ({"GPUOS_AGENT_REFERENCE_AT": "1,x"}, "GPUOS_AGENT_REFERENCE_AT='1,x'"),
    ({"GPUOS_ENGINE_NO_DIGEST": "yes"}, "GPUOS_ENGINE_NO_DIGEST='yes': expected 1"),
    ({"GPUOS_SCHED_FAST": "on"}, "GPUOS_SCHED_FAST='on': expected 1"),
    ({"GPUOS_ENGINE_DIGEST_OFF_AFTER": "-2"}, "GPUOS_ENGINE_DIGEST_OFF_AFTER='-2'"),
    ({"GPUOS_ENGINE_DIGEST_OFF_AFTER": "one"}, "GPUOS_ENGINE_DIGEST_OFF_AFTER='one'"),
])
def test_bad_overrides_are_refused(env, says):
    with pytest.raises(ConfigError, match=None) as e:
        config.overrides_from_environment(env)
    assert says in str(e.value) and e.value.code == ExitCode.USAGE


def test_the_program_gets_one_variable_and_pythonpath():
    environ = {"HOME": "/home/u", "PYTHONPATH": "/mine", "GPUOS_AGENT_OWN": "1", "GPUOS_AGENT_EXIT_WAIT": "3",
               "GPUOS_AGENT_BACKEND": "python", "GPUOS_IMAGES": "/imgs"}
    environ.update({"GPUOS_ENGINE_NO_PARK": "1", "GPUOS_IMAGE_KEY": "/keys/images.key"})
    env = config.boot_environment(environ, FULL)
    assert env.pop(config.ENV) == FULL.to_json()
    assert env.pop("PYTHONPATH") == os.pathsep.join(["/boot", "/pkg", "/mine"])
    # the variables that went into the config are not the program's; the launcher's own stay as they were
    assert env == {"HOME": "/home/u", "GPUOS_AGENT_BACKEND": "python", "GPUOS_IMAGES": "/imgs"}
    assert config.boot_environment({}, FULL)["PYTHONPATH"] == os.pathsep.join(["/boot", "/pkg"])


def test_the_program_pythonpath_after_boot():
    """The launcher's entries come off (the first occurrence of each: a user's own copy stays)."""
    sep = os.pathsep
    assert FULL.program_pythonpath(sep.join(["/boot", "/pkg"])) is None
    assert FULL.program_pythonpath(sep.join(["/boot", "/pkg", "/mine", "/pkg"])) == sep.join(["/mine", "/pkg"])
    assert FULL.program_pythonpath(None) is None
    assert replace(FULL, pythonpath=()).program_pythonpath("/a") == "/a"


def test_the_bootstrap_names_the_variable():
    text = (REPO / "gpuos_tools" / "injection" / "boot" / "sitecustomize.py").read_text()
    assert f'os.environ.pop("{config.ENV}", None)' in text


# -- end to end: the launcher, a real interpreter, the bootstrap ------------------------------------

#: the interpreter's own sitecustomize, which the bootstrap runs first: it records what the
#: launcher passed, and stands in for start() to record what the bootstrap made of it (the tracer
#: itself needs CUPTI and a GPU)
SPY = """
import json, os
from gpuos_tools.injection import start

out = os.environ["SPY_OUT"]
with open(out + ".launched", "w") as f:
    json.dump(dict(os.environ), f)

def spy(cfg):
    if os.environ.get("SPY_FAIL"):
        raise RuntimeError("no tracer here")
    with open(out + ".booted", "w") as f:
        json.dump({"config": cfg.to_json(), "environ": dict(os.environ)}, f)

start.start = spy
"""


@pytest.fixture
def spied(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SPY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(REPO)]))
    monkeypatch.setenv("SPY_OUT", str(tmp_path / "spy"))
    monkeypatch.setattr(launcher, "probe_driver", lambda: SimpleNamespace(gpus=[], release="test", version=None))
    return tmp_path


def test_the_launcher_passes_one_variable_and_the_bootstrap_starts_with_it(spied, monkeypatch):
    monkeypatch.setenv("GPUOS_AGENT_OWN", "cupy")
    monkeypatch.setenv("GPUOS_AGENT_EXIT_WAIT", "5")
    before = dict(os.environ)
    summary = launcher.run_program([sys.executable, "-c", "pass"], output=str(spied / "t.ndjson"), no_images=True,
                                   backend="python", agent=True, cow_budget="1MiB", stage_ahead=True,
                                   mechanism="cupti")
    assert summary.code == 0 and not summary.complete  # the stand-in started no tracer

    launched = json.loads((spied / "spy.launched").read_text())
    added = {k for k in launched if k not in before}
    changed = {k for k in launched if k in before and launched[k] != before[k]}
    removed = {k for k in before if k not in launched}
    assert added == {config.ENV} and changed == {"PYTHONPATH"}
    assert removed == {"GPUOS_AGENT_OWN", "GPUOS_AGENT_EXIT_WAIT"}  # they are in the config now
    assert launched["PYTHONPATH"] == os.pathsep.join([str(launcher.BOOT_DIR), str(launcher.PACKAGE_ROOT),
                                                      before["PYTHONPATH"]])

    sent = BootConfig.from_json(launched[config.ENV])
    booted = json.loads((spied / "spy.booted").read_text())
    assert BootConfig.from_json(booted["config"]) == sent  # parsed once, handed on as it came
    assert sent.agent == AgentConfig(native=None, mechanism="cupti", cow_budget=1 << 20, stage_ahead=True, exit_wait_s=5.0)
    assert sent.own == ("cupy",) and sent.validate is None
    assert sent.trace.native is None and sent.trace.fail_code == ExitCode.NO_CUPTI and sent.trace.fd > 2
    # at boot: the variable gone, PYTHONPATH the user's again, so that children run plain
    assert config.ENV not in booted["environ"] and booted["environ"]["PYTHONPATH"] == before["PYTHONPATH"]
    records = [json.loads(line) for line in (spied / "t.ndjson").read_text().splitlines()]
    assert [r["type"] for r in records] == ["header", "exit"] and records[0]["agent"]["socket"]


def test_a_tracer_that_cannot_start_ends_the_program(spied, monkeypatch):
    monkeypatch.setenv("SPY_FAIL", "1")
    with pytest.raises(GpuosError) as e:
        launcher.run_program([sys.executable, "-c", "print('the program ran')"], output=str(spied / "t.ndjson"),
                             no_images=True, backend="python")
    assert e.value.code == ExitCode.NO_CUPTI and "could not start" in str(e.value)


def test_the_bootstrap_refuses_a_bad_config(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(launcher.BOOT_DIR), str(REPO)]),
           config.ENV: json.dumps({"trace": {"fd": "3"}})}
    done = subprocess.run([sys.executable, "-c", "print('the program ran')"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == ExitCode.NO_CUPTI and done.stdout == ""
    assert f"the tracer could not start in {sys.executable}: ConfigError: {config.ENV}: trace.fd: expected int" \
        in done.stderr


@pytest.mark.parametrize("args, says", [
    (dict(backend="gpu"), "--backend: must be auto, native or python"),
    (dict(validate=True, backend="native"), "--validate runs in the python backend"),
    (dict(validate=True, agent=True), "--agent and --validate exclude each other"),
    (dict(validate=True, validate_max="lots"), "--validate-max:"),
    (dict(stage_ahead=True), "--stage-ahead is an option of --agent"),
    (dict(agent=True, cow_budget="lots"), "--cow-budget:"),
    (dict(online=OnlineConfig(budget=1)), "the online scheduler runs in the agent"),
])
def test_the_launcher_refuses_options_that_do_not_fit(tmp_path, args, says):
    with pytest.raises(GpuosError) as e:
        launcher.run_program(["python3", "p.py"], output=str(tmp_path / "t.ndjson"), **args)
    assert e.value.code == ExitCode.USAGE and says in str(e.value)
    assert not (tmp_path / "t.ndjson").exists()


def test_the_engine_switches_and_the_image_key_go_through_the_config(tmp_path):
    """The residency engine's switches and the image key are read in the launcher and reach the
    agent through the config: the program's environment is not consulted."""
    key = tmp_path / "images.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    o = config.overrides_from_environment({"GPUOS_ENGINE_NO_DIGEST": "1", "GPUOS_ENGINE_NO_CONSERVE": "0",
                                           "GPUOS_ENGINE_DIGEST_OFF_AFTER": "3", "GPUOS_ENGINE_NO_YIELD": "1",
                                           "GPUOS_ENGINE_NO_PARK": "1", "GPUOS_ENGINE_KEEP_DEAD": "1",
                                           "GPUOS_SCHED_DEAD_PLAN": "1", "GPUOS_IMAGE_KEY": str(key)})
    assert o.engine == EngineSettings(digest=False, conserve=True, digest_off_after=3, yield_to_demand=False,
                                      park=False, drop_dead=False, dead_plan=True)
    assert o.image_key == str(key)
    assert config.overrides_from_environment({}).engine == EngineSettings() and \
        config.overrides_from_environment({}).image_key is None
    # the scheduler's fast path is the one switch on by default: 0 turns it off
    assert config.overrides_from_environment({}).engine.fast and EngineSettings().fast
    # dead records move no bytes by default; a fixed plan asks where they are only when told to
    assert EngineSettings().drop_dead and not EngineSettings().dead_plan
    assert config.overrides_from_environment({"GPUOS_SCHED_FAST": "1"}).engine.fast
    assert not config.overrides_from_environment({"GPUOS_SCHED_FAST": "0"}).engine.fast
    # the Python agent (no native core): on CUPTI, whatever the default mechanism
    cfg = AgentConfig(mechanism="cupti", engine=o.engine, image_key=o.image_key)
    assert BootConfig.from_json(BootConfig(trace=TraceConfig(fd=3), agent=cfg).to_json()).agent == cfg
    agent = make_agent(cfg)
    assert agent.engine_settings == o.engine and agent.image_key == b"k" * 32
    assert make_agent(AgentConfig(mechanism="cupti")).image_key is None
    bad = json.loads(BootConfig(trace=TraceConfig(fd=3), agent=cfg).to_json())
    bad["agent"]["engine"]["digest_off_after"] = -1
    with pytest.raises(ConfigError, match="agent.engine: GPUOS_ENGINE_DIGEST_OFF_AFTER: -1 is negative"):
        BootConfig.from_json(json.dumps(bad))


def test_an_image_key_the_program_could_not_use_is_refused_before_it_starts(tmp_path):
    key = tmp_path / "open.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o644)
    with pytest.raises(GpuosError, match="readable or writable by others"):
        config.overrides_from_environment({"GPUOS_IMAGE_KEY": str(key)})
    with pytest.raises(GpuosError, match="cannot read the image key"):
        config.overrides_from_environment({"GPUOS_IMAGE_KEY": str(tmp_path / "missing.key")})
    with pytest.raises(ConfigError, match="agent.image_key: 'rel.key' is not an absolute path"):
        AgentConfig(mechanism="cupti", image_key="rel.key")
