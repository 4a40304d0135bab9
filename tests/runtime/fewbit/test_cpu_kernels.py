"""The CPU (numba) paths: the blocked one-pass forward and the native 16-bit backward.

Every path is compared bitwise with the pure-torch reference (codes, gradients) and with the native torch op (the
forward), in every dtype, at sizes 0, 1, 7 and 2^k +- 1 around the block size (made small here, so that many blocks
run in a fast test).
"""

import os
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_runtime_ops import random_table

from fewbit_design.runtime._packing import pack_reference
from fewbit_design.runtime.fewbit import _cpu_tables, backends
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
    monkeypatch.setattr(backends, "FORWARD_BLOCKED_BYTES", 0)
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
    tensors = backends.table_tensors(table)
    x = sample(numel, dtype, seed=numel)
    boundaries, _ = tensors.for_input(dtype)
    y, packed, record = backends.forward_numba(x, native, boundaries, tensors.interval_codes, 3)
    assert same_bits(y, native(x))
    assert torch.equal(packed, backends.quantize_reference(x, boundaries, tensors.interval_codes, 3))
    assert record is None


@pytest.mark.parametrize("bits", [1, 5, 8])
def test_blocked_forward_at_other_bit_widths_and_shapes(one_thread, bits):
    table = random_table(bits=bits, boundaries=40, seed=bits)
    tensors = backends.table_tensors(table)
    x = sample(3 * BLOCK + 5, torch.float32, seed=bits).reshape(-1, 1)
    y, packed, _ = backends.forward_numba(x, F.gelu, tensors.boundaries32, tensors.interval_codes, bits)
    assert same_bits(y, F.gelu(x))
    assert torch.equal(packed, backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocked_forward_records_non_finite_elements_of_every_block(one_thread, dtype):
    tensors = backends.table_tensors(random_table(bits=3, seed=1))
    x = sample(5 * BLOCK + 3, dtype, seed=2)
    positions = torch.tensor([0, 5, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 2])
    x[positions] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), float("inf")]).to(dtype)
    boundaries, _ = tensors.for_input(dtype)
    y, _, record = backends.forward_numba(x, F.silu, boundaries, tensors.interval_codes, 3)
    assert same_bits(y, F.silu(x))
    expected = op.nonfinite_record(x)
    assert torch.equal(record[0], expected[0]) and same_bits(record[1], expected[1])


def test_blocked_forward_takes_the_record_before_an_in_place_fn_sees_the_block(one_thread):
    tensors = backends.table_tensors(random_table(bits=3, seed=1))
    x = sample(3 * BLOCK, torch.float32)
    x[2 * BLOCK + 1] = float("inf")
    y, _, record = backends.forward_numba(x.clone(), torch.relu_, tensors.boundaries32, tensors.interval_codes, 3)
    assert record[0].tolist() == [2 * BLOCK + 1] and record[1].tolist() == [float("inf")]
    assert same_bits(y, torch.relu(x))


def test_forward_reads_x_once_in_blocks_without_a_separate_non_finite_pass(one_thread, monkeypatch):
    # the forward ran the codes over all of x, then a reduction over all of x (the non-finite check), then
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
    with backends.use_backend("numba"):
        y = op.fewbit_activation(x, gelu, backends.table_tensors(table))
    assert seen == [BLOCK] * 4 + [100]
    assert same_bits(y.detach(), F.gelu(x.detach()))


def test_forward_with_several_threads_is_bitwise_native():
    # with several torch threads torch cuts native(x) at op-specific places: the forward runs it on all of x
    tensors = backends.table_tensors(random_table(bits=3, seed=4))
    x = sample(3 * (1 << 15) + 13, torch.float32, seed=4)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for native in NATIVES.values():
            y, packed, _ = backends.forward_numba(x, native, tensors.boundaries32, tensors.interval_codes, 3)
            assert same_bits(y, native(x))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(packed, backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 3))


# ---------------------------------------------------------------------------------------------------------------------
# the native 16-bit backward


