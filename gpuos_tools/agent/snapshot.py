"""Taking an agent's snapshot into an image from outside the program: what `gpu-ckpt --agent`
and `gpu-ckpt periodic` call (the agent itself is gpuos_tools/agent/agent.py)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuos_tools.agent import control
from gpuos_tools.agent.durable import finish_handover
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.procs import exists


def agents() -> list[tuple[int, Path]]:
    """(pid, socket) of every agent of this user whose process is alive."""
    out = []
    d = control.socket_dir()
    for sock in sorted(d.glob("agent-*.sock")) if d.is_dir() else ():
        pid = sock.stem.removeprefix("agent-")
        if pid.isdigit() and exists(int(pid)):
            out.append((int(pid), sock))
    return out


def find_agent(pid: int | None = None, socket: str | None = None, command: str | None = None) -> Path:
    """The control socket of exactly one agent, chosen by pid, socket path or a regular
    expression over the process's command line."""
    given = [x for x in (pid, socket, command) if x is not None]
    if len(given) != 1:
        raise GpuosError("name the agent by exactly one of pid, socket or command", ExitCode.USAGE)
    if pid is not None:
        return control.resolve(str(pid))
    if socket is not None:
        return control.resolve(socket)
    pattern = re.compile(command)
    hits = []
    for p, sock in agents():
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern.search(cmdline):
            hits.append((p, sock, cmdline.strip()))
    if len(hits) != 1:
        listed = "; ".join(f"{p}: {c[:80]}" for p, _, c in hits) or "none"
        raise GpuosError(f"the command pattern {command!r} must match exactly one agent process, not "
                         f"{len(hits)} ({listed})", ExitCode.NO_SUCH_PROCESS)
    return hits[0][1]


def snapshot_to_image(target: Path, image: str, parent: str | None = None, *, compress: bool = False,
                      chunk_size: int | None = None, checksum: str = "auto", threads: int | None = None,
                      timeout: float = 3600.0) -> dict[str, Any]:
    """Ask the agent at ``target`` for a consistent snapshot written to ``image``. If the
    program exits while the image is written, the agent hands the image's bytes over and it is
    written here (gpuos_tools/agent/durable.py); the answer's ``image`` then says ``handover``."""
    fields: dict[str, Any] = {"digest": False, "image": str(Path(image).absolute()),
                              "parent": str(Path(parent).absolute()) if parent else None, "compress": compress,
                              "chunk_size": chunk_size, "checksum": checksum}
    if threads is not None:
        fields["threads"] = threads
    answer = control.request(target, "snapshot", timeout=timeout, **fields)
    fds = answer.pop("_fds", [])
    answer.pop("ok", None)
    if isinstance(answer.get("image"), dict) and "handover" in answer["image"]:
        try:
            answer["image"] = finish_handover(answer["image"], fds)
        except GpuosError:
            raise
        except Exception as e:  # the bytes are lost with this process: say so plainly
            raise GpuosError(f"the program exited and handed its image over, but writing it failed: "
                             f"{type(e).__name__}: {e}", ExitCode.IO_ERROR) from e
    else:
        for fd in fds:
            os.close(fd)
    return answer


def periodic_snapshot(agent: dict[str, Any], options: dict[str, Any]) -> Callable[[str, str | None], dict]:
    """The snapshot function `gpu-ckpt periodic` calls (gpuos_tools/ckpt/periodic.py contract)."""
    target = find_agent(agent.get("pid"), agent.get("socket"), agent.get("command"))

    def snapshot(path: str, parent: str | None) -> dict[str, Any]:
        return snapshot_to_image(target, path, parent, compress=bool(options.get("compress")),
                                 chunk_size=options.get("chunk_size"), checksum=options.get("checksum") or "auto",
                                 threads=options.get("threads"))

    return snapshot
