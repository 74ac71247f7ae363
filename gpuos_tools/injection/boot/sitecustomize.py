"""Bootstrap of the gpuos tracer, found first on PYTHONPATH by the program the launcher
(gpuos_tools/trace/run.py) starts.

It runs the sitecustomize it shadows (if the interpreter has one), then, when GPUOS_BOOT is set,
removes it from the environment (programs this one starts are not traced into the same pipe),
parses it (gpuos_tools/injection/config.py) and starts the tracer before the program's first line
(gpuos_tools/injection/start.py:boot). A tracer that cannot start ends the program rather than let
it run untraced.
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


_chain_original()
_text = os.environ.pop("GPUOS_BOOT", None)  # config.ENV; nothing is imported unless it is set
if _text is not None:
    _fail_code = 70  # ExitCode.NO_CUPTI, until the config says
    try:
        from gpuos_tools.injection import config as _config, start as _start

        _cfg = _config.BootConfig.from_json(_text)
        _fail_code = _cfg.trace.fail_code
        _start.boot(_cfg)
    except Exception as _exc:  # the user asked for a trace: do not run the program untraced
        sys.stderr.write(
            f"gpu-trace: error: the tracer could not start in {sys.executable}: "
            f"{type(_exc).__name__}: {_exc}\n"
        )
        sys.stderr.flush()
        os._exit(_fail_code)
