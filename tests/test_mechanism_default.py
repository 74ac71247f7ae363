"""The agent's default mechanism, without a GPU: one constant (injection/config.py's
DEFAULT_MECHANISM) decides it; a default of intercept that cannot run here gives way to CUPTI with
one warning, and the config, the header and the summary name what the agent ran on; intercept asked
for (option or variable) is refused instead.

The launcher runs for real (its checks, builds and environment) on a real child interpreter whose
sitecustomize stands in for the tracer, which needs CUPTI or a driver; the default is set to intercept
through the constant whatever it is in the code."""

from __future__ import annotations

import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
from helpers import REPO
from test_boot_config import SPY

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection import config, intercept
from gpuos_tools.injection.config import MECHANISMS, AgentConfig, BootConfig
from gpuos_tools.trace import run as launcher

HAVE_CC = bool(shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))


@pytest.fixture
def spied(tmp_path, monkeypatch):
    """The launcher ready to start a child whose start-up only records what it was handed; no
    mechanism or backend asked for, and a cache of its own (nothing built before)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SPY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(REPO)]))
    monkeypatch.setenv("SPY_OUT", str(tmp_path / "spy"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for k in (launcher.MECHANISM_ENV, launcher.BACKEND_ENV, intercept.PRELOAD):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launcher, "probe_driver", lambda: SimpleNamespace(gpus=[], release="test", version=None))
    return tmp_path


@pytest.fixture
def intercept_default(monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_MECHANISM", "intercept")


def launch(tmp_path, **kw) -> tuple[launcher.RunSummary, list[str], BootConfig, dict, dict]:
    """gpu-trace run --agent on `python -c pass`: the summary, the warnings, the config the child got,
    its environment and the trace's header."""
    said: list[str] = []
    summary = launcher.run_program([sys.executable, "-c", "pass"], output=str(tmp_path / "t.ndjson"), no_images=True,
                                   agent=True, warn=said.append, **kw)
    launched = json.loads((tmp_path / "spy.launched").read_text())
    header = json.loads((tmp_path / "t.ndjson").read_text().splitlines()[0])
    return summary, said, BootConfig.from_json(launched[config.ENV]), launched, header


def about_mechanism(said: list[str]) -> list[str]:
    return [m for m in said if "mechanism" in m]


def assert_fell_back(summary, said, cfg, launched, header, why: str) -> None:
    """CUPTI ran, one warning said why and how to choose, and everything names cupti."""
    (message,) = about_mechanism(said)
    assert "the default mechanism, intercept, cannot run here" in message and why in message, message
    assert "GPUOS_AGENT_MECHANISM=cupti|intercept (or gpu-trace run --agent --mechanism)" in message
    assert cfg.agent.mechanism == "cupti" and summary.mechanism == "cupti"
    assert header["agent"]["mechanism"] == "cupti"
    assert intercept.PRELOAD not in launched  # nothing preloaded


# -- the choice ----------------------------------------------------------------------------------


@pytest.mark.parametrize("default", MECHANISMS)
def test_the_constant_is_the_default_and_an_asked_mechanism_wins(monkeypatch, default):
    monkeypatch.setattr(config, "DEFAULT_MECHANISM", default)
    for k in (launcher.MECHANISM_ENV, launcher.BACKEND_ENV):
        monkeypatch.delenv(k, raising=False)
    assert launcher.agent_mechanism(None, True, "auto") == launcher.Mechanism(default)
    assert not launcher.agent_mechanism(None, True, "auto").explicit
    # the default is not refused up front with the Python backend: it gives way later
    assert launcher.agent_mechanism(None, True, "python") == launcher.Mechanism(default)
    assert launcher.agent_mechanism(None, False, "auto").name == "cupti"  # the tracer alone
    for name in MECHANISMS:
        assert launcher.agent_mechanism(name, True, "auto") == launcher.Mechanism(name, "--mechanism")
        monkeypatch.setenv(launcher.MECHANISM_ENV, name)
        assert launcher.agent_mechanism(None, True, "auto") == launcher.Mechanism(name, launcher.MECHANISM_ENV)
        monkeypatch.delenv(launcher.MECHANISM_ENV)


def test_help_and_man_pages_state_the_constant():
    from gpuos_tools.commands import cli

    assert f"the default is {config.DEFAULT_MECHANISM}." in cli.MECHANISM_DEFAULT
    for page in ("gpu-trace.1", "gpu-ckpt.1", "gpu-prefetch-sched.1"):
        text = " ".join((REPO / "man" / page).read_text().split())
        assert f"the default is {config.DEFAULT_MECHANISM}" in text, page
    assert "else cupti" not in (REPO / "gpuos_tools" / "commands" / "trace.py").read_text()


# -- a default of intercept that cannot run gives way ---------------------------------------------


