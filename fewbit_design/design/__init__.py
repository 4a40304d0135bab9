"""The design math: optimal piecewise-constant approximations q(x) of activation derivatives f'(x).

What it owns, bottom to top:

* :mod:`.activations`: the registry of activations f, their derivatives f' in closed form, name resolution.
* :mod:`.weights`: the weights w(x) (uniform, normal, laplace, student-t, empirical) on a design range.
* :mod:`.integrals`: grids, Gauss-Legendre antiderivatives and the O(n) prefix integrals of the paper's eqs. 8-9.
* :mod:`.dp`: the numba dynamic programs (intervals, eq. 7; weighted 1-D k-means for level sets).
* :mod:`.refine`: continuous refinement (Newton on the boundaries of eq. 5; Lloyd for level sets).
* :mod:`.engine`: ``design(activation, bits, *, weight=..., mode=...) -> Table``, the entry point.
* :mod:`.snr`: SNR theory (reversible reconstructions, eq. 19) and SNR of few-bit tables against bits.

It may import numpy, scipy, numba, :mod:`fewbit_design.errors` and :mod:`fewbit_design.table`; never torch (except
lazily, for a user's activation given as a module), the runtime, the CLI or matplotlib.

The package itself is callable, so ``fewbit_design.design("gelu", 3)`` designs a table whichever of the function
or this package a caller reached; ``from fewbit_design.design import design`` gives the function. Nothing heavy
loads until first use: the runtime imports :mod:`.activations` without loading numba or scipy.

>>> import fewbit_design
>>> table = fewbit_design.design("relu", 1)   # doctest: +SKIP
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .._lazy import lazy_getattr

__all__ = ["design", "activations", "weights", "integrals", "dp", "refine", "engine", "snr"]

_SUBMODULES = ("activations", "weights", "integrals", "dp", "refine", "engine", "snr")


__getattr__ = lazy_getattr(
    __name__,
    {"design": (f"{__name__}.engine", "design"), **{name: (f"{__name__}.{name}", None) for name in _SUBMODULES}},
)


class _CallablePackage(types.ModuleType):
    """This package's module type: calling the package calls :func:`fewbit_design.design.engine.design`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.design(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