def float32_patterns():
    """Every high half (sign, exponent, 7 mantissa bits) with low halves around the rounding point of both 16-bit
    formats (ties, just below and above) and a few others: the rounding of every bfloat16 and float16 neighbourhood."""
    high = torch.arange(65536, dtype=torch.int64) << 16
    lows = torch.tensor([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xA5A5, 0xFFFF])
    return (high[:, None] | lows[None, :]).reshape(-1).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_to_16_bit_rounding_is_torchs_on_all_patterns(dtype):
    from fewbit_design.runtime.fewbit import _numba_kernels as kernels

    values = float32_patterns()
    out = torch.empty(values.numel(), dtype=torch.int16)
    kernels.float32_to_16(values.view(torch.int32).numpy().view("u4"), dtype == torch.bfloat16, out.numpy().view("u2"))
    assert torch.equal(out, values.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_backward_on_every_gradient_pattern_is_the_reference(dtype):
    # every 16-bit gradient pattern (NaN, inf, subnormals) times every level of a table holding 0, 1, subnormal-making
    # and overflowing levels, at every position of a group
    tensors = backends.table_tensors(random_table(bits=3, seed=5))
    levels = torch.tensor([0.0, 1.0, -1.0, 3.1e-5, 0.7, 1e4, -2.5, 6.1e-3])
    grad = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).repeat(3)[: 3 * 65536 - 5]
    x = sample(grad.numel(), torch.float32, seed=6)
    packed = backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 3)
    result = backends.scale_numba(grad, packed, levels, 3)
    expected = backends.scale_reference(grad, packed, levels, 3)
    # bitwise, except the payload of a float16 NaN: torch's own float32 product gives a NaN grad's payload in its
    # vector loop and 0x7FFFFFFF in its tail, so the reference itself has no single payload (bfloat16 NaN is 0xFFFF)
    nan = torch.isnan(expected)
    assert torch.equal(nan, torch.isnan(result))
    assert same_bits(result[~nan], expected[~nan])
    if dtype == torch.bfloat16:
        assert same_bits(result, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_16_bit_backward_matches_the_reference_at_every_size(dtype, numel, bits):
    table = random_table(bits=bits, boundaries=20, seed=bits)
    tensors = backends.table_tensors(table)
    x = sample(numel, torch.float32, seed=numel)
    grad = sample(numel, dtype, seed=numel + 1)
    packed = backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, bits)
    result = backends.scale_numba(grad, packed, tensors.levels32, bits)
    assert same_bits(result, backends.scale_reference(grad, packed, tensors.levels32, bits))


def test_16_bit_backward_makes_no_float32_copy_of_the_gradient(monkeypatch):
    # the gradient was copied to float32 and the product copied back (two extra passes): the kernel now
    # reads and writes the 16-bit patterns, so no float32 tensor of the gradient's size is made
    made = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        made.append((tensor.dtype, tensor.numel()))
        return tensor

    tensors = backends.table_tensors(random_table(bits=3, seed=7))
    grad = sample(5000, torch.bfloat16)
    packed = backends.quantize_reference(sample(5000, torch.float32), tensors.boundaries32, tensors.interval_codes, 3)
    monkeypatch.setattr(torch, "empty", recording_empty)
    backends.scale_numba(grad, packed, tensors.levels32, 3)
    assert [numel for dtype, numel in made if dtype == torch.float32] == []


# ---------------------------------------------------------------------------------------------------------------------
# the fixed cost of a call


