"""Bootstrap of the gpuos tracer, found first on PYTHONPATH by the program `gpu-trace run` starts.

It runs the sitecustomize it shadows (if the interpreter has one), then, when GPUOS_TRACE_FD
is set, starts the tracer before the program's first line. The variables are removed from the
environment so that programs this one starts are not traced into the same pipe.
"""

import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def _chain_original() -> None:
    me = sys.modules.get("sitecustomize")
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
        sys.modules.pop("sitecustomize", None)
        try:
            importlib.import_module("sitecustomize")
        except ImportError:
            pass
    finally:
        sys.path[:] = saved
        if me is not None:
            sys.modules["sitecustomize"] = me


def _clean_environment() -> None:
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != _here]
    extra = os.environ.pop("GPUOS_TRACE_PYTHONPATH_ADDED", "")
    parts = [p for p in parts if p not in extra.split(os.pathsep)]
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)


_chain_original()
_fd = os.environ.pop("GPUOS_TRACE_FD", None)
_fail_code = int(os.environ.pop("GPUOS_TRACE_FAIL_CODE", "70"))  # ExitCode.NO_CUPTI
if _fd is not None:
    _clean_environment()
    try:
        from gpuos_tools.injection import start as _start

        _start.start(int(_fd))
    except Exception as _exc:  # the user asked for a trace: do not run the program untraced
        sys.stderr.write(
            f"gpu-trace: error: the tracer could not start in {sys.executable}: "
            f"{type(_exc).__name__}: {_exc}\n"
        )
        sys.stderr.flush()
        os._exit(_fail_code)
