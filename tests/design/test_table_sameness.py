"""The cross-machine definition of "the same table", without a second machine.

Perturbations imitate another machine (another quadrature order, grids moved by a few ulps, one thread, numba's JIT
off) and must be accepted; corrupted tables (a boundary moved, a level off by 1%, a stored error that does not match)
must be rejected naming the field and both values. The kink tests check, on the design side, that every table of
every activation with breakpoints gives torch's derivative at the kink, at +-0.0 and at the float neighbours.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fewbit_design.design import activations
from fewbit_design.design.canonical import jump_placements
from fewbit_design.table import Table, load
from fewbit_design.tables import TABLES_DIR, TableSpec, read_index, same
from fewbit_design.tables.perturb import ONE_THREAD, design_in_subprocess, perturbed, spread

# Small but varied: smooth (level sets and intervals), a mirror-symmetric f' under both weights, kinks, exact tables.
SPECS = [
    TableSpec("gelu", 3, "levelsets", False, "uniform"),
    TableSpec("gelu", 4, "intervals", False, "normal"),
    TableSpec("hardswish", 4, "levelsets", False, "uniform"),
    TableSpec("selu", 3, "intervals", False, "normal"),
    TableSpec("relu6", 3, "intervals", False, "normal"),
    TableSpec("sigmoid", 2, "intervals", True, "uniform"),
]


def _ids(specs):
    return [spec.file for spec in specs]


@pytest.fixture(scope="module")
def baseline():
    return {spec: spec.design() for spec in SPECS}


@pytest.mark.parametrize("kind", ["quadrature", "grid"])
def test_perturbed_designs_are_the_same_table(kind, baseline):
    for spec in SPECS:
        with perturbed(kind, seed=1):
            other = spec.design()
        assert same.differences(baseline[spec], other) == [], spec.file
        assert same.differences(other, baseline[spec]) == [], spec.file


def test_measured_spread_is_far_inside_the_tolerances():
    # The objective tolerance sits far above what a perturbation moves the error (measured over every activation:
    # 5.9e-13 relative at most), and no pinned value moves more than 1/10 of what it may; re-measure on two specs.
    worst = spread(SPECS[1:3], kinds=("quadrature", "grid"))
    for kind, distances in worst.items():
        assert distances["structure"] == 0, kind
        assert distances["error"] <= same.OBJECTIVE_RTOL / 1000, (kind, distances)
        assert distances["of_tolerance"] <= 0.1, (kind, distances)


def test_one_thread_in_a_subprocess_is_the_same_table(baseline):
    spec = SPECS[1]
    other = design_in_subprocess(spec, ONE_THREAD, timeout=300)
    assert same.differences(baseline[spec], other) == []


def test_numba_jit_off_is_the_same_table():
    # the DPs run as plain Python: a 1-bit design keeps this to seconds
    spec = TableSpec("silu", 1, "levelsets", False, "normal")
    other = design_in_subprocess(spec, {"NUMBA_DISABLE_JIT": "1"}, timeout=300)
    assert same.differences(spec.design(), other) == []


def _with(table: Table, **changes) -> Table:
    data = table.to_dict()
    data.update(changes)
    return Table.from_dict(data)


def _pinned_boundary(table: Table) -> int:
    context = same.Context(table)
    return int(np.argmax([context.curvature(table, i) for i in range(table.boundaries.size)]))


def test_a_boundary_moved_to_a_worse_place_is_rejected(baseline):
    fresh = baseline[SPECS[0]]
    i = _pinned_boundary(fresh)
    boundaries = fresh.boundaries.copy()
    boundaries[i] += 0.2 * (boundaries[i + 1] - boundaries[i])
    context = same.Context(fresh)
    moved = _with(fresh, boundaries=boundaries.tolist())
    moved = _with(moved, error=context.error(moved))  # a consistent stored error: only the optimum can tell
    problems = same.differences(moved, fresh, context)
    shipped_value, fresh_value = float(moved.boundaries[i]), float(fresh.boundaries[i])
    assert any(f"'boundaries[{i}]' is {shipped_value!r}, recomputed {fresh_value!r}" in p for p in problems), problems
    assert any("field 'error'" in p and "a fresh design reaches" in p for p in problems), problems


def test_a_level_off_by_one_percent_is_rejected(baseline):
    fresh = baseline[SPECS[0]]
    levels = fresh.levels.copy()
    levels[2] *= 1.01
    changed = _with(fresh, levels=levels.tolist())
    problems = same.differences(changed, fresh)
    shipped_value, fresh_value = float(changed.levels[2]), float(fresh.levels[2])
    assert any(f"'levels[2]' is {shipped_value!r}, recomputed {fresh_value!r}" in p for p in problems), problems


def test_a_stored_error_that_does_not_match_is_rejected(baseline):
    fresh = baseline[SPECS[0]]
    wrong = _with(fresh, error=fresh.error * (1 + 1e-6))
    problems = same.differences(wrong, fresh)
    assert len(problems) == 1, problems
    assert f"field 'error' is {float(wrong.error)!r}, recomputed from its own boundaries" in problems[0]


def test_structure_must_be_exact(baseline):
    a = baseline[SPECS[0]]
    b = design_b = SPECS[0].design()
    assert same.differences(a, b) == []  # same machine, same process: identical
    assert a.to_json() == design_b.to_json()  # byte for byte, same machine and versions only
    other = _with(b, bits=4)
    assert same.differences(a, other)[0] == "field 'bits' is 3, recomputed 4"


def test_degenerate_mirror_optima_get_one_canonical_table():
    # gelu' (-x) = 1 - gelu'(x) and the normal weight is even: a table and its mirror image have the same error.
    table = TableSpec("gelu", 4, "intervals", False, "normal").design()
    mirror = Table.from_dict(
        {
            **table.to_dict(),
            "boundaries": (-table.boundaries[::-1]).tolist(),
            "levels": (1.0 - table.levels[::-1]).tolist(),
        }
    )
    assert same.Context(table).error(mirror) == pytest.approx(table.error, rel=1e-12)
    assert np.clip(table.boundaries, -10, 10).sum() >= np.clip(mirror.boundaries, -10, 10).sum()  # the rule's pick


# ----------------------------------------------------------------------------------------------------------------------
# Exact gradients at kinks, design side

KINKED = [name for name in activations.names() if activations.bind(name).breakpoints]
PIECEWISE_CONSTANT = {"relu", "leaky_relu", "relu6", "hardtanh", "threshold", "hardshrink", "softshrink"}


def _shipped(name: str) -> list[Table]:
    entries = [e for e in read_index()["tables"] if e["activation"] == name]
    assert entries, name
    return [load(TABLES_DIR / e["file"]) for e in entries]


def _round_up_float32(boundaries: np.ndarray) -> np.ndarray:
    """The runtime's cast: each boundary rounded up to a float32 (so x >= boundary stays exact)."""
    rounded = boundaries.astype(np.float32)
    below = rounded.astype(np.float64) < boundaries
    rounded[below] = np.nextafter(rounded[below], np.float32(np.inf))
    return rounded


