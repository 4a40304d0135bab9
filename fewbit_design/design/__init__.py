"""The design math: optimal piecewise-constant approximations q(x) of activation derivatives f'(x).

What it owns, bottom to top:

* :mod:`.activations`: the registry of activations f and their derivatives f', name resolution, binding, user
  activations; :mod:`.catalogue`: the closed forms of f and f' of every registry activation.
* :mod:`.weights`: the weights w(x) (uniform, normal, laplace, student-t, empirical) on a design range.
* :mod:`.integrals`: grids, Gauss-Legendre antiderivatives and the O(n) prefix integrals of the paper's eqs. 8-9.
* :mod:`.dp`: the numba dynamic programs (intervals, eq. 7; weighted 1-D k-means for level sets).
* :mod:`.refine`: continuous refinement (Newton on the boundaries of eq. 5; Lloyd for level sets).
* :mod:`.engine`: ``design(activation, bits, *, weight=..., mode=...) -> Table``, the entry point.
* :mod:`.snr`: SNR theory (reversible reconstructions, eq. 19) and SNR of few-bit tables against bits.

It may import numpy, scipy, numba, :mod:`fewbit_design.errors` and :mod:`fewbit_design.table`; never torch (except
lazily, for a user's activation given as a module), the runtime, the CLI or matplotlib.

``from fewbit_design.design import design`` gives the entry point (this package is a plain package, not callable).
Nothing heavy loads until first use: the runtime imports :mod:`.activations` without loading numba or scipy.

>>> from fewbit_design.design import design
>>> table = design("relu", 1)   # doctest: +SKIP
"""

from .._lazy import lazy_getattr as _lazy_getattr
from .._lazy import public_dir as _public_dir

__all__ = ["design", "activations", "weights", "integrals", "dp", "refine", "engine", "snr"]

__getattr__ = _lazy_getattr(
    __name__,
    {"design": (".engine", "design"), **{name: (f".{name}", None) for name in __all__[1:]}},
)
__dir__ = _public_dir(__all__)
