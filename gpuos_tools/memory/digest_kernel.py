"""The residency engine's digest kernel: its CUDA source, what it computes on the CPU
(``digest_reference``), and its build by NVRTC. The driver side (``driver_ops.DriverOps``) loads
and launches it; when digests are taken and what they decide is ``digests.py``'s
(docs/residency-engine.md, "Digests")."""

from __future__ import annotations

from typing import Any

from gpuos_tools.cuda.driver import ok as _ok

DIGEST_SLOTS = 8192  #: 16-byte result slots, two per record base (bases beyond: no digest)
DIGEST_THREADS = 256
DIGEST_BLOCKS = 2048  #: at most (a grid-stride loop beyond): enough to keep HBM busy on an H100/H200

#: The digest kernel (docs/residency-engine.md, "Digests"): grid-stride over the 8-byte words, each word
#: mixed with its index by two different 64-bit finalisers, summed per lane (mod 2^64) per thread,
#: per warp (shuffles), per block (shared memory), then one atomicAdd per lane and block into
#: ``out`` (zeroed before). Block 0's thread 0 adds the zero-padded last partial word and the length.
DIGEST_SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 mix_a(u64 z) {  /* splitmix64's finaliser */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
__device__ __forceinline__ u64 mix_b(u64 z) {  /* murmur3's fmix64 */
    z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdULL;
    z = (z ^ (z >> 33)) * 0xc4ceb9fe1a85ec53ULL;
    return z ^ (z >> 33);
}
__device__ __forceinline__ u64 lane_a(u64 w, u64 i) { return mix_a(w ^ mix_a(i + 0x9e3779b97f4a7c15ULL)); }
__device__ __forceinline__ u64 lane_b(u64 w, u64 i) { return mix_b(w + mix_b(i * 0xc2b2ae3d27d4eb4fULL + 0x165667b19e3779f9ULL)); }
extern "C" __global__ void gpuos_engine_digest(const u64* __restrict__ p, u64 nbytes, u64* out) {
    const u64 words = nbytes >> 3;
    u64 a = 0, b = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        const u64 w = __ldg(p + i);
        a += lane_a(w, i);
        b += lane_b(w, i);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const u64 rest = nbytes & 7;
        if (rest) {
            const unsigned char* t = (const unsigned char*)(p + words);
            u64 w = 0;
            for (u64 k = 0; k < rest; ++k) w |= (u64)t[k] << (8 * k);
            a += lane_a(w, words);
            b += lane_b(w, words);
        }
        a += mix_a(nbytes ^ 0x6a09e667f3bcc909ULL);
        b += mix_b(nbytes ^ 0xbb67ae8584caa73bULL);
    }
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, o);
        b += __shfl_down_sync(0xffffffffu, b, o);
    }
    __shared__ u64 sa[32], sb[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) { sa[warp] = a; sb[warp] = b; }
    __syncthreads();
    if (warp == 0) {
        a = lane < warps ? sa[lane] : 0;
        b = lane < warps ? sb[lane] : 0;
        for (int o = 16; o > 0; o >>= 1) {
            a += __shfl_down_sync(0xffffffffu, a, o);
            b += __shfl_down_sync(0xffffffffu, b, o);
        }
        if (lane == 0) { atomicAdd(out, a); atomicAdd(out + 1, b); }
    }
}
"""


def digest_reference(data: bytes) -> bytes:
    """What the digest kernel computes, on the CPU (numpy): 16 bytes, lanes a then b, each
    little-endian. The definition the GPU tests compare the kernel with."""
    import numpy as np

    def mix_a(z: Any) -> Any:
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def mix_b(z: Any) -> Any:
        z = (z ^ (z >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
        z = (z ^ (z >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
        return z ^ (z >> np.uint64(33))

    n = len(data)
    nw = n // 8
    rest = data[nw * 8:]
    w = np.frombuffer(data, dtype="<u8", count=nw).astype(np.uint64)
    if rest:
        w = np.append(w, np.uint64(int.from_bytes(rest, "little")))
    i = np.arange(len(w), dtype=np.uint64)
    ln = np.array([n], dtype=np.uint64)
    with np.errstate(over="ignore"):
        a = np.sum(mix_a(w ^ mix_a(i + np.uint64(0x9E3779B97F4A7C15))), dtype=np.uint64)
        b = np.sum(mix_b(w + mix_b(i * np.uint64(0xC2B2AE3D27D4EB4F) + np.uint64(0x165667B19E3779F9))),
                   dtype=np.uint64)
        a = a + mix_a(ln ^ np.uint64(0x6A09E667F3BCC909))[0]
        b = b + mix_b(ln ^ np.uint64(0xBB67AE8584CAA73B))[0]
    return int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")


def device_arch(device: Any = None) -> int | None:
    """Compute capability as 90 for 9.0: of ``device`` (a CUdevice), else of the current
    context's device, else of device 0 (None when the driver cannot say)."""
    from cuda.bindings import driver as drv

    try:
        if device is None:
            err, device = drv.cuCtxGetDevice()
            if err != drv.CUresult.CUDA_SUCCESS:
                drv.cuInit(0)
                device = _ok(drv.cuDeviceGet(0), "cuDeviceGet")
        a = drv.CUdevice_attribute
        major = _ok(drv.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "major")
        minor = _ok(drv.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "minor")
        return int(major) * 10 + int(minor)
    except Exception:  # noqa: BLE001 (then PTX for the lowest architecture)
        return None


def compile_digest(arch: int | None) -> tuple[bytes, int | None]:
    """The digest kernel built by NVRTC (no context needed): a CUBIN for ``arch`` when NVRTC
    supports it (no JIT: PTX from an NVRTC newer than the driver would not load), else PTX for
    the lowest architecture NVRTC supports (the driver JITs it); the image and the arch of a
    CUBIN (None: PTX). RuntimeError saying why not."""
    from cuda.bindings import nvrtc

    def check(result: tuple, what: str) -> Any:
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {getattr(result[0], 'name', result[0])}")
        return result[1] if len(result) == 2 else None

    try:
        archs = [int(a) for a in nvrtc.nvrtcGetSupportedArchs()[-1]]
    except Exception:  # noqa: BLE001 (an older binding: Turing's, the oldest CUDA 13 supports)
        archs = []
    cubin = arch is not None and arch in archs
    target = f"sm_{arch}" if cubin else f"compute_{min(archs) if archs else 75}"
    prog = check(nvrtc.nvrtcCreateProgram(DIGEST_SOURCE.encode(), b"gpuos_engine_digest.cu", 0, [], []),
                 "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={target}".encode(), b"-default-device"]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            n = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"nvrtcCompileProgram({target}): {getattr(res[0], 'name', res[0])}: "
                               f"{log.decode(errors='replace').strip()[:500]}")
        if cubin:
            n = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = b" " * n
            check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
            return image, arch
        n = check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * n
        check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.rstrip(b"\0 ") + b"\0", None
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
