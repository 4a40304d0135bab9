"""runtime._eager: in eager, the compressed ops (linear, norm, gated MLP, attention core) run as autograd.Function
twins of their custom ops (no custom-op dispatch per call); the twin gives bitwise the op's output and gradients
and saves the same bytes, in every dtype and at odd sizes; tracers (opcheck, torch.compile) still see the op."""

from __future__ import annotations

import pytest
import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime._eager import tracing
from fewbit_design.runtime.attention import ops as attention_ops
from fewbit_design.runtime.gated import compressed as gated_ops
from fewbit_design.runtime.linear import ops as linear_ops
from fewbit_design.runtime.linear import quant
from fewbit_design.runtime.norms import ops as norm_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _run(function, arguments, differentiable):
    """(outputs, gradients of the differentiable arguments, saved bytes) of one forward and backward."""
    leaves = [a.detach().clone().requires_grad_() if i in differentiable else a for i, a in enumerate(arguments)]
    with memory.saved_bytes() as saved:
        outputs = function(*leaves)
    first = outputs[0] if isinstance(outputs, tuple | list) else outputs
    grad = torch.randn(first.shape, generator=torch.Generator().manual_seed(5)).to(first.dtype)
    first.backward(grad)
    return first.detach(), [leaves[i].grad for i in sorted(differentiable)], saved.total


def _assert_same(twin, op, arguments, differentiable):
    got, expected = _run(twin, arguments, differentiable), _run(op, arguments, differentiable)
    assert torch.equal(got[0], expected[0])
    for a, b in zip(got[1], expected[1], strict=True):
        assert torch.equal(a, b)
    assert got[2] == expected[2]


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_compressed_linear_twin_is_the_op(dtype, transposed):
    x = _randn(3, 7, 67, dtype=dtype)
    weight = _randn(*((67, 13) if transposed else (13, 67)), dtype=dtype, seed=1)
    bias = _randn(13, dtype=dtype, seed=2)
    packed, scales = quant.quantize_groups(x, 8, 64, stochastic=True, seed=3)
    arguments = (x, weight, bias, packed, scales, 8, 64, transposed)
    _assert_same(linear_ops._CompressedLinearEager.apply, torch.ops.fewbit.compressed_linear, arguments, {0, 1, 2})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "layer_norm"])
def test_compressed_norm_twin_is_the_op(dtype, kind):
    x = _randn(5, 3, 70, dtype=dtype)
    weight, bias = _randn(70, dtype=dtype, seed=1), (_randn(70, dtype=dtype, seed=2) if kind == "layer_norm" else None)
    seed = torch.tensor(11)
    arguments = (x, weight, bias, kind, 1, 1e-5, norm_ops.DEFAULT_THRESHOLD, 8, 64, seed, -1)
    differentiable = {0, 1} if bias is None else {0, 1, 2}
    _assert_same(
        norm_ops._NormCompressedEager.apply, torch.ops.fewbit.norm_forward_compressed, arguments, differentiable
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_compressed_gated_twin_is_the_op(dtype, fused):
    rows, hidden, width = 11, 24, 40
    x = _randn(rows, hidden, dtype=dtype)
    w_gate = _randn(2 * width if fused else width, hidden, dtype=dtype, seed=1)
    w_up = None if fused else _randn(width, hidden, dtype=dtype, seed=2)
    w_down, b_down = _randn(hidden, width, dtype=dtype, seed=3), _randn(hidden, dtype=dtype, seed=4)
    x_packed, x_scales = quant.quantize_groups(x, 8, 64, stochastic=True, seed=5)
    arguments = (x, w_gate, None, w_up, None, w_down, b_down, "silu", 8, 64, True, torch.tensor(7), x_packed, x_scales)
    differentiable = {0, 1, 5, 6} if fused else {0, 1, 3, 5, 6}
    _assert_same(
        gated_ops._GatedCompressedEager.apply, torch.ops.fewbit.gated_mlp_compressed, arguments, differentiable
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_compressed_attention_twin_is_the_op(dtype, dropout):
    q = _randn(2, 4, 9, 16, dtype=dtype)
    k, v = _randn(2, 2, 9, 16, dtype=dtype, seed=1), _randn(2, 2, 9, 16, dtype=dtype, seed=2)
    codes = [c for t in (q, k, v) for c in quant.quantize_groups(t, 8, 64, stochastic=False, seed=0)]
    seed = torch.tensor(5) if dropout else None  # the dropout mask's seed
    arguments = (q, k, v, None, codes, None, True, 2, False, 8, 64, seed, dropout)
    _assert_same(
        attention_ops._CompressedAttentionEager.apply, torch.ops.fewbit.compressed_attention, arguments, {0, 1, 2}
    )


def test_eager_entry_points_use_the_twins():
    """The public entry points record the twin's backward node in eager (the custom op's node costs about 75 us
    more per layer in Python dispatch, forward and backward)."""
    x = torch.randn(4, 64, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(8, 64))
    y = linear_ops.compressed_linear(x * 1, weight)
    assert "eager" in type(y.grad_fn).__name__
    norm = norm_ops.memory_sharing_norm(x, weight[0], None, kind="llama", normalized_ndim=1, eps=1e-6, bits=8)
    assert "eager" in type(norm.grad_fn).__name__
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    assert "eager" in type(attention_ops.compressed_attention(q, k, v, is_causal=True).grad_fn).__name__


def test_tracing_sees_fake_and_functional_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not tracing(torch.zeros(1), None, torch.nn.Parameter(torch.zeros(1)))
    with FakeTensorMode():
        fake = torch.zeros(1)
    assert tracing(fake) and tracing(torch.zeros(1), fake)
