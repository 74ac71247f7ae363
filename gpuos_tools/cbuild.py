"""Building and loading the toolkit's small C libraries: compiled once per version of their
sources with the system C compiler into the user's cache (no CUDA headers needed), and loaded
only from files that this user (or root) owns and no one else can write.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path


class BuildError(Exception):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpuos-tools"


def build_library(
    cache: Path | None = None,
    *,
    source: Path,
    stem: str = "libgpuos_trace",
    flags: tuple[str, ...] = ("-O2",),
    libs: tuple[str, ...] = ("-ldl", "-lpthread"),
    includes: tuple[Path, ...] = (),
    sources: tuple[Path, ...] = (),
) -> Path:
    """Compile a native library (once per version of its source and headers) and return its path.

    The tracer, the agent's core, the owned and managed allocators and gpu-kinfer-bridge's serve
    loop each pass their source, include directories, flags and extra ``sources``. The file name carries a hash
    of the sources, every header of ``includes`` and the flags, so an edit rebuilds and two
    versions never share a file.
    BuildError says why when there is no compiler or it fails.
    """
    digest = hashlib.sha256(source.read_bytes())
    for extra in sources:
        digest.update(extra.read_bytes())
    for directory in includes:
        for header in sorted(Path(directory).glob("*.h")):
            digest.update(header.read_bytes())
    digest.update(" ".join((*flags, *libs)).encode())
    tag = digest.hexdigest()[:16]
    target = (cache or cache_dir()) / f"{stem}-{tag}.so"
    if target.exists():
        _trusted(target.parent, directory=True)
        _trusted(target, directory=False)
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise BuildError("no C compiler (cc, gcc or clang) on PATH")
    if not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.parent.chmod(0o700)  # whatever the umask: only this user may put code here
    _trusted(target.parent, directory=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [compiler, *flags, "-shared", "-fPIC", *(f"-I{d}" for d in includes), "-o", str(tmp), str(source),
           *(str(x) for x in sources), *libs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # CC names a program that is not there
        raise BuildError(f"{compiler}: {e.strerror or e}") from None
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def _trusted(path: Path, directory: bool) -> None:
    """Refuse to load code from ``path`` unless only this user (or root) could have put it there:
    it is what it claims to be (not a symbolic link), owned by this user or root, and not
    writable by group or others (a shared XDG_CACHE_HOME would otherwise let another user plant a
    library that every traced program loads)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise BuildError(f"{path}: {e.strerror}") from None
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise BuildError(f"{path}: not a {'directory' if directory else 'regular file'} (a link is not followed)")
    if st.st_uid not in (os.geteuid(), 0):
        raise BuildError(f"{path} belongs to uid {st.st_uid}: refusing to load code from it")
    if st.st_mode & 0o022:
        raise BuildError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                         "refusing to load code from it; set XDG_CACHE_HOME to a directory of your own")


def loaded_library_path(fragment: str) -> str | None:
    """The file of a shared library this process has mapped (e.g. the libcupti cupti-python loaded)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None
