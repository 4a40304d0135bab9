"""``design(activation, bits, ...) -> Table``: optimal few-bit approximations of an activation's derivative.

Two modes (DESIGN.md, "The approximation"):

* ``levelsets`` (default): the optimal scalar quantizer of f'(X), X ~ w. The grid cells of [A, B], sorted by
  their mean f', are split into 2**bits clusters by the exact level-sets DP (weighted 1-D k-means, which includes each
  cell's own spread); Lloyd iterations (with Newton steps on the levels) on the continuous problem then move the
  levels to the conditional means and the code regions to the nearest-level sets, whose boundaries are roots of
  f'(x) = midpoint of adjacent levels. Lloyd also starts from the intervals-mode levels, and the intervals-mode table
  itself is a candidate: the best table is kept, so level sets never lose to intervals.
* ``intervals`` (the paper): 2**bits intervals with codes 0..M-1 from the exact grid DP of eq. 7, refined
  continuously with the gradient of eq. 5 (damped Newton with its tridiagonal Hessian, L-BFGS-B as a fallback).
  ``symmetric`` quantizes |x| (codes shared by x and -x) and reports the full-line error, as the paper does for
  sigmoid and tanh.

The stored ``error`` is L of the final table by adaptive quadrature (split at every boundary and breakpoint),
never a grid value; ``design["grid_error"]`` is the grid DP's L.

Default grid sizes (``grid=None``), chosen so that results are converged and an 8-bit design stays around a second:
with the default spacing (half the points follow w (f'')^2), quadrupling the grid changes the stored error by less
than 1e-11 relative at 2, 4, 6, 7 and 8 bits in our checks (gelu, silu, selu, sigmoid, hardswish, mish, softsign,
elu; uniform and normal weights; both modes), except one 8-bit level-sets table (selu, normal weight: 6e-6), where
the finer grid starts refinement in a slightly better local optimum:

* intervals: max(2048, 32 * 2**bits) grid points (the DP is O(n^2 K) in the worst case; refinement removes the
  grid's resolution limit);
* level-sets: max(4096, 64 * 2**bits) grid cells for the DP (O(K n log n)), a scan grid of 16384 points for the
  roots of the level-set boundaries.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import FewBitError, check_bits, check_choice
from ..table import MODES, Table, format_float
from . import activations as registry
from .canonical import canonicalize
from .integrals import (
    Antiderivative,
    Problem,
    cell_integrals,
    graded,
    integrate,
    make_grid,
    prefix_integrals,
    split_at,
)
from .refine import refine_intervals, refine_levelsets, regions_loss
from .weights import Weight, check_design_range, make_weight

__all__ = ["design", "default_grid", "table_error", "signal_power", "check_derivative", "snr_db_of", "describe"]

#: Panels of the fine grid that carries the accurate moments of the refinements.
PANELS = 4096
#: Points of the scan grid on which level-set crossings are bracketed.
SCAN_POINTS = 16384
#: Largest grid accepted.
MAX_GRID = 1 << 22
#: Largest |f'| a table may hold: the runtime multiplies levels in float32 (and f'**2 must stay far inside float64).
MAX_DERIVATIVE = float(np.finfo(np.float32).max)
#: Points of the scan that checks f' over the design range before any work.
CHECK_POINTS = 4097

Progress = Callable[[str], None]
#: Grid spacings: ``adaptive`` follows w (f'')^2 (half the points) and is uniform otherwise; ``uniform`` is the
#: paper's evenly spaced grid.
SPACINGS = ("adaptive", "uniform")


def default_grid(bits: int, mode: str) -> int:
    """The default number of grid points of a design (see the module header)."""
    if mode == "intervals":
        return max(2048, 32 * 2**bits)
    return max(4096, 64 * 2**bits)


def _bind(activation: Any, params: dict[str, Any] | None) -> registry.BoundActivation:
    if isinstance(activation, registry.BoundActivation):
        if params:
            raise FewBitError(f"activation {activation.name!r} is already bound; pass params to bind() instead")
        return activation
    return registry.bind(activation, params)


def _weight(weight: str | Weight, low: float, high: float, loc: Any, scale: Any, df: Any, samples: Any) -> Weight:
    if isinstance(weight, Weight):
        return weight
    return make_weight(weight, low=low, high=high, loc=loc, scale=scale, df=df, samples=samples)


def _check_grid(grid: Any, bits: int) -> int | None:
    if grid is None:
        return None
    minimum = 2**bits + 1
    if isinstance(grid, bool) or not isinstance(grid, int | np.integer) or not minimum <= grid <= MAX_GRID:
        raise FewBitError(f"grid must be an integer from {minimum} (2**bits + 1) to {MAX_GRID}, got {grid!r}")
    return int(grid)


def table_error(problem: Problem, boundaries: np.ndarray, codes: np.ndarray, levels: np.ndarray) -> float:
    """L = integral of (f' - q)**2 w over the problem's range, by adaptive quadrature split at every boundary."""
    edges = np.concatenate([[problem.low], boundaries[(boundaries > problem.low) & (boundaries < problem.high)]])
    edges = np.concatenate([edges, [problem.high]])
    # The level of each piece between edges: the interval holding its middle.
    middle = (edges[:-1] + edges[1:]) / 2.0
    piece_levels = levels[codes[np.searchsorted(boundaries, middle, side="right")]]
    starts, ends, owner = _graded_pieces(edges, problem.split_points)
    y = piece_levels[owner]
    values = integrate(lambda x, k: problem.error_density(x, y[k][:, None])[None], starts, ends)
    return float(values.sum())


def describe(bound: registry.BoundActivation) -> str:
    """``leaky_relu(negative_slope=0.2)``: the activation with its parameters, for messages."""
    params = ", ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value!r}"
                       for key, value in bound.params.items())  # fmt: skip
    return f"{bound.name}({params})" if params else bound.name


def check_derivative(bound: registry.BoundActivation, w: Weight) -> None:
    """Check f' on a scan of the design range (where w > 0) before any work: finite, and within
    :data:`MAX_DERIVATIVE`. A user activation (``--activation-module``) is also checked for jumps and unbounded
    derivatives (see :meth:`~fewbit_design.design.activations.BoundActivation.check_range`).

    Without this an overflowing f' (``leaky_relu`` with ``negative_slope=1e308``) ran the adaptive quadrature on
    infinite values until it ran out of memory.
    """
    bound.check_range(w.low, w.high)
    x = np.linspace(w.low, w.high, CHECK_POINTS)
    inside = np.asarray(bound.breakpoints + w.breakpoints, dtype=np.float64)
    x = np.union1d(x, inside[(inside > w.low) & (inside < w.high)])
    x = x[np.asarray(w(x)) > 0]
    if x.size == 0:
        return
    d = np.asarray(bound.df(x), dtype=np.float64)
    what = f"the derivative of {describe(bound)}"
    bad = ~np.isfinite(d)
    if bad.any():
        raise FewBitError(f"{what} is not finite at x={float(x[bad][0]):g} inside the design range")
    big = np.abs(d) > MAX_DERIVATIVE
    if big.any():
        at = int(np.argmax(np.abs(d)))
        raise FewBitError(
            f"{what} reaches {float(d[at]):g} at x={float(x[at]):g} inside the design range; a table holds levels "
            f"within +-{MAX_DERIVATIVE:.3g} (float32, the dtype the runtime multiplies in)"
        )


def snr_db_of(signal: float, error: float, what: str) -> float | None:
    """``10 log10(signal / error)`` in dB; None when the table is exact (``error == 0``).

    "Exact" means q = f' wherever w > 0, up to the quadrature's rounding; that includes f' = 0 there (a table of
    zeros, whose SNR 0/0 is undefined). Computed as a difference of logarithms, so a tiny error cannot overflow the
    ratio to an infinite SNR.
    """
    if error == 0:
        return None
    if not signal > 0:
        raise FewBitError(
            f"{what}: the integral of f'**2 w is 0 but the table's error is {error:g}: f' is not integrable as "
            "sampled (a spike narrower than the quadrature sees?)"
        )
    return 10.0 * (math.log10(signal) - math.log10(error))


def signal_power(problem: Problem, boundaries: np.ndarray = ()) -> float:
    """The integral of f'**2 w over the range (the numerator of the SNR), split at the table's ``boundaries`` (where
    f' changes most) and graded toward every split like :func:`table_error`."""
    inside = np.abs(np.asarray(boundaries, dtype=np.float64)) if problem.symmetric else np.asarray(boundaries, float)
    inside = np.unique(inside[(inside > problem.low) & (inside < problem.high)])
    edges = np.concatenate([[problem.low], inside, [problem.high]])
    starts, ends, _ = _graded_pieces(edges, problem.split_points)
    values = integrate(lambda x, k: problem.densities(x)[2:], starts, ends)
    return float(values.sum())


def _graded_pieces(edges: np.ndarray, split_points: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The intervals between ``edges`` (a table's boundaries and the range's ends), graded toward their ends
    (:func:`~fewbit_design.design.integrals.graded`), then split at ``split_points``: (starts, ends, interval of each
    piece). Grading goes where q jumps; the split points (breakpoints of f', the nodes of an empirical weight) only
    split, or an empirical weight's 8193 nodes would each be graded."""
    starts, ends, owner = graded(edges[:-1], edges[1:], np.arange(edges.size - 1))
    starts, ends, piece = split_at(starts, ends, split_points)
    return starts, ends, owner[piece]


def _point_density(problem: Problem, spacing: str) -> Callable | None:
    """Where grid points go: w (f'')^2, the density whose cube root spaces an optimal fine quantizer.

    Mixed half and half with uniform spacing by :func:`make_grid`; ``spacing='uniform'`` gives plain even spacing
    (the paper's grid).
    """
    if spacing == "uniform":
        return None

    def density(x: np.ndarray) -> np.ndarray:
        d = problem.densities(x)
        mean = np.where(d[0] > 0, d[1] / np.where(d[0] > 0, d[0], 1.0), 0.0)
        return d[0] * np.gradient(mean, x) ** 2 + 1e-12 * d[0]

    return density


def _panel_grid(problem: Problem, major: np.ndarray, density: Callable | None) -> np.ndarray:
    grid = make_grid(problem.low, problem.high, PANELS + 1, breakpoints=major, density=density)
    return np.union1d(grid, problem.breakpoints)


def _fold(points: np.ndarray, problem: Problem) -> np.ndarray:
    points = np.abs(points) if problem.symmetric else points
    return np.unique(points[(points > problem.low) & (points < problem.high)])


def _torch_threads_kept(function: Callable) -> Callable:
    """numba's parallel DP runs on the OpenMP runtime that torch shares, and resets torch's thread count: put it back
    afterwards when torch is already imported (never import it here: the design package runs without torch).
    Measured before this: two 1-thread training processes on 2 cores ran a GPT-2 step in 2.0 s instead of 0.23 s
    after designing tables, each then using 2 spinning OpenMP threads."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None else None
        try:
            return function(*args, **kwargs)
        finally:
            if threads is not None and torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    return wrapper


@_torch_threads_kept
def design(
    activation: str | registry.Activation | registry.BoundActivation,
    bits: int,
    *,
    params: dict[str, Any] | None = None,
    weight: str | Weight = "uniform",
    low: float = -10.0,
    high: float = 10.0,
    loc: float | None = 0.0,
    scale: float | None = 1.0,
    df: float | None = None,
    samples: Any = None,
    mode: str = "levelsets",
    symmetric: bool = False,
    grid: int | None = None,
    spacing: str = "adaptive",
    refine: bool = True,
    progress: Progress | None = None,
) -> Table:
    """Design the optimal ``bits``-bit piecewise-constant approximation of an activation's derivative.

    ``activation`` is a registry name (``fewbit-design list``), an :class:`~fewbit_design.design.activations.Activation`
    (bound with ``params``) or a :class:`~fewbit_design.design.activations.BoundActivation`. ``weight`` is a kind
    (uniform, normal, laplace, student-t, empirical, with ``loc``, ``scale``, ``df``, ``samples``) on the design range
    [``low``, ``high``], or a :class:`~fewbit_design.design.weights.Weight`, whose own range is then used. ``mode`` is
    ``'levelsets'`` or ``'intervals'``; ``symmetric`` (intervals only) quantizes |x|. ``grid`` overrides the default
    grid size and ``spacing='uniform'`` spaces it evenly (the paper's grid) instead of following w (f'')^2;
    ``refine=False`` keeps the grid DP's solution. ``progress`` receives a short message per stage.

    >>> table = design("gelu", 3, mode="intervals", grid=513)
    >>> table.bits, table.mode, len(table.codes)
    (3, 'intervals', 8)
    """
    bits = check_bits(bits)
    mode = check_choice("mode", mode, MODES)
    if not isinstance(symmetric, bool | np.bool_):
        raise FewBitError(f"symmetric must be True or False, got {symmetric!r}")
    symmetric = bool(symmetric)
    if symmetric and mode != "intervals":
        raise FewBitError(f"symmetric applies only to mode 'intervals' (it quantizes |x|), got mode {mode!r}")
    grid = _check_grid(grid, bits)
    spacing = check_choice("spacing", spacing, SPACINGS)
    if not isinstance(weight, Weight):
        low, high = check_design_range(low, high)
    bound = _bind(activation, params)
    w = _weight(weight, low, high, loc, scale, df, samples)
    check_derivative(bound, w)
    try:
        # Every overflow or invalid operation of the design's own arithmetic is an error here, never a nan or inf
        # carried on (f' and w evaluate with their own errstate and are checked for finite values).
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            return _design(bound, w, bits, mode, symmetric, grid, spacing, refine, progress)
    except FloatingPointError as exc:
        raise FewBitError(
            f"designing a {bits}-bit table for {describe(bound)} with weight {w.kind!r} on [{w.low:g}, {w.high:g}] "
            f"overflows float64 ({exc}): the activation's parameters, the weight or the range are too extreme"
        ) from None


def _design(
    bound: registry.BoundActivation,
    w: Weight,
    bits: int,
    mode: str,
    symmetric: bool,
    grid: int | None,
    spacing: str,
    refine: bool,
    progress: Progress | None,
) -> Table:
    say = progress or (lambda message: None)
    points = grid if grid is not None else default_grid(bits, mode)

    major = np.asarray(bound.breakpoints + w.breakpoints, dtype=np.float64)
    nodes = w.nodes if w.kind == "empirical" else None
    everything = major if nodes is None else np.concatenate([major, nodes])
    name = f"the derivative of {bound.name}"
    # A coarse grid that follows the weight: adaptive quadrature splits there, so a narrow weight is never missed.
    split = make_grid(w.low, w.high, 257, density=w) if w.kind != "uniform" else ()
    full = Problem(bound.df, w, w.low, w.high, breakpoints=everything, name=name, split_points=split)

    if mode == "intervals":
        boundaries, codes, levels, info = _design_intervals(
            full, bound, w, bits, points, symmetric, refine, spacing, say
        )
    else:
        boundaries, codes, levels, info = _design_levelsets(full, w, major, bits, points, refine, spacing, say)

    say("canonical form (kinks, exact constants, flat runs, mirror images)")
    canonical = canonicalize(
        boundaries, codes, levels, df=bound.df, breakpoints=bound.breakpoints, weight=w, low=w.low, high=w.high,
        mode=mode, symmetric=symmetric,
    )  # fmt: skip
    boundaries, codes, levels = canonical.boundaries, canonical.codes, canonical.levels
    say("final error by adaptive quadrature")
    error = table_error(full, boundaries, codes, levels)
    snr_db = snr_db_of(signal_power(full, boundaries), error, name)
    record = {"grid": int(points), "refined": bool(info["refined"]), "version": __version__}
    record["grid_error"] = format_float(info["grid_error"])
    record["iterations"] = int(info["iterations"])
    if "start" in info:
        record["start"] = info["start"]
    if canonical.exact_boundaries or canonical.exact_levels:
        record["exact"] = {"boundaries": canonical.exact_boundaries, "levels": canonical.exact_levels}
    return Table(
        activation=bound.name,
        params=dict(bound.params),
        bits=bits,
        mode=mode,
        symmetric=symmetric,
        weight=w.to_dict(),
        boundaries=boundaries,
        codes=codes,
        levels=levels,
        error=error,
        snr_db=snr_db,
        design=record,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Intervals mode


def _intervals_solution(
    problem: Problem, major: np.ndarray, K: int, points: int, refine: bool, spacing: str, say: Progress
) -> tuple[np.ndarray, np.ndarray, float, Any]:
    """Grid DP then refinement on ``problem`` (plain or folded): boundaries, levels, grid L, refinement result."""
    from .dp import intervals_dp

    density = _point_density(problem, spacing)
    grid = make_grid(problem.low, problem.high, points, breakpoints=_fold(major, problem), density=density)
    if grid.size - 1 < K:
        raise FewBitError(f"grid of {grid.size} points is too small for {K} intervals")
    say(f"intervals DP on {grid.size} grid points")
    grid_loss, cuts = intervals_dp(prefix_integrals(problem, grid), K)
    boundaries = grid[cuts]
    antiderivative = Antiderivative(problem, _panel_grid(problem, _fold(major, problem), density))
    if refine:
        say("refining boundaries (Newton / L-BFGS-B on L with the gradient of eq. 5)")
        result = refine_intervals(antiderivative, boundaries)
    else:
        from .refine import IntervalsResult, intervals_loss

        loss, levels = intervals_loss(antiderivative, boundaries)
        result = IntervalsResult(boundaries, levels, loss, loss, 0, False)
    return result.boundaries, result.levels, grid_loss, result


def _design_intervals(
    full: Problem,
    bound: registry.BoundActivation,
    w: Weight,
    bits: int,
    points: int,
    symmetric: bool,
    refine: bool,
    spacing: str,
    say: Progress,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    K = 2**bits
    major = np.asarray(bound.breakpoints + w.breakpoints, dtype=np.float64)
    problem = full
    if symmetric:
        problem = Problem(
            bound.df, w, w.low, w.high, breakpoints=full.breakpoints, symmetric=True, name=full.name,
            split_points=full.split_points,
        )  # fmt: skip
    s, levels, grid_loss, result = _intervals_solution(problem, major, K, points, refine, spacing, say)
    if symmetric:
        boundaries = np.concatenate([-s[::-1], s])
        codes = np.concatenate([np.arange(K - 1, 0, -1), np.arange(K)])
    else:
        boundaries = s
        codes = np.arange(K)
    info = {"refined": result.refined, "grid_error": grid_loss, "iterations": result.iterations}
    return boundaries, codes, levels, info


# ----------------------------------------------------------------------------------------------------------------------
# Level-sets mode


def _cells_table(
    grid: np.ndarray, cells: np.ndarray, cluster_of_cell: np.ndarray, full: Problem, levels: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The DP's own table: each grid cell keeps its cluster; massless cells take the nearest level."""
    codes = cluster_of_cell.copy()
    empty = codes < 0
    if empty.any():
        middle = (grid[:-1][empty] + grid[1:][empty]) / 2.0
        midpoints = (levels[1:] + levels[:-1]) / 2.0
        codes[empty] = np.searchsorted(midpoints, full.df(middle), side="left")
    keep = np.concatenate([[True], codes[1:] != codes[:-1]])
    return grid[1:-1][keep[1:]], codes[keep]


def _exact_constants(
    full: Problem,
    grid: np.ndarray,
    mass: np.ndarray,
    values: np.ndarray,
    group: np.ndarray,
    sums: np.ndarray,
    cluster_of_group: np.ndarray,
    levels: np.ndarray,
) -> np.ndarray:
    """A cluster on which f' is constant (one merged value, no spread) gets f' itself as its level, exactly.

    Cell means of a constant like hardsigmoid' = 1/6 differ from it in the last bits; the exact value makes such
    tables exact (error 0).
    """
    counts = np.bincount(cluster_of_group, minlength=levels.size)
    spread = sums[2] - sums[1] ** 2 / sums[0]
    kept = np.flatnonzero(mass > 0)
    order = kept[np.argsort(values[kept], kind="stable")]
    levels = levels.copy()
    for cluster in np.flatnonzero(counts == 1):
        g = int(np.flatnonzero(cluster_of_group == cluster)[0])
        # Values within a group agree to 1e-12; a spread beyond rounding (relative to F2) means f' varies in a cell.
        if spread[g] <= 1e-10 * abs(sums[2][g]):
            cell = order[np.searchsorted(group, g)]
            levels[cluster] = float(full.df(np.array([(grid[cell] + grid[cell + 1]) / 2.0]))[0])
    return levels


def _design_levelsets(
    full: Problem,
    w: Weight,
    major: np.ndarray,
    bits: int,
    points: int,
    refine: bool,
    spacing: str,
    say: Progress,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    from .dp import levelsets_dp, merge_sorted_atoms

    K = 2**bits
    density = _point_density(full, spacing)
    grid = make_grid(full.low, full.high, points, breakpoints=_fold(major, full), density=density)
    cells = cell_integrals(full, grid)
    mass = cells[0]
    values = np.where(mass > 0, cells[1] / np.where(mass > 0, mass, 1.0), 0.0)
    prefix, group, sums = merge_sorted_atoms(values, mass, cells[2])
    groups = prefix.shape[1] - 1
    if groups == 0:
        raise FewBitError(f"weight {w.kind!r} has no mass inside the design range [{w.low:g}, {w.high:g}]")
    used = min(K, groups)
    say(f"level-sets DP on {groups} distinct cells")
    grid_loss, cuts = levelsets_dp(prefix, used)
    # Cluster means from direct sums (exact when a cluster holds one constant value, e.g. relu6' = 1).
    cluster_of_group = np.searchsorted(cuts, np.arange(groups), side="right")
    levels = np.bincount(cluster_of_group, sums[1], used) / np.bincount(cluster_of_group, sums[0], used)
    levels = _exact_constants(full, grid, mass, values, group, sums, cluster_of_group, levels)
    # cluster of every cell: sorted kept cells -> group -> cluster
    kept = np.flatnonzero(mass > 0)
    order = kept[np.argsort(values[kept], kind="stable")]
    cluster_of_cell = np.full(mass.size, -1, dtype=np.int64)
    cluster_of_cell[order] = np.searchsorted(cuts, group, side="right")

    antiderivative = Antiderivative(full, _panel_grid(full, _fold(major, full), density))
    info: dict[str, Any] = {"refined": False, "grid_error": grid_loss, "iterations": 0}
    boundaries, codes = _cells_table(grid, cells, cluster_of_cell, full, levels)
    loss, _ = regions_loss(antiderivative, boundaries, codes, levels)
    best = (loss, boundaries, codes, levels)
    intervals_table = None
    if refine and used > 1:
        scan_grid = make_grid(full.low, full.high, SCAN_POINTS + 1, breakpoints=_fold(major, full), density=density)
        say("Lloyd/Newton iterations from the DP levels")
        candidates = [("dp", refine_levelsets(antiderivative, scan_grid, levels))]
        say("Lloyd/Newton iterations from the intervals-mode levels")
        intervals_grid = default_grid(bits, "intervals")
        s, interval_levels, _, _ = _intervals_solution(full, major, K, intervals_grid, True, spacing, say)
        candidates.append(("intervals", refine_levelsets(antiderivative, scan_grid, np.unique(interval_levels))))
        for start, result in candidates:
            if result.loss < best[0]:
                best = (result.loss, result.boundaries, result.codes, result.levels)
                info.update(refined=True, iterations=result.iterations, start=start)
        # The intervals-mode table itself (levels sorted) is a valid table: level sets never do worse than it.
        order = np.argsort(interval_levels, kind="stable")
        rank = np.empty(K, dtype=np.int64)
        rank[order] = np.arange(K)
        intervals_table = (s, rank, interval_levels[order])
    loss, boundaries, codes, levels = best
    info["error"] = table_error(full, boundaries, codes, levels)
    if intervals_table is not None:
        error = table_error(full, *intervals_table)
        if error < info["error"]:
            boundaries, codes, levels = intervals_table
            info.update(error=error, start="intervals-table")
    # Codes are ranks of ascending levels; unused codes repeat the last level.
    levels = np.concatenate([levels, np.full(K - levels.size, levels[-1])])
    return boundaries, codes, levels, info
