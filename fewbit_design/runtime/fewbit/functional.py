"""Few-bit versions of the ``torch.nn.functional`` activations (thin wrappers: the math is in :mod:`.ops`).

Each function takes torch's arguments (same names, defaults and order) plus keyword-only ``bits=3``,
``weight='uniform'``, ``mode='levelsets'`` and ``table=None`` (a :class:`~fewbit_design.table.Table`, a
``fewbit-table/1`` dict or a path; its bits, weight and mode win). The output is bitwise what the torch function
returns; the backward stores ``bits`` bits per element and multiplies by the table's levels. ``inplace`` is
accepted for compatibility and ignored (the result is computed out of place).

>>> import torch
>>> from fewbit_design.runtime import functional as FF
>>> x = torch.randn(4, requires_grad=True)
>>> y = FF.gelu(x, bits=3)                     # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .backends import table_tensors
from .lookup import TableLike, document_arguments, resolve_table
from .ops import fewbit_activation

__all__ = [
    "relu",
    "relu6",
    "leaky_relu",
    "elu",
    "celu",
    "selu",
    "gelu",
    "silu",
    "mish",
    "sigmoid",
    "tanh",
    "softplus",
    "softsign",
    "hardtanh",
    "hardsigmoid",
    "hardswish",
    "logsigmoid",
    "tanhshrink",
    "softshrink",
    "hardshrink",
    "threshold",
    "quick_gelu",
    "relu_squared",
]


def _apply(
    activation: str,
    input: torch.Tensor,
    params: Mapping[str, Any],
    native: Callable[[torch.Tensor], torch.Tensor],
    bits: int,
    weight: str,
    mode: str,
    table: TableLike | None,
) -> torch.Tensor:
    resolved = resolve_table(table, activation=activation, params=params, bits=bits, weight=weight, mode=mode)
    return fewbit_activation(input, native, table_tensors(resolved, input.device))


def relu(input, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.relu`."""
    return _apply("relu", input, {}, F.relu, bits, weight, mode, table)


def relu6(input, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.relu6`."""
    return _apply("relu6", input, {}, F.relu6, bits, weight, mode, table)


def leaky_relu(input, negative_slope=0.01, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.leaky_relu`."""
    params = {"negative_slope": negative_slope}
    return _apply("leaky_relu", input, params, lambda x: F.leaky_relu(x, negative_slope), bits, weight, mode, table)


def elu(input, alpha=1.0, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.elu`."""
    return _apply("elu", input, {"alpha": alpha}, lambda x: F.elu(x, alpha), bits, weight, mode, table)


def celu(input, alpha=1.0, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.celu`."""
    return _apply("celu", input, {"alpha": alpha}, lambda x: F.celu(x, alpha), bits, weight, mode, table)


def selu(input, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.selu`."""
    return _apply("selu", input, {}, F.selu, bits, weight, mode, table)


def gelu(input, approximate="none", *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.gelu`."""
    params = {"approximate": approximate}
    return _apply("gelu", input, params, lambda x: F.gelu(x, approximate=approximate), bits, weight, mode, table)


def silu(input, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.silu`."""
    return _apply("silu", input, {}, F.silu, bits, weight, mode, table)


def mish(input, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.mish`."""
    return _apply("mish", input, {}, F.mish, bits, weight, mode, table)


def sigmoid(input, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.sigmoid` (what :class:`torch.nn.Sigmoid` calls)."""
    return _apply("sigmoid", input, {}, torch.sigmoid, bits, weight, mode, table)


def tanh(input, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.tanh` (what :class:`torch.nn.Tanh` calls)."""
    return _apply("tanh", input, {}, torch.tanh, bits, weight, mode, table)


def softplus(input, beta=1.0, threshold=20.0, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.softplus`."""
    params = {"beta": beta, "threshold": threshold}
    return _apply("softplus", input, params, lambda x: F.softplus(x, beta, threshold), bits, weight, mode, table)


def softsign(input, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.softsign`."""
    return _apply("softsign", input, {}, F.softsign, bits, weight, mode, table)


def hardtanh(
    input, min_val=-1.0, max_val=1.0, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None
):
    """Few-bit :func:`torch.nn.functional.hardtanh`."""
    params = {"min_val": min_val, "max_val": max_val}
    return _apply("hardtanh", input, params, lambda x: F.hardtanh(x, min_val, max_val), bits, weight, mode, table)


def hardsigmoid(input, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.hardsigmoid`."""
    return _apply("hardsigmoid", input, {}, F.hardsigmoid, bits, weight, mode, table)


def hardswish(input, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.hardswish`."""
    return _apply("hardswish", input, {}, F.hardswish, bits, weight, mode, table)


def logsigmoid(input, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.logsigmoid`."""
    return _apply("logsigmoid", input, {}, F.logsigmoid, bits, weight, mode, table)


def tanhshrink(input, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.tanhshrink`."""
    return _apply("tanhshrink", input, {}, F.tanhshrink, bits, weight, mode, table)


def softshrink(input, lambd=0.5, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.softshrink`."""
    return _apply("softshrink", input, {"lambd": lambd}, lambda x: F.softshrink(x, lambd), bits, weight, mode, table)


def hardshrink(input, lambd=0.5, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.hardshrink`."""
    return _apply("hardshrink", input, {"lambd": lambd}, lambda x: F.hardshrink(x, lambd), bits, weight, mode, table)


def threshold(input, threshold, value, inplace=False, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit :func:`torch.nn.functional.threshold`."""
    params = {"threshold": threshold, "value": value}
    return _apply("threshold", input, params, lambda x: F.threshold(x, threshold, value), bits, weight, mode, table)


def quick_gelu_native(input: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), written as Hugging Face's ``QuickGELUActivation`` and timm's ``QuickGELU`` write it."""
    return input * torch.sigmoid(1.702 * input)


def relu_squared_native(input: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2, written as Hugging Face's ``ReLUSquaredActivation`` writes it."""
    return torch.square(F.relu(input))


def quick_gelu(input, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit x * sigmoid(1.702 x) (CLIP's GELU approximation; forward bitwise as in transformers and timm)."""
    return _apply("quick_gelu", input, {}, quick_gelu_native, bits, weight, mode, table)


def relu_squared(input, *, bits=3, weight="uniform", mode="levelsets", table=None):
    """Few-bit relu(x) ** 2 (Primer's activation; forward bitwise as in transformers)."""
    return _apply("relu_squared", input, {}, relu_squared_native, bits, weight, mode, table)


for _name in __all__:
    document_arguments(globals()[_name], f"torch.nn.functional.{_name}")
del _name
