"""Prefix integrals, moments and the adaptive quadrature, checked against scipy.integrate.quad (independent)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import integrate as scipy_integrate

from fewbit_design.design import activations, weights
from fewbit_design.design.integrals import (
    Antiderivative,
    Problem,
    cell_integrals,
    integrate,
    make_grid,
    moments,
    prefix_integrals,
    split_at,
)

CASES = [
    ("gelu", "normal", {}),
    ("selu", "uniform", {}),  # f' jumps at 0
    ("softplus", "laplace", {"loc": 0.5, "scale": 2.0}),  # w kinks at 0.5
    ("hardswish", "student-t", {"df": 3.0}),  # f' jumps at -3 and 3
]


def _problem(name: str, kind: str, options: dict, symmetric: bool = False, low=-10.0, high=10.0) -> Problem:
    act = activations.bind(name)
    w = weights.make_weight(kind, low=low, high=high, **options)
    return Problem(act.df, w, low, high, breakpoints=act.breakpoints + w.breakpoints, symmetric=symmetric)


def _quad(function, a: float, b: float, points=()) -> float:
    inside = [p for p in points if a < p < b]
    return scipy_integrate.quad(function, a, b, points=inside or None, epsabs=1e-14, epsrel=1e-13, limit=500)[0]


def _quad_moments(name: str, kind: str, options: dict, a: float, b: float) -> np.ndarray:
    act = activations.bind(name)
    w = weights.make_weight(kind, **options)
    points = act.breakpoints + w.breakpoints
    return np.array([_quad(lambda x, k=k: float(w(x) * act.df(x) ** k), a, b, points) for k in range(3)])


@pytest.mark.parametrize(("name", "kind", "options"), CASES)
def test_prefix_integrals_match_quad(name, kind, options):
    problem = _problem(name, kind, options)
    grid = make_grid(-10.0, 10.0, 801, breakpoints=problem.breakpoints)
    prefix = prefix_integrals(problem, grid)
    assert prefix.shape == (3, grid.size)
    assert np.all(prefix[:, 0] == 0)
    for index in (200, 433, grid.size - 1):
        expected = _quad_moments(name, kind, options, -10.0, grid[index])
        np.testing.assert_allclose(prefix[:, index], expected, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize(("name", "kind", "options"), CASES)
def test_moments_and_antiderivative_match_quad(name, kind, options):
    problem = _problem(name, kind, options)
    rng = np.random.default_rng(1)
    a = np.sort(rng.uniform(-9, 9, 5))
    b = a + rng.uniform(0.01, 4.0, 5)
    got = moments(problem, a, b)
    expected = np.stack([_quad_moments(name, kind, options, lo, hi) for lo, hi in zip(a, b, strict=True)], axis=1)
    np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-13)
    antiderivative = Antiderivative(problem, make_grid(-10.0, 10.0, 1025, breakpoints=problem.breakpoints))
    np.testing.assert_allclose(antiderivative.moments(a, b), expected, rtol=1e-10, atol=1e-13)


def test_symmetric_moments_fold_both_sides():
    # Moments of |x| in [a, b] equal the plain moments of [a, b] plus those of [-b, -a] (any f', here silu').
    plain = _problem("silu", "normal", {"loc": 0.7}, low=-4.0, high=10.0)
    folded = _problem("silu", "normal", {"loc": 0.7}, symmetric=True, low=-4.0, high=10.0)
    assert (folded.low, folded.high) == (0.0, 10.0)
    assert 4.0 in folded.breakpoints  # the weight's lower edge folds onto u = 4
    a, b = np.array([0.0, 0.5, 3.0, 6.0]), np.array([0.5, 3.0, 6.0, 10.0])
    expected = moments(plain, a, b) + moments(plain, -b, -a)
    np.testing.assert_allclose(moments(folded, a, b), expected, rtol=1e-13, atol=1e-15)


def test_make_grid_contains_breakpoints_and_ends():
    grid = make_grid(-10.0, 10.0, 101, breakpoints=[-3.0, 0.001, 6.0, 12.0])
    assert grid[0] == -10.0 and grid[-1] == 10.0
    assert np.all(np.diff(grid) > 0)
    for b in (-3.0, 0.001, 6.0):
        assert b in grid
    assert 12.0 not in grid
    # A narrow weight pulls points towards it.
    w = weights.make_weight("normal", scale=0.05)
    dense = make_grid(-10.0, 10.0, 101, density=w)
    assert np.count_nonzero(np.abs(dense) < 0.2) > 10


def test_integrate_known_values_and_components():
    a = np.array([0.0, -1.0, 2.0])
    b = np.array([1.0, 3.0, 2.0])  # the last interval is empty

    def func(x, index):
        return np.stack([np.exp(x), np.sin(x) * index[:, None]])

    got = integrate(func, a, b, components=2)
    np.testing.assert_allclose(got[0], [np.e - 1, np.exp(3) - np.exp(-1), 0.0], rtol=1e-14)
    np.testing.assert_allclose(got[1], [0.0, 1 * (np.cos(-1) - np.cos(3)), 0.0], atol=1e-15)


def test_integrate_adapts_to_a_sharp_peak():
    # A narrow Gaussian inside a wide interval: the adaptive rule must resolve it (value by its closed form).
    got = integrate(lambda x, k: np.exp(-0.5 * ((x - 0.3) / 0.05) ** 2)[None], np.array([-10.0]), np.array([10.0]))
    np.testing.assert_allclose(got[0, 0], 0.05 * np.sqrt(2 * np.pi), rtol=1e-12)


def test_split_at():
    a, b = np.array([-1.0, 0.0, 2.0]), np.array([0.0, 3.0, 5.0])
    starts, ends, owner = split_at(a, b, np.array([-0.5, 0.0, 1, 2, 4]))
    assert starts.tolist() == [-1.0, -0.5, 0.0, 1.0, 2.0, 2.0, 4.0]
    assert ends.tolist() == [-0.5, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert owner.tolist() == [0, 0, 1, 1, 1, 2, 2]


def test_cell_integrals_sum_to_total():
    problem = _problem("tanh", "uniform", {})
    grid = make_grid(-10.0, 10.0, 64)
    cells = cell_integrals(problem, grid)
    expected = _quad_moments("tanh", "uniform", {}, -10.0, 10.0)
    np.testing.assert_allclose(cells.sum(axis=1), expected, rtol=1e-12)
