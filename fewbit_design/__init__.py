"""fewbit-design: optimal few-bit approximations of activation derivatives.

Terms used throughout the package:

* **weight** w(x) >= 0: the expected distribution of pre-activations x.
* **boundary**: a point t_i where the approximation q(x) may jump; boundaries are sorted and finite.
* **interval**: a piece of the real line between consecutive boundaries (the first and last are unbounded);
  x belongs to interval m = number of boundaries <= x.
* **code**: the integer in [0, 2**bits) stored per element for the backward pass; each interval has one.
* **level**: the value y of the approximation for a code; q(x) = levels[codes[interval(x)]].
* **error** L = integral of (f'(x) - q(x))**2 w(x) dx.

Where things are: :mod:`fewbit_design.design` (the math; :func:`fewbit_design.design.design` is the entry point),
:mod:`fewbit_design.table` (the table format), :mod:`fewbit_design.tables` (the shipped set),
:mod:`fewbit_design.plots`, :mod:`fewbit_design.cli` (the command) and :mod:`fewbit_design.runtime` (PyTorch). This
module imports nothing heavy: ``design``, ``Table`` and friends load on first use, and importing
:mod:`fewbit_design.runtime` never loads scipy, matplotlib or numba.

>>> from fewbit_design.design import design
>>> table = design("relu", 1)   # doctest: +SKIP
"""

from ._lazy import lazy_getattr as _lazy_getattr
from ._lazy import public_dir as _public_dir
from ._version import __version__
from .errors import FewBitError

__all__ = ["__version__", "FewBitError", "Table", "design", "load"]

# ``fewbit_design.design`` is the design package. Its modules are also reachable here by their short names
# (``from fewbit_design import snr``).
_LAZY = {
    "Table": ("fewbit_design.table", "Table"),
    "load": ("fewbit_design.table", "load"),
    "design": ("fewbit_design.design", None),
    **{
        name: (f"fewbit_design.design.{name}", None)
        for name in ("activations", "weights", "integrals", "dp", "refine", "snr")
    },
}
__getattr__ = _lazy_getattr(__name__, _LAZY)
__dir__ = _public_dir(__all__, _LAZY)
