"""Pictures (``--plot FILE``): matplotlib found or a clear error, the file name checked before
any work is done, and the file written whole or not at all.

Every command that draws uses these, so that the same mistake gives the same message and exit
status everywhere: no matplotlib is a usage error (2, as an option this installation cannot
honour), a name whose suffix matplotlib cannot write is a usage error too, and a directory that
does not exist or cannot be written is an output error (74, as for a stream's ``-o``).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from gpuos_tools.errors import ExitCode, GpuosError

INSTALL_HINT = "pip install 'gpuos-tools[plot]'"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GpuosError(f"--plot needs matplotlib: {INSTALL_HINT}", ExitCode.USAGE) from exc
    return plt


def formats() -> dict[str, str]:
    """File suffixes matplotlib can write here (``png``, ``svg``, ``pdf``...), with their names."""
    plt = pyplot()
    fig = plt.figure()
    try:
        return dict(fig.canvas.get_supported_filetypes())
    finally:
        plt.close(fig)


def check_path(path: str | os.PathLike[str]) -> Path:
    """``path`` if a picture can be written there: a suffix matplotlib knows, in a directory that
    exists and is writable. Call before reading any input, so a mistake costs nothing."""
    target = Path(path)
    known = formats()
    suffix = target.suffix[1:].lower()
    if suffix not in known:
        shown = ", ".join(f".{s}" for s in sorted(known))
        why = f"a {target.suffix} file" if suffix else "no file suffix"
        raise GpuosError(f"{target}: {why}: a picture is written as one of {shown}", ExitCode.USAGE)
    directory = target.parent
    if not directory.is_dir():
        raise GpuosError(f"{target}: cannot write: no directory {directory}", ExitCode.IO_ERROR)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise GpuosError(f"{target}: cannot write: {directory} is not writable", ExitCode.PERMISSION)
    if target.is_dir():
        raise GpuosError(f"{target}: cannot write: it is a directory", ExitCode.IO_ERROR)
    return target


def save(fig: Any, path: str | os.PathLike[str], dpi: int) -> None:
    """Write ``fig`` to ``path`` (format from the suffix) through a temp file beside it, renamed
    into place once complete: an interrupted or failed save leaves no half-written picture."""
    target = Path(path)
    temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "xb") as f:
            fig.savefig(f, dpi=dpi, format=target.suffix[1:].lower())
        os.replace(temp, target)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        code = ExitCode.PERMISSION if isinstance(exc, PermissionError) else ExitCode.IO_ERROR
        raise GpuosError(f"{target}: cannot write: {exc.strerror or exc}", code) from exc
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
