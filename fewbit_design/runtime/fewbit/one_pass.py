"""The activations whose CUDA forward is one Triton pass: x read once, y and the packed codes written.

y is computed by the formula of torch's own CUDA kernel, in the same float32 arithmetic (ATen's ``opmath_t`` for
float32, float16 and bfloat16 input), with the same functions of CUDA's math library (libdevice, see
:mod:`._triton_math`), rounded once to the input's dtype. The kernel is compiled with FMA contraction on and
without flush-to-zero, as nvcc compiles ATen by default (``--fmad=true``, ``-ftz=false``), so that y is bitwise
torch's on the GPU (NaN: any payload) by construction; the tests marked ``cuda`` check it there, and no GPU has run
them yet. Served (ATen file under
``aten/src/ATen/native/cuda/``, function: formula in float32):

* relu (``clamp_min(x, 0)``): TensorCompare.cu, ``launch_clamp_scalar``: isnan(x) ? x : max(x, 0);
* relu6, hardtanh (``clamp(x, lo, hi)``): TensorCompare.cu, ``launch_clamp_scalar``: isnan(x) ? x : min(max(x, lo),
  hi);
* leaky_relu: ActivationLeakyReluKernel.cu, ``leaky_relu_kernel``: x > 0 ? x : x * slope;
* gelu: ActivationGeluKernel.cu, ``GeluCUDAKernelImpl``: x * 0.5 * (1 + erf(x * M_SQRT1_2));
* gelu (tanh): ActivationGeluKernel.cu, ``GeluCUDAKernelImpl``: 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3)));
* silu: ActivationSiluKernel.cu, ``silu_kernel``: x / (1 + exp(-x));
* sigmoid: UnarySpecialOpsKernel.cu, ``sigmoid_kernel_cuda``: 1 / (1 + exp(-x));
* tanh: UnaryGeometricTanhKernel.cu, ``tanh_kernel_cuda``: tanh(x).

Not served (the forward stays two passes: torch's op, then the codes kernel): float64 input; the other
activations (their ATen kernels use functions or parameters that this table does not cover yet: ``expm1`` for
elu / celu / selu, ``log1p`` for softplus / mish / logsigmoid, several torch ops for quick_gelu and relu_squared);
:class:`~.nn.FewBit` (any function); the ``functional`` forms that pass a lambda (gelu, leaky_relu, hardtanh with
arguments). The sign of a zero from ``max`` / ``min`` (relu and hardtanh at -0) is the hardware's: the kernel uses
the instruction ATen's ``::max`` compiles to.

:func:`reference` is each formula in torch float32 operations: the oracle of the kernel under Triton's interpreter,
where ``functions`` supplies the interpreter's exp / tanh / erf.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...errors import FewBitError

__all__ = ["CODES_ONLY", "SERVED_DTYPES", "Formula", "formula_for", "reference", "TORCH_FUNCTIONS"]

# activation ids: a runtime argument of the Triton forward kernel (CODES_ONLY: the codes, no y)
CODES_ONLY, RELU, HARDTANH, LEAKY_RELU, GELU, GELU_TANH, SILU, SIGMOID, TANH = range(9)
SERVED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# float32 constants, as ATen's constexpr opmath_t ones (the double expression rounded once)
GELU_ALPHA = float(torch.tensor(math.sqrt(0.5), dtype=torch.float32))  # M_SQRT1_2
GELU_BETA = float(torch.tensor(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, dtype=torch.float32))
GELU_KAPPA = float(torch.tensor(0.044715, dtype=torch.float32))


class Formula(NamedTuple):
    """One served activation with its parameters (float32, as ATen converts them: ``Scalar.to<float>()``)."""

    name: str
    kernel_id: int
    low: float = 0.0  # hardtanh's min_val; leaky_relu's negative_slope
    high: float = 0.0  # hardtanh's max_val


def _float32(value: float) -> float:
    return float(torch.tensor(float(value), dtype=torch.float32))


_NN_MODULE = __name__.rpartition(".")[0] + ".nn"
_FIXED = {
    torch.relu: Formula("relu", RELU),
    F.relu: Formula("relu", RELU),
    torch.sigmoid: Formula("sigmoid", SIGMOID),
    torch.tanh: Formula("tanh", TANH),
    F.silu: Formula("silu", SILU),
    F.relu6: Formula("hardtanh", HARDTANH, 0.0, 6.0),
}


def _module_formula(owner: object) -> Formula | None:
    """The formula of a few-bit ``nn`` module's own ``_native`` (its hyper-parameters read now)."""
    name = getattr(owner, "activation", None)
    if name in ("relu", "silu", "sigmoid", "tanh"):
        return Formula(name, {"relu": RELU, "silu": SILU, "sigmoid": SIGMOID, "tanh": TANH}[name])
    if name == "gelu":
        approximate = getattr(owner, "approximate", None)
        if approximate == "none":
            return Formula("gelu", GELU)
        return Formula("gelu_tanh", GELU_TANH) if approximate == "tanh" else None
    if name == "leaky_relu":
        return Formula("leaky_relu", LEAKY_RELU, _float32(owner.negative_slope))
    if name in ("hardtanh", "relu6"):
        return Formula("hardtanh", HARDTANH, _float32(owner.min_val), _float32(owner.max_val))
    return None


