"""fewbit-design: optimal few-bit approximations of activation derivatives.

Terms used throughout the package:

* **weight** w(x) >= 0: the expected distribution of pre-activations x.
* **boundary**: a point t_i where the approximation q(x) may jump; boundaries are sorted and finite.
* **interval**: a piece of the real line between consecutive boundaries (the first and last are unbounded);
  x belongs to interval m = number of boundaries <= x.
* **code**: the integer in [0, 2**bits) stored per element for the backward pass; each interval has one.
* **level**: the value y of the approximation for a code; q(x) = levels[codes[interval(x)]].
* **error** L = integral of (f'(x) - q(x))**2 w(x) dx.

This module imports nothing heavy: ``design``, ``Table`` and friends load on first use, and importing
:mod:`fewbit_design.runtime` never loads scipy, matplotlib or numba.

>>> import fewbit_design
>>> table = fewbit_design.design("relu", 1)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .errors import FewBitError

__all__ = ["__version__", "FewBitError", "Table", "design", "load"]

_LAZY = {
    "Table": ("fewbit_design.table", "Table"),
    "load": ("fewbit_design.table", "load"),
    "design": ("fewbit_design.design", "design"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fewbit_design' has no attribute {name!r}")
