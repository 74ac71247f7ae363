"""Atomic file creation, as moreutils' sponge does it: a temp file beside the target, then rename."""

from __future__ import annotations

import os
import secrets
import stat

from gpuos_tools.errors import ExitCode
from gpuos_tools.stream.framing import StreamError


def create_temp(target: str) -> tuple[str, int]:
    """Create an empty temp file in ``target``'s directory; return (temp path, open fd).

    The temp gets the mode an ordinary ``open(target, "w")`` would give (0666 less the umask),
    or the existing target's mode, so the rename changes nothing but the content.
    """
    directory, base = os.path.split(target)
    while True:
        temp = os.path.join(directory, f".{base}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise StreamError(
                f"{target}: cannot create: {e.strerror}",
                ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.IO_ERROR,
                path=target,
            ) from e
        break
    try:
        os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
    except FileNotFoundError:
        pass
    return temp, fd


def discard(temp: str) -> None:
    try:
        os.unlink(temp)
    except FileNotFoundError:
        pass


def replace(target: str, data: bytes, fsync: bool = False) -> None:
    """Write ``data`` to ``target`` atomically: a temp file beside it, then a rename (the temp
    is removed when anything fails). ``fsync``: flushed to the disk before the rename."""
    temp, fd = create_temp(target)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        discard(temp)
        raise
