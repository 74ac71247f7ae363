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
