"""The eager fast path of the exact memory-sharing norm (runtime.norms.ops._ExactNorm): no torch.library dispatch,
a backward in three passes over the rows, four with a bias (reconstruct xhat, torch's fused LayerNorm backward,
scale by rstd), and
gradients equal to the reference backward (the custom op's, which torch.compile runs) within tests/tolerances.py,
for every kind, float32 / bfloat16 / float64, odd shapes, kept (zero and tiny) weights, no affine and no bias."""

from __future__ import annotations

import pytest
import torch
from dispatched import Dispatched
from tolerances import assert_gradient_close, gradient_tolerance

from fewbit_design.runtime.linear.quant import dequantize_groups, quantize_groups
from fewbit_design.runtime.norms import MemorySharingNorm, ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _case(kind: str, dtype: torch.dtype, width: int, affine: str, zeros: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = bias = None
    if affine != "none":
        weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
        if kind == "gemma":
            weight = weight - 1.0  # Gemma scales by 1 + weight
        if zeros:  # kept channels: an exact zero, a tiny one, one small next to its bias
            weight[0] = -1.0 if kind == "gemma" else 0.0
            if width > 2:
                weight[2] = (-1.0 if kind == "gemma" else 0.0) + 1e-30
        if affine == "bias":
            bias = (torch.randn(width, generator=generator) * 0.3).to(dtype)
            if zeros and width > 3:
                bias[3], weight[3] = 2.0, 0.1
    return weight, bias


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "kind,affine",
    [("layer_norm", "bias"), ("layer_norm", "weight"), ("layer_norm", "none"), ("rms_norm", "weight"),
     ("rms_norm", "none"), ("llama", "weight"), ("t5", "weight"), ("gemma", "weight")],
)  # fmt: skip
@pytest.mark.parametrize("shape", [(1, 13), (7, 3, 48), (2, 5, 1)], ids=["1x13", "7x3x48", "width1"])
@pytest.mark.parametrize("zeros", [False, True], ids=["invertible", "kept"])
@pytest.mark.parametrize("bits", [None, 3, 8], ids=["exact", "codes3", "codes8"])
def test_fast_backward_equals_reference(dtype, kind, affine, shape, zeros, bits):
    # bits: the compressed mode's backward, which runs the fast path on the output decoded from its codes
    dtype = DTYPES[dtype]
    width = shape[-1]
    weight, bias = _case(kind, dtype, width, affine, zeros)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2 + 0.3).to(dtype)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    y, rstd, channels, kept = ops._forward_exact(x, weight, bias, kind, 1, 1e-5, ops.DEFAULT_THRESHOLD, -1)
    assert torch.equal(y, ops.forward_reference(x, weight, bias, kind, 1, 1e-5)[0])
    if bits is not None:
        packed, scales = quantize_groups(y, bits, 4, stochastic=True, seed=3)
        y = dequantize_groups(packed, scales, width, bits, 4, dtype).reshape(shape)
    if zeros and weight is not None:
        assert channels.numel() >= 1  # the zero weight at least is kept
    reference = ops._backward_reference(grad, y, rstd, channels, kept, weight, bias, kind, dtype)
    fast = ops._backward_fast(grad, y, rstd, channels, kept, weight, bias, kind, dtype, (True, True, True))
    # reconstruction from the rounded y (tests/tolerances.py): eps/2 of |xhat| + |b / w| on the inverted channels,
    # one rounding more for the reciprocal
    xhat = (
        (
            (x.double() - (x.double().mean(-1, keepdim=True) if kind == "layer_norm" else 0))
            * rstd.double().reshape(*shape[:-1], 1)
        )
        .abs()
        .max()
    )
    ratio = 0.0
    if bias is not None:
        inverted = torch.ones(width, dtype=torch.bool)
        inverted[channels] = False
        ratio = float((bias.double() / weight.double())[inverted].abs().max()) if inverted.any() else 0.0
    reconstruction = 0.5 * (float(xhat) + ratio) + 2
    tolerance = gradient_tolerance(dtype, max(x.numel() // width, width), reconstruction=reconstruction)
    # the input gradient rstd * (dxhat - xhat * mean(dxhat * xhat) [- mean(dxhat)]) cancels terms of size rstd * |dxhat|
    # (completely for a width of 1: both backwards' roundings are relative to those terms, not to the result)
    effective = 1.0 if weight is None else ops._effective_weight(weight, kind, torch.float64).abs().max()
    terms = float(rstd.double().max() * grad.double().abs().max() * effective)
    for what, expected, got in zip(("input", "weight", "bias"), reference, fast, strict=True):
        if got is None or expected.numel() == 0:
            assert got is None or got.numel() == 0, what
            continue
        scale = float(expected.double().abs().max())
        factor = max(1.0, terms / scale) if what == "input" and scale else 1.0
        assert_gradient_close(expected, got, tolerance * factor, f"{kind} {affine} {dtype} {shape} {what} gradient")


def test_fast_backward_skips_gradients_not_needed():
    x, weight, bias = torch.randn(4, 8), torch.rand(8) + 0.5, torch.randn(8)
    y, rstd, channels, kept = ops._forward_exact(x, weight, bias, "layer_norm", 1, 1e-5, 0.25, -1)
    grads = ops._backward_fast(torch.randn(4, 8), y, rstd, channels, kept, weight, bias, "layer_norm", x.dtype,
                               (True, False, False))  # fmt: skip
    assert grads[0] is not None and grads[1] is None and grads[2] is None


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "llama"])
def test_eager_norm_runs_no_custom_op_and_three_or_four_passes_in_backward(kind):
    # the regression: eager norms went through torch.library's dispatch (fewbit::norm_forward / norm_backward) and a
    # backward of about twelve passes over the rows; native LayerNorm's backward is one fused kernel
    rows, width = 6, 16
    bias = torch.nn.Parameter(torch.randn(width)) if kind == "layer_norm" else None
    norm = MemorySharingNorm((width,), kind=kind, eps=1e-5, weight=torch.nn.Parameter(torch.rand(width) + 0.5),
                             bias=bias)  # fmt: skip
    x = torch.randn(rows, width, requires_grad=True)
    with Dispatched() as forward:
        y = norm(x)
    upstream = torch.randn(rows, width)
    with Dispatched() as backward:
        y.backward(upstream)
    names = [name for name, _ in forward.calls + backward.calls]
    assert not [name for name in names if name.startswith("fewbit.")], names
    passes = [name for name, sizes in backward.calls if rows * width in sizes]
    assert len(passes) <= (4 if bias is not None else 3), passes


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_compiled_backward_op_is_the_fused_fast_path(kind, monkeypatch):
    # the regression: fewbit::norm_backward (what a compiled norm's backward runs) took the ~12-pass reference while
    # eager took _backward_fast; now both are the fused kernel, with the same gradients bitwise
    rows, width = 6, 16
    x, weight = torch.randn(rows, width), torch.rand(width) + 0.5
    bias = torch.randn(width) if kind == "layer_norm" else None
    y, rstd, channels, kept = ops._forward_exact(x, weight, bias, kind, 1, 1e-5, 0.25, -1)
    grad = torch.randn(rows, width)
    fast, calls = ops._backward_fast, []
    monkeypatch.setattr(ops, "_backward_fast", lambda *args: calls.append(args) or fast(*args))
    got = torch.ops.fewbit.norm_backward(grad, y, rstd, channels, kept, weight, bias, kind, x.dtype)
    assert len(calls) == 1
    expected = fast(grad, y, rstd, channels, kept, weight, bias, kind, x.dtype, (True, True, True))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2]) if bias is not None else got[2].numel() == 0


