"""The python tracer's parameter layouts are keyed by function handle, and the driver reuses the
handles of an unloaded module's functions for later ones: a module unload must empty the cache,
or a later kernel's arguments are read with another kernel's layout (a crash, or wrong bytes)."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import pytest

from gpuos_tools.injection import tracer


@pytest.fixture
def clean_tracer(monkeypatch):
    monkeypatch.setattr(tracer, "_layouts", {})
    monkeypatch.setattr(tracer, "_counters", dict(tracer._counters, module_unloads=0))
    monkeypatch.setattr(tracer, "_cubins", [])
    return tracer


def _params(*values: bytes) -> tuple[int, list]:
    """A kernelParams array in host memory: pointers to each argument's bytes."""
    bufs = [ctypes.create_string_buffer(v, len(v)) for v in values]
    arr = (ctypes.c_uint64 * len(bufs))(*(ctypes.addressof(b) for b in bufs))
    return ctypes.addressof(arr), [arr, *bufs]


def test_a_module_unload_forgets_the_layouts_of_its_function_handles(clean_tracer, monkeypatch):
    t = clean_tracer
    handle = 0x7F00DEAD0000
    layouts = {"first": ((0, 8), (8, 8), (16, 4)), "second": ((0, 4),)}
    kernel = {"now": "first"}
    monkeypatch.setattr(t, "_param_info", lambda func: (layouts[kernel["now"]], "cuFuncGetParamInfo"))
    monkeypatch.setattr(t, "_append", lambda item: None)

    entry = t._learn(handle, SimpleNamespace(symbol_name="first"))
    kp, keep = _params(b"A" * 8, b"B" * 8, b"C" * 4)
    assert t._args(entry, kp, 0) == b"A" * 8 + b"B" * 8 + b"C" * 4

    # the module goes; a kernel of another module gets the same handle with one 4-byte parameter
    t._resource(7, SimpleNamespace(ptr=0))
    assert t._layouts == {} and t._counters["module_unloads"] == 1
    kernel["now"] = "second"
    assert t._layouts.get(handle, False) is False  # the launch handler learns it again
    entry = t._learn(handle, SimpleNamespace(symbol_name="second"))
    kp, keep = _params(struct.pack("<i", 7))
    assert t._args(entry, kp, 0) == struct.pack("<i", 7)
    assert entry[0] == 1



def test_capture_status_needs_no_driver_call_until_a_capture_begins(monkeypatch):
    """_capturing is asked at every launch: before any cuStreamBeginCapture no stream can be
    capturing, so no driver call; from a capture's enter callback on, the driver is asked."""
    import sys

    monkeypatch.setattr(tracer, "_capture_begun", False)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # importing it would raise
    assert tracer._capturing(0x1234) is False
    handler = tracer._DRIVER_APIS["cuStreamBeginCapture_v2"][0]
    pp = (ctypes.c_uint64 * 2)(0x1234, 0)  # (hStream, mode)
    cb = struct.pack("<I4xQQQ", tracer._ENTER, 0, ctypes.addressof(pp), 0)
    buf = ctypes.create_string_buffer(cb, len(cb))
    handler(0, SimpleNamespace(ptr=ctypes.addressof(buf)))
    assert tracer._capture_begun
    with pytest.raises(ImportError):  # now it asks the driver
        tracer._capturing(0x1234)
