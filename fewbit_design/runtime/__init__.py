"""PyTorch runtime: few-bit activations that load design tables, BLPA, reversible layers, memory accounting.

Importing this package loads torch but never scipy or matplotlib, and numba only when a CPU kernel first runs.
Submodules load on first attribute access, so ``from fewbit_design import runtime`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    import torch  # noqa: F401  (fail here, with the fix, rather than deep inside a submodule)
except ModuleNotFoundError as error:
    if error.name != "torch":
        raise
    raise ModuleNotFoundError(
        "fewbit_design.runtime needs PyTorch: pip install 'fewbit-design[runtime]' "
        "(or install the torch build for your machine first)",
        name="torch",
    ) from error

_SUBMODULES = ("nn", "functional", "memory", "blpa", "reversible", "ops", "convert", "tables")
_LAZY_ATTRIBUTES: dict[str, tuple[str, str]] = {}

__all__ = list(_SUBMODULES) + list(_LAZY_ATTRIBUTES)


def _register(name: str, module: str, attribute: str | None = None) -> None:
    _LAZY_ATTRIBUTES[name] = (module, attribute or name)
    if name not in __all__:
        __all__.append(name)


_register("FewBit", "nn", "FewBit")
_register("load_table", "tables", "load_table")
_register("convert", "convert", "convert")


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        module, attribute = _LAZY_ATTRIBUTES[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
