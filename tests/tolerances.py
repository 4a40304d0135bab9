"""Gradient tolerances of the exact modes (memory-sharing norms, the gated-MLP op's exact mode) against native, derived
per dtype (imported by the test modules).

Both results are the exact gradient plus rounding. Measured normwise (the largest difference against the largest
native element, so a gradient element near zero is not held to a relative bound it cannot meet):

* each result ends in a rounding to its dtype: at most eps/2 of the element, so the two differ by at most ``eps``
  (``eps = torch.finfo(dtype).eps``: 2^-23 float32, 2^-7 bfloat16, 2^-10 float16) of the largest element;
* the exact modes start one step later from a rounded value where native starts from the exact one: a norm
  reconstructs its normalised input from its output rounded to the dtype (eps/2 of ``|xhat| + |b / w|``, and the
  converter inverts only channels with ``|b / w| <= 1 / threshold``); the gated op recomputes ``act(gate) * up`` with
  native's own kernels (bitwise, no extra term). ``reconstruction`` counts these roundings in units of eps;
* reductions (length ``n``: the width for an input gradient, the rows for a weight gradient) accumulate in float32
  on CPU for every dtype, in another order or blocking than native: random-sign rounding errors grow like
  ``lambda sqrt(n)`` float32 unit roundoffs (Higham's probabilistic bound), lambda = 4 for the tails.

So ``tolerance = (1 + reconstruction) * eps(dtype) + 2 * sqrt(n) * eps(float32)`` (the unit roundoff is eps/2).
Measured: 3-30x below it (the gated op is bitwise equal to native). A wrong formula, a wrong channel or a lost term
is off by a sizeable fraction of the largest element, far above it in every dtype.
"""

from __future__ import annotations

import math

import torch


def gradient_tolerance(dtype: torch.dtype, reduction: int, *, reconstruction: float = 0.0) -> float:
    """The normwise tolerance derived in the module docstring, relative to the largest native element."""
    return (1.0 + reconstruction) * torch.finfo(dtype).eps + 2.0 * math.sqrt(reduction) * torch.finfo(torch.float32).eps


def assert_gradient_close(native: torch.Tensor, ours: torch.Tensor, tolerance: float, what: str) -> None:
    """``max |ours - native| <= tolerance * max |native|``, same dtype and shape, finite."""
    assert ours.dtype == native.dtype and ours.shape == native.shape, what
    assert torch.isfinite(ours).all(), what
    scale = float(native.abs().max().float()) if native.numel() else 0.0
    error = float((native.float() - ours.float()).abs().max()) if native.numel() else 0.0
    assert error <= tolerance * scale, f"{what}: {error:.3g} > {tolerance:.3g} * {scale:.3g}"
