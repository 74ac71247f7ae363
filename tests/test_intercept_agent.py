"""The agent on driver-API interception (csrc/gpuos_intercept.c built with -DGPUOS_AGENT), on the
stand-in driver (tests/fake_libcuda_entry.c as libcuda.so.1), against the agent on CUPTI
callbacks (csrc/gpuos_trace.c with -DGPUOS_AGENT) fed the same calls through a stand-in libcupti.

A program under `gpu-trace run --agent --mechanism intercept` makes the calls of
tests/intercept_agent_scenario.py through all three routes (direct, dlsym, cuGetProcAddress);
the same calls are delivered to the CUPTI front end as CUPTI's callbacks
(tests/intercept_cupti_replay.py). The trace's records (launches with their argument bytes and
layouts, allocations, copies with their payload, memsets, frees, streams, modules) and the
core's state (allocations, access sets, dirty set, the snapshot protection upcalls, counters)
must be the same, and nothing of CUPTI may be in the program."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuos_tools import cbuild
from gpuos_tools.access.predict import Predictor
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection import core as core_mod
from gpuos_tools.injection import intercept
from gpuos_tools.injection.config import AgentConfig, BootConfig, ConfigError, TraceConfig
from gpuos_tools.trace import run as launcher

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("icagent")
    cache = d / "cache"
    out = {"dir": d, "interposer": intercept.build_agent(cache), "cupti_agent": core_mod.build(cache)}
    fake = cbuild.build_library(cache, source=TESTS / "fake_libcuda_entry.c", stem="libfake-drv",
                                flags=("-O2", "-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1"), libs=("-lpthread",))
    (d / "drv").mkdir()
    shutil.copy(fake, d / "drv" / "libcuda.so.1")
    out["drv"] = d / "drv"
    out["cupti"] = cbuild.build_library(cache, source=TESTS / "fake_libcupti.c", stem="libfake-cupti", libs=())
    shim = d / "libshim.so"
    done = subprocess.run([CC, "-O2", "-shared", "-fPIC", "-o", str(shim), str(TESTS / "intercept_agent_shim.c"),
                           str(d / "drv" / "libcuda.so.1")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out["shim"] = shim
    return out


def environment(built, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(built["drv"]), XDG_CACHE_HOME=str(built["dir"] / "xdg"),
               PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    env.pop("LD_PRELOAD", None)
    env.pop("GPUOS_AGENT_MECHANISM", None)
    env.update(extra or {})
    return env


def strip(rec: dict) -> dict:
    """A record without what differs between two processes: times, thread ids, host addresses."""
    host = rec.get("type") == "memcpy" and rec.get("dir") == "HtoD"
    return {k: v for k, v in rec.items() if k not in ("ts", "tid") and not (host and k == "src")}


@pytest.fixture(scope="module")
def both(built, tmp_path_factory) -> dict:
    """The scenario under the interposer agent (gpu-trace run's launcher, in this process: the
    program is its child) and through CUPTI's callbacks (a process of its own)."""
    d = tmp_path_factory.mktemp("runs")
    env = environment(built)
    trace = d / "trace.ndjson"
    state_file = d / "state.json"
    # a cupti-python the program could import: were the agent's start-up to import it, the
    # program would find it in sys.modules
    (d / "site" / "cupti").mkdir(parents=True)
    (d / "site" / "cupti" / "__init__.py").write_text("cupti = None\n")
    with pytest.MonkeyPatch.context() as mp:
        for k in ("LD_LIBRARY_PATH", "XDG_CACHE_HOME"):
            mp.setenv(k, env[k])
        mp.setenv("PYTHONPATH", os.pathsep.join([str(d / "site"), env["PYTHONPATH"]]))
        for k in ("LD_PRELOAD", "GPUOS_AGENT_MECHANISM", "GPUOS_AGENT_BACKEND"):
            mp.delenv(k, raising=False)
        # the launcher's look at the GPUs (cuda-python) is all it needs of a real driver
        mp.setattr(launcher, "probe_driver", lambda: SimpleNamespace(gpus=[], release="test", version=None))
        summary = launcher.run_program(
            [sys.executable, str(TESTS / "intercept_agent_prog.py"), str(built["shim"]), str(state_file)],
            output=str(trace), no_images=True, agent=True, mechanism="intercept")
    assert summary.code == 0 and summary.complete, summary.errors
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    replay_out = d / "replay.json"
    done = subprocess.run([sys.executable, str(TESTS / "intercept_cupti_replay.py"), str(built["cupti_agent"]),
                           str(built["interposer"]), str(built["cupti"]), str(replay_out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=d)
    assert done.returncode == 0, done.stderr
    replay = json.loads(replay_out.read_text())
    return {"records": records, "state": json.loads(state_file.read_text()), "cupti": replay}


def test_the_interposer_agent_ships_the_records_the_cupti_agent_does(both):
    header, *body, end = both["records"]
    assert header["type"] == "header" and header["mechanism"] == "intercept" and header["cupti"] is None
    assert header["backend"] == "native-agent" and header["agent"]["mechanism"] == "intercept"
    assert end["type"] == "exit" and end["code"] == 0 and end["complete"]
    got = [strip(r) for r in body]
    want = [strip(r) for r in both["cupti"]["records"]]
    assert got == want
    kinds = [r["type"] for r in got]
    # what the scenario did, every kind of record there: a stream, a module (and its library record),
    # two allocations, a copy carrying its bytes, five launches, three memsets, a free, a stream destroyed
    assert kinds.count("launch") == 4 and kinds.count("alloc") == 2 and kinds.count("memset") == 3
    assert {"stream", "module", "library", "memcpy", "free"} <= set(kinds)
    launches = [r for r in got if r["type"] == "launch"]
    assert [r["api"] for r in launches] == ["cuLaunchKernel", "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernel"]
    assert all(r["layout"] == "cuFuncGetParamInfo" and len(r["params"]) == 2 for r in launches)
    a, b, stream = both["state"]["addresses"]
    assert launches[0]["kernel"] == "fake_kernel_100010" and launches[0]["stream"] == stream
    assert bytes.fromhex(launches[0]["params"][0]["hex"]) == a.to_bytes(8, "little")
    copy = next(r for r in got if r["type"] == "memcpy")
    assert copy["dir"] == "HtoD" and bytes.fromhex(copy["data"])[:8] == a.to_bytes(8, "little")
    module = next(r for r in got if r["type"] == "module")
    assert module["format"] == "ptx" and module["size"] > 0


def test_module_variables_are_traced_and_their_pointers_followed(both):
    """The scenario locates one kernel of its module and a variable (without its size), and
    stores a's address in the variable; the driver says which module the other kernel, launched
    first, came from. Each kernel of the module reads a through the variable."""
    got = [strip(r) for r in both["records"][1:-1]]
    symbols = [r for r in got if r["type"] == "symbol"]
    parent = symbols[0]["parent"]
    assert symbols == [
        {"type": "symbol", "api": "cuModuleGetFunction", "of": "function", "name": "fake_kernel_100020",
         "parent": parent, "func": 0x100020},
        {"type": "symbol", "api": "cuModuleGetGlobal_v2", "of": "variable", "name": "table", "parent": parent,
         "addr": both["state"]["variable"]},
        {"type": "symbol", "api": "cuFuncGetModule", "of": "function", "name": "fake_kernel_100010",
         "parent": parent, "func": 0x100010},
    ]
    a, b, _ = both["state"]["addresses"]
    pred = Predictor("range")
    accesses = [acc for r in both["records"] if (acc := pred.feed(r)) is not None]
    copy_into = next(acc for acc in accesses if acc["of"] == "memcpy" and not acc["writes"])
    assert not copy_into["unknown"]  # the driver's memory, known by name
    launches = [acc for acc in accesses if acc["of"] == "launch"]
    ids = {r["addr"]: r["id"] for r in both["records"] if r["type"] == "alloc"}
    ptsz = launches[2]  # fake_kernel_100010 on a + 64: only the variable reaches a's start
    assert {"alloc": ids[a], "offset": 0, "size": 1 << 20, "how": "scan:untyped,variable:table"} in ptsz["reads"]
    other = launches[1]  # fake_kernel_100020 on b
    assert {"alloc": ids[a], "offset": 0, "size": 1 << 20, "how": "stored,variable:table"} in other["reads"]


def test_the_core_ends_in_the_same_state_under_both_front_ends(both):
    mine, theirs = both["state"], both["cupti"]["state"]
    for key in ("cupti_mapped", "cupti_imported", "agent_mechanism"):
        mine = {k: v for k, v in mine.items() if k != key}
    assert mine == theirs
    state = both["state"]
    assert state["counters"]["ops"] >= 7 and state["counters"]["allocations"] == 1  # b was freed
    assert state["first_launch_access"] is not None
    assert state["context_before_alloc"] and state["context_before_alloc"] == state["context"]
    assert state["dirty_known"] and state["dirty"]  # the launches and memset wrote something
    # the snapshot: the memset into b protected it on its stream, the second one found it safe,
    # the launch on stream 0 protected what it may write there
    assert state["protects"][0] == [[1], state["addresses"][2]]
    assert len(state["protects"]) == 2 and state["protects"][1][1] == 0
    assert state["context"] == 0xC0C0000


def test_nothing_of_cupti_is_in_the_program(both):
    state = both["state"]
    assert state["cupti_mapped"] == [] and state["cupti_imported"] == []
    assert state["agent_mechanism"] == "intercept"


def test_interception_is_the_agents_and_on_its_native_core(monkeypatch):
    monkeypatch.delenv("GPUOS_AGENT_MECHANISM", raising=False)
    monkeypatch.delenv("GPUOS_AGENT_BACKEND", raising=False)
    monkeypatch.setenv("GPUOS_AGENT_MECHANISM", "intercept")
    assert launcher.agent_mechanism(None, True, "auto").name == "intercept"
    assert launcher.agent_mechanism("cupti", True, "auto").name == "cupti"  # the option wins
    assert launcher.agent_mechanism(None, False, "auto").name == "cupti"  # the variable is the agent's only
    for value in ("intercept", "cupti"):  # either value without --agent is a mistake, not ignored
        with pytest.raises(GpuosError, match="--mechanism goes with --agent") as e:
            launcher.agent_mechanism(value, False, "auto")
        assert e.value.code == ExitCode.USAGE
    with pytest.raises(GpuosError, match="native core"):
        launcher.agent_mechanism("intercept", True, "python")
    monkeypatch.setenv("GPUOS_AGENT_MECHANISM", "ebpf")
    with pytest.raises(GpuosError, match="GPUOS_AGENT_MECHANISM"):
        launcher.agent_mechanism(None, True, "auto")
    with pytest.raises(ConfigError, match="mechanism"):
        AgentConfig(mechanism="intercept")  # no native core
    cfg = BootConfig(trace=TraceConfig(fd=3), agent=AgentConfig(native="/x/lib.so", mechanism="intercept"))
    assert BootConfig.from_json(cfg.to_json()).agent.mechanism == "intercept"


def test_the_preload_goes_first_and_leaves_with_the_boot():
    assert intercept.preload({"LD_PRELOAD": "/u/a.so"}, "/c/lib.so") == "/c/lib.so /u/a.so"
    assert intercept.preload({}, "/c/lib.so") == "/c/lib.so"
    assert intercept.unpreload("/c/lib.so /u/a.so", "/c/lib.so") == "/u/a.so"
    assert intercept.unpreload("/c/lib.so", "/c/lib.so") is None


def test_a_fatbin_handed_to_a_load_call_lists_its_kernels():
    """The interposer ships the image a load call was given; a fatbin's kernels are read from its
    cubins (CUPTI's module callback hands over a cubin)."""
    from gpuos_tools.cuda import elf
    from gpuos_tools.model import wire
    from gpuos_tools.model.decode import Decoder

    data = (TESTS / "data" / "kernels.fatbin").read_bytes()
    rec = next(Decoder(None).feed([(wire.MODULE, 1, 2, 7, data)]))
    assert rec["format"] == "fatbin"
    want = {k for _, cubin in elf.extract_cubins(data) for k in elf.kernels(cubin)}
    assert want and set(rec["kernels"]) == want
