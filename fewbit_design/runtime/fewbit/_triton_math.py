"""Float32 math for the Triton kernels: CUDA's math library when compiled, numpy under Triton's interpreter.

Compiled, :func:`exp`, :func:`tanh` and :func:`erf` are libdevice's ``__nv_expf``, ``__nv_tanhf`` and ``__nv_erff``:
the functions that ATen's CUDA kernels reach through ``::expf`` / ``c10::cuda::compat::exp``, ``::tanhf`` and
``::erff`` (nvcc links the same libdevice). Triton's own ``tl.exp`` is not one of them (it lowers to
``ex2.approx``), so the kernels that promise torch's values call these.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) has no libdevice; there each function is
:data:`INTERPRETED_FUNCTIONS`' numpy function (float64, rounded once to float32, which does not depend on where an
element sits in a block), so a test can compute the same values outside the kernel.

Importing this module loads triton; the runtime imports it only for CUDA tensors or under the interpreter.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = ["INTERPRETED", "INTERPRETED_FUNCTIONS", "erf", "exp", "tanh"]


@triton.jit
def _probe():
    pass


#: whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when triton decorated them)
INTERPRETED = not isinstance(_probe, JITFunction)

_erf64 = np.vectorize(math.erf, otypes=[np.float64])


def _rounded(function: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    def float32_function(values: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return function(np.asarray(values, dtype=np.float32).astype(np.float64)).astype(np.float32)

    return float32_function


#: name -> the numpy float32 function the interpreted kernels compute (float64, rounded once)
INTERPRETED_FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": _rounded(np.exp),
    "tanh": _rounded(np.tanh),
    "erf": _rounded(_erf64),
}


if INTERPRETED:
    from triton.runtime.interpreter import TensorHandle

    def _interpreted(name: str, x):
        # the interpreter runs a kernel as Python over numpy arrays: x.handle.data is the block's values (x may
        # arrive wrapped in a constexpr, as the product of a constexpr and a tensor is there)
        x = tl.core._unwrap_if_constexpr(x)
        values = INTERPRETED_FUNCTIONS[name](x.handle.data)
        return tl.core.tensor(TensorHandle(values, tl.float32), x.type)

    def exp(x):
        """exp(x), float32 (``__nv_expf`` when compiled)."""
        return _interpreted("exp", x)

    def tanh(x):
        """tanh(x), float32 (``__nv_tanhf`` when compiled)."""
        return _interpreted("tanh", x)

    def erf(x):
        """erf(x), float32 (``__nv_erff`` when compiled)."""
        return _interpreted("erf", x)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def exp(x):
        """exp(x), float32: ``__nv_expf``."""
        return libdevice.exp(x)

    @triton.jit
    def tanh(x):
        """tanh(x), float32: ``__nv_tanhf``."""
        return libdevice.tanh(x)

    @triton.jit
    def erf(x):
        """erf(x), float32: ``__nv_erff``."""
        return libdevice.erf(x)
