"""The few-bit op's kernels (pure-torch reference, numba, Triton under the interpreter) against independent oracles.

Oracles, computed here without the runtime's code:
* code(x) = table.codes[numpy.searchsorted(table.boundaries, x in float64, side='right')] (the table's definition;
  NaN sorts last, so NaN takes the last interval);
* the packed layout as a little-endian bit stream: element i's code at bits [i*b, (i+1)*b) (numpy.packbits),
  which is what "groups of 8 in b bytes, element k at bits [k*b, (k+1)*b) of the little-endian word" amounts to;
* grad_input = grad (as float32, float64 for float64 grads) * levels (same dtype)[code], rounded to grad's dtype
  by torch.
"""

import importlib.util

import numpy as np
import pytest
import torch
from devices import DEVICES

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import _packing as packing
from fewbit_design.runtime.fewbit import backends as op_backends
from fewbit_design.runtime.fewbit import ops as op
from fewbit_design.runtime.fewbit.lookup import load_table
from fewbit_design.table import Table

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def random_table(bits=3, boundaries=13, seed=0, activation="gelu"):
    rng = np.random.default_rng(seed)
    count = 2**bits
    codes = rng.integers(0, count, boundaries + 1)
    codes[: min(count, boundaries + 1)] = rng.permutation(count)[: min(count, boundaries + 1)]
    return Table(
        activation=activation,
        params={"approximate": "none"} if activation == "gelu" else {},
        bits=bits,
        mode="levelsets",
        symmetric=False,
        weight={"kind": "uniform", "low": -10.0, "high": 10.0},
        boundaries=np.sort(rng.normal(scale=2.0, size=boundaries)) + np.arange(boundaries) * 1e-3,
        codes=codes,
        levels=rng.normal(size=count),
        error=0.0,
        snr_db=None,
    )


def oracle_codes(table, x):
    values = x.detach().reshape(-1).to(torch.float64).numpy()
    return table.codes[np.searchsorted(table.boundaries, values, side="right")]


def oracle_packed(codes, bits):
    codes = np.asarray(codes, dtype=np.int64)
    stream = ((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    nbytes = -(-len(codes) // 8) * bits
    packed = np.packbits(stream, bitorder="little")
    return np.concatenate([packed, np.zeros(nbytes - len(packed), np.uint8)])


def oracle_grad(table, x, grad):
    compute = np.float64 if grad.dtype == torch.float64 else np.float32
    levels = table.levels.astype(compute)[oracle_codes(table, x)]
    product = grad.detach().reshape(-1).to(torch.float64 if compute is np.float64 else torch.float32).numpy() * levels
    return torch.from_numpy(product).to(grad.dtype).reshape(grad.shape)


def edge_values(table, dtype):
    """Boundaries, their float neighbours in ``dtype``, signed zeros, infinities, NaN, tiny and huge values."""
    exact = torch.tensor(table.boundaries, dtype=torch.float64)
    near = exact.to(dtype)
    up = torch.nextafter(near, torch.tensor(float("inf"), dtype=dtype))
    down = torch.nextafter(near, torch.tensor(float("-inf"), dtype=dtype))
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 1e30, -1e30])
    return torch.cat([near, up, down, special.to(dtype)])


def backends():
    params = [pytest.param("reference"), pytest.param("numba")]
    params.append(pytest.param("triton", marks=needs_triton))
    return params


def run(backend, function, *args):
    with op_backends.use_backend(backend):
        return getattr(op, function)(*args)


# ---------------------------------------------------------------------------------------------------------------------
# codes and gradients against the oracles


SHAPES = [(1,), (7,), (1023,), (8 * 5 + 3,), (3, 5), (2, 3, 7), (2, 3, 4, 5), (0,), (3, 0, 2)]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codes_and_gradient_match_the_table(backend, dtype, shape):
    table = random_table(bits=3, seed=sum(shape) + len(shape))
    tensors = op_backends.table_tensors(table)
    boundaries, levels = tensors.for_input(dtype)
    generator = torch.Generator().manual_seed(len(shape) * 100 + sum(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    grad = torch.randn(shape, generator=generator).to(dtype)

    packed = run(backend, "quantize", x, boundaries, tensors.interval_codes, 3)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-x.numel() // 8) * 3
    np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x), 3))

    result = run(backend, "scale", grad, packed, levels, 3)
    assert result.dtype == dtype and result.shape == grad.shape
    torch.testing.assert_close(result, oracle_grad(table, x, grad), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_boundaries_their_neighbours_and_special_values(backend, dtype):
    # the rounding of boundaries to the compute dtype must not move any input across a boundary
    table = random_table(bits=4, boundaries=20, seed=3)
    tensors = op_backends.table_tensors(table)
    boundaries, levels = tensors.for_input(dtype)
    x = edge_values(table, dtype)
    packed = run(backend, "quantize", x, boundaries, tensors.interval_codes, 4)
    np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x), 4))
    grad = torch.linspace(-2, 2, x.numel()).to(dtype)
    torch.testing.assert_close(
        run(backend, "scale", grad, packed, levels, 4), oracle_grad(table, x, grad), rtol=0, atol=0
    )


