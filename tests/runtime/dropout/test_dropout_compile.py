"""The dropout ops under tracers: ``torch.library.opcheck`` on every op, and ``torch.compile`` (aot_eager and
inductor) draws inside the op as eager does, so a compiled step gives eager's (and native's) output, gradients and
random stream for the same seed, and keeps only the packed mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fewbit_design.runtime import memory
from fewbit_design.runtime.dropout import ops
from fewbit_design.runtime.dropout.nn import CompactDropout

P = 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x = (torch.rand(5, 19) + 0.5).to(dtype).requires_grad_()
    grad = torch.randn(5, 19).to(dtype)
    packed = ops.pack_mask(torch.rand(5, 19) < 0.7)
    state = torch.get_rng_state()
    for operator, arguments in [
        (torch.ops.fewbit.dropout_bits.default, (x, P, False)),
        (torch.ops.fewbit.dropout_bits.default, (x, P, True)),
        (torch.ops.fewbit.dropout_bits_backward.default, (grad.requires_grad_(), packed, P, False)),
        (torch.ops.fewbit.dropout_seed.default, (x, P)),
        (torch.ops.fewbit.dropout_seed_backward.default, (grad, state, P, [19, 1])),
    ]:
        torch.library.opcheck(operator, arguments)


def _step(function, x: torch.Tensor, seed: int = 5):
    """(y, x's gradient, the next random numbers, bytes saved) of one step from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    with memory.saved_bytes() as saved:
        y = function(x)
    after = torch.rand(3)
    (grad,) = torch.autograd.grad(y, x, torch.linspace(-1.0, 2.0, y.numel()).reshape(y.shape))
    return y.detach(), grad, after, saved.total


@pytest.mark.parametrize("mode", ops.MODES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_dropout_is_eager_and_native(mode, backend):
    x = (torch.rand(6, 45, generator=torch.Generator().manual_seed(0)) + 0.5).requires_grad_()
    layer = CompactDropout(P, mode=mode)
    torch._dynamo.reset()
    compiled = _step(torch.compile(layer, backend=backend, fullgraph=True), x)
    eager = _step(layer, x)
    native = _step(lambda t: F.dropout(t, P), x)
    for got, want in ((compiled, eager), (eager, native)):
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    kept = math.ceil(x.numel() / 8) if mode == "bits" else ops.state_nbytes(x.device)
    assert compiled[3] == eager[3] == kept


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_block_draws_the_eager_masks(backend):
    """A block around the dropout: the compiled step's output and gradients equal eager's within float32 rounding
    (inductor fuses the linear's epilogue and the GELU in another order: a few ulp; a different mask would differ by
    whole elements, 1 / (1 - p) of their size)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.Linear(16, 32), CompactDropout(P), torch.nn.GELU(), torch.nn.Linear(32, 16), CompactDropout(P)
    )
    x = torch.randn(4, 7, 16, requires_grad=True)

    def run(function):
        torch.manual_seed(8)
        y = function(x)
        y.pow(2).sum().backward()
        grads = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
        x.grad = None
        block.zero_grad(set_to_none=True)
        return [y.detach(), *grads]

    torch._dynamo.reset()
    compiled, eager = run(torch.compile(block, backend=backend)), run(block)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