def _kink_points(bound) -> np.ndarray:
    kinks = np.array(bound.breakpoints, dtype=np.float64)
    return np.concatenate(
        [kinks, np.nextafter(kinks, np.inf), np.nextafter(kinks, -np.inf), [0.0, -0.0, 5e-324, -5e-324]]
    )


def test_kinks_are_listed_and_placed_as_torch_differentiates():
    assert set(KINKED) >= PIECEWISE_CONSTANT | {"hardsigmoid", "hardswish", "elu", "celu", "selu", "relu_squared"}
    # relu'(0) = 0: the left piece at the kink, so the boundary is the next float after 0
    assert jump_placements(activations.bind("relu").df, (0.0,)) == {0.0: 5e-324}
    # hardswish'(3) = 1 (right piece), hardswish'(-3) = 0 (left piece)
    assert jump_placements(activations.bind("hardswish").df, (-3.0, 3.0)) == {-3.0: np.nextafter(-3.0, 4), 3.0: 3.0}
    assert jump_placements(activations.bind("elu").df, (0.0,)) == {}  # continuous f' at 0 with alpha = 1


@pytest.mark.parametrize("name", KINKED)
def test_every_shipped_table_gives_torchs_piece_at_the_kinks(name):
    bound = activations.bind(name)
    inside = [b for b in bound.breakpoints if -10.0 < b < 10.0]  # the shipped range (softplus jumps at 20)
    placements = jump_placements(bound.df, inside)
    checked = 0
    for table in _shipped(name):
        for kink, place in placements.items():
            # a boundary next to a kink sits exactly at its place (not a rounding error away from it)
            near = table.boundaries[np.abs(table.boundaries - kink) <= 2e-5]
            assert np.all(near == place), (table.source, kink, near)
            left, right = np.nextafter(kink, -np.inf), np.nextafter(kink, np.inf)
            if table.code(left) == table.code(right):
                continue  # the table does not separate the two pieces here
            # the kink itself takes the piece torch's derivative uses there, in float64 and in float32
            expected = table.code(right) if place == kink else table.code(left)
            assert table.code(kink) == expected, (table.source, kink)
            if kink == 0.0:
                assert table.code(-0.0) == expected, table.source
            b32 = _round_up_float32(table.boundaries)
            x32 = np.array([kink, np.nextafter(np.float32(kink), np.float32(-np.inf))], dtype=np.float32)
            code32 = table.codes[np.searchsorted(b32, x32, side="right")]
            assert code32[0] == expected, (table.source, kink)
            checked += 1
    assert checked or not placements


@pytest.mark.parametrize("name", sorted(PIECEWISE_CONSTANT))
def test_piecewise_constant_tables_are_exact_where_the_bits_allow(name):
    bound = activations.bind(name)
    x = np.concatenate([np.linspace(-12.0, 12.0, 4801), _kink_points(bound), [-1e3, 1e3]])
    x32 = x.astype(np.float32)
    x32 = np.concatenate([x32, np.nextafter(x32, np.float32(np.inf)), np.nextafter(x32, np.float32(-np.inf))])
    pieces = 1 + len(bound.breakpoints)
    needed = pieces if not bound.even else 1 + len(bound.breakpoints) // 2
    exact = 0
    for table in _shipped(name):
        if table.mode == "intervals" and needed > 2**table.bits:
            continue
        np.testing.assert_array_equal(table.q(x), bound.df(x), err_msg=table.source)
        codes = table.codes[np.searchsorted(_round_up_float32(table.boundaries), x32, side="right")]
        np.testing.assert_array_equal(table.levels[codes], bound.df(x32.astype(np.float64)), err_msg=table.source)
        assert table.error == 0.0, table.source
        exact += 1
    assert exact >= 30


def test_exact_values_are_written_in_full_precision(tmp_path):
    table = TableSpec("hardsigmoid", 2, "levelsets", False, "uniform").design()
    data = json.loads(table.to_json())
    assert data["boundaries"][0] == float(np.nextafter(-3.0, 0.0))  # not rounded to -3.0 by 12 digits
    assert 1 / 6 in data["levels"]
    assert Table.from_dict(data).q(np.array([-3.0, np.nextafter(-3.0, 0.0)])).tolist() == [0.0, 1 / 6]