@pytest.mark.parametrize("backend", backends())
def test_bfloat16_subnormal_gradients_are_scaled_exactly(backend):
    # the Triton interpreter converts bfloat16 to float32 with subnormals flushed to zero: the backward kernel read
    # 1.8e-40 as 0 (found by test_properties.py's hypothesis search); it now reads the bit pattern, as forward does
    table = random_table(bits=2, boundaries=3, seed=4)
    tensors = op_backends.table_tensors(table)
    x = torch.linspace(-6, 6, 21, dtype=torch.bfloat16)
    grad = torch.tensor([1.8367e-40, -9.2e-41, 1e-39, -1.1e-38] * 5 + [3.0], dtype=torch.bfloat16)
    assert (grad[:-1].abs() < torch.finfo(torch.bfloat16).tiny).all()  # subnormal
    packed = run(backend, "quantize", x, tensors.boundaries32, tensors.interval_codes, 2)
    result = run(backend, "scale", grad, packed, tensors.levels32, 2)
    torch.testing.assert_close(result, oracle_grad(table, x, grad), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_large_odd_input(backend):
    table = random_table(bits=2, boundaries=5, seed=7)
    tensors = op_backends.table_tensors(table)
    x = torch.randn((1 << 20) + 3, generator=torch.Generator().manual_seed(1)) * 2
    packed = run(backend, "quantize", x, tensors.boundaries32, tensors.interval_codes, 2)
    np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x), 2))
    grad = torch.randn_like(x)
    torch.testing.assert_close(run(backend, "scale", grad, packed, tensors.levels32, 2), oracle_grad(table, x, grad))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.t(),
        lambda t: t[:, ::3],
        lambda t: t[1:, 2:].transpose(0, 1),
        lambda t: t[:1].expand(5, t.shape[1]),
    ],
    ids=["transpose", "step", "slice-transpose", "expand"],
)
def test_non_contiguous_inputs_follow_the_flattened_order(backend, view):
    table = random_table(bits=3, seed=11)
    tensors = op_backends.table_tensors(table)
    base = torch.randn(9, 13, generator=torch.Generator().manual_seed(2)) * 3
    x = view(base)
    assert not x.is_contiguous()
    packed = run(backend, "quantize", x, tensors.boundaries32, tensors.interval_codes, 3)
    np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x.contiguous()), 3))
    grad = view(torch.randn(9, 13))
    result = run(backend, "scale", grad, packed, tensors.levels32, 3)
    torch.testing.assert_close(result, oracle_grad(table, x, grad.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("bits", range(1, 9))
def test_kernels_agree_bitwise_at_every_bit_width(bits):
    table = random_table(bits=bits, boundaries=2**bits + 3, seed=bits)
    tensors = op_backends.table_tensors(table)
    x = torch.randn(2051, generator=torch.Generator().manual_seed(bits)) * 3
    grad = torch.randn(2051, generator=torch.Generator().manual_seed(bits + 1))
    expected = oracle_packed(oracle_codes(table, x), bits)
    names = ["reference", "numba"] + (["triton"] if HAS_TRITON else [])
    for backend in names:
        packed = run(backend, "quantize", x, tensors.boundaries32, tensors.interval_codes, bits)
        np.testing.assert_array_equal(packed.numpy(), expected, err_msg=backend)
        result = run(backend, "scale", grad, packed, tensors.levels32, bits)
        torch.testing.assert_close(result, oracle_grad(table, x, grad), rtol=0, atol=0, msg=backend)


def test_float32_table_with_two_code_changes_in_one_bucket_searches_that_bucket():
    # 1.0001 and 1.0002 share the top 16 bits of their float32 patterns: no single threshold resolves that bucket
    table = Table(
        activation="gelu",
        params={"approximate": "none"},
        bits=2,
        mode="levelsets",
        symmetric=False,
        weight={"kind": "uniform", "low": -10.0, "high": 10.0},
        boundaries=[-1.0, 1.0001, 1.0002],
        codes=[0, 1, 2, 3],
        levels=[0.0, 0.5, 1.0, 1.5],
        error=0.0,
        snr_db=None,
    )
    lut = op_backends.build_lut32(op_backends.boundaries_float32(table.boundaries), table.codes)
    assert (
        np.count_nonzero(lut == op_backends.MULTI) == 1
    )  # 1.0001 and 1.0002 share a bucket: resolved by binary search
    tensors = op_backends.table_tensors(table)
    x = torch.cat([torch.linspace(0.99, 1.01, 4001), edge_values(table, torch.float32)])
    packed = run("numba", "quantize", x, tensors.boundaries32, tensors.interval_codes, 2)
    np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x), 2))