def test_eager_and_compiled_norm_agree_and_keep_the_zero_channel():
    torch._dynamo.reset()
    weight = torch.nn.Parameter(torch.rand(16) + 0.5)
    with torch.no_grad():
        weight[5] = 0.0
    bias = torch.nn.Parameter(torch.randn(16))
    norm = MemorySharingNorm((16,), kind="layer_norm", eps=1e-5, weight=weight, bias=bias)
    x = torch.randn(3, 7, 16)
    results = []
    for module in (norm, torch.compile(norm, backend="aot_eager", fullgraph=True)):
        leaf = x.clone().requires_grad_()
        module(leaf).square().sum().backward()
        results.append([leaf.grad, norm.weight.grad.clone(), norm.bias.grad.clone()])
        norm.zero_grad(set_to_none=True)
    tolerance = gradient_tolerance(torch.float32, 16, reconstruction=8)
    for what, eager, compiled in zip(("input", "weight", "bias"), *results, strict=True):
        assert torch.isfinite(eager).all(), what
        assert_gradient_close(compiled, eager, tolerance, f"{what} gradient, eager against compiled")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_layer_norm_forward_is_torch_kernel_alone_in_every_dtype(dtype, affine):
    # the regression: a bfloat16 LayerNorm recomputed float32 statistics in forward (a float32 copy of x and a
    # Tensor.var, ~10x the norm itself on CPU); the forward is now torch's own fused kernel and nothing else full-size
    rows, width = 6, 16
    dtype = DTYPES[dtype]
    weight = (torch.rand(width) + 0.5).to(dtype) if affine else None
    bias = torch.randn(width).to(dtype) if affine else None
    x = torch.randn(rows, width).to(dtype)
    with Dispatched() as forward:
        y, rstd = ops.forward_reference(x, weight, bias, "layer_norm", 1, 1e-5)
    passes = [name for name, sizes in forward.calls if rows * width in sizes]
    assert passes == ["aten.native_layer_norm.default"], passes
    assert rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and rstd.shape == (rows,)
    expected = 1 / (x.double().var(-1, unbiased=False) + 1e-5).sqrt()  # 16-bit: torch's rstd, rounded to 16 bits
    assert torch.allclose(rstd.double(), expected, rtol=4 * torch.finfo(dtype).eps, atol=0)
