"""The memory-sharing norm's compressed mode (``bits``): the forward is exact mode's, bitwise; it keeps K-bit codes
of its output instead of the output; compressed linear layers that read the output keep those same codes (one set
for the norm and its q, k, v siblings); gradients approach exact mode's as K grows."""

import pytest
import torch
from dispatched import Dispatched

from fewbit_design.runtime import memory
from fewbit_design.runtime.linear import CompressedLinear, saved_nbytes
from fewbit_design.runtime.linear.quant import dequantize_groups
from fewbit_design.runtime.norms import ops
from fewbit_design.runtime.norms.nn import MemorySharingNorm
from fewbit_design.runtime.norms.ops import memory_sharing_norm

WIDTH, ROWS = 64, 24


def norm(kind, bits):
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.rand(WIDTH, generator=generator) + 0.5)
    bias = torch.nn.Parameter(torch.randn(WIDTH, generator=generator)) if kind == "layer_norm" else None
    return MemorySharingNorm((WIDTH,), kind=kind, eps=1e-5, weight=weight, bias=bias, bits=bits)


def inputs():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, WIDTH, generator=generator).requires_grad_()
    return x, torch.randn(ROWS, WIDTH, generator=generator)


def gradients(module, x, grad):
    torch.manual_seed(0)
    y = module(x)
    return y, torch.autograd.grad(y, [x] + list(module.parameters()), grad)


@pytest.mark.parametrize("kind", ["layer_norm", "llama"])
def test_forward_is_exact_and_gradient_error_falls_with_bits(kind):
    x, grad = inputs()
    y, exact = gradients(norm(kind, None), x, grad)
    errors = {}
    for bits in (2, 4, 8):
        got_y, got = gradients(norm(kind, bits), x, grad)
        assert torch.equal(got_y, y)
        errors[bits] = max(float((a - b).norm() / b.norm()) for a, b in zip(got, exact, strict=True))
    assert errors[8] < errors[4] < errors[2] and errors[8] < 0.02, errors


def test_keeps_codes_not_its_output():
    x, _ = inputs()
    module = norm("llama", 8)
    with memory.saved_bytes() as saved:
        y = module(x)
    assert not saved.contains(y)
    assert saved.total == saved_nbytes(y.shape, 8, 64) + 4 * ROWS  # the codes and one float32 rstd per row


def test_linear_layers_reading_the_output_keep_the_norms_codes():
    """q, k and v after a compressed norm: one set of codes in all (before the norm shared its codes, the linear
    layers kept a set of their own beside the norm's)."""
    x, _ = inputs()
    module = norm("llama", 8)
    projections = [CompressedLinear(WIDTH, WIDTH, bias=False, bits=8) for _ in range(3)]
    with memory.saved_bytes() as saved:
        y = module(x)
        outputs = [p(y) for p in projections]
    assert saved.total == saved_nbytes(y.shape, 8, 64) + 4 * ROWS
    sum(o.square().sum() for o in outputs).backward()
    assert all(p.weight.grad is not None for p in projections) and x.grad is not None


