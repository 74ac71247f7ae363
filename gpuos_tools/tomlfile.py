"""Reading a TOML profile without surprises: every way a file can be wrong is a clean error
naming the file, never an internal one.

A profile is a small text file a person wrote: it is read only when it is a regular file (a
FIFO or a device would block or never end), at most ``MAX_PROFILE`` bytes, and must be UTF-8
(the TOML specification says so; ``tomllib.load`` would raise UnicodeDecodeError). Missing is
NO_INPUT, unreadable PERMISSION, anything else BAD_INPUT with the position tomllib gives.
"""

from __future__ import annotations

import os
import stat
import tomllib
from typing import Any

from gpuos_tools.errors import ExitCode, GpuosError

#: Larger than any profile a person writes.
MAX_PROFILE = 1 << 20


def load_toml(path: str | os.PathLike[str], what: str = "profile") -> dict[str, Any]:
    """The tables of a TOML file; ``what`` names it in messages ("no such profile")."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise GpuosError(f"{name}: no such {what}", ExitCode.NO_INPUT) from None
    except PermissionError as e:
        raise GpuosError(f"{name}: cannot read: {e.strerror}", ExitCode.PERMISSION) from None
    except OSError as e:
        raise GpuosError(f"{name}: cannot read: {e.strerror}", ExitCode.NO_INPUT) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise GpuosError(f"{name}: is a directory, not a {what}", ExitCode.NO_INPUT)
        if not stat.S_ISREG(st.st_mode):
            raise GpuosError(f"{name}: not a regular file (a {what} is read only from one)", ExitCode.BAD_INPUT)
        if st.st_size > MAX_PROFILE:
            raise GpuosError(f"{name}: {st.st_size} bytes: too large for a {what} (at most {MAX_PROFILE})",
                             ExitCode.BAD_INPUT)
        chunks = []
        while chunk := os.read(fd, MAX_PROFILE + 1):
            chunks.append(chunk)
            if sum(map(len, chunks)) > MAX_PROFILE:
                raise GpuosError(f"{name}: too large for a {what} (at most {MAX_PROFILE} bytes)", ExitCode.BAD_INPUT)
    except OSError as e:
        raise GpuosError(f"{name}: cannot read: {e.strerror}", ExitCode.NO_INPUT) from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise GpuosError(f"{name}: not valid UTF-8 (line {line}, byte {e.start + 1}): a {what} is UTF-8 text",
                         ExitCode.BAD_INPUT) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise GpuosError(f"{name}: not valid TOML: {e}", ExitCode.BAD_INPUT) from None
    except RecursionError:
        raise GpuosError(f"{name}: not valid TOML: nested too deeply", ExitCode.BAD_INPUT) from None
