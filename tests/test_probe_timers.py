"""scripts/probe_timers.py: functions wrapped with timers inside a program run in the same
interpreter, counted per thread, within the window its marker function opens and closes."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO

def test_calls_are_timed_per_thread_inside_the_window(tmp_path):
    prog = tmp_path / "prog.py"
    (tmp_path / "lib_probe.py").write_text(
        "import time\nclass Probe:\n    def work(self, s):\n        time.sleep(s)\ndef mark():\n    return None\n")
    prog.write_text(
        "import threading, lib_probe\n"
        "p = lib_probe.Probe()\n"
        "p.work(0.001)\n"
        "lib_probe.mark()\n"
        "for _ in range(3):\n    p.work(0.01)\n"
        "t = threading.Thread(target=p.work, args=(0.02,), name='side')\nt.start(); t.join()\n"
        "lib_probe.mark()\n"
        "p.work(0.001)\n")
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "probe_timers.py"), "--wrap", "lib_probe:Probe.work",
                    "--window", "lib_probe:mark", "--out", str(out), "--", str(prog)],
                   check=True, cwd=tmp_path, env={"PYTHONPATH": f"{REPO}:{tmp_path}"}, timeout=60)
    rep = json.loads(out.read_text())
    rows = {(r["thread"], r["function"]): r for r in rep["rows"]}
    assert rep["windowed"] and set(rows) == {("MainThread", "Probe.work"), ("side", "Probe.work")}
    main, side = rows[("MainThread", "Probe.work")], rows[("side", "Probe.work")]
    assert main["calls"] == 3 and 0.03 <= main["s"] < 0.5 and side["calls"] == 1 and side["s"] >= 0.02
    assert rep["span_s"] >= main["s"] + side["s"]


def test_a_name_that_does_not_resolve_stops_before_the_program_runs(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text("open('ran', 'w').close()\n")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "probe_timers.py"), "--wrap", "json:nothing_here",
                        "--", str(prog)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "json:nothing_here" in p.stderr and not (tmp_path / "ran").exists()
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "probe_timers.py"), "--wrap", "json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr
