"""The memory-sharing norm's compressed mode (``bits``): the forward is exact mode's, bitwise; it keeps K-bit codes
of its output instead of the output; compressed linear layers that read the output keep those same codes (one set
for the norm and its q, k, v siblings); gradients approach exact mode's as K grows."""

import pytest
import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime.linear import CompressedLinear, saved_nbytes
from fewbit_design.runtime.norms.nn import MemorySharingNorm

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
