"""Helpers for the tests: running Python in a child process against this tree."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BRIDGE = [sys.executable, str(REPO / "cmd" / "gpu-kinfer-bridge")]


#: The made-up record types the stream's own tests write, as a tool writing them would: each with
#: a schema (of no fields), since the writer refuses a type without one. ``REGISTER_TEST_TYPES``
#: is the same as code, for a child process.
TEST_TYPES = ("a", "b", "c", "tick", "note", "old", "new", "late", "x", "mystery", "odd")
REGISTER_TEST_TYPES = (
    "from gpuos_tools.stream.records import register_output, registered\n"
    "from gpuos_tools.stream.schema import RecordType\n"
    f"register_output(*(RecordType(n, 'a test record') for n in {TEST_TYPES!r} if registered(n) is None))\n"
)


def load_script(name: str) -> Any:
    """scripts/NAME.py as a fresh module (a benchmark's functions, without running it)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def usage_error(main: Any, argv: list[str]) -> int | str | None:
    """The exit code of a script's ``main`` run with command line ``argv`` that must stop it
    before anything runs (argparse's usage error: 2)."""
    saved = sys.argv
    sys.argv = ["script", *argv]
    try:
        main()
    except SystemExit as exc:
        return exc.code
    finally:
        sys.argv = saved
    return None


def register_test_types() -> None:
    exec(REGISTER_TEST_TYPES, {})


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("GPUOS_DEBUG", None)
    env.update(extra)
    return env


FAKE_CUDA = """
import mmap, sys
f = open(sys.argv[1], 'rb')
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print('ready', flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def fake_cuda_process(directory: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A real process that maps a file named libcuda.so.1 (made under ``directory``): a CUDA
    process to everything but the driver. It lives until the block ends; ``args`` are extra
    words on its command line."""
    lib = directory / "fakelib" / "libcuda.so.1"
    lib.parent.mkdir()
    lib.write_bytes(b"\0" * 4096)
    proc = subprocess.Popen([sys.executable, "-c", FAKE_CUDA, str(lib), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def python(code: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """Run ``code`` in a fresh interpreter that imports this tree; capture its output."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run([sys.executable, "-c", code], env=child_env(), check=False, **kwargs)


def image_dir_problems(directory: str | os.PathLike[str]) -> list[str]:
    """What is wrong in a directory of checkpoint images after writers were killed: every
    committed image (and its parent chain) must verify clean; a writer's dot-named temp directory
    is fine (never an image); anything else under a final name (a partial image made visible)
    is a problem."""
    from gpuos_tools.image import is_image, verify

    problems = []
    for path in sorted(Path(directory).iterdir()):
        if is_image(path):
            problems += verify(path)
        elif not (path.name.startswith(".") and path.name.endswith(".tmp")):
            problems.append(f"{path}: neither an image nor a writer's temp directory")
    return problems


def kinfer_daemon(name: str, *args: str, env: dict[str, str] | None = None,
                  stdout: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """`gpu-kinfer-bridge serve --ring NAME --gpu off ARGS`, returned once it serves the ring."""
    from gpuos_tools.kinfer import ring

    proc = subprocess.Popen([*BRIDGE, "serve", "--ring", name, "--gpu", "off", *args], env=env or child_env(),
                            stdout=stdout, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
        if ring.served_by(name, proc.pid):
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("daemon did not start")
