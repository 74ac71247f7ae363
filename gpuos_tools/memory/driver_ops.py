"""What the residency engine asks of the owned library and the CUDA driver: the ``Ops`` protocol
(a fake in the CPU tests) and ``DriverOps``, the real one, in the agent's context
(docs/residency-engine.md, "The driver side")."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Protocol

from gpuos_tools.cuda.driver import capturing as _capturing
from gpuos_tools.cuda.driver import ok as _ok
from gpuos_tools.memory import owned as owned_lib
from gpuos_tools.memory.digest_kernel import (
    DIGEST_BLOCKS, DIGEST_SLOTS, DIGEST_THREADS, compile_digest, device_arch,
)
from gpuos_tools.memory.states import Pieces
from gpuos_tools.memory.threads import agents_thread


class Ops(Protocol):
    """What the engine asks of the owned library and the driver (DriverOps; a fake in tests)."""

    def lookup(self, addr: int) -> Any: ...  # an owned.Record (base, size, resident) or None
    def make_resident(self, base: int) -> None: ...
    def release(self, base: int) -> None: ...
    def copy_in(self, base: int, pieces: Pieces, stream: Any) -> None: ...
    def copy_out(self, base: int, pieces: Pieces, stream: Any) -> None: ...
    def host(self, base: int, size: int) -> Pieces: ...  # the engine's own pinned copy
    def stream(self) -> Any: ...
    def event(self) -> Any: ...
    def record(self, ev: Any, stream: Any) -> None: ...
    def wait(self, stream: Any, ev: Any) -> None: ...
    def done(self, ev: Any) -> bool: ...
    def synchronize(self, ev: Any) -> None: ...
    def destroy(self, ev: Any) -> None: ...
    def timer(self) -> Any: ...  # an event that keeps its time (for the lazy load's figures)
    def elapsed_ms(self, start: Any, end: Any) -> float: ...  # between two completed timers
    def sync_all(self) -> None: ...  # the context's work has completed
    def enter(self) -> None: ...  # make the program's context current on this thread
    # optional (DriverOps has it; without it no stream is ever capturing):
    # capturing(stream) -> bool: the stream is capturing a CUDA graph
    # optional (DriverOps has it; without it no record's contents are dead):
    # dead(base) -> bool: every torch block of the record is freed, its contents undefined
    # optional (DriverOps has them; without them the engine takes no digests):
    # digest_prepare() -> None: start building the digest kernel (no context needed)
    # digest_init() -> str | None: load it (the program's context current); None, or why not
    # digest(base, size, slot, stream) -> None: enqueue the digest of the device bytes into slot
    # digest_value(slot) -> bytes: a slot's 16 bytes, once an event after its digest completed


class DriverOps:
    """Ops on the owned library (gpuos_tools/memory/owned.py) and the CUDA driver, in the
    agent's context."""

    def __init__(self, agent: Any = None, owned: bool = True) -> None:
        self.agent = agent
        self.lib = None  #: None: the program's memory is not owned (only loads into mapped memory)
        if owned:
            self.lib = owned_lib.OwnedLibrary.load()
        self._hosts: dict[int, tuple[int, int]] = {}  #: base -> (pinned address, size), the engine's own
        self._image: tuple[bytes, int | None] | None = None  #: compile_digest's
        self._image_error: str | None = None
        self._builder: threading.Thread | None = None
        self._digest_fn: Any = None
        self._slots_dev = 0  #: DIGEST_SLOTS x 16 bytes on the GPU (the kernel's sums)
        self._slots_host = 0  #: the same in pinned host memory (copied after each digest)

    # -- digests (digest_kernel.py; docs/residency-engine.md, "Digests") --

    def digest_prepare(self) -> None:
        """Start compiling the digest kernel on a thread (NVRTC takes ~0.1-0.5 s)."""
        def build() -> None:
            # its driver calls (the device's architecture) are the agent's own: the tracer must
            # not take the agent's lock for them, which the first eviction holds while it joins
            with agents_thread(getattr(self.agent, "own", None)):
                try:
                    self._image = compile_digest(device_arch())
                except Exception as exc:  # noqa: BLE001 (digest_init says why)
                    self._image_error = f"{type(exc).__name__}: {exc}"

        self._builder = threading.Thread(target=build, name="gpuos-engine-nvrtc", daemon=True)
        self._builder.start()

    def digest_init(self) -> str | None:
        """Load the kernel into the current context and allocate the result slots; None when
        ready, else why not."""
        from cuda.bindings import driver as drv

        if self._builder is None:
            self.digest_prepare()
        self._builder.join()
        if self._image is None:
            return self._image_error or "the digest kernel was not built"
        arch = device_arch()
        if self._image[1] is not None and arch is not None and arch != self._image[1]:
            self._image = compile_digest(arch)  # built for device 0, the program runs on another kind
        image = ctypes.create_string_buffer(self._image[0], len(self._image[0]))
        module = _ok(drv.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData(digest)")
        self._digest_fn = _ok(drv.cuModuleGetFunction(module, b"gpuos_engine_digest"), "cuModuleGetFunction(digest)")
        n = DIGEST_SLOTS * 16
        self._slots_dev = int(_ok(drv.cuMemAlloc(n), "cuMemAlloc(digest slots)"))
        self._slots_host = int(_ok(drv.cuMemHostAlloc(n, 0), "cuMemHostAlloc(digest slots)"))
        ctypes.memset(self._slots_host, 0, n)
        return None

    def digest(self, base: int, size: int, slot: int, stream: Any) -> None:
        """Enqueue on ``stream``: zero the slot, the kernel over ``size`` bytes at ``base``, the
        slot's 16 bytes to pinned host memory."""
        from cuda.bindings import driver as drv

        dev = self._slots_dev + 16 * slot
        _ok(drv.cuMemsetD8Async(dev, 0, 16, stream), "cuMemsetD8Async(digest)")
        words = size // 8
        blocks = max(1, min(DIGEST_BLOCKS, (words + DIGEST_THREADS - 1) // DIGEST_THREADS))
        args = (ctypes.c_uint64(base), ctypes.c_uint64(size), ctypes.c_uint64(dev))
        params = (ctypes.c_void_p * 3)(*(ctypes.addressof(a) for a in args))
        _ok(drv.cuLaunchKernel(self._digest_fn, blocks, 1, 1, DIGEST_THREADS, 1, 1, 0, stream,
                               ctypes.addressof(params), 0), "cuLaunchKernel(digest)")
        _ok(drv.cuMemcpyDtoHAsync(self._slots_host + 16 * slot, dev, 16, stream), "cuMemcpyDtoHAsync(digest)")

    def digest_value(self, slot: int) -> bytes:
        return ctypes.string_at(self._slots_host + 16 * slot, 16)

    def enter(self) -> None:
        from cuda.bindings import driver as drv

        ctx = getattr(self.agent, "ctx", None)
        if ctx is not None:
            _ok(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def lookup(self, addr: int) -> Any:
        return self.lib.lookup(addr) if self.lib is not None else None

    def dead(self, base: int) -> bool:
        """Whether every torch block of the record at ``base`` is freed (owned.py ``torch_dead``)."""
        return self.lib is not None and self.lib.torch_dead(base)

    def make_resident(self, base: int) -> None:
        if self.lib is None:
            raise RuntimeError("not owned: nothing can be mapped")
        self.lib.make_resident(base)

    def release(self, base: int) -> None:
        if self.lib is None:
            raise RuntimeError("not owned: nothing can be released")
        self.lib.release(base)

    def copy_in(self, base: int, pieces: Pieces, stream: Any) -> None:
        from cuda.bindings import driver as drv

        off = 0
        for host, n in pieces:
            _ok(drv.cuMemcpyHtoDAsync(base + off, host, n, stream), "cuMemcpyHtoDAsync(load)")
            off += n

    def copy_out(self, base: int, pieces: Pieces, stream: Any) -> None:
        from cuda.bindings import driver as drv

        off = 0
        for host, n in pieces:
            _ok(drv.cuMemcpyDtoHAsync(host, base + off, n, stream), "cuMemcpyDtoHAsync(save)")
            off += n

    def host(self, base: int, size: int) -> Pieces:
        from cuda.bindings import driver as drv

        h = self._hosts.get(base)
        if h is None or h[1] != size:
            if h is not None:
                drv.cuMemFreeHost(h[0])
            h = (int(_ok(drv.cuMemHostAlloc(size, 0), "cuMemHostAlloc")), size)
            self._hosts[base] = h
        return [h]

    def stream(self) -> Any:
        from cuda.bindings import driver as drv

        return _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def event(self) -> Any:
        from cuda.bindings import driver as drv

        return _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def record(self, ev: Any, stream: Any) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuEventRecord(ev, stream), "cuEventRecord")

    def wait(self, stream: Any, ev: Any) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")

    def done(self, ev: Any) -> bool:
        from cuda.bindings import driver as drv

        err = drv.cuEventQuery(ev)[0]
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery: {getattr(err, 'name', err)}")

    def synchronize(self, ev: Any) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuEventSynchronize(ev), "cuEventSynchronize")

    def destroy(self, ev: Any) -> None:
        from cuda.bindings import driver as drv

        drv.cuEventDestroy(ev)

    def timer(self) -> Any:
        from cuda.bindings import driver as drv

        return _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate(timer)")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        from cuda.bindings import driver as drv

        f = getattr(drv, "cuEventElapsedTime", None) or drv.cuEventElapsedTime_v2
        return float(_ok(f(start, end), "cuEventElapsedTime"))

    def sync_all(self) -> None:
        from cuda.bindings import driver as drv

        _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def capturing(self, stream: Any) -> bool:
        return _capturing(stream)
