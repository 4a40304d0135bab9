"""The dropout op on a CUDA GPU (skipped without one; ``scripts/gpu_suite.sh`` runs it): mode "bits" draws with
torch's fused kernel, so the forward, the gradients and the CUDA random stream are native's, and keeps an eighth of
native's bool mask; mode "seed" keeps the 16-byte Philox state and applies in backward the mask forward drew."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fewbit_design.runtime import memory
from fewbit_design.runtime.dropout import ops

pytestmark = pytest.mark.cuda

P = 0.3


def _input(dtype, transposed):
    x = torch.rand(37, 129, device="cuda") + 0.5
    x = x.t() if transposed else x
    return x.to(dtype).detach().requires_grad_()


def _step(function, x):
    """(y, x's gradient, the next CUDA random numbers, bytes saved) of one step from the same CUDA seed."""
    torch.cuda.manual_seed(7)
    with memory.saved_bytes() as saved:
        y = function(x)
    after = torch.rand(4, device="cuda")
    (grad,) = torch.autograd.grad(
        y, x, torch.linspace(-1.0, 2.0, y.numel(), device="cuda").reshape(y.shape).to(y.dtype)
    )
    return y.detach(), grad, after, saved.total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_bits_mode_is_native_and_keeps_an_eighth_of_the_bool_mask(dtype, transposed):
    x = _input(dtype, transposed)
    ours, native = _step(lambda t: ops.dropout(t, P), x), _step(lambda t: F.dropout(t, P), x)
    assert all(torch.equal(a, b) for a, b in zip(ours[:3], native[:3], strict=True))
    assert native[3] == x.numel() and ours[3] == math.ceil(x.numel() / 8)


@pytest.mark.parametrize("transposed", [False, True])
def test_seed_mode_applies_the_forward_mask_and_keeps_the_philox_state(transposed):
    x = _input(torch.float32, transposed)
    torch.cuda.manual_seed(3)
    with memory.saved_bytes() as saved:
        y = ops.dropout(x, 0.5, mode="seed")
    torch.rand(1000, device="cuda")  # the generator moves on before backward
    (noise,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(noise != 0, y.detach() != 0) and 0 < int((y != 0).sum()) < y.numel()
    assert saved.total == ops.state_nbytes(x.device) == 16
