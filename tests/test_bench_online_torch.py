"""scripts/bench_online_torch.py's rows without a GPU (run_job stubbed): the UM baseline's rows
(--um) run the job untraced with --managed, are checked against hbm, and carry ours_vs_um (against
the Belady run at the same budget) and vs_um100; with --rounds the configs run interleaved, each
ratio pairs runs of one round, and the medians come out."""

from __future__ import annotations

import json
import sys

from helpers import load_script, usage_error


def load():
    return load_script("bench_online_torch")


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


def test_rounds_interleave_the_configs_pair_ratios_within_a_round_and_give_medians(tmp_path, monkeypatch):
    mod = load()
    calls = []
    # round 1: a fast machine (hbm 1.0), round 2 a slow one (hbm 2.0): each ratio within its round
    loops = {("hbm", 0): 1.0, ("66%", 0): 4.0, ("acc-offload", 0): 8.0,
             ("hbm", 1): 2.0, ("66%", 1): 6.0, ("acc-offload", 1): 18.0,
             ("hbm", 2): 1.5, ("66%", 2): 5.0, ("acc-offload", 2): 12.0}

    def fake_run(job, job_args, sched, timeout):
        name = "acc-offload" if "--accelerate" in job_args else ("hbm" if sched is None else sched[1])
        rnd = sum(1 for c in calls if c == name)
        calls.append(name)
        return {"ok": True, "loop_s": loops[(name, rnd)], "digest": "d", "tokens_per_s": 10 / loops[(name, rnd)]}

    monkeypatch.setattr(mod, "run_job", fake_run)
    out = tmp_path / "b.json"
    monkeypatch.setattr(sys, "argv", ["b", "--workloads", "llm", "--configs", "hbm,66%,acc-offload", "--no-warmup",
                                      "--rounds", "3", "--json", str(out)])
    assert mod.main() == 0
    assert calls == ["hbm", "66%", "acc-offload"] * 3
    data = json.loads(out.read_text())
    acc = [r for r in data["rows"] if r["config"] == "acc-offload"]
    assert [r["round"] for r in acc] == [0, 1, 2]
    assert [r["ours_vs_acc"] for r in acc] == [2.0, 3.0, 2.4]  # each against 66% of its own round
    speeds = [r["speed_vs_hbm"] for r in data["rows"] if r["config"] == "66%"]
    assert speeds == [0.25, round(2 / 6, 4), 0.3]
    med = {m["config"]: m for m in data["medians"]}
    assert med["acc-offload"]["ours_vs_acc"] == 2.4 and med["acc-offload"]["rounds"] == 3
    assert med["66%"]["loop_s"] == 5.0 and med["66%"]["speed_vs_hbm"] == 0.3
    assert med["hbm"]["tokens_per_s"] == round(10 / 1.5, 4)


def test_rounds_must_be_positive():
    assert usage_error(load().main, ["--rounds", "0"]) == 2


def test_a_config_suffix_gives_run_options():
    mod = load()
    args = type("A", (), {"configs": "66%,66%-b4,50%-lru,66%-lru-b2,66%-fixed,50%-fixed-l64", "dynamic": False, "um": ""})()
    got = {c[0]: (c[1], c[2], c[4]) for c in mod.configs(args, "llm")}
    assert got == {"66%": ("66%", "belady", []), "66%-b4": ("66%", "belady", ["--prefetch-batch", "4"]),
                   "50%-lru": ("50%", "lru", []), "66%-lru-b2": ("66%", "lru", ["--prefetch-batch", "2"]),
                   "66%-fixed": ("66%", "belady", ["--plan", "fixed"]),
                   "50%-fixed-l64": ("50%", "belady", ["--plan", "fixed", "--lookahead", "64"])}
