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
import ctypes.util
import errno
import os
import sys

#: libseccomp's actions (seccomp.h): let a call through, or fail it with an errno
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise OSError(errno.ENOSYS, f"libseccomp is not installed ({e}): install libseccomp2") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def deny_io_uring() -> None:
    """Install, through libseccomp, a filter that fails io_uring_setup with ENOSYS in this process
    (and so in every process it starts; libseccomp sets no_new_privs, as an unprivileged filter
    needs). Raises OSError when libseccomp is missing or the kernel refuses the filter."""
    lib = _libseccomp()
    nr = lib.seccomp_syscall_resolve_name(b"io_uring_setup")
    if nr < 0:
        raise OSError(errno.ENOSYS, "libseccomp does not know io_uring_setup on this architecture")
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        for what, rc in (("seccomp_rule_add", lambda: lib.seccomp_rule_add(ctx, _SCMP_ACT_ERRNO | errno.ENOSYS, nr, 0)),
                         ("seccomp_load", lambda: lib.seccomp_load(ctx))):
            err = rc()
            if err < 0:  # libseccomp returns -errno
                raise OSError(-err, f"{what}: {os.strerror(-err)}")
    finally:
        lib.seccomp_release(ctx)


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