def test_eager_call_skips_torchs_argument_binding(monkeypatch):
    # torch's Function.apply ran inspect.signature(forward).bind(...) on every call, about 20 us (a native
    # GELU of 2^14 elements); the few-bit op passes every argument positionally and skips it in eager mode
    def binding_apply(cls, *args, **kwargs):
        raise AssertionError("torch's Function.apply (inspect.signature(...).bind) ran on the eager path")

    table = random_table(bits=3, seed=8)
    x = sample(1000, torch.float32).requires_grad_()
    grad = sample(1000, torch.float32, seed=9)
    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(binding_apply))
    y = op.fewbit_activation(x, F.gelu, backends.table_tensors(table))
    (result,) = torch.autograd.grad(y, x, grad)
    assert same_bits(y.detach(), F.gelu(x.detach()))
    tensors = backends.table_tensors(table)
    packed = backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 3)
    assert same_bits(result, backends.scale_reference(grad, packed, tensors.levels32, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeated_calls_prepare_the_table_once(monkeypatch, dtype):
    # the fixed cost of a call: every call converted the table to numpy and hashed its bytes to find its
    # LUT (8 us, half a native GELU of 2^14 elements); now a call with a table seen before reuses a cached plan
    tensors = backends.table_tensors(random_table(bits=3, seed=11))
    boundaries, _ = tensors.for_input(dtype)
    conversions = []
    real_numpy = torch.Tensor.numpy

    def numpy(tensor, *args, **kwargs):
        if tensor.data_ptr() == boundaries.data_ptr():
            conversions.append(tensor)
        return real_numpy(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", numpy)
    monkeypatch.setattr(_cpu_tables, "_LUT_CACHE", {})
    monkeypatch.setattr(_cpu_tables, "_PLAN_CACHE", {})
    for seed in range(3):
        x = sample(100, dtype, seed=seed)
        codes = backends.quantize_numba(x, boundaries, tensors.interval_codes, 3)
        assert torch.equal(codes, backends.quantize_reference(x, boundaries, tensors.interval_codes, 3))
    assert len(conversions) <= 2  # the first call only (LUT key, and the plan's copy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cached_plan_follows_an_in_place_change_of_the_table(dtype):
    tensors = backends.table_tensors(random_table(bits=3, seed=12))
    boundaries, _ = tensors.for_input(dtype)
    boundaries, codes = boundaries.clone(), tensors.interval_codes.clone()
    x = sample(1000, dtype, seed=3)
    backends.quantize_numba(x, boundaries, codes, 3)
    codes.copy_(codes.flip(0))
    boundaries.sub_(0.5)
    assert torch.equal(
        backends.quantize_numba(x, boundaries, codes, 3), backends.quantize_reference(x, boundaries, codes, 3)
    )


def test_module_decodes_its_table_once_and_follows_a_new_table():
    # the module built its TableTensors (five buffer moves and views) on every call; now once per device and buffers
    from fewbit_design.runtime import nn as fewbit_nn

    module = fewbit_nn.GELU(table=random_table(bits=3, seed=13))
    first = module._table_tensors(torch.device("cpu"))
    assert module._table_tensors(torch.device("cpu")) is first
    x = sample(257, torch.float32, seed=5).requires_grad_()
    grad = sample(257, torch.float32, seed=6)
    other = random_table(bits=2, seed=14)
    module.table = other
    (result,) = torch.autograd.grad(module(x), x, grad)
    tensors = backends.table_tensors(other)
    packed = backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 2)
    assert same_bits(result, backends.scale_reference(grad, packed, tensors.levels32, 2))
    copy = __import__("copy").deepcopy(module)
    assert copy._table_tensors(torch.device("cpu")).boundaries32.data_ptr() != first.boundaries32.data_ptr()


def one_boundary_table(boundary, codes=(0, 1), bits=1):
    table = random_table(bits=bits, boundaries=1, seed=0, activation="relu")
    return table.__class__(**{**table.__dict__, "boundaries": __import__("numpy").array([boundary]), "codes": codes})


def never_called(x):
    raise AssertionError("the fused relu forward ran torch's relu on all-finite input")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", SIZES[1:] + [2**16 - 1, 2**16 + 1])
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_relu_forward_computes_y_and_codes_in_one_pass(bits, numel, dtype):
    # relu's forward ran the codes kernel (a 65536-entry LUT gather, 4-10x native relu), then torch's
    # relu; a one-boundary table now takes a vectorised kernel that also writes y, bitwise torch's relu
    from fewbit_design.runtime.tables import load_table

    tensors = backends.table_tensors(load_table("relu", bits=bits))
    boundaries, _ = tensors.for_input(dtype)
    x = sample(numel, dtype, seed=numel)
    x[: min(numel, 4)] = torch.tensor([-0.0, 0.0, 1e-40, -1e-40])[: min(numel, 4)].to(dtype)
    fused = backends.fused_relu(lambda t: never_called(t))
    y, packed, record = backends.forward_numba(x, fused, boundaries, tensors.interval_codes, bits)
    assert same_bits(y, F.relu(x))
    assert torch.equal(packed, backends.quantize_reference(x, boundaries, tensors.interval_codes, bits))
    assert record is None
    for native in (F.relu, torch.relu):  # recognised as they are
        y, packed, _ = backends.forward_numba(x, native, boundaries, tensors.interval_codes, bits)
        assert same_bits(y, F.relu(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("boundary", [5e-324, 0.0, -0.0, -1.5, 0.3, 1e-6, 70000.0, -1e39])
def test_one_boundary_kernels_on_every_16_bit_pattern(dtype, boundary):
    # the integer-key comparison of threshold_pack16 against the reference on all 65536 patterns (NaN, +-inf, -0,
    # subnormals), for codes below/above in both orders; relu's y and the non-finite record too
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    for codes in ((0, 1), (1, 0), (2, 2)):
        tensors = backends.table_tensors(one_boundary_table(boundary, codes, bits=2))
        packed = backends.quantize_numba(patterns, tensors.boundaries32, tensors.interval_codes, 2)
        assert torch.equal(
            packed, backends.quantize_reference(patterns, tensors.boundaries32, tensors.interval_codes, 2)
        )
    y, packed, record = backends.forward_numba(patterns, F.relu, tensors.boundaries32, tensors.interval_codes, 2)
    assert same_bits(y, F.relu(patterns))
    expected = op.nonfinite_record(patterns)
    assert torch.equal(record[0], expected[0]) and same_bits(record[1], expected[1])


@pytest.mark.parametrize("numel", [1, 7, 65, 4099])
def test_fused_relu_with_non_finite_float32_input_is_torchs(numel):
    tensors = backends.table_tensors(one_boundary_table(5e-324))
    x = sample(numel, torch.float32, seed=numel)
    specials = torch.tensor([0x7FC00001, 0xFFC00000 - 2**32, 0x7F800000, 0xFF800000 - 2**32, 0x80000000 - 2**32])
    x[torch.arange(numel) % 3 == 0] = specials.view(torch.float32).repeat(numel)[: len(range(0, numel, 3))]
    y, packed, record = backends.forward_numba(x, F.relu, tensors.boundaries32, tensors.interval_codes, 1)
    assert same_bits(y, F.relu(x))
    assert torch.equal(packed, backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 1))
    expected = op.nonfinite_record(x)
    assert torch.equal(record[0], expected[0]) and same_bits(record[1], expected[1])


@pytest.mark.parametrize("boundary", [0.0, -0.0, 2.5, -1e-40, 1e39])
@pytest.mark.parametrize("numel", SIZES)
def test_one_boundary_float32_codes_are_the_reference(boundary, numel):
    tensors = backends.table_tensors(one_boundary_table(boundary, (3, 1), bits=2))
    x = sample(numel, torch.float32, seed=numel)
    x[: min(numel, 3)] = torch.tensor([float("nan"), -0.0, float("inf")])[: min(numel, 3)]
    packed = backends.quantize_numba(x, tensors.boundaries32, tensors.interval_codes, 2)
    assert torch.equal(packed, backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 2))


def test_relu_module_gradient_with_the_fused_forward_is_the_reference():
    from fewbit_design.runtime import nn as fewbit_nn

    module = fewbit_nn.ReLU(bits=3)
    x = sample(1000, torch.bfloat16, seed=9).requires_grad_()
    grad = sample(1000, torch.bfloat16, seed=10)
    y = module(x)
    assert same_bits(y.detach(), F.relu(x.detach()))
    (result,) = torch.autograd.grad(y, x, grad)
    tensors = module._table_tensors(torch.device("cpu"))
    packed = backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 3)
    assert same_bits(result, backends.scale_reference(grad, packed, tensors.levels32, 3))


@pytest.mark.parametrize(
    "bits, boundaries, kernel", [(2, 13, "fixup"), (3, 13, "fixup"), (7, 13, "fixup"), (3, 9, "steps"), (2, 2, "steps")]
)
def test_float32_codes_on_every_bucket_are_the_reference(bits, boundaries, kernel):
    # quantize_pack_lut32_fixup (1-7 bits, few boundaries) reads a uint8 table and resolves the marked buckets
    # (boundaries, NaN, +-inf) in a second pass; quantize_pack_steps32 (at most STEPS_BOUNDARIES boundaries) adds a
    # step per boundary <= x: every high half with low halves 0, 1, 0x8000 and 0xFFFF
    table = random_table(bits=bits, boundaries=boundaries, seed=bits)
    tensors = backends.table_tensors(table)
    high = torch.arange(65536, dtype=torch.int64) << 16
    patterns = torch.stack([high, high | 1, high | 0x8000, high | 0xFFFF], dim=1).reshape(-1)
    x = patterns.to(torch.int32).view(torch.float32)  # int64 -> int32 wraps: the same bit patterns
    used, _ = backends._codes_kernel(x, tensors.boundaries32, tensors.interval_codes, bits, None)
    assert kernel in used.__name__
    packed, nonfinite = backends._codes_numba(x, tensors.boundaries32, tensors.interval_codes, bits)
    assert torch.equal(packed, backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, bits))
    assert nonfinite == int((~torch.isfinite(x)).sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7, 63, 64, 65, 1023, 1025])