def test_shipped_table_with_a_crowded_bucket_in_the_branchless_kernel():
    # silu's 8-bit level-set table has two boundaries within 2^-7 relative of each other: before the binary search
    # for such buckets, the whole tensor fell back to comparing with all 349 boundaries (about 10x slower)
    table = load_table("silu", bits=8)
    lut = op_backends.build_lut32(op_backends.boundaries_float32(table.boundaries), table.codes)
    assert np.any(lut == op_backends.MULTI)
    assert (
        np.count_nonzero(op_backends.direct_lut32(lut) == 0x100) > op_backends.BRANCHLESS_SPLITS
    )  # the branchless kernel runs
    tensors = op_backends.table_tensors(table)
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 4
    x = torch.cat([x, edge_values(table, torch.float32)])
    for backend in ("reference", "numba"):
        packed = run(backend, "quantize", x, tensors.boundaries32, tensors.interval_codes, 8)
        np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x), 8), err_msg=backend)


def test_lookup_table_of_a_designed_like_table_is_built(make_table):
    table = make_table("gelu", 3)
    assert not np.any(
        op_backends.build_lut32(op_backends.boundaries_float32(table.boundaries), table.codes) == op_backends.MULTI
    )


def test_boundaries_are_rounded_up_to_float32():
    boundaries = np.array([0.1, -0.1, 1.0, 3e38, 4e38, -4e38, 1e-46])
    rounded = op_backends.boundaries_float32(boundaries)
    assert np.all(rounded.astype(np.float64) >= boundaries)
    with np.errstate(over="ignore"):
        below = np.nextafter(rounded, np.float32(-np.inf)).astype(np.float64)
    assert np.all(below < boundaries)  # the smallest float32 that is >= each boundary


# ---------------------------------------------------------------------------------------------------------------------
# 64-bit offsets (without allocating 2**31 elements)


def test_numba_work_split_uses_exact_64_bit_ranges():
    from fewbit_design.runtime.fewbit import _numba_kernels as kernels

    n = 3 * 2**31 + 5
    parts = kernels.split(n, 2)
    assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) == 2
    assert parts[0][1] == parts[1][0] > 2**31 and parts[0][1] % kernels.CHUNK == 0
    assert kernels.split(10, 4) == [(0, 10)]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_numba_kernels_split_over_threads_agree(threads, monkeypatch):
    from fewbit_design.runtime.fewbit import _numba_kernels as kernels

    monkeypatch.setattr(kernels, "MIN_TASK", 8)
    table = random_table(bits=3, seed=9)
    tensors = op_backends.table_tensors(table)
    x = torch.randn(5 * kernels.CHUNK + 11, generator=torch.Generator().manual_seed(4))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        packed = op_backends.quantize_numba(x, tensors.boundaries32, tensors.interval_codes, 3)
        grad = torch.randn_like(x)
        result = op_backends.scale_numba(grad, packed, tensors.levels32, 3)
    finally:
        torch.set_num_threads(previous)
    np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x), 3))
    torch.testing.assert_close(result, oracle_grad(table, x, grad), rtol=0, atol=0)


