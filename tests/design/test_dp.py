"""Both dynamic programs against brute-force enumeration, and the fast versions against the plain O(n^2 K) ones."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fewbit_design.design import dp


def _prefix(masses: np.ndarray, values: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    seconds = masses * values * values + (0.0 if extra is None else extra)
    return np.vstack([np.r_[0, np.cumsum(masses)], np.r_[0, np.cumsum(masses * values)], np.r_[0, np.cumsum(seconds)]])


def _direct_cost(masses, values, extra, labels) -> float:
    """The weighted squared error of a labelling, computed from scratch (no prefix sums)."""
    total = float(np.sum(extra))
    for label in np.unique(labels):
        m, v = masses[labels == label], values[labels == label]
        mean = np.sum(m * v) / np.sum(m)
        total += float(np.sum(m * (v - mean) ** 2))
    return total


def _brute_force_contiguous(masses, values, extra, K):
    """Every split of the sequence into K non-empty contiguous runs: (best cost, best cuts)."""
    n = masses.size
    best, best_cuts = np.inf, None
    for cuts in itertools.combinations(range(1, n), K - 1):
        labels = np.searchsorted(np.array(cuts), np.arange(n), side="right")
        cost = _direct_cost(masses, values, extra, labels)
        if cost < best - 1e-12:
            best, best_cuts = cost, np.array(cuts)
    return best, best_cuts


def _random_atoms(rng, n, ties=False):
    masses = rng.uniform(0.1, 1.0, n)
    values = rng.normal(size=n)
    if ties:
        values = np.round(values)
    extra = rng.uniform(0.0, 0.05, n)  # each atom's own spread (a grid cell is not a point)
    return masses, values, extra


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_intervals_dp_matches_brute_force(K, seed):
    rng = np.random.default_rng(seed)
    masses, values, extra = _random_atoms(rng, 12)
    cost, cuts = dp.intervals_dp(_prefix(masses, values, extra), K)
    best, best_cuts = _brute_force_contiguous(masses, values, extra, K)
    assert cost == pytest.approx(best, rel=1e-12)
    assert cuts.tolist() == best_cuts.tolist()


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("seed", range(3))
def test_levelsets_dp_matches_brute_force_over_every_labelling(K, seed):
    # The level-sets DP works on atoms sorted by value; brute force tries every assignment of atoms to K clusters,
    # contiguous or not, so this also checks that sorted contiguous clusters are optimal.
    rng = np.random.default_rng(100 + seed)
    masses, values, extra = _random_atoms(rng, 8 if K < 4 else 7)
    order = np.argsort(values)
    cost, _ = dp.levelsets_dp(_prefix(masses[order], values[order], extra[order]), K)
    best = min(
        _direct_cost(masses, values, extra, np.array(labels))
        for labels in itertools.product(range(K), repeat=masses.size)
        if len(set(labels)) == K
    )
    assert cost == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_levelsets_dp_matches_brute_force_contiguous(K):
    rng = np.random.default_rng(7)
    masses, values, extra = _random_atoms(rng, 12)
    order = np.argsort(values)
    masses, values, extra = masses[order], values[order], extra[order]
    cost, cuts = dp.levelsets_dp(_prefix(masses, values, extra), K)
    best, best_cuts = _brute_force_contiguous(masses, values, extra, K)
    assert cost == pytest.approx(best, rel=1e-12)
    assert cuts.tolist() == best_cuts.tolist()


@pytest.mark.parametrize("parallel", [False, True])
def test_pruned_intervals_dp_identical_to_plain(parallel):
    rng = np.random.default_rng(3)
    for trial in range(12 if parallel else 40):
        n = int(rng.integers(5, 150))
        masses, values, extra = _random_atoms(rng, n, ties=trial % 3 == 0)
        if trial % 4 == 0:
            values[: n // 2] = 0.0  # long flat runs: the pruning's hard case
            extra[: n // 2] = 0.0
        prefix = _prefix(masses, values, extra if trial % 2 else None)
        for K in (2, 3, 5, 9):
            if K > n:
                continue
            fast = dp.intervals_dp(prefix, K, parallel=parallel)
            plain = dp.intervals_dp_reference(prefix, K)
            assert fast[0] == plain[0]
            assert fast[1].tolist() == plain[1].tolist()


@pytest.mark.parametrize("parallel", [False, True])
def test_levelsets_dp_equals_plain(parallel):
    rng = np.random.default_rng(5)
    for _ in range(20):
        n = int(rng.integers(5, 300))
        masses, values, extra = _random_atoms(rng, n)
        order = np.argsort(values)
        prefix = _prefix(masses[order], values[order], extra[order])
        for K in (2, 4, 7):
            fast = dp.levelsets_dp(prefix, K, parallel=parallel)
            plain = dp.levelsets_dp_reference(prefix, K)
            assert fast[0] == pytest.approx(plain[0], rel=1e-12, abs=1e-14)


def test_parallel_and_serial_layers_agree_on_a_large_problem():
    rng = np.random.default_rng(11)
    values = np.sort(rng.normal(size=20000))
    prefix = _prefix(np.ones_like(values), values)
    serial = dp.levelsets_dp(prefix, 16, parallel=False)
    parallel = dp.levelsets_dp(prefix, 16, parallel=True)
    assert serial[0] == parallel[0] and serial[1].tolist() == parallel[1].tolist()
    x = np.linspace(-10, 10, 3000)
    prefix = _prefix(np.full(x.size, 20 / x.size), np.exp(-x * x))
    serial = dp.intervals_dp(prefix, 16, parallel=False)
    parallel = dp.intervals_dp(prefix, 16, parallel=True)
    assert serial[0] == parallel[0] and serial[1].tolist() == parallel[1].tolist()


def test_kmeans_1d_merges_identical_values_and_returns_fewer_clusters():
    values = np.array([3.0, 1.0, 1.0, 3.0, 1.0, 3.0 + 1e-15])
    cost, levels, thresholds = dp.kmeans_1d(values, K=4)
    assert levels.tolist() == [1.0, 3.0]
    assert cost == pytest.approx(0.0, abs=1e-12)
    assert thresholds.tolist() == [3.0]


def test_kmeans_1d_weighted_and_reference_agree():
    rng = np.random.default_rng(2)
    values = np.concatenate([rng.normal(-5, 0.1, 50), rng.normal(0, 0.1, 50), rng.normal(7, 0.1, 50)])
    weights = rng.uniform(0.5, 2.0, values.size)
    cost, levels, _ = dp.kmeans_1d(values, weights, K=3)
    cost_ref, levels_ref, _ = dp.kmeans_1d(values, weights, K=3, reference=True)
    assert cost == pytest.approx(cost_ref, rel=1e-12)
    np.testing.assert_allclose(levels, levels_ref, rtol=1e-13)
    # Three well separated groups: the levels are their weighted means.
    for level, center in zip(levels, (-5, 0, 7), strict=True):
        group = np.abs(values - center) < 1
        assert level == pytest.approx(np.sum(weights[group] * values[group]) / np.sum(weights[group]), rel=1e-12)


def test_zero_cost_ties_are_broken_like_the_plain_dp():
    # relu' on a grid: many optimal splits with cost exactly 0.
    values = np.r_[np.zeros(30), np.ones(30)]
    prefix = _prefix(np.ones(60), values)
    for K in (2, 3, 8):
        assert dp.intervals_dp(prefix, K)[1].tolist() == dp.intervals_dp_reference(prefix, K)[1].tolist()
        assert dp.intervals_dp(prefix, K)[0] == 0.0