@pytest.mark.parametrize("name", ["gelu", "silu", "tanh"])
def test_two_pass_forward_is_native_and_codes_are_the_reference(name, numel, dtype):
    # the fixed cost of a call: small inputs take _forward_two_passes, which reads x through numpy (a copy
    # only where x is not contiguous) and writes the codes into numpy memory shared with torch
    table = random_table(bits=3, seed=21)
    tensors = backends.table_tensors(table)
    boundaries, _ = tensors.for_input(dtype)
    wide = sample(2 * numel, dtype, seed=numel)
    for x in (wide[:numel], wide[::2], wide.reshape(-1, 2)[:, 0] if numel else wide):
        x = x.clone() if x.is_contiguous() else x
        x[:: max(1, numel // 3)] = float("nan") if numel > 3 else x[:: max(1, numel // 3)]
        y, packed, record = backends.forward_numba(x, NATIVES[name], boundaries, tensors.interval_codes, 3)
        assert same_bits(y, NATIVES[name](x))
        assert torch.equal(packed, backends.quantize_reference(x, boundaries, tensors.interval_codes, 3))
        expected = op.nonfinite_record(x)
        if expected is None:
            assert record is None
        else:
            assert torch.equal(record[0], expected[0]) and same_bits(record[1], expected[1])


def test_the_forward_reads_no_environment_variable_per_call(monkeypatch):
    # the fixed cost of a call: backend_for read FEWBIT_BACKEND with os.environ.get on every forward and
    # backward (1-2 us: the key is encoded each time); it now probes os.environ's own mapping, so a change still takes
    # effect at the next call
    reads = []
    real_getitem = type(os.environ).__getitem__

    def getitem(self, key):
        if key == backends.BACKEND_ENV:
            reads.append(key)
        return real_getitem(self, key)

    table = random_table(bits=3, seed=22)
    x = sample(100, torch.float32).requires_grad_()
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    monkeypatch.setattr(type(os.environ), "__getitem__", getitem)
    y = op.fewbit_activation(x, F.gelu, backends.table_tensors(table))
    torch.autograd.grad(y, x, torch.ones_like(y))
    assert backends.backend_for(torch.device("cpu")) == "numba"
    assert reads == []
    monkeypatch.setenv(backends.BACKEND_ENV, "reference")
    assert backends.backend_for(torch.device("cpu")) == "reference"
    # a thread that never entered use_backend sees the environment too (the thread-local's class default)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(backends.backend_for(torch.device("cpu"))))
    thread.start()
    thread.join()
    assert seen == ["reference"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits, boundaries", [(1, 2), (2, 3), (3, 9), (3, 12), (4, 12)])
def test_16_bit_steps_kernel_on_every_pattern_is_the_reference(dtype, bits, boundaries):
    # bfloat16 forward: 16-bit tables with at most STEPS_BOUNDARIES boundaries compare the pattern's
    # signed key with one key per boundary (vectorised) instead of a 65536-entry lookup per element: every pattern
    # (NaN, +-inf, -0, subnormals) at sizes that end inside a chunk and inside a group of 8
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    for seed in range(3):
        tensors = backends.table_tensors(random_table(bits=bits, boundaries=boundaries, seed=seed))
        used, _ = backends._codes_kernel(patterns, tensors.boundaries32, tensors.interval_codes, bits, None)
        assert "steps16" in used.__name__
        for x in (patterns, patterns[:4099], patterns[-7:], patterns[:1]):
            packed, nonfinite = backends._codes_numba(x, tensors.boundaries32, tensors.interval_codes, bits)
            assert torch.equal(
                packed, backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, bits)
            )
            assert nonfinite == int((~torch.isfinite(x)).sum())


def test_16_bit_steps_keys_refuse_a_table_they_cannot_reproduce():
    # the keys are checked on all patterns against the exact table; a table whose codes are no sum of per-boundary
    # steps of the key order (here: a made-up LUT) falls back to the lookup kernel
    lut = np.zeros(65536, dtype=np.uint8)
    lut[::2] = 1
    assert _cpu_tables._steps_keys16(torch.bfloat16, lut, np.array([0.0], np.float32), np.array([0, 1])) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7, 63, 65, 4097])
