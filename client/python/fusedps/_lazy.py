"""Modules imported on first use, so that ``import fusedps`` (and calls that move no tensors,
such as Client.info) stay free of torch's and numpy's import time (about a second for torch).

Internal module. Usage, at a module's top level::

    torch = LazyModule("torch")      # nothing imported yet
    ...
    isinstance(x, torch.Tensor)       # imports torch here, once
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Optional


class LazyModule:
    """Stands for the module ``name``; the first attribute read imports it (an ImportError
    then names the module), later reads go straight to it."""

    def __init__(self, name: str):
        self._name = name
        self._module: Optional[ModuleType] = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<lazy module {self._name!r} ({state})>"