def test_compiled_equals_eager():
    x, grad = inputs()
    module = norm("layer_norm", 8)
    y, eager = gradients(module, x, grad)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    got_y = compiled(x)
    torch.manual_seed(0)
    got_y = compiled(x)
    got = torch.autograd.grad(got_y, [x] + list(module.parameters()), grad)
    torch._dynamo.reset()
    assert torch.equal(got_y, y)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _decoded_and_reference(kind, bits, x, weight, bias, grad):
    """The codes the eager op keeps (same seed), the output decoded from them, and the reference backward on it."""
    torch.manual_seed(0)
    seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    y, rstd, channels, kept, packed, scales = ops._norm_forward_compressed_impl(
        x.detach(), weight, bias, kind, 1, 1e-5, ops.DEFAULT_THRESHOLD, bits, 64, seed, -1
    )
    decoded = dequantize_groups(packed, scales, x.shape[-1], bits, 64, y.dtype).reshape(y.shape)
    reference = ops._backward_reference(grad, decoded, rstd, channels, kept, weight, bias, kind, x.dtype)
    fast = ops._backward_fast(grad, decoded, rstd, channels, kept, weight, bias, kind, x.dtype, (True, True, True))
    return reference, fast


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["layer_norm", "llama", "rms_norm", "gemma"])
@pytest.mark.parametrize("shape", [(3, 7, 72), (5, 13), (2, 1)], ids=["3x7x72", "5x13", "width1"])
def test_eager_backward_is_the_fast_path_on_the_decoded_output(dtype, kind, shape):
    """Regression: the eager compressed norm's backward ran the reference (custom op ``fewbit::norm_backward``,
    about twelve passes over the rows) on the decoded output where the exact norm runs the fused fast path
    (:func:`ops._backward_fast`). Now it is the fast path on the decoded output, bitwise; the fast path against the
    reference on decoded outputs is held in tests/runtime/norms/test_norms_fast_path.py."""
    dtype = DTYPES[dtype]
    width = shape[-1]
    generator = torch.Generator().manual_seed(4)
    weight = torch.nn.Parameter((torch.rand(width, generator=generator) + 0.5).to(dtype))
    if width > 2:
        with torch.no_grad():
            weight[1] = 0.0  # a kept channel
    bias = torch.nn.Parameter(torch.randn(width, generator=generator).to(dtype)) if kind == "layer_norm" else None
    x = (torch.randn(shape, generator=generator) * 2).to(dtype).requires_grad_()
    grad = torch.randn(shape, generator=generator).to(dtype)
    torch.manual_seed(0)
    y = memory_sharing_norm(x, weight, bias, kind=kind, normalized_ndim=1, eps=1e-5, bits=4)
    got = torch.autograd.grad(y, [x, weight] + ([bias] if bias is not None else []), grad)
    _, fast = _decoded_and_reference(kind, 4, x, weight, bias, grad)
    for what, expected, value in zip(("input", "weight", "bias"), fast, got, strict=False):
        assert torch.equal(value, expected), what


def test_eager_backward_runs_no_custom_op_and_four_passes():
    rows, width = 6, 64
    module = norm("layer_norm", 8)
    x = torch.randn(rows, width, requires_grad=True)
    y, upstream = module(x), torch.randn(rows, width)
    with Dispatched() as backward:
        y.backward(upstream)
    names = [name for name, _ in backward.calls]
    assert not [name for name in names if name.startswith("fewbit.")], names
    # the decode's output (a numba pass: only its allocation shows), then four passes as the exact norm's with a bias
    passes = [name for name, sizes in backward.calls if rows * width in sizes and name != "aten.empty.memory_format"]
    assert len(passes) <= 4, passes
    # nothing allocated for the gradients of the codes, statistics and kept channels (non-differentiable outputs)
    zeros = [sizes for name, sizes in backward.calls if name.startswith("aten.zeros") and max(sizes) > rows]
    assert not zeros, zeros


@pytest.mark.parametrize("kind", ["layer_norm", "llama"])
def test_non_finite_rows_give_nan_gradients_as_the_reference(kind):
    x, grad = inputs()
    with torch.no_grad():
        x[3, 5] = float("inf")
        x[7, 0] = float("nan")
    module = norm(kind, 8)
    torch.manual_seed(0)
    got = torch.autograd.grad(module(x), [x] + list(module.parameters()), grad)
    reference, _ = _decoded_and_reference(kind, 8, x, module.weight, module.bias, grad)
    for value, expected in zip(got, reference, strict=False):
        assert torch.equal(value.isnan(), expected.isnan())
    assert got[0][[3, 7]].isnan().all() and torch.isfinite(got[0][[0, 1, 2, 4, 5, 6]]).all()
    assert got[1].isnan().any()  # the weight gradient sums over the NaN rows
