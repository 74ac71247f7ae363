"""Driver helpers through cuda-python: is there a usable driver, which GPUs does it show, and
which GPU and driver does the current context run on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuos_tools.errors import ExitCode, GpuosError


def ok(result: tuple, what: str) -> Any:
    """The value of a cuda.bindings driver call's (CUresult, value...) tuple; RuntimeError
    naming ``what`` and the error when it failed."""
    from cuda.bindings import driver as drv

    if result[0] != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {getattr(result[0], 'name', result[0])}")
    return result[1] if len(result) == 2 else (result[1:] or None)


def relax_capture() -> bool:
    """Let this thread's driver calls through while another thread of the process captures a CUDA
    graph in the global capture mode (PyTorch's default), where a "potentially unsafe" call (an
    event query or synchronise, a pinned allocation, ...) from any other thread is an error that
    invalidates the program's capture. For the agent's own threads, which never capture: the mode
    is the thread's and stays. False where there is no driver to ask."""
    try:
        from cuda.bindings import driver as drv

        err, _ = drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    except Exception:  # noqa: BLE001 (no cuda-python, no libcuda: nothing to relax)
        return False
    return err == drv.CUresult.CUDA_SUCCESS


def capturing(stream: Any) -> bool:
    """Whether ``stream`` is capturing into a graph (or a capture on it was invalidated): work
    ordered on it now becomes a node of the graph, and an event recorded there cannot be waited
    on from outside. A query refused because another stream's capture forbids touching this one
    (the legacy stream beside a capturing blocking stream) counts as capturing."""
    from cuda.bindings import driver as drv

    err, status = drv.cuStreamIsCapturing(stream)
    if err == drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
        return True
    if err != drv.CUresult.CUDA_SUCCESS:
        return False  # (a stream gone: the caller's own error path sees it)
    return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def context_facts() -> dict[str, Any]:
    """The GPU (name, UUID) and CUDA driver version of the current context, for an image's
    manifest; a fact the driver does not give is left out."""
    from cuda.bindings import driver as drv

    facts: dict[str, Any] = {}
    err, dev = drv.cuCtxGetDevice()
    if err == drv.CUresult.CUDA_SUCCESS:
        err, name = drv.cuDeviceGetName(256, dev)
        if err == drv.CUresult.CUDA_SUCCESS:
            facts["gpu"] = name.split(b"\0", 1)[0].decode()
        err, uuid = drv.cuDeviceGetUuid(dev)
        if err == drv.CUresult.CUDA_SUCCESS:
            facts["gpu_uuid"] = bytes(uuid.bytes).hex()
    err, version = drv.cuDriverGetVersion()
    if err == drv.CUresult.CUDA_SUCCESS:
        facts["cuda"] = int(version)
    return facts


@dataclass
class DriverInfo:
    version: int  #: CUDA driver API version, e.g. 13000
    gpus: list[dict] = field(default_factory=list)  #: [{index, uuid, name, memory}]
    release: str | None = None  #: driver release from NVML, e.g. "580.159.04"

    @property
    def version_string(self) -> str:
        return f"{self.version // 1000}.{self.version % 1000 // 10}"


def _uuid_string(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def probe_driver() -> DriverInfo:
    """Initialise the driver (no context is created) and list the GPUs, or raise NO_DRIVER."""
    try:
        from cuda.bindings import driver as drv
    except ImportError as exc:
        raise GpuosError(
            f"cuda-python is not installed ({exc}); install the CUDA extra: pip install 'gpuos-tools[cuda]'",
            ExitCode.NO_DRIVER,
        ) from exc
    try:
        (err,) = drv.cuInit(0)
    except Exception as exc:  # cuda-python raises (DynamicLibNotFoundError) without libcuda.so.1
        raise GpuosError(f"no NVIDIA driver: {exc}", ExitCode.NO_DRIVER) from exc
    if err != drv.CUresult.CUDA_SUCCESS:
        raise GpuosError(f"no usable NVIDIA GPU: cuInit failed with {err.name}", ExitCode.NO_DRIVER)
    err, version = drv.cuDriverGetVersion()
    err, count = drv.cuDeviceGetCount()
    if err != drv.CUresult.CUDA_SUCCESS or count == 0:
        raise GpuosError("the NVIDIA driver sees no GPU", ExitCode.NO_DRIVER)
    gpus = []
    for index in range(count):
        _, dev = drv.cuDeviceGet(index)
        _, name = drv.cuDeviceGetName(256, dev)
        _, uuid = drv.cuDeviceGetUuid(dev)
        _, memory = drv.cuDeviceTotalMem(dev)
        gpus.append({
            "index": index,
            "uuid": _uuid_string(bytes(uuid.bytes)),
            "name": name.split(b"\0", 1)[0].decode(errors="replace"),
            "memory": int(memory),
        })
    return DriverInfo(version=int(version), gpus=gpus, release=_nvml_driver_release())


def _nvml_driver_release() -> str | None:
    """The driver's release string (580.159.04) from NVML, when nvidia-ml-py is there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            release = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return release.decode() if isinstance(release, bytes) else str(release)
    except Exception:
        return None