def test_backward_of_strided_and_shaped_gradients_is_the_reference(dtype, numel):
    # the fixed cost of a call: scale_numba reads the gradient through numpy (flattened there, copied only
    # where it is not contiguous): a 1-D strided gradient stays strided through reshape, so it must be copied
    tensors = backends.table_tensors(random_table(bits=3, seed=23))
    _, levels = tensors.for_input(dtype)
    x = sample(numel, torch.float32, seed=1)
    packed = backends.quantize_reference(x, tensors.boundaries32, tensors.interval_codes, 3)
    wide = sample(2 * numel, dtype, seed=2)
    for grad in (wide[::2], wide[:numel].clone(), wide.reshape(-1, 2)[:, 1] if numel else wide[:0]):
        result = backends.scale_numba(grad, packed, levels, 3)
        assert same_bits(result, backends.scale_reference(grad, packed, levels, 3))
    if numel == 4097:
        grid = sample(2 * 4097, dtype, seed=3).reshape(17, 482)[:, ::2]  # 2-D, non-contiguous
        packed = backends.quantize_reference(
            sample(grid.numel(), torch.float32), tensors.boundaries32, tensors.interval_codes, 3
        )
        assert same_bits(
            backends.scale_numba(grid, packed, levels, 3), backends.scale_reference(grid, packed, levels, 3)
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("numel", [1, 7, 9, 4095, 4097, 8195])
def test_backward_select_tree_picks_every_level(dtype, bits, numel):
    # backward: at 1-3 bits the backward kernels (16-bit and float32/64) expand the codes to bytes and pick
    # the level by a tree of selects on the code's bits instead of a table load; every code at every position of a
    # group, across chunk ends (4096), with zero levels of both signs (+0 out, as torch selects)
    count = 2**bits
    codes = torch.arange(numel) % count
    codes = codes[torch.randperm(numel, generator=torch.Generator().manual_seed(numel))]
    packed = pack_reference(codes, bits)
    for levels in (torch.linspace(-1.5, 2.0, count), torch.tensor([0.0, -0.0, 0.3, -7.0, 1e-3, 0.0, 5.0, -0.0])):
        levels = levels[:count].to(torch.float64 if dtype == torch.float64 else torch.float32).contiguous()
        grad = sample(numel, dtype, seed=bits)
        result = backends.scale_numba(grad, packed, levels, bits)
        assert same_bits(result, backends.scale_reference(grad, packed, levels, bits))
