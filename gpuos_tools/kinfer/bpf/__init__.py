"""The kernel-side producer of gpu-kinfer-bridge: an eBPF program on the block layer.

- ``linnos_block.bpf.c``: the program (CO-RE), compiled with clang into ``linnos_block.bpf.o``,
  which ships with the package so that a user needs no compiler for it (``build`` rebuilds it
  and checks the shipped one against its source);
- ``loader.c``: loads it with libbpf, forwards each read's kernel-side features into a kinfer
  ring as a C producer and joins the daemon's answers with the requests' completions
  (``loader`` builds it with the system C compiler and drives it through ctypes);
- ``collect``: turns the joined records into ``io`` records and per-disk watch statistics.

Why a C loader on libbpf rather than a Python binding: the loader sits between the kernel
and the daemon on every read, so its per-event cost is added latency; libbpf is the library
the kernel community maintains for CO-RE objects (Debian's libbpf1/libbpf-dev). The Python
bindings found on PyPI are early releases (pylibbpf 0.0.x) or, like bcc, compile their
programs at run time with LLVM and kernel headers instead of loading a prebuilt CO-RE object.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "linnos_block.bpf.c"
OBJECT = HERE / "linnos_block.bpf.o"
HEADER = HERE / "linnos_block.h"
LOADER_SOURCE = HERE / "loader.c"
KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")

# capability bits (linux/capability.h)
_CAP_SYS_ADMIN, _CAP_PERFMON, _CAP_BPF = 21, 38, 39


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def unavailable_reason(kernel_btf: Path = KERNEL_BTF) -> str | None:
    """Why the block-layer program cannot be loaded here (None when it can be tried).

    Checks what can be checked without loading: privileges (root, or CAP_BPF with
    CAP_PERFMON, or CAP_SYS_ADMIN), the kernel's BTF (CO-RE needs it) and the shipped object.
    The load itself may still fail (a kernel without these tracepoints, a lockdown mode):
    ``loader.Loader`` then says why, with libbpf's and the verifier's words.
    """
    caps = _effective_caps()
    if not (caps >> _CAP_SYS_ADMIN & 1 or (caps >> _CAP_BPF & 1 and caps >> _CAP_PERFMON & 1)):
        who = "root without CAP_SYS_ADMIN or CAP_BPF+CAP_PERFMON (a restricted container?)" if os.geteuid() == 0 else "not root"
        return f"loading BPF programs needs CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN (running as {who})"
    if not kernel_btf.exists():
        return f"{kernel_btf} is missing: the kernel was built without BTF (CONFIG_DEBUG_INFO_BTF), which CO-RE programs need"
    if not OBJECT.exists():
        return f"{OBJECT} is missing (rebuild it: python -m gpuos_tools.kinfer.bpf.build)"
    return None