@needs_triton
def test_triton_offsets_are_64_bit():
    from fewbit_design.runtime.fewbit import _triton_kernels as kernels

    block = 4
    pid = 2**30 + 7  # pid * block * 8 is far beyond 2**31
    out = torch.empty(block * 8, dtype=torch.int64)
    kernels._group_offsets_kernel[(1,)](out, pid, BLOCK_GROUPS=block)
    expected = torch.arange(block * 8, dtype=torch.int64) + pid * block * 8
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------------------------
# packing


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1023, 8 * 97 + 3])
def test_fast_pack_and_unpack_match_the_reference_and_the_bit_stream(bits, numel):
    codes = torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(bits * 1000 + numel))
    expected = oracle_packed(codes.numpy(), bits)
    np.testing.assert_array_equal(packing.pack(codes, bits).numpy(), expected)
    np.testing.assert_array_equal(packing.pack_reference(codes, bits).numpy(), expected)
    packed = torch.from_numpy(expected)
    assert torch.equal(packing.unpack(packed, bits, numel), codes)
    assert torch.equal(packing.unpack_reference(packed, bits, numel), codes)
    assert packing.packed_nbytes(numel, bits) == len(expected)


def test_pack_rejects_bad_input():
    with pytest.raises(FewBitError, match="bits must be an integer from 1 to 8"):
        packing.pack(torch.zeros(3, dtype=torch.int64), 9)
    with pytest.raises(FewBitError, match="integer tensor"):
        packing.pack(torch.zeros(3), 2)
    with pytest.raises(FewBitError, match="ceil"):
        packing.unpack(torch.zeros(5, dtype=torch.uint8), 3, 20)


# ---------------------------------------------------------------------------------------------------------------------
# custom ops and dispatch


@pytest.mark.parametrize("device", DEVICES)
def test_custom_ops_pass_opcheck(device):
    table = random_table(bits=3, seed=5)
    tensors = op_backends.table_tensors(table, device)
    x = torch.randn(37, device=device)
    torch.library.opcheck(torch.ops.fewbit.quantize.default, (x, tensors.boundaries32, tensors.interval_codes, 3))
    packed = torch.ops.fewbit.quantize(x, tensors.boundaries32, tensors.interval_codes, 3)
    grad = torch.randn(37, device=device)
    torch.library.opcheck(torch.ops.fewbit.scale.default, (grad, packed, tensors.levels32, 3))


def test_backend_choice_is_checked(monkeypatch):
    with pytest.raises(FewBitError, match="backend must be"):
        with op_backends.use_backend("cuda"):
            pass
    monkeypatch.setenv(op_backends.BACKEND_ENV, "fast")
    with pytest.raises(FewBitError, match="FEWBIT_BACKEND"):
        op_backends.backend_for(torch.device("cpu"))
    monkeypatch.setenv(op_backends.BACKEND_ENV, "reference")
    assert op_backends.backend_for(torch.device("cpu")) == "reference"
    monkeypatch.delenv(op_backends.BACKEND_ENV)
    assert op_backends.backend_for(torch.device("cpu")) == "numba"
    assert op_backends.backend_for(torch.device("meta")) == "reference"


@pytest.mark.parametrize("name", ["table_tensors", "use_backend", "quantize_numba", "build_lut32"])
def test_backend_names_reached_through_ops_warn_and_are_the_backends_own(name):
    with pytest.warns(DeprecationWarning, match=f"ops.{name} is deprecated: import it from .*backends"):
        assert getattr(op, name) is getattr(op_backends, name)
    with pytest.raises(AttributeError, match="no attribute 'quantise'"):
        op.quantise  # noqa: B018


def test_without_numba_the_reference_runs(monkeypatch):
    monkeypatch.delenv(op_backends.BACKEND_ENV, raising=False)
    monkeypatch.setattr(op_backends, "_importable", lambda module: module != "numba")
    assert op_backends.backend_for(torch.device("cpu")) == "reference"
    table = random_table(bits=2, seed=2)
    tensors = op_backends.table_tensors(table)
    x = torch.randn(99)
    packed = op_backends.quantize(x, tensors.boundaries32, tensors.interval_codes, 2)
    np.testing.assert_array_equal(packed.numpy(), oracle_packed(oracle_codes(table, x), 2))


def test_bad_inputs_raise_one_clear_error():
    tensors = op_backends.table_tensors(random_table(bits=3, seed=1))
    with pytest.raises(FewBitError, match="float32, float16, bfloat16 or float64"):
        op_backends.quantize(torch.arange(5), tensors.boundaries32, tensors.interval_codes, 3)
    with pytest.raises(FewBitError, match="boundaries must be torch.float64"):
        op_backends.quantize(torch.randn(5, dtype=torch.float64), tensors.boundaries32, tensors.interval_codes, 3)
    with pytest.raises(FewBitError, match="packed codes must be"):
        op_backends.scale(torch.randn(20), torch.zeros(3, dtype=torch.uint8), tensors.levels32, 3)
