"""Helpers for the tests: running Python in a child process against this tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("GPUOS_DEBUG", None)
    env.update(extra)
    return env


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
    from gpuos_tools.ckpt.image import is_image, verify

    problems = []
    for path in sorted(Path(directory).iterdir()):
        if is_image(path):
            problems += verify(path)
        elif not (path.name.startswith(".") and path.name.endswith(".tmp")):
            problems.append(f"{path}: neither an image nor a writer's temp directory")
    return problems
