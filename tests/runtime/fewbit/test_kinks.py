"""Exact gradients at kinks (runtime side), with torch as the oracle.

Convention (DESIGN.md): x >= boundary -> the interval on the right; the runtime rounds boundaries *up* to float32.
A table is exact at a kink k when its boundary sits at k where torch uses the right piece there, and at
nextafter(k, +inf) (float64) where torch uses the left piece. The shipped tables are built that way (design side,
14d015f) and are tested at the end; the tests above them do not depend on the shipped set: their tables are built
from the registry: boundaries at the kinks, one code per piece, levels = f' on each piece where
f' is piecewise constant (then the few-bit gradient is torch's, bitwise, everywhere) and distinct arbitrary levels
elsewhere (then the test checks which piece each point lands in).

Which piece torch uses at a kink is read from torch itself (float64 gradients at k and at its float64 neighbours);
where both pieces give the same derivative at k (elu with alpha = 1, softsign) either piece is accepted.
"""

import importlib.util
import math

import pytest
import torch

from fewbit_design.design import activations
from fewbit_design.runtime.fewbit import backends
from fewbit_design.runtime.fewbit import ops as op
from fewbit_design.table import Table

HAS_TRITON = importlib.util.find_spec("triton") is not None
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PIECEWISE_CONSTANT = ("relu", "leaky_relu", "relu6", "hardtanh", "threshold", "hardshrink", "softshrink")
KINKED = [name for name in activations.names() if activations.bind(name).breakpoints]
BACKENDS = ["reference", "numba", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))]


def torch_module(name):
    """torch's module for a registry activation, or (for entries with no torch.nn class, e.g. Hugging Face ones)
    the native function of the runtime's module for it: the function torch differentiates is the oracle."""
    bound = activations.bind(name)
    if bound.activation.torch_name:
        cls = getattr(torch.nn, bound.activation.torch_name)
        return cls(**bound.params) if bound.params else cls()
    from fewbit_design.runtime.fewbit import nn as runtime_nn

    for cls in vars(runtime_nn).values():
        if isinstance(cls, type) and getattr(cls, "activation", None) == name and hasattr(cls, "_native"):
            module = cls.__new__(cls)
            torch.nn.Module.__init__(module)
            for key, value in bound.params.items():
                setattr(module, key, value)
            return module._native
    pytest.skip(f"{name}: no torch module and no runtime module to take the native function from")


def torch_grad(name, x, grad=None):
    leaf = x.detach().clone().requires_grad_()
    out = torch_module(name)(leaf)
    out.backward(torch.ones_like(out) if grad is None else grad)
    return leaf.grad


def kink_sides(name):
    """[(kink, side)] with side 'left', 'right' or 'either': the piece whose derivative torch uses at the kink."""
    sides = []
    for kink in activations.bind(name).breakpoints:
        neighbours = [math.nextafter(kink, -math.inf), kink, math.nextafter(kink, math.inf)]
        points = torch.tensor(neighbours, dtype=torch.float64)
        below, at, above = torch_grad(name, points).tolist()
        if abs(at - below) <= 1e-12 and abs(at - above) <= 1e-12:
            sides.append((kink, "either"))
        else:
            sides.append((kink, "left" if abs(at - below) < abs(at - above) else "right"))
    return sides


def exact_table(name):
    """A table with boundaries exactly at the kinks, one code per piece, levels as described in the module doc."""
    bound = activations.bind(name)
    sides = kink_sides(name)
    boundaries = [math.nextafter(k, math.inf) if side == "left" else k for k, side in sides]
    kinks = [k for k, _ in sides]
    inner = [(a + b) / 2 for a, b in zip(kinks[:-1], kinks[1:], strict=True)]
    representatives = [kinks[0] - 1.0, *inner, kinks[-1] + 1.0]
    if name in PIECEWISE_CONSTANT:
        levels = torch_grad(name, torch.tensor(representatives, dtype=torch.float64)).tolist()
    else:
        levels = [0.25 + piece for piece in range(len(representatives))]  # distinct: a wrong piece is visible
    pieces = len(levels)
    return Table(
        activation=bound.name,
        params=dict(bound.params),
        bits=max(1, math.ceil(math.log2(pieces))),
        mode="intervals",
        symmetric=False,
        weight={"kind": "uniform", "low": -10.0, "high": 10.0},
        boundaries=boundaries,
        codes=list(range(pieces)),
        levels=levels,
        error=0.0,
        snr_db=None,
    )


def fewbit_grad(table, name, x, grad, backend):
    leaf = x.detach().clone().requires_grad_()
    with backends.use_backend(backend):
        out = op.fewbit_activation(leaf, torch_module(name), backends.table_tensors(table))
        out.backward(grad)
    return leaf.grad


def kink_points(name, dtype):
    """Each kink, its neighbours in ``dtype``, and +-0.0."""
    kinks = torch.tensor([k for k, _ in kink_sides(name)], dtype=dtype)
    up = torch.nextafter(kinks, torch.tensor(math.inf, dtype=dtype))
    down = torch.nextafter(kinks, torch.tensor(-math.inf, dtype=dtype))
    zeros = torch.tensor([0.0, -0.0], dtype=dtype)
    return torch.cat([kinks, up, down, zeros])