def formula_for(native: Callable[[torch.Tensor], torch.Tensor]) -> Formula | None:
    """The one-pass formula that computes ``native(x)``, or None (the forward then runs ``native`` itself).

    Recognised: torch's functions called with their defaults (``torch.relu``, ``F.relu``, ``torch.sigmoid``,
    ``torch.tanh``, ``F.silu``, ``F.relu6``) and the ``_native`` method of the few-bit ``nn`` modules of the
    served activations (not of a subclass that overrides it).

    Args:
        native: the function whose value the forward returns
    """
    try:
        fixed = _FIXED.get(native)
    except TypeError:  # an unhashable callable: not one of torch's functions
        fixed = None
    if fixed is not None:
        return fixed
    owner = getattr(native, "__self__", None)
    function = getattr(native, "__func__", None)
    if owner is None or function is None:
        return None
    # the few-bit nn class that declares the activation (by its module's name: nn imports this module) must be the
    # one whose _native this is
    declaring = next((cls for cls in type(owner).__mro__ if "activation" in vars(cls)), None)
    if declaring is None or declaring.__module__ != _NN_MODULE or vars(declaring).get("_native") is not function:
        return None
    return _module_formula(owner)


# ----------------------------------------------------------------------------------------------------------------------
# The formulas in torch float32 (the oracle)


#: the functions :func:`reference` uses by default: torch's own
TORCH_FUNCTIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp,
    "tanh": torch.tanh,
    "erf": torch.erf,
}


def _maximum(a: torch.Tensor, b: float) -> torch.Tensor:
    # max(a, b) for non-NaN a; max(-0, +0) is +0 (numpy's fmax, the interpreter's; on the GPU, max.f32)
    return torch.where(a > b, a, torch.tensor(b, dtype=a.dtype))


def _minimum(a: torch.Tensor, b: float) -> torch.Tensor:
    return torch.where(a < b, a, torch.tensor(b, dtype=a.dtype))


def _float32_formula(formula: Formula, x: torch.Tensor, functions: Mapping[str, Callable]) -> torch.Tensor:
    name = formula.name
    if name == "relu":
        return torch.where(torch.isnan(x), x, _maximum(x, 0.0))
    if name == "hardtanh":
        return torch.where(torch.isnan(x), x, _minimum(_maximum(x, formula.low), formula.high))
    if name == "leaky_relu":
        return torch.where(x > 0, x, x * formula.low)
    if name == "gelu":
        return x * 0.5 * (1.0 + functions["erf"](x * GELU_ALPHA))
    if name == "gelu_tanh":
        cube = x * x * x
        inner = GELU_BETA * (x + GELU_KAPPA * cube)
        return 0.5 * x * (1.0 + functions["tanh"](inner))
    if name == "silu":
        return x / (1.0 + functions["exp"](-x))
    if name == "sigmoid":
        return 1.0 / (1.0 + functions["exp"](-x))
    if name == "tanh":
        return functions["tanh"](x)
    raise AssertionError(f"no formula for {name!r}")


def reference(
    formula: Formula, x: torch.Tensor, functions: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
) -> torch.Tensor:
    """The formula of ``formula`` applied to x, in float32 torch operations, rounded once to x's dtype.

    Args:
        formula: a served activation (:func:`formula_for`)
        x: float32, float16 or bfloat16 input (any shape)
        functions: exp / tanh / erf on float32 tensors (default :data:`TORCH_FUNCTIONS`)
    """
    if x.dtype not in SERVED_DTYPES:
        raise FewBitError(f"one-pass formulas take float32, float16 or bfloat16 input, got {x.dtype}")
    with torch.no_grad():
        result = _float32_formula(formula, x.detach().to(torch.float32), functions or TORCH_FUNCTIONS)
    return result.to(x.dtype)
