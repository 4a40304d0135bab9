"""The CPU (numba) paths of issue 22: the blocked one-pass forward and the native 16-bit backward.

Every path is compared bitwise with the pure-torch reference (codes, gradients) and with the native torch op (the
forward), in every dtype, at sizes 0, 1, 7 and 2^k +- 1 around the block size (made small here, so that many blocks
run in a fast test).
"""

import pytest
import torch
import torch.nn.functional as F
from test_runtime_ops import random_table

from fewbit_design.runtime.fewbit import backends
from fewbit_design.runtime.fewbit import ops as op

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BLOCK = 1 << 10  # FORWARD_BLOCK in these tests
SIZES = [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 4 * BLOCK - 1, 4 * BLOCK + 1, 8 * BLOCK + 3]
NATIVES = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "relu": F.relu,
}


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setattr(backends, "FORWARD_BLOCK", BLOCK)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def sample(numel, dtype, seed=0):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3
    return x.to(dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("name", list(NATIVES))
def test_blocked_forward_is_bitwise_native_and_codes_are_the_reference(one_thread, name, numel, dtype):
    native = NATIVES[name]
    table = random_table(bits=3, seed=numel)
    tensors = op.table_tensors(table)
    x = sample(numel, dtype, seed=numel)
    boundaries, _ = tensors.for_input(dtype)
    y, packed, record = backends.forward_numba(x, native, boundaries, tensors.interval_codes, 3)
    assert same_bits(y, native(x))
    assert torch.equal(packed, op.quantize_reference(x, boundaries, tensors.interval_codes, 3))
    assert record is None


@pytest.mark.parametrize("bits", [1, 5, 8])
def test_blocked_forward_at_other_bit_widths_and_shapes(one_thread, bits):
    table = random_table(bits=bits, boundaries=40, seed=bits)
    tensors = op.table_tensors(table)
    x = sample(3 * BLOCK + 5, torch.float32, seed=bits).reshape(-1, 1)
    y, packed, _ = backends.forward_numba(x, F.gelu, tensors.boundaries32, tensors.interval_codes, bits)
    assert same_bits(y, F.gelu(x))
    assert torch.equal(packed, op.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocked_forward_records_non_finite_elements_of_every_block(one_thread, dtype):
    tensors = op.table_tensors(random_table(bits=3, seed=1))
    x = sample(5 * BLOCK + 3, dtype, seed=2)
    positions = torch.tensor([0, 5, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 2])
    x[positions] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), float("inf")]).to(dtype)
    boundaries, _ = tensors.for_input(dtype)
    y, _, record = backends.forward_numba(x, F.silu, boundaries, tensors.interval_codes, 3)
    assert same_bits(y, F.silu(x))
    expected = op.nonfinite_record(x)
    assert torch.equal(record[0], expected[0]) and same_bits(record[1], expected[1])


def test_blocked_forward_takes_the_record_before_an_in_place_fn_sees_the_block(one_thread):
    tensors = op.table_tensors(random_table(bits=3, seed=1))
    x = sample(3 * BLOCK, torch.float32)
    x[2 * BLOCK + 1] = float("inf")
    y, _, record = backends.forward_numba(x.clone(), torch.relu_, tensors.boundaries32, tensors.interval_codes, 3)
    assert record[0].tolist() == [2 * BLOCK + 1] and record[1].tolist() == [float("inf")]
    assert same_bits(y, torch.relu(x))


def test_forward_reads_x_once_in_blocks_without_a_separate_non_finite_pass(one_thread, monkeypatch):
    # issue 22: the forward ran the codes over all of x, then a reduction over all of x (the non-finite check), then
    # the native op over all of x: three passes. Now the native op sees blocks whose codes were just computed, and
    # the kernels count non-finite elements, so the reduction never runs on the numba path.
    def no_reduction(x):
        raise AssertionError("the numba forward ran a separate non-finite pass over x")

    monkeypatch.setattr(op, "_maybe_nonfinite", no_reduction)
    seen = []

    def gelu(block):
        seen.append(block.numel())
        return F.gelu(block)

    table = random_table(bits=3, seed=3)
    x = sample(4 * BLOCK + 100, torch.float32).requires_grad_()
    with op.use_backend("numba"):
        y = op.fewbit_activation(x, gelu, op.table_tensors(table))
    assert seen == [BLOCK] * 4 + [100]
    assert same_bits(y.detach(), F.gelu(x.detach()))


def test_forward_with_several_threads_is_bitwise_native():
    # with several torch threads torch cuts native(x) at op-specific places: the forward runs it on all of x
    tensors = op.table_tensors(random_table(bits=3, seed=4))
    x = sample(3 * (1 << 15) + 13, torch.float32, seed=4)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for native in NATIVES.values():
            y, packed, _ = backends.forward_numba(x, native, tensors.boundaries32, tensors.interval_codes, 3)
            assert same_bits(y, native(x))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(packed, op.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 3))