def expected_pieces(name, points):
    """The piece (interval index) or pieces torch uses at each point."""
    sides = kink_sides(name)
    result = []
    for value in points.to(torch.float64).tolist():
        piece = sum(value > k for k, _ in sides)
        options = {piece}
        for index, (k, side) in enumerate(sides):
            if value == k:
                options = {index} if side == "left" else {index + 1} if side == "right" else {index, index + 1}
        result.append(options)
    return result


def torch_oracle(name, x, grad):
    """torch's gradient, with the runtime's non-finite rule at NaN input (NaN: torch's own there depends on the
    element's position in the tensor, see tests/runtime/fewbit/test_nonfinite.py)."""
    return torch.where(torch.isnan(x), torch.full_like(grad, math.nan), torch_grad(name, x, grad))


def same_bits(a, b):
    """Bitwise equality, NaN == NaN (any payload): what 'torch's gradient, bitwise' means here."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a[~nan_a].view(integer), b[~nan_b].view(integer))


def test_the_exact_tables_are_built_as_documented():
    # relu: torch's relu'(0) = 0, the left piece, so the boundary is the float64 after 0
    table = exact_table("relu")
    assert table.boundaries.tolist() == [math.nextafter(0.0, math.inf)]
    assert table.levels.tolist() == [0.0, 1.0]
    # hardtanh: torch's backward is 0 for x <= min_val or x >= max_val
    assert kink_sides("hardtanh") == [(-1.0, "left"), (1.0, "right")]
    assert dict(kink_sides("softshrink")) == {-0.5: "right", 0.5: "left"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", KINKED)
def test_gradient_at_kinks_is_the_level_of_torchs_piece(name, dtype, backend):
    table = exact_table(name)
    points = kink_points(name, dtype)
    grad = fewbit_grad(table, name, points, torch.ones_like(points), backend)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    levels = torch.tensor(table.levels, dtype=compute).to(dtype).tolist()
    for value, got, options in zip(points.tolist(), grad.tolist(), expected_pieces(name, points), strict=True):
        allowed = {levels[piece] for piece in options}
        assert got in allowed, f"{name} {dtype} {backend}: gradient at x = {value!r} is {got}, expected {allowed}"


def special_and_random(name, dtype, count=120, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e-3, 0.3, 1.0, 4.0, 30.0], dtype=torch.float64)
    random = torch.randn(count, generator=generator, dtype=torch.float64) * scales[torch.arange(count) % 5]
    special = torch.tensor([1e-40, -1e-40, 1e30, -1e30, math.inf, -math.inf, math.nan], dtype=torch.float64)
    return torch.cat([random.to(dtype), kink_points(name, dtype), special.to(dtype)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", PIECEWISE_CONSTANT)
def test_piecewise_constant_gradient_is_torchs_bitwise_everywhere(name, dtype, backend):
    x = special_and_random(name, dtype)
    generator = torch.Generator().manual_seed(1)
    grad = (torch.randn(x.shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
    got = fewbit_grad(exact_table(name), name, x, grad, backend)
    expected = torch_oracle(name, x, grad)
    assert same_bits(got, expected), (name, dtype, backend, (got - expected).abs().max())


def test_zero_level_gives_plus_zero_like_torch():
    # regression: grad * 0 is -0.0 for a negative grad; torch's relu backward selects +0.0
    x = torch.tensor([-1.0, -2.0])
    for backend in ("reference", "numba"):
        got = fewbit_grad(exact_table("relu"), "relu", x, torch.tensor([-1.0, -3.0]), backend)
        assert torch.signbit(got).tolist() == [False, False], backend


def test_shipped_tables_sit_at_the_kinks():
    # the design side ships exact tables since 14d015f: relu's boundary is the float64 after 0, levels 0 and 1
    from fewbit_design.runtime import load_table

    table = load_table("relu", bits=1)
    assert table.boundaries.tolist() == [math.nextafter(0.0, math.inf)] and table.levels.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("name", PIECEWISE_CONSTANT)
def test_shipped_piecewise_constant_tables_are_exact(name):
    from fewbit_design.runtime import load_table

    table = load_table(name, bits=2)
    for dtype in DTYPES:
        x = special_and_random(name, dtype, count=100)
        grad = torch.randn(x.shape, dtype=torch.float64).to(dtype)
        for backend in ("reference", "numba"):
            assert same_bits(fewbit_grad(table, name, x, grad, backend), torch_oracle(name, x, grad)), (name, dtype)


@pytest.mark.parametrize("name", KINKED)
def test_shipped_tables_at_kinks_use_torchs_piece(name):
    # at a kink the few-bit gradient is the level of the piece torch uses: the same as at the neighbour on that side
    from fewbit_design.runtime import load_table

    table = load_table(name, bits=3)
    for dtype in DTYPES:
        for k, side in kink_sides(name):
            if side == "either":
                continue
            at = torch.tensor(k, dtype=dtype)
            neighbour = torch.nextafter(at, torch.tensor(-math.inf if side == "left" else math.inf, dtype=dtype))
            points = torch.stack([neighbour, at])
            for backend in ("reference", "numba"):
                grad = fewbit_grad(table, name, points, torch.ones_like(points), backend)
                assert grad[0] == grad[1], (name, dtype, k, side, backend, grad.tolist())
