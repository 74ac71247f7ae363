"""Side files for large binary payloads, named by their content hash."""

from __future__ import annotations

import hashlib
import os

from gpuos_tools.errors import ExitCode
from gpuos_tools.stream import atomic
from gpuos_tools.stream.framing import StreamError


def store_blob(directory: str | os.PathLike[str], data: bytes, suffix: str = "") -> tuple[str, str]:
    """Store ``data`` as ``<sha256 hex><suffix>`` in ``directory`` (created if needed).

    Returns ``("sha256:<hex>", file name relative to directory)``. A file already there is
    left alone: same name, same content. New files appear atomically, so a reader never sees
    a partial blob.
    """
    digest = hashlib.sha256(data).hexdigest()
    name = digest + suffix
    path = os.path.join(os.fspath(directory), name)
    if not os.path.exists(path):
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            code = ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.IO_ERROR
            raise StreamError(f"{directory}: cannot create directory: {e.strerror}", code, path=path) from e
        temp, fd = atomic.create_temp(path)
        try:
            with open(fd, "wb") as f:
                f.write(data)
            os.replace(temp, path)
        except BaseException as e:
            atomic.discard(temp)
            if isinstance(e, OSError):
                raise StreamError(f"{path}: write failed: {e.strerror}", ExitCode.IO_ERROR, path=path) from e
            raise
    return f"sha256:{digest}", name
