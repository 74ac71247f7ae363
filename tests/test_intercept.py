"""Driver-API interception without CUPTI (gpuos_tools/injection/csrc/gpuos_intercept.c) on the
stand-in driver (tests/fake_libcuda_entry.c built as libcuda.so.1): every call a program makes
directly, through dlsym on a driver handle and through cuGetProcAddress is counted once, by route
and per kernel, against the driver's own counts; arguments and the per-thread-stream variant reach
the driver intact; dlsym keeps answering RTLD_NEXT and RTLD_DEFAULT for the real caller."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuos_tools import cbuild
from gpuos_tools.injection import intercept

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FAKE = TESTS / "fake_libcuda_entry.c"
PROG = TESTS / "intercept_prog.c"
THREADS = 4
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"


def compile_c(*args: str) -> None:
    done = subprocess.run([CC, "-O2", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The interposer, the fake driver as libcuda.so.1 (with and without -Bsymbolic) and the program."""
    d = tmp_path_factory.mktemp("intercept")
    cache = d / "cache"
    out = {"lib": intercept.build(cache), "dir": d}
    for name, extra in (("drv", ("-Wl,-Bsymbolic",)), ("drv-plain", ())):
        fake = cbuild.build_library(cache, source=FAKE, stem=f"libfake-{name}",
                                    flags=("-O2", *extra, "-Wl,-soname,libcuda.so.1"), libs=("-lpthread",))
        (d / name).mkdir()
        shutil.copy(fake, d / name / "libcuda.so.1")
        out[name] = d / name
    compile_c("-o", str(d / "prog"), str(PROG), str(d / "drv" / "libcuda.so.1"), "-ldl", "-lpthread")
    out["prog"] = d / "prog"
    return out


def run(built, args: list[str], tmp_path: Path, preload: bool = True, driver: str = "drv",
        extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[intercept.Counts]]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(built[driver]), PYTHONPATH=str(ROOT))
    env.pop("LD_PRELOAD", None)
    outdir = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    outdir.mkdir()
    if preload:
        env = intercept.environment(built["lib"], str(outdir / "counts-%p.json"), env)
    env.update(extra_env or {})
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert not list(outdir.glob("*.tmp")), "a count file was left half written"
    return done, [intercept.read_counts(p) for p in sorted(outdir.glob("counts-*.json"))]


# what intercept_prog.c `all` does, per call and route (direct, dlsym, getproc)
EXPECTED = {
    "cuLaunchKernel": {"direct": 3 + 1, "dlsym": 4, "getproc": 5 + 6 + 1 + 1000 * THREADS},
    "cuLaunchKernelEx": {"direct": 2, "dlsym": 0, "getproc": 0},
    "cuMemAlloc_v2": {"direct": 1, "dlsym": 0, "getproc": 1},
    "cuMemFree_v2": {"direct": 1, "dlsym": 0, "getproc": 1},
    "cuMemcpyHtoD_v2": {"direct": 1, "dlsym": 0, "getproc": 0},
    "cuMemCreate": {"direct": 1, "dlsym": 0, "getproc": 0},
    "cuMemMap": {"direct": 1, "dlsym": 0, "getproc": 0},
    "cuMemUnmap": {"direct": 1, "dlsym": 0, "getproc": 0},
    "cuMemRelease": {"direct": 1, "dlsym": 0, "getproc": 0},
    "cuMemsetD32Async": {"direct": 0, "dlsym": 0, "getproc": 2},
    "cuGetProcAddress": {"direct": 0, "dlsym": 0, "getproc": 1},
    "cuGetProcAddress_v2": {"direct": 0, "dlsym": 8 + THREADS, "getproc": 1},
}
KERNELS = {0x100000 + 0x10 * n: launches for n, launches in
           [(1, 3), (2, 2), (3, 4), (4, 5), (5, 6), (6, 1), (7, 1)] + [(100 + t, 1000) for t in range(THREADS)]}


