"""`gpu-prefetch-sched run` without a GPU: how the agent sees the driver calls is
GPUOS_AGENT_MECHANISM's to say, as for `gpu-ckpt run`; the launcher reads it, the command's header
names the mechanism the agent ran on, and a value the agent cannot run on is refused before the
program starts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import typer

from gpuos_tools.commands import cli, prefetch_sched
from gpuos_tools.errors import ExitCode
from gpuos_tools.injection import config
from gpuos_tools.trace import run as launcher

PROGRAM = ["--", "python3", "job.py"]


def run(monkeypatch, capsys, env: dict[str, str]) -> tuple[int, dict, list[dict], str]:
    for k in ("GPUOS_AGENT_MECHANISM", "GPUOS_AGENT_BACKEND"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen: dict = {}

    def fake(program, **kw):
        seen.update(kw, program=program)
        with open(kw["online"].summary, "w") as f:
            json.dump({"bytes_in": 0}, f)
        # what the launcher ran the agent on: its choice (a default that gives way is tested
        # with the launcher itself, tests/test_mechanism_default.py)
        ran = launcher.agent_mechanism(kw.get("mechanism"), True, "auto").name
        return SimpleNamespace(code=0, errors=[], mechanism=ran)

    monkeypatch.setattr(launcher, "run_program", fake)
    code = cli.run(typer.main.get_command(prefetch_sched.app), "gpu-prefetch-sched",
                   ["run", "--budget", "66%", *PROGRAM])
    out, err = capsys.readouterr()
    return code, seen, [json.loads(line) for line in out.splitlines() if line.strip()], err


@pytest.mark.parametrize("default", ["cupti", "intercept"])
@pytest.mark.parametrize("value", [None, "cupti", "intercept"])
def test_the_mechanism_is_the_variables_and_named_in_the_header(monkeypatch, capsys, value, default):
    monkeypatch.setattr(config, "DEFAULT_MECHANISM", default)
    code, seen, recs, _ = run(monkeypatch, capsys, {} if value is None else {"GPUOS_AGENT_MECHANISM": value})
    want = value or default
    assert code == 0
    assert "mechanism" not in seen  # the launcher reads the variable (and the default) itself
    assert seen["agent"] is True and seen["program"] == PROGRAM[1:]
    assert recs[0]["type"] == "header" and recs[0]["mechanism"] == want
    assert recs[-1]["type"] == "sched_summary"


@pytest.mark.parametrize("env,says", [
    ({"GPUOS_AGENT_MECHANISM": "ebpf"}, "GPUOS_AGENT_MECHANISM: must be cupti or intercept, not 'ebpf'"),
    ({"GPUOS_AGENT_MECHANISM": "intercept", "GPUOS_AGENT_BACKEND": "python"}, "needs the agent's native core"),
])
def test_a_mechanism_the_agent_cannot_run_on_is_refused_before_the_program_starts(monkeypatch, capsys, env, says):
    code, seen, recs, err = run(monkeypatch, capsys, env)
    assert code == ExitCode.USAGE and says in err, err
    assert seen == {} and recs == []  # the program never started, nothing on stdout
