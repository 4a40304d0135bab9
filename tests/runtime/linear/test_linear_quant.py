"""The group quantizer of runtime.linear: error bounds from the group's own range, exact grid ends, determinism by
seed, storage size, non-finite groups, custom ops (opcheck) and bad options."""

from __future__ import annotations

import math

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime.linear import quant


def group_steps(rows: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Per element: (max - min) / (2**bits - 1) over its group, computed group by group (independent of quant)."""
    steps = torch.empty_like(rows, dtype=torch.float64)
    for start in range(0, rows.shape[1], group_size):
        block = rows[:, start : start + group_size].double()
        spread = block.amax(dim=1, keepdim=True) - block.amin(dim=1, keepdim=True)
        steps[:, start : start + group_size] = spread / (2**bits - 1)
    return steps


def roundtrip(x, bits, group_size, rounding, seed=0):
    packed, scales = quant.quantize_groups(x, bits, group_size, stochastic=rounding == "stochastic", seed=seed)
    return quant.dequantize_groups(packed, scales, x.shape[-1], bits, group_size, torch.float32), packed, scales


@pytest.mark.parametrize("features", [1, 7, 64, 100, 131])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_value_is_within_one_step_of_its_group_grid(features, bits, rounding):
    torch.manual_seed(features * 10 + bits)
    x = torch.randn(5, features) * torch.linspace(0.1, 5.0, features)  # groups with very different ranges
    decoded, _, _ = roundtrip(x, bits, 64, rounding)
    steps = group_steps(x, bits, 64)
    error = (decoded.double() - x.double()).abs()
    # nearest: half a step; stochastic: less than one step; plus float32 rounding of low + code * step (a few ulps
    # of the group's largest magnitude)
    limit = steps * (0.5 if rounding == "nearest" else 1.0) + 4 * 2**-24 * x.abs().amax().double()
    assert bool((error <= limit).all()), float((error - limit).max())


def test_group_extremes_and_constant_groups_decode_exactly():
    x = torch.tensor([[-1.5, 0.25, 3.0, 0.0, 7.0, 7.0, 7.0, 7.0]])
    for rounding in quant.ROUNDINGS:
        decoded, _, _ = roundtrip(x, 2, 4, rounding)
        assert decoded[0, 0] == -1.5 and decoded[0, 2] == 3.0  # the grid ends are the group's min and max
        assert torch.equal(decoded[0, 4:], x[0, 4:])  # step 0: no division by zero, the value itself


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    # values a third of a step above a grid point (the group's min and max sit on the grid): nearest rounding
    # always rounds them down, stochastic rounding lands on the upper point a third of the time
    bits, steps = 2, 3
    x = torch.tensor([[0.0, float(steps)] + [1 + 1 / 3] * 62])
    nearest, _, _ = roundtrip(x, bits, 64, "nearest")
    assert torch.allclose(nearest[0, 2:], torch.ones(62))  # bias -1/3 per element
    trials = 400
    mean = sum(roundtrip(x, bits, 64, "stochastic", seed=seed)[0] for seed in range(trials)) / trials
    # per element the decoded value is 1 or 2 with p = 1/3: std sqrt(2/9); over 400 seeds the mean's std is 0.024
    # per element, and over the 62 elements' average 0.003
    assert abs(float(mean[0, 2:].mean()) - (1 + 1 / 3)) < 0.015
    assert abs(float(nearest[0, 2:].mean()) - (1 + 1 / 3)) > 0.3


def test_codes_are_a_function_of_the_seed():
    x = torch.randn(4, 96)
    first = quant.quantize_groups(x, 4, 64, stochastic=True, seed=7)
    again = quant.quantize_groups(x, 4, 64, stochastic=True, seed=7)
    other = quant.quantize_groups(x, 4, 64, stochastic=True, seed=8)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("shape", [(3, 100), (2, 5, 64), (0, 64), (6, 1)])
@pytest.mark.parametrize("bits", [2, 3, 8])
def test_storage_is_packed_codes_plus_eight_bytes_per_group(shape, bits):
    x = torch.randn(shape)
    _, packed, scales = roundtrip(x, bits, 64, "stochastic")
    numel, features = math.prod(shape), shape[-1]
    expected = math.ceil(numel / 8) * bits + 8 * (numel // features) * math.ceil(features / 64)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.float32
    assert packed.numel() + 4 * scales.numel() == expected == quant.saved_nbytes(shape, bits, 64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_makes_its_group_decode_to_nan(bad):
    x = torch.randn(2, 128)
    x[1, 70] = bad
    decoded, _, _ = roundtrip(x, 8, 64, "stochastic")
    assert bool(decoded[1, 64:].isnan().all())
    assert bool(decoded[0].isfinite().all()) and bool(decoded[1, :64].isfinite().all())


def test_custom_ops_pass_opcheck():
    x = torch.randn(3, 100)
    packed, scales = torch.ops.fewbit.group_quantize(x, 4, 64, True, torch.tensor(5))
    torch.library.opcheck(quant.group_quantize, (x, 4, 64, True, torch.tensor(5)))
    torch.library.opcheck(quant.group_dequantize, (packed, scales, 100, 4, 64, torch.bfloat16))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ((1, 64, "stochastic"), "bits"),
        ((9, 64, "stochastic"), "bits"),
        ((8, 0, "stochastic"), "group_size"),
        ((8, 64, "floor"), "rounding"),
    ],
)
def test_bad_options_raise_one_line(options, message):
    with pytest.raises(FewBitError, match=message):
        quant.check_options(*options)