def test_every_route_is_counted_once_against_what_the_driver_received(built, tmp_path):
    base, none = run(built, [str(built["prog"]), "all", str(THREADS)], tmp_path, preload=False)
    assert base.returncode == 0, base.stderr
    assert none == []
    done, counts = run(built, [str(built["prog"]), "all", str(THREADS)], tmp_path)
    assert done.returncode == 0, done.stderr  # the program checked every launch's arguments itself
    truth = json.loads(done.stdout)
    assert {k: v for k, v in truth.items() if k != "func_name"} == \
        {k: v for k, v in json.loads(base.stdout).items() if k != "func_name"}  # the driver saw the same
    (c,) = counts
    assert c.pid > 0 and c.libcuda.endswith("libcuda.so.1")
    assert c.calls == EXPECTED
    # held against the driver's own counts
    assert c.total("cuLaunchKernel") == truth["launch"] + truth["launch_ptsz"]
    assert c.total("cuLaunchKernelEx") == truth["launch_ex"]
    assert c.total("cuMemAlloc_v2") == truth["alloc_v2"] and truth["alloc_v1"] == 1  # v1 passed, not counted
    assert c.total("cuMemFree_v2") == truth["free_v2"]
    assert c.total("cuMemsetD32Async") == truth["memset_d32_async"]
    assert c.total("cuGetProcAddress") == truth["getproc_v1"]
    assert c.total("cuGetProcAddress_v2") == truth["getproc_v2"]
    assert c.launches() == sum(n for n, _ in c.kernels.values()) == sum(KERNELS.values())
    assert {f: n for f, (n, _) in c.kernels.items()} == KERNELS
    assert {name for _, name in c.kernels.values()} == {f"fake_kernel_{f:x}" for f in KERNELS}
    assert truth["func_name"] == len(KERNELS)  # a name is asked once per kernel
    # the driver handed out its own exports except for cuMemsetD32Async and cuGetProcAddress
    # (static functions of the fake): those were wrapped by name; the old cuMemAlloc was not
    assert c.getproc == {"identity": 5 + THREADS, "by_name": 3, "other": 1,
                         "requested": ["cuLaunchKernel", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemsetD32Async",
                                       "cuGetProcAddress", "cuGetProcAddress_v2"],
                         "skipped": [{"name": "cuMemAlloc", "version": 3000}]}
    assert c.raw["slots"]["cuLaunchKernel"] == ["dlsym", "getproc", "getproc"]  # legacy and ptsz apart
    assert c.raw["slots_full"] == 0 and c.raw["kernels_dropped"] == 0


def test_a_driver_that_hands_out_its_exports_through_the_global_scope_is_still_counted_once(built, tmp_path):
    """Without -Bsymbolic the fake's cuGetProcAddress answers with the preloaded exports: those
    are returned as they are (counted on the direct route), never wrapped a second time."""
    done, (c,) = run(built, [str(built["prog"]), "all", str(THREADS)], tmp_path, driver="drv-plain")
    assert done.returncode == 0, done.stderr
    truth = json.loads(done.stdout)
    assert c.total("cuLaunchKernel") == truth["launch"] + truth["launch_ptsz"]
    assert c.calls["cuLaunchKernel"]["getproc"] == 0 and c.calls["cuLaunchKernel"]["dlsym"] == 4
    assert {name: sum(r.values()) for name, r in c.calls.items()} == \
        {name: sum(r.values()) for name, r in EXPECTED.items()}
    assert {f: n for f, (n, _) in c.kernels.items()} == KERNELS


