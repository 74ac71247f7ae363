"""Puts a fake in place of cuda-python's driver module for one test: code that does ``from
cuda.bindings import driver`` at call time then talks to the fake."""

from __future__ import annotations

import sys
import types
from typing import Any


def install_driver(monkeypatch: Any, fake: Any) -> Any:
    """Make ``fake`` the module ``cuda.bindings.driver`` until the test ends; returns it."""
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = fake
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    return fake
