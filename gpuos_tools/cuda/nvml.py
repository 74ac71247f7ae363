"""NVML through nvidia-ml-py (``import pynvml``): the machine's GPUs and the CUDA processes on them.

NVML sees every GPU of the machine whatever CUDA_VISIBLE_DEVICES says, numbers them as
nvidia-smi does, and lists the processes that hold a context on each with their memory. It is
optional: ``open_nvml()`` gives None (and says why in ``NVML_MISSING``) when nvidia-ml-py or
libnvidia-ml is not there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Nvml:
    """An initialised NVML session (``nvmlShutdown`` on ``close``)."""

    def __init__(self, pynvml: Any):
        self._nv = pynvml

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except Exception:
            pass

    def driver_release(self) -> str | None:
        try:
            release = self._nv.nvmlSystemGetDriverVersion()
        except Exception:
            return None
        return release.decode() if isinstance(release, bytes) else str(release)

    def gpus(self) -> list[dict[str, Any]]:
        """Every GPU: index (nvidia-smi's), uuid, name, memory total/used/free in bytes, minor."""
        nv = self._nv
        out = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            try:
                minor = int(nv.nvmlDeviceGetMinorNumber(handle))
            except Exception:
                minor = None
            out.append({
                "index": index,
                "uuid": _text(nv.nvmlDeviceGetUUID(handle)),
                "name": _text(nv.nvmlDeviceGetName(handle)),
                "memory": int(mem.total),
                "memory_used": int(mem.used),
                "memory_free": int(mem.free),
                "minor": minor,
            })
        return out

    def processes(self) -> dict[int, list[dict[str, Any]]]:
        """pid -> [{index, uuid, memory}] for every process with a compute context on a GPU.

        ``memory`` is None where NVML cannot tell. Pids are as NVML sees them (the host's pid
        namespace); in a container NVML may list none.
        """
        nv = self._nv
        out: dict[int, list[dict[str, Any]]] = {}
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nv.nvmlDeviceGetUUID(handle))
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                out.setdefault(int(p.pid), []).append(
                    {"index": index, "uuid": uuid, "memory": None if used is None else int(used)}
                )
        return out


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


#: Why the last ``open_nvml()`` gave None.
NVML_MISSING: list[str] = []


def open_nvml() -> Nvml | None:
    """An NVML session, or None when nvidia-ml-py or the NVML library is missing."""
    try:
        import pynvml
    except ImportError as e:
        NVML_MISSING[:] = [f"nvidia-ml-py is not installed ({e})"]
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded...
        NVML_MISSING[:] = [f"NVML unavailable: {e}"]
        return None
    return Nvml(pynvml)


@contextmanager
def nvml_session() -> Iterator[Nvml | None]:
    nv = open_nvml()
    try:
        yield nv
    finally:
        if nv is not None:
            nv.close()


def gpu_summary() -> str | None:
    """Each GPU as "name, driver release", one line per GPU (what `nvidia-smi
    --query-gpu=name,driver_version --format=csv,noheader` prints), for benchmark records; None
    without NVML."""
    with nvml_session() as nv:
        return describe(nv) if nv is not None else None


def describe(nv: Nvml) -> str | None:
    """``gpu_summary`` of an open session."""
    release = nv.driver_release() or "unknown driver"
    return "\n".join(f"{g['name']}, {release}" for g in nv.gpus()) or None