def test_no_c_compiler(spied, intercept_default, monkeypatch):
    monkeypatch.setenv("CC", str(spied / "no-such-cc"))
    summary, said, cfg, launched, header = launch(spied)
    assert_fell_back(summary, said, cfg, launched, header, "the agent's interposer cannot be built")
    # the native core cannot be built either: the Python agent, said in the same warning
    assert cfg.agent.native is None and "on the Python agent (its native core is unavailable too)" in said[-1]


@pytest.mark.parametrize("how", ["option", "variable"])
def test_the_python_backend(spied, intercept_default, monkeypatch, how):
    if how == "option":
        summary, said, cfg, launched, header = launch(spied, backend="python")
        why = "--backend python asks for the Python agent"
    else:
        monkeypatch.setenv(launcher.BACKEND_ENV, "python")
        summary, said, cfg, launched, header = launch(spied)
        why = "GPUOS_AGENT_BACKEND=python asks for the Python agent"
    assert_fell_back(summary, said, cfg, launched, header, why)
    assert cfg.agent.native is None and "on the Python agent" in about_mechanism(said)[0]


def not_a_library(path):
    path.write_bytes(b"not an ELF file\n")
    return path


def test_an_interposer_that_does_not_build(spied, intercept_default, monkeypatch):
    def broken(cache=None):
        raise launcher.cbuild.BuildError("cc -shared ... failed:\nerror: expected ';'")

    monkeypatch.setattr(intercept, "build_agent", broken)
    summary, said, cfg, launched, header = launch(spied)
    assert_fell_back(summary, said, cfg, launched, header, "the agent's interposer cannot be built: cc -shared")
    if HAVE_CC:  # the CUPTI front end's core builds: the agent stays native
        assert cfg.agent.native and "on the native core" in about_mechanism(said)[0]


def test_an_interposer_that_does_not_load(spied, intercept_default, monkeypatch):
    bad = not_a_library(spied / "libgpuos_icagent-x.so")
    monkeypatch.setattr(intercept, "build_agent", lambda cache=None: bad)
    summary, said, cfg, launched, header = launch(spied)
    assert_fell_back(summary, said, cfg, launched, header, "the agent's interposer cannot be loaded")


# -- asked for, it is refused -----------------------------------------------------------------------


@pytest.mark.parametrize("default", MECHANISMS)
@pytest.mark.parametrize("how", ["option", "variable"])
def test_intercept_asked_for_and_unavailable_is_refused(spied, monkeypatch, default, how):
    monkeypatch.setattr(config, "DEFAULT_MECHANISM", default)
    bad = not_a_library(spied / "libgpuos_icagent-x.so")
    monkeypatch.setattr(intercept, "build_agent", lambda cache=None: bad)
    kw = {"mechanism": "intercept"} if how == "option" else {}
    if how == "variable":
        monkeypatch.setenv(launcher.MECHANISM_ENV, "intercept")
    with pytest.raises(GpuosError) as e:
        launch(spied, **kw)
    source = "--mechanism" if how == "option" else "GPUOS_AGENT_MECHANISM"
    assert e.value.code == ExitCode.FAILURE
    assert str(e.value).startswith(f"{source} intercept: the agent's interposer cannot be loaded")
    assert "CUPTI callbacks instead (cupti)" in str(e.value)
    assert not (spied / "spy.launched").exists()  # the program never started


def test_intercept_asked_for_with_the_python_backend_is_refused(spied, intercept_default):
    with pytest.raises(GpuosError, match="needs the agent's native core") as e:
        launch(spied, mechanism="intercept", backend="python")
    assert e.value.code == ExitCode.USAGE and not (spied / "spy.launched").exists()


def test_cupti_asked_for_under_a_default_of_intercept_says_nothing(spied, intercept_default, monkeypatch):
    monkeypatch.setattr(intercept, "build_agent", lambda cache=None: pytest.fail("the interposer was built"))
    summary, said, cfg, launched, header = launch(spied, mechanism="cupti", backend="python")
    assert about_mechanism(said) == [] and cfg.agent.mechanism == "cupti" and summary.mechanism == "cupti"


# -- and where it can run, it runs ------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_default_of_intercept_that_can_run_preloads_the_interposer(spied, intercept_default):
    summary, said, cfg, launched, header = launch(spied)
    assert about_mechanism(said) == []
    assert cfg.agent.mechanism == "intercept" and summary.mechanism == "intercept"
    assert header["agent"]["mechanism"] == "intercept"
    assert launched[intercept.PRELOAD].split()[0] == cfg.agent.native
    assert os.path.basename(cfg.agent.native).startswith(intercept.AGENT_STEM)


def test_the_config_field_defaults_to_the_constant():
    field = AgentConfig.__dataclass_fields__["mechanism"]
    assert field.default == config.DEFAULT_MECHANISM
