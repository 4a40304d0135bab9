"""The fused CPU kernels of the group quantizer against its pure-torch reference: the same bytes and values (bitwise)
in every dtype, layout, bit width and rounding; the counter-based noise; thread independence; and no large
temporaries (the kernels allocate their outputs and nothing else torch sees)."""

from __future__ import annotations

import pytest
import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime.linear import quant

pytest.importorskip("numba")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def sample(rows: int, features: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator) * torch.linspace(0.01, 30.0, features)
    x[0, :] = 2.5  # a constant row: step 0
    if rows > 2 and features > 3:
        x[1, 3] = float("nan")
        x[2, 0] = float("inf")
        x[2, -1] = -float("inf")
    return x.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN (scales hold NaN lows for non-finite groups)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "features", "group_size"), [(9, 100, 64), (16, 131, 64), (5, 7, 4), (3, 24, 7)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rounding", quant.ROUNDINGS)
def test_quantize_and_dequantize_kernels_match_the_reference_bitwise(dtype, rows, features, group_size, bits, rounding):
    x = sample(rows, features, dtype, rows * features + bits)
    stochastic = rounding == "stochastic"
    packed, scales = quant.quantize_groups(x, bits, group_size, stochastic=stochastic, seed=2**40 + 7)
    expected_packed, expected_scales = quant.quantize_groups_reference(
        x, bits, group_size, stochastic=stochastic, seed=2**40 + 7
    )
    assert torch.equal(packed, expected_packed)
    assert same(scales, expected_scales)
    decoded = quant.dequantize_groups(packed, scales, features, bits, group_size, dtype)
    expected = quant.dequantize_groups_reference(packed, scales, features, bits, group_size, dtype)
    assert same(decoded, expected)


def test_non_contiguous_and_nd_inputs_match_the_reference():
    x = sample(48, 40, torch.float32, 3).t()  # (40, 48), non-contiguous
    packed, scales = quant.quantize_groups(x, 4, 16, stochastic=True, seed=5)
    reference = quant.quantize_groups_reference(x.contiguous(), 4, 16, stochastic=True, seed=5)
    assert torch.equal(packed, reference[0]) and same(scales, reference[1])
    y = sample(24, 64, torch.bfloat16, 4).view(2, 3, 4, 64)
    packed, scales = quant.quantize_groups(y, 8, 64, stochastic=False, seed=0)
    reference = quant.quantize_groups_reference(y, 8, 64, stochastic=False, seed=0)
    assert torch.equal(packed, reference[0]) and same(scales, reference[1])


def test_noise_is_the_numba_hash_uniform_and_distinct():
    from fewbit_design.runtime.linear import _numba_quant

    rows, columns, seed = 64, 256, 2**61 + 12345
    noise = quant.noise_reference(rows, columns, seed)
    expected = torch.empty(rows, columns)
    _numba_quant.noise(seed, rows, columns, expected.numpy())
    assert torch.equal(noise, expected)
    assert float(noise.min()) >= 0.0 and float(noise.max()) < 1.0
    # uniform: mean 1/2 and variance 1/12 within 5 standard errors (16384 draws)
    count = noise.numel()
    assert abs(float(noise.mean()) - 0.5) < 5 * (1 / 12 / count) ** 0.5
    assert abs(float(noise.var()) - 1 / 12) < 5 * (1 / 180 / count) ** 0.5
    assert noise.unique().numel() > 0.99 * count  # no repeated pattern across rows
    assert not torch.equal(noise, quant.noise_reference(rows, columns, seed + 1))


def test_stochastic_codes_depend_on_the_seed_only_not_on_threads():
    x = sample(2048, 64, torch.float32, 11)  # enough rows for run() to split them over two threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = quant.quantize_groups(x, 8, 64, stochastic=True, seed=3)
        torch.set_num_threads(2)
        double = quant.quantize_groups(x, 8, 64, stochastic=True, seed=3)
        other = quant.quantize_groups(x, 8, 64, stochastic=True, seed=4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single[0], double[0]) and same(single[1], double[1])
    assert not torch.equal(single[0], other[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stochastic_rounding_is_unbiased_in_every_dtype(dtype):
    # every value 0.3 of a step above a grid point: the mean over seeds of the decoded values is the value itself
    x = torch.tensor([[0.0, 3.0] + [1.25] * 62]).to(dtype)  # 2 bits: grid 0, 1, 2, 3
    draws = torch.stack(
        [
            quant.dequantize_groups(*quant.quantize_groups(x, 2, 64, stochastic=True, seed=seed), 64, 2, 64, dtype)
            for seed in range(200)
        ]
    ).float()
    mean = draws[:, 0, 2:].mean()
    # each draw is 1 or 2 (variance 0.1875): 200 * 62 draws, 5 standard errors
    assert abs(float(mean) - 1.25) < 5 * (0.1875 / draws[:, 0, 2:].numel()) ** 0.5
    assert set(draws[:, 0, 2:].unique().tolist()) == {1.0, 2.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_and_dequantize_allocate_only_their_outputs(dtype, bits):
    # regression: the torch path made a float32 copy, a position tensor, a noise tensor and int64 codes per call
    # (several times the input); the fused kernels allocate the packed codes and scales, resp. the output
    x = sample(64, 256, dtype, 1)
    with memory.peak(x) as quantizing:
        packed, scales = quant.quantize_groups(x, bits, 64, stochastic=True, seed=1)
    assert quantizing.peak_bytes <= packed.nbytes + scales.nbytes
    with memory.peak(packed, scales) as decoding:
        decoded = quant.dequantize_groups(packed, scales, 256, bits, 64, dtype)
    assert decoding.peak_bytes <= decoded.nbytes
