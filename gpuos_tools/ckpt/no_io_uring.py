"""Run a command whose processes cannot use io_uring, so that CRIU can dump them.

CRIU cannot dump an io_uring instance, and libuv (in PyTorch's TCPStore server, which torchrun
hosts) sets one up whenever the kernel allows, whatever its UV_USE_IO_URING or torch's USE_LIBUV
say. A seccomp filter that answers ENOSYS to io_uring_setup makes libuv fall back to epoll, and
the filter is inherited by every child and kept across exec (CRIU dumps and restores it with the
tree).

    python -m gpuos_tools.ckpt.no_io_uring torchrun --nproc-per-node 2 train.py

The command replaces this process (same pid); nothing else about it changes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

IO_URING_SETUP = 425  #: the same number on every architecture since Linux 5.1
#: AUDIT_ARCH_* of the machines the filter knows; elsewhere it lets every call through
ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def deny_io_uring() -> bool:
    """Install the filter in this process (and so in every process it starts); False where the
    architecture is not one the filter knows. Raises OSError when the kernel refuses it."""
    arch = ARCHES.get(platform.machine())
    if arch is None:
        return False
    insns = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 0, 3, arch),
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JEQ_K, 0, 1, IO_URING_SETUP),
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    table = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    prog = _Prog(len(insns), table)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(e)}")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.cast(ctypes.pointer(prog), ctypes.c_void_p), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_SECCOMP): {os.strerror(e)}")
    return True


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 64 if not argv else 0
    try:
        deny_io_uring()
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"no_io_uring: {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 71
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
