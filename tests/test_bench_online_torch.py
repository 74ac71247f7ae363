"""scripts/bench_online_torch.py's rows without a GPU (run_job stubbed): the UM baseline's rows
(--um) run the job untraced with --managed, are checked against hbm, and carry ours_vs_um (against
the Belady run at the same budget) and vs_um100."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("bench_online_torch", ROOT / "scripts" / "bench_online_torch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_um_rows(tmp_path, monkeypatch):
    mod = load()
    calls = []
    loops = {"hbm": 1.0, "66%": 2.0, "um100": 3.0, "um66": 8.0}

    def fake_run(job, job_args, sched, timeout):
        managed = job_args[job_args.index("--managed") + 1] if "--managed" in job_args else None
        name = {None: "hbm", "1.0": "um100", "0.66": "um66"}[managed] if sched is None else sched[1]
        calls.append((name, sched, managed))
        r = {"ok": True, "loop_s": loops[name], "digest": "d" if name != "um66" else "other", "tokens_per_s": 1.0}
        if managed:
            r.update(um={"evictions": 5}, um_loop={"evictions": 3, "evicted_bytes": 10, "faulted_bytes": 10,
                                                  "hook_s": 0.1})
        return r

    monkeypatch.setattr(mod, "run_job", fake_run)
    out = tmp_path / "b.json"
    monkeypatch.setattr(sys, "argv", ["b", "--workloads", "llm", "--configs", "hbm,66%", "--um", "100%,66%",
                                      "--json", str(out)])
    assert mod.main() == 1  # um66's digest differs from hbm's: the run fails
    # first a discarded hbm run (a fresh GPU machine's first job runs slower), then the rows
    assert [c[0] for c in calls] == ["hbm", "hbm", "66%", "um100", "um66"]
    assert calls[3][1] is None and calls[4][1] is None  # untraced: the job's own --managed
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["um100"]["identical"] is True and rows["um100"]["speed_vs_hbm"] == round(1 / 3, 4)
    assert "ours_vs_um" not in rows["um100"] and "vs_um100" not in rows["um100"]  # no 100% Belady row asked
    u = rows["um66"]
    assert u["identical"] is False and u["ours_config"] == "66%" and u["ours_vs_um"] == 4.0
    assert u["vs_um100"] == round(8 / 3, 3) and u["um_loop"]["evictions"] == 3 and u["policy"] == "managed"


def test_no_warmup_runs_only_the_rows(tmp_path, monkeypatch):
    mod = load()
    calls = []

    def fake_run(job, job_args, sched, timeout):
        calls.append(sched)
        return {"ok": True, "loop_s": 1.0, "digest": "d", "tokens_per_s": 1.0}

    monkeypatch.setattr(mod, "run_job", fake_run)
    monkeypatch.setattr(sys, "argv", ["b", "--workloads", "llm", "--configs", "hbm", "--no-warmup",
                                      "--json", str(tmp_path / "b.json")])
    assert mod.main() == 0 and calls == [None]