def test_kernel_names_can_be_left_unresolved(built, tmp_path):
    done, (c,) = run(built, [str(built["prog"]), "all", "1"], tmp_path, extra_env={"GPUOS_INTERCEPT_NAMES": "0"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["func_name"] == 0
    assert all(name is None for _, name in c.kernels.values())


def test_ctypes_on_the_driver_goes_through_dlsym_and_the_program_reads_its_counts(built, tmp_path):
    script = textwrap.dedent("""
        import ctypes, json
        from gpuos_tools.injection.intercept import InProcess, delta
        view = InProcess.attach()
        before = view.totals()
        cuda = ctypes.CDLL("libcuda.so.1")
        for i in range(10):
            assert cuda.cuLaunchKernel(ctypes.c_void_p(0x2000 + 16 * (i % 2)), 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
        print(json.dumps(delta(before, view.totals())))
        view.dump(__import__("sys").argv[1])
    """)
    dumped = tmp_path / "dumped.json"
    done, (c,) = run(built, [sys.executable, "-c", script, str(dumped)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"cuLaunchKernel": 10}
    assert c.calls["cuLaunchKernel"] == {"direct": 0, "dlsym": 10, "getproc": 0}
    assert {f: n for f, (n, _) in c.kernels.items()} == {0x2000: 5, 0x2010: 5}
    assert intercept.read_counts(dumped).calls == c.calls


def test_a_wrapped_name_found_before_the_driver_is_loaded_loads_it_and_forwards(built, tmp_path):
    """RTLD_DEFAULT finds the exported wrapper even before libcuda is loaded: calling it loads the
    driver then, and the call reaches it (the caveat is written in docs/interception.md)."""
    script = textwrap.dedent("""
        import ctypes
        launch = ctypes.CDLL(None).cuLaunchKernel
        assert launch(ctypes.c_void_p(0x5000), 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
        counts = (ctypes.c_int64 * 16)()
        ctypes.CDLL("libcuda.so.1").fake_entry_counts(counts, 16)
        print(counts[0])
    """)
    done, (c,) = run(built, [sys.executable, "-c", script], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert c.calls["cuLaunchKernel"] == {"direct": 1, "dlsym": 0, "getproc": 0}


def test_without_the_library_a_program_sees_no_counters(built, tmp_path):
    done, _ = run(built, [sys.executable, "-c",
                          "from gpuos_tools.injection.intercept import InProcess; print(InProcess.attach())"],
                  tmp_path, preload=False)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


def test_a_program_that_never_calls_the_driver_runs_as_before_and_writes_nothing(built, tmp_path):
    done, counts = run(built, [sys.executable, "-c", "import ctypes, json; print(json.dumps([1]))"], tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "[1]", done.stderr
    assert counts == []
    done, counts = run(built, ["/bin/sh", "-c", "exit 3"], tmp_path)
    assert done.returncode == 3 and counts == []


def test_a_forked_child_counts_only_its_own_calls(built, tmp_path):
    script = textwrap.dedent("""
        import ctypes, os, sys
        cuda = ctypes.CDLL("libcuda.so.1")
        launch = lambda f: cuda.cuLaunchKernel(ctypes.c_void_p(f), 1, 1, 1, 1, 1, 1, 0, None, None, None)
        for _ in range(5):
            launch(0x3000)
        pid = os.fork()
        if pid == 0:
            launch(0x4000); launch(0x4000)
            sys.exit(0)
        os.waitpid(pid, 0)
        launch(0x3000)
        print(pid)
    """)
    done, counts = run(built, [sys.executable, "-c", script], tmp_path)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout)
    by_pid = {c.pid: c for c in counts}
    assert set(by_pid) == {child, next(p for p in by_pid if p != child)}
    assert {f: n for f, (n, _) in by_pid[child].kernels.items()} == {0x4000: 2}
    parent = next(c for p, c in by_pid.items() if p != child)
    assert {f: n for f, (n, _) in parent.kernels.items()} == {0x3000: 6}


RTLD_SOURCES = {
    "a.c": """
        #define _GNU_SOURCE
        #include <dlfcn.h>
        int which(void) { return 1; }
        int next_which(void) {
            int (*f)(void) = (int (*)(void))dlsym(RTLD_NEXT, "which");
            return f ? f() : -1;
        }
    """,
    "b.c": "int which(void) { return 2; }\n",
    "d.c": "int only_in_d(void) { return 4; }\n",
    "c.c": """
        #define _GNU_SOURCE
        #include <dlfcn.h>
        int find_d(void) {
            int (*f)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "only_in_d");
            return f ? f() : -1;
        }
    """,
    "main.c": """
        #include <dlfcn.h>
        #include <stdio.h>
        int next_which(void);
        int main(void) {
            void *c = dlopen("libc_local.so", RTLD_NOW | RTLD_LOCAL);
            int (*find_d)(void) = c ? (int (*)(void))dlsym(c, "find_d") : 0;
            printf("%d %d\\n", next_which(), find_d ? find_d() : -2);
            return 0;
        }
    """,
}


def test_dlsym_still_resolves_rtld_next_and_rtld_default_for_the_real_caller(built, tmp_path):
    """RTLD_NEXT means "after the caller", RTLD_DEFAULT searches the caller's own scope too (a
    library dlopen'ed RTLD_LOCAL sees its dependencies): the interposer must not become the caller."""
    d = tmp_path / "rtld"
    d.mkdir()
    for name, text in RTLD_SOURCES.items():
        (d / name).write_text(textwrap.dedent(text))
    compile_c("-shared", "-fPIC", "-o", str(d / "liba.so"), str(d / "a.c"), "-ldl")
    compile_c("-shared", "-fPIC", "-o", str(d / "libb.so"), str(d / "b.c"))
    compile_c("-shared", "-fPIC", "-o", str(d / "libd.so"), str(d / "d.c"))
    compile_c("-shared", "-fPIC", "-o", str(d / "libc_local.so"), str(d / "c.c"), f"-L{d}", "-Wl,--no-as-needed", "-ld",
              "-ldl")
    compile_c("-o", str(d / "main"), str(d / "main.c"), f"-L{d}", "-Wl,--no-as-needed", "-la", "-lb", "-ldl")
    env = {"LD_LIBRARY_PATH": f"{d}:{built['drv']}"}
    plain, _ = run(built, [str(d / "main")], tmp_path, preload=False, extra_env=env)
    assert plain.stdout.split() == ["2", "4"], plain.stderr
    done, _ = run(built, [str(d / "main")], tmp_path, extra_env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "4"]


def test_the_build_is_cached_per_source_version(tmp_path):
    first = intercept.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert intercept.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert first.name.startswith("libgpuos_intercept-")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(first)], capture_output=True, text=True)
    if exported.returncode == 0:
        names = {line.split()[-1] for line in exported.stdout.splitlines()}
        assert {"dlsym", "cuGetProcAddress", "cuGetProcAddress_v2", "cuLaunchKernel", "cuLaunchKernel_ptsz",
                "cuLaunchKernelEx", "cuGraphLaunch", "cuMemMap", "cuMemUnmap", "cuMemAllocAsync",
                "cuMemAllocFromPoolAsync", "gpuos_intercept_dump"} <= names


def test_the_library_names_the_calls_it_wraps(built):
    names = intercept.call_names(built["lib"])
    assert set(EXPECTED) <= set(names) and set(intercept.LAUNCHES) <= set(names)
    assert len(names) == len(set(names)) and "cuGetExportTable" in names


def test_count_files_are_checked_and_summed():
    data = {"tool": "gpuos_intercept", "pid": 7, "libcuda": None, "routes": ["direct", "dlsym", "getproc"],
            "calls": {"cuLaunchKernel": [1, 2, 3], "cuLaunchKernelEx": [0, 0, 4], "cuMemcpyAsync": [0, 0, 9]},
            "kernels": [{"func": 16, "launches": 10, "name": "k"}]}
    c = intercept.parse_counts(data)
    assert c.launches() == 10 and c.total("cuMemcpyAsync") == 9 and c.total("cuMemMap") == 0
    assert c.by_route() == {"direct": 1, "dlsym": 2, "getproc": 7}
    assert c.kernels == {16: (10, "k")}
    with pytest.raises(ValueError):
        intercept.parse_counts({"tool": "something else"})
    assert intercept.delta({"a": 1, "b": 2}, {"a": 1, "b": 5, "c": 1}) == {"b": 3, "c": 1}
    env = intercept.environment("/x/lib.so", "/o-%p.json", {"LD_PRELOAD": "/y.so"}, libcuda="/d/libcuda.so.1")
    assert env == {"LD_PRELOAD": "/x/lib.so /y.so", "GPUOS_INTERCEPT_OUT": "/o-%p.json",
                   "GPUOS_INTERCEPT_LIBCUDA": "/d/libcuda.so.1"}


def test_a_hook_registered_before_the_driver_starts_runs_once_in_the_first_cuinit_before_the_driver(built, tmp_path):
    """gpuos_intercept_before_init (the validators' zygote forks there, agent/zygote.py): called
    in the first cuInit, whatever route it came by, before the driver's own cuInit runs, and
    never again; cuInit's own result comes back untouched."""
    script = textwrap.dedent("""
        import ctypes, json, sys
        lib = ctypes.CDLL(sys.argv[1])
        cuda = ctypes.CDLL("libcuda.so.1")
        counts = (ctypes.c_int64 * 16)()
        seen = []
        def hook():
            cuda.fake_entry_counts(counts, 16)
            seen.append(sum(counts))  # what the driver had received by then
        HOOK = ctypes.CFUNCTYPE(None)
        cb = HOOK(hook)
        lib.gpuos_intercept_before_init.argtypes = [HOOK]
        lib.gpuos_intercept_before_init(cb)
        results = [cuda.cuInit(0), cuda.cuInit(1), cuda.cuInit(0)]
        print(json.dumps({"seen": seen, "results": results}))
    """)
    done, (c,) = run(built, [sys.executable, "-c", script, str(built["lib"])], tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["seen"] == [0] and out["results"] == [0, 1, 0]  # INVALID_VALUE is 1 in the fake
    assert c.calls["cuInit"] == {"direct": 0, "dlsym": 3, "getproc": 0}
