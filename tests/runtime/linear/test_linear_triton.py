"""The Triton kernels of the group quantizer against its pure-torch reference, under Triton's interpreter (CPU): the
same packed bytes, scales and decoded values (bitwise) for every bit width 2-8, float32 / bfloat16 / float16, both
roundings (the stochastic noise is the reference's counter-based hash), odd row and group counts, partial last
groups, strided inputs; the dispatch that sends CUDA tensors to them; on a GPU (marked ``cuda``), the compiled
kernels against the CPU reference."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_linear_kernels import same, sample  # the inputs with non-finite values, and bitwise-or-both-NaN

from fewbit_design.errors import FewBitError
from fewbit_design.runtime.linear import quant, triton_quant

pytest.importorskip("triton")

pytestmark = [
    # the interpreter evaluates 1 / step before the select that drops it for a constant group (step 0)
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = range(2, 9)
SEED = 2**40 + 7  # both 32-bit halves of the seed in use


def check(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int = SEED) -> None:
    """Triton's codes, scales and decoded values of x are the reference's, bitwise."""
    features = x.shape[-1]
    assert triton_quant.kernel_serves(features, group_size)
    packed, scales = triton_quant.quantize_groups_triton(x, bits, group_size, stochastic=stochastic, seed=seed)
    expected_packed, expected_scales = quant.quantize_groups_reference(
        x.contiguous(), bits, group_size, stochastic=stochastic, seed=seed
    )
    assert torch.equal(packed, expected_packed)
    assert same(scales, expected_scales)
    decoded = triton_quant.dequantize_groups_triton(packed, scales, features, bits, group_size, x.dtype)
    expected = quant.dequantize_groups_reference(packed, scales, features, bits, group_size, x.dtype)
    assert same(decoded, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rounding", quant.ROUNDINGS)
def test_triton_group_quantizer_is_the_reference_bitwise(dtype, bits, rounding):
    # 7 rows of 7 groups of 64 (the default), and 65 rows of 72 features: a full group and a partial one of 8
    for rows, features in ((7, 7 * 64), (65, 72)):
        check(sample(rows, features, dtype, rows + bits), bits, quant.GROUP_SIZE, rounding == "stochastic")


@pytest.mark.parametrize(
    ("rows", "features", "group_size"),
    [
        (1, 64, 64),  # one group
        (63, 3 * 16, 16),
        (129, 32, 32),  # 2**7 + 1 rows
        (127, 8, 8),  # 2**7 - 1 rows of one smallest group
        (2, 63 * 8, 8),  # 63 groups a row
        (3, 65 * 8, 8),  # 65 groups a row
        (5, 1016, 128),  # 2**10 - 8 features: 7 full groups and a partial one of 120
        (9, 96, 24),  # a group size that is not a power of 2
        (4, 4096, 4096),  # the largest group the kernels take
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_row_and_group_counts_are_the_reference_bitwise(rows, features, group_size, dtype):
    x = sample(rows, features, dtype, rows * features)
    for bits, rounding in ((3, "stochastic"), (8, "nearest")):
        check(x, bits, group_size, rounding == "stochastic")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_are_the_reference_bitwise(dtype):
    wide = sample(33, 3 * 64, dtype, 5)
    check(wide[:, 64:128], 4, 64, True)  # a slice of the features: rows 192 apart, read in place
    check(wide[::2, :128], 4, 32, False)  # every other row
    check(sample(64, 40, dtype, 6).t(), 5, 8, True)  # transposed (column stride 40): read from a copy
    fused = sample(2 * 9, 3 * 128, dtype, 7).view(2, 9, 3 * 128)  # (batch, sequence, q | k | v)
    check(fused[..., 128:256], 6, 64, True)  # k, 3-D
    check(sample(1, 64, dtype, 8).expand(5, 64), 2, 16, True)  # stride 0 between rows


def test_float64_input_and_output_go_through_float32_as_in_the_reference():
    x = sample(9, 128, torch.float64, 9)
    check(x, 4, 64, True)
    packed, scales = triton_quant.quantize_groups_triton(x, 4, 64, stochastic=True, seed=1)
    decoded = triton_quant.dequantize_groups_triton(packed, scales, 128, 4, 64, torch.float64)
    assert same(decoded, quant.dequantize_groups_reference(packed, scales, 128, 4, 64, torch.float64))


def test_the_noise_is_the_references_for_large_seeds():
    # the 2 values of a group of 8 sit 0.3 and 0.6 of a step above grid points: each seed's stochastic codes
    # follow its noise; seeds whose halves are above 2**31 travel as negative int32 words
    x = torch.tensor([[0.0, 0.3, 0.6, 1.3, 1.6, 2.3, 2.6, 3.0]] * 16)
    for seed in (0, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 12345 * 2**33 + 2**31 + 17):
        check(x, 2, 8, True, seed)


def test_the_dispatch_runs_the_kernels_where_they_serve_the_shape_else_the_reference(monkeypatch):
    # CPU tensors routed as CUDA ones are (the interpreter runs the kernels on the CPU)
    monkeypatch.setattr(quant, "kernels_for", lambda device: "triton")
    launched, run = [], triton_quant._run
    monkeypatch.setattr(
        triton_quant, "_run", lambda launch, device: launched.append(launch.kernel) or run(launch, device)
    )
    x = sample(5, 72, torch.bfloat16, 1)
    packed, scales = quant.quantize_groups(x, 3, 64, stochastic=True, seed=4)
    decoded = quant.dequantize_groups(packed, scales, 72, 3, 64, torch.bfloat16)
    assert launched == ["_group_quantize_forward_kernel", "_group_dequantize_forward_kernel"]
    expected = quant.quantize_groups_reference(x, 3, 64, stochastic=True, seed=4)
    assert torch.equal(packed, expected[0]) and same(scales, expected[1])
    assert same(decoded, quant.dequantize_groups_reference(packed, scales, 72, 3, 64, torch.bfloat16))
    # features or group size not a multiple of 8 (a group's codes would share a packing word with the next
    # group's), a group above MAX_GROUP_SIZE, no values: the reference
    launched.clear()
    for features, group_size in ((7, 64), (36, 12), (2 * 8192, 8192), (0, 64)):
        assert not triton_quant.kernel_serves(features, group_size)
        x = sample(3, features, torch.float32, features)
        packed, scales = quant.quantize_groups(x, 3, group_size, stochastic=True, seed=4)
        expected = quant.quantize_groups_reference(x, 3, group_size, stochastic=True, seed=4)
        assert torch.equal(packed, expected[0]) and same(scales, expected[1])
        decoded = quant.dequantize_groups(packed, scales, features, 3, group_size, x.dtype)
        assert same(decoded, quant.dequantize_groups_reference(packed, scales, features, 3, group_size, x.dtype))
    packed, scales = quant.quantize_groups(torch.zeros(0, 64), 3, 64, stochastic=True, seed=4)
    assert packed.numel() == 0 and scales.shape == (0, 1, 2)
    assert launched == []


def test_shapes_the_kernels_do_not_serve_are_one_clear_error():
    with pytest.raises(FewBitError, match="multiples of 8, the group size at most 4096, got 7 features in groups"):
        triton_quant.quantize_groups_triton(torch.zeros(2, 7), 4, 64, stochastic=False, seed=0)
    with pytest.raises(FewBitError, match="got 64 features in groups of 12"):
        triton_quant.dequantize_groups_triton(torch.zeros(64, dtype=torch.uint8), torch.zeros(2, 6, 2), 64, 4, 12,
                                              torch.float32)  # fmt: skip


def test_codes_of_the_wrong_size_raise_one_clear_error():
    packed, scales = triton_quant.quantize_groups_triton(sample(4, 64, torch.float32, 3), 4, 64, stochastic=False,
                                                         seed=0)  # fmt: skip
    with pytest.raises(FewBitError, match=r"128 bytes and \(4, 1, 2\) scales, got 127 bytes"):
        triton_quant.dequantize_groups_triton(packed[:-1], scales, 64, 4, 64, torch.float32)


def test_cuda_tensors_go_to_the_triton_kernels_cpu_ones_to_numba():
    assert quant.kernels_for(torch.device("cuda")) == "triton"
    assert quant.kernels_for(torch.device("cuda", 1)) == "triton"
    assert quant.kernels_for(torch.device("cpu")) == "numba"
    assert quant.kernels_for(torch.device("meta")) == "reference"


NO_TRITON = """
import sys
sys.modules["triton"] = None  # as if it were not installed
import torch
import fewbit_design.runtime
from fewbit_design.runtime.linear import quant
packed, scales = quant.quantize_groups(torch.randn(3, 64), 4, 64, stochastic=True, seed=1)
print(quant.kernels_for(torch.device("cuda")), tuple(scales.shape))
"""


def test_without_triton_the_runtime_imports_and_cuda_tensors_run_the_reference():
    done = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["reference", "(3,", "1,", "2)"]


def test_without_the_interpreter_cpu_tensors_get_one_clear_error(monkeypatch):
    monkeypatch.setattr(triton_quant, "_interpreted", lambda kernel: False)
    with pytest.raises(FewBitError, match="run on CUDA tensors, got cpu tensors"):
        triton_quant.quantize_groups_triton(torch.zeros(2, 64), 4, 64, stochastic=False, seed=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_cuda_group_quantizer_is_the_cpu_reference_bitwise(dtype, bits):
    # compiled kernels on a GPU (quantize_groups dispatches CUDA tensors to them) against the CPU reference
    x = sample(4099, 3 * 64 + 8, dtype, bits)
    for stochastic in (False, True):
        packed, scales = quant.quantize_groups(x.cuda(), bits, 64, stochastic=stochastic, seed=SEED)
        expected = quant.quantize_groups_reference(x, bits, 64, stochastic=stochastic, seed=SEED)
        assert torch.equal(packed.cpu(), expected[0]) and same(scales.cpu(), expected[1])
        decoded = quant.dequantize_groups(packed, scales, x.shape[-1], bits, 64, dtype)
        reference = quant.dequantize_groups_reference(expected[0], expected[1], x.shape[-1], bits, 64, dtype)
        assert same(decoded.cpu(), reference)
