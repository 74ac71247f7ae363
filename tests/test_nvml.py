"""gpuos_tools.cuda.nvml on a stubbed pynvml (no GPU): what benchmarks record as "gpu"."""

from __future__ import annotations

from gpuos_tools.cuda import nvml


class StubNvml:
    """The few pynvml calls Nvml.gpus and driver_release make, for two GPUs."""

    def __init__(self, release: bytes | None = b"580.159.04") -> None:
        self.release = release

    def nvmlSystemGetDriverVersion(self):
        if self.release is None:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return self.release

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return type("M", (), {"total": 80 << 30, "used": 0, "free": 80 << 30})()

    def nvmlDeviceGetMinorNumber(self, h: int) -> int:
        return h

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return b"GPU-%d" % h

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200" if h else b"NVIDIA H100 80GB HBM3"


def test_describe_prints_what_nvidia_smi_would_for_name_and_driver() -> None:
    assert nvml.describe(nvml.Nvml(StubNvml())) == "NVIDIA H100 80GB HBM3, 580.159.04\nNVIDIA H200, 580.159.04"
    assert nvml.describe(nvml.Nvml(StubNvml(None))) == ("NVIDIA H100 80GB HBM3, unknown driver\n"
                                                        "NVIDIA H200, unknown driver")


def test_gpu_summary_is_none_without_nvml(monkeypatch) -> None:
    monkeypatch.setattr(nvml, "open_nvml", lambda: None)
    assert nvml.gpu_summary() is None
