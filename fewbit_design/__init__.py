"""fewbit-design: optimal few-bit approximations of activation derivatives.

Terms used throughout the package:

* **weight** w(x) >= 0: the expected distribution of pre-activations x.
* **boundary**: a point t_i where the approximation q(x) may jump; boundaries are sorted and finite.
* **interval**: a piece of the real line between consecutive boundaries (the first and last are unbounded);
  x belongs to interval m = number of boundaries <= x.
* **code**: the integer in [0, 2**bits) stored per element for the backward pass; each interval has one.
* **level**: the value y of the approximation for a code; q(x) = levels[codes[interval(x)]].
* **error** L = integral of (f'(x) - q(x))**2 w(x) dx.

Where things are: :mod:`fewbit_design.design` (the math), :mod:`fewbit_design.table` (the table format),
:mod:`fewbit_design.tables` (the shipped set), :mod:`fewbit_design.plots`, :mod:`fewbit_design.cli` (the command)
and :mod:`fewbit_design.runtime` (PyTorch). This module imports nothing heavy: ``design``, ``Table`` and friends
load on first use, and importing :mod:`fewbit_design.runtime` never loads scipy, matplotlib or numba.

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
}
# ``fewbit_design.design`` is the design package; it is callable, so ``fewbit_design.design("gelu", 3)`` works.
# The design math's modules are also reachable here by their short names (``from fewbit_design import snr``).
_DESIGN_MODULES = ("design", "activations", "weights", "integrals", "dp", "refine", "snr")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
    elif name == "design":
        value = importlib.import_module("fewbit_design.design")
    elif name in _DESIGN_MODULES:
        value = importlib.import_module(f"fewbit_design.design.{name}")
    else:
        raise AttributeError(f"module 'fewbit_design' has no attribute {name!r}")
    globals()[name] = value
    return value
