"""The eager fast path of the exact gated-MLP op (runtime.gated.ops._ExactGatedMLP): no torch.library dispatch, a
backward that allocates no more full-size tensors than native autograd's and sums no absent bias, and gradients
bitwise equal to the custom op's (the path torch.compile runs: the same kernels in the same order), for every
activation, both layouts, with and without biases, float32 / bfloat16 / float64 and odd row counts."""

from __future__ import annotations

import pytest
import torch
from dispatched import Dispatched

from fewbit_design.runtime.gated import gated_mlp
from fewbit_design.runtime.gated.ops import ACTIVATIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _weights(hidden: int, width: int, fused: bool, bias: bool, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def parameter(*shape):
        return torch.nn.Parameter((torch.randn(*shape, generator=generator) / shape[-1] ** 0.5).to(dtype))

    w_gate = parameter(2 * width if fused else width, hidden)
    b_gate = parameter(2 * width if fused else width) if bias else None
    w_up = None if fused else parameter(width, hidden)
    b_up = parameter(width) if bias and not fused else None
    return [w_gate, b_gate, w_up, b_up, parameter(hidden, width), parameter(hidden) if bias else None]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 7])
def test_eager_gradients_bitwise_equal_to_the_custom_op(dtype, activation, fused, bias, rows):
    dtype = DTYPES[dtype]
    hidden, width = 6, 10
    weights = _weights(hidden, width, fused, bias, dtype)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    upstream = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    leaves = [x, *(w for w in weights if w is not None)]
    y_fast = gated_mlp(x, *weights, activation)  # eager: the autograd.Function
    fast = torch.autograd.grad(y_fast, leaves, upstream)
    y_op, _, _ = torch.ops.fewbit.gated_mlp(x, *weights, activation)  # the custom op compile runs
    op = torch.autograd.grad(y_op, leaves, upstream)
    assert torch.equal(y_fast, y_op)
    for index, (a, b) in enumerate(zip(op, fast, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"gradient {index}"


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_eager_backward_runs_no_custom_op_no_absent_bias_sum_and_allocates_as_native(fused):
    # the regression: the eager op went through torch.library's dispatch, summed three absent biases and allocated
    # six (N, I) tensors in backward (act, the product, dh, dh * a, dh * up, act'), native autograd four
    rows, hidden, width = 5, 6, 10
    weights = _weights(hidden, width, fused, False, torch.float32)
    x = torch.randn(rows, hidden, requires_grad=True)
    with Dispatched() as forward:
        y = gated_mlp(x, *weights, "silu")
    upstream = torch.randn(rows, hidden)
    with Dispatched() as backward:
        y.backward(upstream)
    names = [name for name, _ in forward.calls + backward.calls]
    assert not [name for name in names if name.startswith("fewbit.")], names
    assert not [name for name, _ in backward.calls if name.startswith("aten.sum")], names
    fresh = [name for name, sizes in backward.calls if rows * width in sizes and not name.split(".")[1].endswith("_")]
    assert len(fresh) <= 4, fresh
