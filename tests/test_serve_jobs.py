"""How `gpu-prefetch-sched serve` starts its jobs, without a GPU: the coordinator (sched/serve.py)
starts each through the callable the command hands in, with the job's serve config; the command's
callable runs the job as `gpu-prefetch-sched run --serve SPEC`, whose SPEC becomes the boot
config's serve part."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import typer

from gpuos_tools.commands import cli, prefetch_sched
from gpuos_tools.sched.serve import serve_jobs
from gpuos_tools.trace import run as launcher

#: a job that served nothing: says its summary (as `run` would) and its own throughput, and ends
JOB = """
import json, sys
print(json.dumps({"type": "header"}))
print(json.dumps({"type": "sched_summary", "bytes_in": 10, "evictions": 1}))
print(json.dumps({"steps": 4, "loop_s": 2.0, "job": sys.argv[1]}))
"""


def test_the_coordinator_starts_jobs_through_the_callable_it_is_given(tmp_path):
    started = []

    def start(serve, argv, stdout, stderr):
        started.append((serve, argv))
        return subprocess.Popen([sys.executable, "-c", JOB, argv[-1]], stdout=stdout, stderr=stderr,
                                stdin=subprocess.DEVNULL)

    result = serve_jobs([["python3", "a.py", "A"], ["python3", "b.py", "B"]], 1 << 30, 0.05, "belady", 2,
                        str(tmp_path), start)
    assert [s for s, _ in started] == [
        {"socket": str(tmp_path / "serve.sock"), "job": i, "overlap": False, "ledger": str(tmp_path / "serve.ledger")}
        for i in range(2)]
    assert [a for _, a in started] == [["python3", "a.py", "A"], ["python3", "b.py", "B"]]
    rows = result["jobs"]
    assert [r["ok"] for r in rows] == [True, True] and [r["exit"] for r in rows] == [0, 0]
    assert [r["output"]["job"] for r in rows] == ["A", "B"]
    assert rows[0]["throughput"] == 2.0 and rows[0]["bytes_in"] == 10


def test_the_commands_job_is_run_with_its_serve_spec():
    serve = {"socket": "/tmp/s.sock", "job": 1, "overlap": True, "ledger": "/tmp/l"}
    cmd = prefetch_sched.job_command(serve, ["python3", "job.py", "--x"], 1 << 30, "lru", 3)
    assert cmd[:4] == [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run"]
    i = cmd.index("--serve")
    assert json.loads(cmd[i + 1]) == serve
    assert cmd[cmd.index("--budget") + 1] == str(1 << 30) and cmd[cmd.index("--policy") + 1] == "lru"
    assert cmd[cmd.index("--lookahead") + 1] == "3" and cmd[cmd.index("--") + 1:] == ["python3", "job.py", "--x"]


def test_the_commands_job_plans_as_serve_was_told():
    serve = {"socket": "/tmp/s.sock", "job": 0}
    cmd = prefetch_sched.job_command(serve, ["job.py"], 1 << 30, "belady", 2)
    assert cmd[cmd.index("--plan") + 1] == "count" and "--plan-bw" not in cmd
    cmd = prefetch_sched.job_command(serve, ["job.py"], 1 << 30, "belady", 2, "time", "20GB/s,10GB/s")
    assert cmd[cmd.index("--plan") + 1] == "time" and cmd[cmd.index("--plan-bw") + 1] == "20GB/s,10GB/s"
    assert cmd.index("--plan") < cmd.index("--")  # options of run, not of the job


def test_serve_refuses_a_plan_it_cannot_pass_on_before_any_job_starts(monkeypatch):
    started = []
    monkeypatch.setattr(prefetch_sched, "serve_jobs", lambda *a, **k: started.append(a))
    app = typer.main.get_command(prefetch_sched.app)
    for bad in (["--plan", "soon"], ["--plan", "time", "--plan-bw", "0GB/s"], ["--plan-bw", "1GB/s,2GB/s,3GB/s"]):
        code = cli.run(app, "gpu-prefetch-sched", ["serve", "--budget", "1GiB", *bad, "--job", "true"])
        assert code == 2, bad
    assert not started


def test_run_makes_the_serve_spec_part_of_the_boot_config(monkeypatch, tmp_path):
    """`run --serve SPEC` hands the launcher an online config whose serve part is SPEC, the
    program's allocations all owned."""
    seen = {}

    def fake(program, **kw):
        seen.update(kw)
        with open(kw["online"].summary, "w") as f:
            json.dump({"bytes_in": 0}, f)
        return SimpleNamespace(code=0, errors=[], mechanism="cupti")  # the launcher's summary names it

    monkeypatch.setattr(launcher, "run_program", fake)
    spec = {"socket": str(tmp_path / "s.sock"), "job": 3, "overlap": False, "ledger": None}
    code = cli.run(typer.main.get_command(prefetch_sched.app), "gpu-prefetch-sched",
                   ["run", "--budget", "1GiB", "--policy", "lru", "--lookahead", "1", "--serve", json.dumps(spec),
                    "--", "python3", "job.py"])
    assert code == 0
    online = seen["online"]
    assert online.executor_config()["serve"] == spec and online.budget == 1 << 30 and online.policy == "lru"
    assert seen["agent"] is True and seen["own"] == ("cupy", "torch")
