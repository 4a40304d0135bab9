"""The compressed gated-MLP backward's numba passes (fewbit_design.runtime.gated._numba_gated): two passes over the
(rows, I) tensors from the codes of gate and up, where the torch path (the reference, still run for float16, float64,
``gelu`` and off the CPU) takes seven, with gradients equal to the torch path's within the dtype's rounding, for
every activation the kernels have, float32 and bfloat16, odd sizes, 3 and 8 bits, both layouts, and NaN where a
group of the codes is non-finite."""

import pytest
import torch
from dispatched import Dispatched
from tolerances import assert_gradient_close, gradient_tolerance

from fewbit_design.runtime.gated import compressed
from fewbit_design.runtime.linear.quant import quantize_groups

WHAT = ("input", "gate weight", "gate bias", "up weight", "up bias", "down weight", "down bias")


def _case(rows, hidden, width, fused, dtype, bits, seed=0, nan_at=None):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    w_gate = (torch.randn(2 * width if fused else width, hidden, generator=generator) * 0.4).to(dtype)
    w_up = None if fused else (torch.randn(width, hidden, generator=generator) * 0.4).to(dtype)
    w_down = (torch.randn(hidden, width, generator=generator) * 0.4).to(dtype)
    gate = x @ w_gate.t()
    gate, up = gate.chunk(2, dim=-1) if fused else (gate, x @ w_up.t())
    gate, up = gate.contiguous(), up.contiguous()
    if nan_at is not None:
        gate[nan_at] = float("inf")
    gate_codes = quantize_groups(gate, bits, 64, stochastic=True, seed=seed + 1)
    up_codes = quantize_groups(up, bits, 64, stochastic=True, seed=seed + 2)
    x_codes = quantize_groups(x, bits, 64, stochastic=True, seed=seed + 3)
    grad = torch.randn(rows, hidden, generator=generator).to(dtype)
    return grad, x_codes, gate_codes, up_codes, w_gate, w_up, w_down


def _backward(case, activation, bits, monkeypatch=None):
    grad, x_codes, gate_codes, up_codes, w_gate, w_up, w_down = case
    if monkeypatch is not None:  # the torch path
        monkeypatch.setattr(compressed, "_fused_kernels", lambda *_: None)
    try:
        return compressed._backward_impl(
            grad, *x_codes, *gate_codes, *up_codes, w_gate, w_up, w_down, activation, bits, 64, True, True, True
        )
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("rows,hidden,width,bits", [(37, 24, 70, 8), (13, 16, 131, 3), (1, 8, 5, 4)])
def test_kernels_equal_the_torch_path_within_rounding(dtype, activation, fused, rows, hidden, width, bits, monkeypatch):
    case = _case(rows, hidden, width, fused, dtype, bits)
    assert compressed._fused_kernels(case[0], activation, bits) is not None
    got = _backward(case, activation, bits)
    expected = _backward(case, activation, bits, monkeypatch)
    # the torch path rounds gate~, up~, act(gate~) and each product to the dtype (eps / 2 each), the kernels compute
    # in float32 and round once; their exp is within 2 float32 ulp of torch's. So two eps of the dtype beyond the
    # final rounding, and float32 reductions of length rows (weight gradients) or width (input gradient)
    tolerance = gradient_tolerance(dtype, max(rows, 2 * width), reconstruction=2)
    for what, value, reference in zip(WHAT, got, expected, strict=True):
        if reference.numel() == 0:
            assert value.numel() == 0, what
            continue
        assert_gradient_close(reference, value, tolerance, f"{activation} {dtype} {what} gradient")


def test_the_torch_path_runs_where_the_kernels_do_not_apply():
    grad = torch.randn(4, 8)
    assert compressed._fused_kernels(grad, "gelu", 8) is None
    assert compressed._fused_kernels(grad.double(), "silu", 8) is None
    assert compressed._fused_kernels(grad.half(), "silu", 8) is None
    assert compressed._fused_kernels(grad[:0], "silu", 8) is None


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu"])
def test_a_non_finite_group_gives_nan_gradients_as_the_torch_path(activation, monkeypatch):
    case = _case(6, 16, 70, False, torch.float32, 8, nan_at=(2, 65))
    got = _backward(case, activation, 8)
    expected = _backward(case, activation, 8, monkeypatch)
    for what, value, reference in zip(WHAT, got, expected, strict=True):
        assert torch.equal(value.isnan(), reference.isnan()), what
    assert got[0][2].isnan().all() and torch.isfinite(got[0][[0, 1, 3, 4, 5]]).all()


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_eager_backward_makes_no_torch_pass_over_the_intermediates(fused):
    """Regression: the compressed backward decoded gate and up, then ran act, the product, two products with dh and
    act's backward as torch ops (seven passes over the (rows, I) tensors, plus a cat in the fused layout); the numba
    passes leave only the matrix products there (and the allocations of h~ and of [d_gate, d_up])."""
    rows, hidden, width = 16, 8, 24
    case = _case(rows, hidden, width, fused, torch.float32, 8)
    with Dispatched() as backward:
        _backward(case, "silu", 8)
    passes = [
        name
        for name, sizes in backward.calls
        if any(size >= rows * width for size in sizes) and name not in ("aten.mm.default", "aten.empty.memory_format")
    ]
    assert not passes, passes
