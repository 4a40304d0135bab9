"""Property-based tests (hypothesis) of table loading and the few-bit kernels.

* random valid tables (bits, boundaries, codes, levels, modes) round-trip through JSON and load unchanged;
* random invalid tables (each field broken in one of many ways, broken JSON, deep nesting, non-UTF-8 bytes) raise a
  FewBitError naming the file, never another exception;
* random inputs (shapes, strides, dtypes, special values) give the same packed codes and the same gradients in
  every kernel and in an independent numpy reference (``np.searchsorted(boundaries, x, side='right')``, NaN last).

Example counts: small by default (the file runs in well under a minute on 2 cores; the Triton interpreter gets a
tenth); ``HYPOTHESIS_PROFILE=nightly`` selects a profile with 20x more examples.
"""

import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_kinks import same_bits

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import _packing as packing
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime.fewbit import backends
from fewbit_design.runtime.fewbit.lookup import MAX_NESTING, as_table
from fewbit_design.table import MODES, Table, format_float

settings.register_profile("fewbit-default", max_examples=30, deadline=None)
settings.register_profile("nightly", max_examples=600, deadline=None)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "fewbit-default"))
QUICK = settings(PROFILE, max_examples=max(3, PROFILE.max_examples // 10))
COMMON = settings(PROFILE, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
HAS_TRITON = __import__("importlib.util").util.find_spec("triton") is not None
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def relu_table(**overrides):
    document = {
        "format": "fewbit-table/1", "activation": "relu", "params": {}, "bits": 1, "mode": "levelsets",
        "symmetric": False, "weight": {"kind": "uniform", "low": -10.0, "high": 10.0},
        "boundaries": [0.0], "codes": [0, 1], "levels": [0.0, 1.0], "error": 0.0, "snr_db": None,
    }  # fmt: skip
    document.update(overrides)
    return document


# ---------------------------------------------------------------------------------------------------------------------
# regression tests (both failed before the fix: RecursionError, and a table accepted with an overflow)


def test_regression_level_finite_in_float64_not_float32(tmp_path):
    path = tmp_path / "big-level.json"
    path.write_text(json.dumps(relu_table(levels=[0.0, 1e300])))
    with pytest.raises(FewBitError, match="levels"):
        fnn.ReLU(table=path)


def test_regression_deeply_nested_json(tmp_path):
    path = tmp_path / "nested.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FewBitError, match="nest"):
        fnn.ReLU(table=path)


@pytest.mark.parametrize("field", ["boundaries", "levels", "error", "snr_db"])
def test_regression_integer_beyond_float_range(field, tmp_path):
    # found by the property test below: json gives a Python int, numpy / float() raised OverflowError
    document = relu_table()
    document[field] = [10**400, 1.0] if isinstance(document[field], list) else 10**400
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(document))
    with pytest.raises(FewBitError, match=field):
        as_table(str(path))
    with pytest.raises(FewBitError, match=field):
        as_table(document)


def test_boundary_beyond_float32_range_is_exact(tmp_path):
    # a boundary of 1e300 rounds up to +inf in float32: x >= it only for x = +inf, as in float64
    table = as_table(relu_table(boundaries=[0.0, 1e300], codes=[0, 1, 0], levels=[0.0, 1.0]))
    x = torch.tensor([-1.0, 6e4, math.inf, -math.inf])  # 6e4: finite in every dtype
    tensors = backends.table_tensors(table)
    for dtype in DTYPES:
        boundaries, _ = tensors.for_input(dtype)
        packed = backends.quantize_reference(x.to(dtype), boundaries, tensors.interval_codes, 1)
        codes = packing.unpack_reference(packed, 1, 4)
        assert codes.tolist() == [0, 1, 0, 0], dtype


# ---------------------------------------------------------------------------------------------------------------------
# strategies


def table_floats(low=-1e300, high=1e300):
    """Finite floats as tables store them (12 significant digits), from tiny subnormals to huge values."""
    special = [0.0, -0.0, 5e-324, -5e-324, 1e-40, 3.4e38, -3.4e38, 0.5, -3.0, 6.0]
    values = st.one_of(
        st.floats(low, high, allow_nan=False, allow_infinity=False),
        st.floats(max(low, -20.0), min(high, 20.0)),
        st.sampled_from([value for value in special if low <= value <= high]),
    )
    return values.map(format_float)


@st.composite
def valid_tables(draw):
    bits = draw(st.integers(1, 8))
    boundaries = sorted(set(draw(st.lists(table_floats(), max_size=40))))
    boundaries = [b for b in boundaries if b != 0.0 or math.copysign(1.0, b) > 0]  # one zero, positive
    count = draw(st.integers(1, 2**bits))
    codes = draw(st.lists(st.integers(0, count - 1), min_size=len(boundaries) + 1, max_size=len(boundaries) + 1))
    levels = draw(st.lists(table_floats(-1e38, 1e38), min_size=count, max_size=count))
    return Table(
        activation=draw(st.sampled_from(["gelu", "relu", "silu"])),
        params={},
        bits=bits,
        mode=draw(st.sampled_from(MODES)),
        symmetric=draw(st.booleans()),
        weight={"kind": "uniform", "low": -10.0, "high": 10.0},
        boundaries=boundaries,
        codes=codes,
        levels=levels,
        error=draw(table_floats(0.0, 1e10)),
        snr_db=draw(st.one_of(st.none(), table_floats(-100.0, 100.0))),
    )


@COMMON
@given(table=valid_tables())
def test_valid_tables_round_trip_through_json(table, tmp_path_factory):
    path = tmp_path_factory.mktemp("tables") / "table.json"
    path.write_text(table.to_json())
    loaded = as_table(str(path))
    assert loaded.to_dict() == table.to_dict()
    assert np.array_equal(loaded.boundaries, table.boundaries) and np.array_equal(loaded.codes, table.codes)
    assert np.array_equal(loaded.levels, table.levels) and loaded.bits == table.bits and loaded.mode == table.mode
    backends.table_tensors(loaded)  # and the kernels accept it


BAD_VALUES = st.sampled_from(
    [
        None,
        True,
        "3",
        3.5,
        -1,
        0,
        9,
        2**70,
        -(2**70),
        10**400,
        [],
        {},
        [None],
        ["a"],
        [[1]],
        [1e300],
        [float("nan")],
        [float("inf")],
        [2, 1],
        [0.0, 0.0],
        "x" * 50,
        {"a": [1]},
    ]  # fmt: skip
)
FIELDS = ["format", "activation", "params", "bits", "mode", "symmetric", "weight", "boundaries", "codes", "levels",
          "error", "snr_db", "design"]  # fmt: skip


def _finite(value):
    """``math.isfinite`` that calls an integer beyond the float range (-10**400) not finite instead of raising."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@st.composite
def invalid_documents(draw):
    """Text of a table file broken in one way (a field replaced, removed, or the JSON itself damaged)."""
    document = relu_table(bits=2, boundaries=[-1.0, 0.0, 1.0], codes=[0, 1, 2, 3], levels=[0.0, 0.25, 0.5, 1.0])
    kinds = ["replace", "remove", "truncate", "garbage", "nest", "not-object", "levels-f32", "huge-integer"]
    kind = draw(st.sampled_from(kinds))
    if kind == "replace":
        field = draw(st.sampled_from(FIELDS))
        value = draw(BAD_VALUES)
        assume(not (field in ("params", "weight", "design") and isinstance(value, dict)))
        assume(not (field == "snr_db" and value is None))
        assume(not (field == "symmetric" and value is True))
        assume(not (field == "error" and isinstance(value, int) and value >= 0 and value < 10**300))
        assume(not (field == "snr_db" and isinstance(value, int | float) and _finite(value) and value < 10**300))
        document[field] = value
    elif kind == "remove":
        del document[draw(st.sampled_from(["format", "activation", "bits", "mode", "boundaries", "codes", "levels"]))]
    elif kind == "levels-f32":
        document["levels"][draw(st.integers(0, 3))] = draw(st.sampled_from([1e39, -1e39, 1e300, -3.5e38]))
    elif kind == "huge-integer":  # a JSON integer beyond the float range (float() raises OverflowError)
        field = draw(st.sampled_from(["boundaries", "levels", "error", "snr_db"]))
        huge = draw(st.sampled_from([10**309, -(10**400)]))
        document[field] = [huge] + document[field][1:] if isinstance(document[field], list) else huge
    elif kind == "nest":
        depth = draw(st.integers(MAX_NESTING + 1, 5 * MAX_NESTING))
        document["design"] = json.loads("[" * depth + "]" * depth)
    text = json.dumps(document)
    if kind == "truncate":
        text = text[: draw(st.integers(0, len(text) - 1))]
    elif kind == "garbage":
        position = draw(st.integers(0, len(text)))
        text = text[:position] + draw(st.text(min_size=1, max_size=5)) + text[position:]
        assume(text != json.dumps(document))
    elif kind == "not-object":
        text = json.dumps(draw(st.one_of(st.lists(st.integers()), st.integers(), st.text(), st.none())))
    return text


@COMMON
@given(text=invalid_documents(), binary=st.booleans())
def test_invalid_tables_raise_fewbit_error_naming_the_file(text, binary, tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "bad-table.json"
    data = text.encode("utf-8")
    if binary:
        data = data[: len(data) // 2] + b"\xff\xfe" + data[len(data) // 2 :]
    path.write_bytes(data)
    try:
        as_table(str(path))
    except FewBitError as exc:
        assert "bad-table.json" in str(exc) and "\n" not in str(exc)
    else:
        # "garbage" may insert whitespace or text into a string: then the table is still valid
        table = as_table(str(path))
        assert table.activation and table.bits in (1, 2, 3, 4, 5, 6, 7, 8)


# ---------------------------------------------------------------------------------------------------------------------
# kernels against the numpy reference


def special_values(table):
    near = []
    for boundary in table.boundaries.tolist():
        near += [boundary, math.nextafter(boundary, math.inf), math.nextafter(boundary, -math.inf)]
    return near + [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 1e-45, 3e38, -3e38, 65504.0, 7e4]


@st.composite
def inputs(draw, table):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    numel = int(np.prod(shape))
    pool = special_values(table)
    values = draw(
        st.lists(
            st.one_of(st.sampled_from(pool), st.floats(-50, 50), st.floats(allow_nan=True)),
            min_size=numel,
            max_size=numel,
        )
    )
    with np.errstate(over="ignore"):
        x = torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)
    view = draw(st.sampled_from(["plain", "transposed", "flipped-strides", "expanded"]))
    if view == "transposed" and x.dim() >= 2:
        x = x.transpose(0, -1)
    elif view == "flipped-strides" and x.dim() >= 1 and x.shape[0] > 1:
        x = x[::2]
    elif view == "expanded":
        x = x.unsqueeze(0).expand(2, *x.shape)
    grad = torch.tensor(draw(st.lists(st.floats(-1e4, 1e4), min_size=x.numel(), max_size=x.numel())))
    return x, grad.to(torch.float64).reshape(x.shape).to(dtype)


def numpy_codes(table, x):
    values = x.detach().reshape(-1).to(torch.float64).numpy()
    return table.codes[np.searchsorted(table.boundaries, values, side="right")]  # NaN sorts last: last interval


def numpy_packed(codes, bits):
    stream = ((np.asarray(codes, dtype=np.int64)[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    nbytes = -(-len(codes) // 8) * bits
    packed = np.packbits(stream, bitorder="little")
    return np.concatenate([packed, np.zeros(nbytes - len(packed), np.uint8)])


def numpy_grad(table, codes, grad):
    compute = torch.float64 if grad.dtype == torch.float64 else torch.float32
    levels = torch.from_numpy(np.array(table.levels)).to(compute)[torch.from_numpy(codes)]
    product = grad.reshape(-1).to(compute) * levels
    product = torch.where(levels == 0, torch.zeros((), dtype=compute), product)  # a zero level selects +0
    return product.to(grad.dtype).reshape(grad.shape)


def check_kernel(backend, table, x, grad):
    tensors = backends.table_tensors(table)
    boundaries, levels = tensors.for_input(x.dtype)
    codes = numpy_codes(table, x)
    with backends.use_backend(backend):
        packed = backends.quantize(x, boundaries, tensors.interval_codes, table.bits)
        assert np.array_equal(packed.numpy(), numpy_packed(codes, table.bits)), (backend, x.dtype)
        got = backends.scale(grad, packed, levels if grad.dtype == torch.float64 else tensors.levels32, table.bits)
    assert same_bits(got.reshape(grad.shape), numpy_grad(table, codes, grad)), (backend, x.dtype)


@st.composite
def table_and_input(draw):
    table = draw(valid_tables())
    x, grad = draw(inputs(table))
    return table, x, grad


@COMMON
@given(case=table_and_input())
@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_kernels_match_the_numpy_reference(backend, case):
    check_kernel(backend, *case)


@settings(QUICK, suppress_health_check=[HealthCheck.too_slow])
@given(case=table_and_input())
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_triton_matches_the_numpy_reference(case):
    table, x, grad = case
    assume(x.numel() <= 64)
    check_kernel("triton", table, x, grad)
