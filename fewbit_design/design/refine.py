"""Continuous refinement of a grid solution, with accurate moments (never the grid): neither step increases L.

* :func:`refine_intervals`: the K - 1 interior boundaries s of the intervals mode minimise L(s) with the optimal
  levels y(s) of eq. 4. The gradient is eq. 5, dL/ds_i = (y_i - y_{i-1}) (2 f'(s_i) - y_i - y_{i-1}) w(s_i), written
  with the densities so that it also holds for the symmetric (folded) problem; its Hessian is tridiagonal (each s_i
  meets only y_{i-1} and y_i), so damped Newton converges in a handful of steps; L-BFGS-B with the same gradient
  takes over if Newton stalls. The result is kept only if L decreased.
* :func:`refine_levelsets`: Lloyd's algorithm on the continuous problem, with Newton steps. Codes are the level sets
  of the nearest level, {x : f'(x) closest to y_c}, unions of intervals whose boundaries are the roots of
  f'(x) = (y_c + y_{c+1}) / 2 (a sign-change scan on a fine grid, then vectorised Illinois regula falsi to machine
  precision); levels move to the conditional means E[f'(X) | code] (Lloyd) or by a damped Newton step on the
  distortion when that is better. No accepted step raises L; the best table seen is returned.

Moments come from an :class:`~.integrals.Antiderivative` (exact Gauss-Legendre on a fine panel grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .integrals import Antiderivative, Problem

__all__ = [
    "IntervalsResult",
    "LevelsetsResult",
    "intervals_loss",
    "refine_intervals",
    "levelset_regions",
    "regions_loss",
    "refine_levelsets",
]

# Levenberg-Marquardt damping factors tried in turn for a Newton step.
_DAMPING = (0.0, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e4)
# Relative decrease of L below which Lloyd stops, and its iteration cap.
_LLOYD_TOLERANCE = 1e-12
_LLOYD_ITERATIONS = 100


@dataclass(frozen=True)
class IntervalsResult:
    """Boundaries (K - 1, strictly inside the range), optimal levels (K) and L of an intervals-mode solution."""

    boundaries: np.ndarray
    levels: np.ndarray
    loss: float
    start_loss: float
    iterations: int
    refined: bool


@dataclass(frozen=True)
class LevelsetsResult:
    """A level-sets solution: boundaries inside the range, a code per interval, ascending levels, and L."""

    boundaries: np.ndarray
    codes: np.ndarray
    levels: np.ndarray
    loss: float
    start_loss: float
    iterations: int


# ----------------------------------------------------------------------------------------------------------------------
# Intervals mode


def _levels(problem: Problem, edges: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Optimal level per interval, y = FW / W; an interval without mass takes the density ratio at its middle."""
    mass = m[0]
    levels = np.empty(mass.size)
    full = mass > 0
    levels[full] = m[1, full] / mass[full]
    if not full.all():
        middle = (edges[:-1][~full] + edges[1:][~full]) / 2.0
        d = problem.densities(middle)
        levels[~full] = np.where(d[0] > 0, d[1] / np.where(d[0] > 0, d[0], 1.0), 0.0)
    return levels


def intervals_loss(antiderivative: Antiderivative, boundaries: np.ndarray) -> tuple[float, np.ndarray]:
    """L and the optimal levels (eq. 4) for sorted interior boundaries of the intervals mode."""
    loss, levels, _ = _intervals_state(antiderivative, np.asarray(boundaries, dtype=np.float64))
    return loss, levels


def _tridiagonal_solve(diagonal: np.ndarray, off: np.ndarray, rhs: np.ndarray) -> np.ndarray | None:
    """Solve a symmetric tridiagonal system (None when singular)."""
    from scipy.linalg import LinAlgError, solve_banded

    if diagonal.size == 1:
        return rhs / diagonal if diagonal[0] != 0 else None
    bands = np.zeros((3, diagonal.size))
    bands[0, 1:] = off
    bands[1] = diagonal
    bands[2, :-1] = off
    try:
        solution = solve_banded((1, 1), bands, rhs, check_finite=False)
    except (LinAlgError, ValueError):
        return None
    return solution if np.all(np.isfinite(solution)) else None


def _newton_directions(gradient: np.ndarray, diagonal: np.ndarray, off: np.ndarray, scale: np.ndarray):
    """Descent directions of (H + lambda D) d = -g for growing damping lambda (Levenberg-Marquardt)."""
    for damping in _DAMPING:
        direction = _tridiagonal_solve(diagonal + damping * scale, off, -gradient)
        if direction is not None and float(gradient @ direction) < 0.0:
            yield direction


def _one_sided_span(problem: Problem, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points around x for finite differences that stay in the range and do not cross a breakpoint."""
    h = 1e-6 * np.maximum(1.0, np.abs(x))
    plus = np.minimum(x + h, problem.high)
    minus = np.maximum(x - h, problem.low)
    if problem.breakpoints.size:
        k = np.searchsorted(problem.breakpoints, x, side="right")
        after = problem.breakpoints[np.minimum(k, problem.breakpoints.size - 1)]
        plus = np.where((k < problem.breakpoints.size) & (after > x), np.minimum(plus, after), plus)
        j = np.searchsorted(problem.breakpoints, x, side="left") - 1
        before = problem.breakpoints[np.maximum(j, 0)]
        minus = np.where((j >= 0) & (before < x), np.maximum(minus, before), minus)
    return minus, plus


def _intervals_newton_terms(
    antiderivative: Antiderivative, s: np.ndarray, levels: np.ndarray, mass: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradient (eq. 5) and the tridiagonal Hessian of L(s) with optimal levels, in terms of the densities.

    With m0, m1 the densities at boundary s_k between levels y_l (left) and y_r (right), u = m1 - y_r m0 and
    v = m1 - y_l m0: g_k = (y_r - y_l)(2 m1 - (y_r + y_l) m0); H_kk = (y_r - y_l)(2 m1' - (y_r + y_l) m0')
    - 2 u^2 / W_r - 2 v^2 / W_l; H_k,k+1 = 2 u_k v_k+1 / W (W: the mass of the interval between them).
    """
    problem = antiderivative.problem
    d = problem.densities(s)
    minus, plus = _one_sided_span(problem, s)
    slope = (problem.densities(plus) - problem.densities(minus)) / (plus - minus)
    left, right = levels[:-1], levels[1:]
    delta, total = right - left, right + left
    gradient = delta * (2.0 * d[1] - total * d[0])
    u = d[1] - right * d[0]
    v = d[1] - left * d[0]
    inverse = np.where(mass > 0, 1.0 / np.where(mass > 0, mass, 1.0), 0.0)
    diagonal = delta * (2.0 * slope[1] - total * slope[0]) - 2.0 * u * u * inverse[1:] - 2.0 * v * v * inverse[:-1]
    off = 2.0 * u[:-1] * v[1:] * inverse[1:-1]
    return gradient, diagonal, off


def _intervals_state(antiderivative: Antiderivative, s: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    problem = antiderivative.problem
    edges = np.concatenate([[problem.low], s, [problem.high]])
    m = np.diff(antiderivative(edges), axis=1)
    levels = _levels(problem, edges, m)
    loss = float(np.sum(np.maximum(m[2] - 2.0 * levels * m[1] + levels * levels * m[0], 0.0)))
    return loss, levels, m[0]


def refine_intervals(
    antiderivative: Antiderivative, boundaries: np.ndarray, *, max_iterations: int = 100
) -> IntervalsResult:
    """Refine interior boundaries to a local minimum of L(s); keep the result only if L fell.

    Damped Newton steps on L(s) with the gradient of eq. 5 and its tridiagonal Hessian (the levels follow eq. 4),
    each accepted only if it lowers L and keeps the boundaries strictly inside the range and in order; when Newton
    stalls away from a stationary point, L-BFGS-B (same gradient) continues. Boundaries that sit exactly on a
    breakpoint (a jump of f' or w, where L is not differentiable) stay there.
    """
    problem = antiderivative.problem
    start = np.asarray(boundaries, dtype=np.float64)
    start_loss, start_levels, mass = _intervals_state(antiderivative, start)
    free = ~np.isin(start, problem.breakpoints)
    if not free.any() or start_loss <= 0.0:
        return IntervalsResult(start, start_levels, start_loss, start_loss, 0, False)
    span = problem.high - problem.low
    s, loss, levels = start.copy(), start_loss, start_levels
    iterations = 0
    for iterations in range(1, max_iterations + 1):
        gradient, diagonal, off = _intervals_newton_terms(antiderivative, s, levels, mass)
        g, h, o = gradient[free], diagonal[free], _restricted_off(off, free)
        scale = np.maximum(np.abs(h), 1e-12 * max(float(np.max(np.abs(h))), 1e-300))
        accepted = None
        for direction in _newton_directions(g, h, o, scale):
            step = direction
            for _ in range(4):
                trial = s.copy()
                trial[free] += step
                if np.all(np.diff(trial) > 0) and trial[0] > problem.low and trial[-1] < problem.high:
                    trial_loss, trial_levels, trial_mass = _intervals_state(antiderivative, trial)
                    if trial_loss < loss:
                        accepted = (trial, trial_loss, trial_levels, trial_mass, step)
                        break
                step = step / 2.0
            if accepted is not None:
                break
        if accepted is None:
            iterations -= 1
            break
        s, new_loss, levels, mass, step = accepted
        decrease = loss - new_loss
        loss = new_loss
        if decrease <= 1e-15 * loss or float(np.max(np.abs(step))) <= 1e-14 * span:
            break
    gradient, _, _ = _intervals_newton_terms(antiderivative, s, levels, mass)
    if loss > 0.0 and float(np.max(np.abs(gradient[free]), initial=0.0)) * span > 1e-9 * loss:
        s, loss, levels, extra = _lbfgsb(antiderivative, s, loss, free)
        iterations += extra
    if loss < start_loss:
        return IntervalsResult(s, levels, loss, start_loss, iterations, True)
    return IntervalsResult(start, start_levels, start_loss, start_loss, iterations, False)


def _restricted_off(off: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Off-diagonal of the Hessian restricted to the free boundaries (0 between free ones that are not neighbours)."""
    index = np.flatnonzero(free)
    if index.size < 2:
        return np.empty(0)
    neighbours = np.diff(index) == 1
    return np.where(neighbours, off[np.minimum(index[:-1], off.size - 1)], 0.0)


def _lbfgsb(
    antiderivative: Antiderivative, start: np.ndarray, start_loss: float, free: np.ndarray, max_iterations: int = 200
) -> tuple[np.ndarray, float, np.ndarray, int]:
    """L-BFGS-B on the free boundaries with the gradient of eq. 5; returns the start when it does not improve."""
    from scipy.optimize import minimize

    problem = antiderivative.problem
    scale = 1.0 / start_loss

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        s = start.copy()
        s[free] = x
        order = np.argsort(s, kind="stable")
        sorted_s = s[order]
        loss, levels, _ = _intervals_state(antiderivative, sorted_s)
        d = problem.densities(sorted_s)
        left, right = levels[:-1], levels[1:]
        gradient = np.empty_like(s)
        gradient[order] = (right - left) * (2.0 * d[1] - (left + right) * d[0])
        return loss * scale, gradient[free] * scale

    result = minimize(
        objective,
        start[free],
        jac=True,
        method="L-BFGS-B",
        bounds=[(problem.low, problem.high)] * int(free.sum()),
        options={"maxiter": max_iterations, "ftol": 1e-15, "gtol": 1e-13, "maxcor": 10},
    )
    candidate = start.copy()
    candidate[free] = result.x
    candidate = np.sort(candidate)
    iterations = int(getattr(result, "nit", 0))
    if np.all(np.diff(candidate) > 0) and candidate[0] > problem.low and candidate[-1] < problem.high:
        loss, levels, _ = _intervals_state(antiderivative, candidate)
        if loss < start_loss:
            return candidate, loss, levels, iterations
    loss, levels, _ = _intervals_state(antiderivative, start)
    return start, loss, levels, iterations


# ----------------------------------------------------------------------------------------------------------------------
# Level-sets mode


def _nearest(values: np.ndarray, midpoints: np.ndarray) -> np.ndarray:
    """Code of the nearest level for each value (levels ascending; a tie goes to the lower level)."""
    return np.searchsorted(midpoints, values, side="left")


def _roots(
    df, lo: np.ndarray, hi: np.ndarray, target: np.ndarray, *, tolerance: float = 0.0, iterations: int = 100
) -> np.ndarray:
    """Roots of df(x) = target in brackets [lo, hi] with a sign change, to a few ulps (or ``tolerance``).

    Vectorised Illinois regula falsi (superlinear, the bracket always shrinks); after ``iterations // 2`` steps the
    brackets still open are bisected, which bounds the work whatever df does.
    """
    lo, hi, target = lo.copy(), hi.copy(), np.asarray(target, dtype=np.float64)
    g_lo = df(lo) - target
    g_hi = df(hi) - target
    last = np.zeros(lo.size, dtype=np.int8)  # which end moved last: -1 lo, +1 hi
    a = np.arange(lo.size)
    for step in range(iterations):
        a = a[hi[a] - lo[a] > tolerance + 4.0 * np.spacing(np.maximum(np.abs(lo[a]), np.abs(hi[a])))]
        if a.size == 0:
            break
        l, h, gl, gh = lo[a], hi[a], g_lo[a], g_hi[a]
        middle = l + (h - l) / 2.0
        if step >= iterations // 2:
            x = middle
        else:
            denominator = gh - gl
            safe = np.where(denominator != 0, denominator, 1.0)
            x = h - gh * (h - l) / safe
            x = np.where((denominator != 0) & (x > l) & (x < h), x, middle)
        g = df(x) - target[a]
        zero = g == 0
        move_lo = (np.signbit(g) == np.signbit(gl)) & ~zero
        move_hi = ~move_lo & ~zero
        i_lo, i_hi, i_zero = a[move_lo], a[move_hi], a[zero]
        # Illinois: when the same end moves twice in a row, halve the value kept at the other end.
        g_hi[i_lo] = np.where(last[i_lo] == -1, g_hi[i_lo] / 2.0, g_hi[i_lo])
        g_lo[i_hi] = np.where(last[i_hi] == 1, g_lo[i_hi] / 2.0, g_lo[i_hi])
        lo[i_lo], g_lo[i_lo], last[i_lo] = x[move_lo], g[move_lo], -1
        hi[i_hi], g_hi[i_hi], last[i_hi] = x[move_hi], g[move_hi], 1
        lo[i_zero] = hi[i_zero] = x[zero]
    return lo + (hi - lo) / 2.0


class _Scan:
    """f' on a fine scan grid of [low, high] (breakpoints included), evaluated once for all Lloyd iterations."""

    def __init__(self, problem: Problem, grid: np.ndarray) -> None:
        self.problem = problem
        self.grid = np.asarray(grid, dtype=np.float64)
        self.values = np.asarray(problem.df(self.grid), dtype=np.float64)
        if not np.all(np.isfinite(self.values)):
            bad = float(self.grid[~np.isfinite(self.values)][0])
            from ..errors import FewBitError

            raise FewBitError(f"{problem.name} is not finite at x={bad:g} inside the design range")
        span = max(abs(problem.low), abs(problem.high), 1.0)
        self.snap = 1e-9 * span


@dataclass(frozen=True)
class _Regions:
    """Nearest-level regions of some levels: the table part, and the smooth crossings of f' with the midpoints."""

    boundaries: np.ndarray
    codes: np.ndarray
    crossings: np.ndarray  # roots of f'(x) = midpoint where f' is continuous
    crossed: np.ndarray  # index of the midpoint each crossing solves


def _regions(scan: _Scan, levels: np.ndarray) -> _Regions:
    problem = scan.problem
    midpoints = (levels[1:] + levels[:-1]) / 2.0
    codes_at = _nearest(scan.values, midpoints)
    change = np.flatnonzero(codes_at[1:] != codes_at[:-1])
    if change.size == 0:
        empty = np.empty(0)
        return _Regions(empty, np.array([codes_at[0]], dtype=np.int64), empty, np.empty(0, dtype=np.int64))
    first = np.minimum(codes_at[change], codes_at[change + 1])
    last = np.maximum(codes_at[change], codes_at[change + 1])
    count = last - first
    bracket = np.repeat(change, count)
    offset = np.arange(bracket.size) - np.repeat(np.cumsum(count) - count, count)
    which = np.repeat(first, count) + offset  # the midpoint crossed
    lo, hi = scan.grid[bracket], scan.grid[bracket + 1]
    target = midpoints[which]
    roots = np.empty(lo.size)
    smooth = np.ones(lo.size, dtype=bool)
    if problem.breakpoints.size:
        # A bracket ending on a breakpoint where f' jumps across the midpoint has its root there.
        for end, other, inward in ((lo, hi, 1.0), (hi, lo, -1.0)):
            on = np.flatnonzero(np.isin(end, problem.breakpoints))
            if on.size:
                near = end[on] + inward * scan.snap / 4.0
                same = np.signbit(problem.df(near) - target[on]) == np.signbit(problem.df(other[on]) - target[on])
                roots[on[same]] = end[on[same]]
                smooth[on[same]] = False
    todo = np.flatnonzero(smooth)
    roots[todo] = _roots(problem.df, lo[todo], hi[todo], target[todo], tolerance=0.0)
    inside = (roots > problem.low) & (roots < problem.high)
    crossings, crossed = roots[inside & smooth], which[inside & smooth]
    roots = np.unique(roots[inside])
    edges = np.concatenate([[problem.low], roots, [problem.high]])
    codes = _nearest(problem.df((edges[:-1] + edges[1:]) / 2.0), midpoints)
    keep = np.concatenate([[True], codes[1:] != codes[:-1]])
    return _Regions(roots[keep[1:]], codes[keep].astype(np.int64), crossings, crossed)


def levelset_regions(scan: _Scan, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Boundaries (inside the range) and a code per interval of the nearest-level regions of ascending ``levels``."""
    regions = _regions(scan, levels)
    return regions.boundaries, regions.codes


def regions_loss(
    antiderivative: Antiderivative, boundaries: np.ndarray, codes: np.ndarray, levels: np.ndarray
) -> tuple[float, np.ndarray]:
    """L of a table (boundaries inside the range, codes, levels) and the per-code moments (3, codes)."""
    problem = antiderivative.problem
    edges = np.concatenate([[problem.low], boundaries, [problem.high]])
    m = np.diff(antiderivative(edges), axis=1)
    per_code = np.zeros((3, levels.size))
    for c in range(3):
        np.add.at(per_code[c], codes, m[c])
    y = levels
    loss = float(np.sum(np.maximum(per_code[2] - 2.0 * y * per_code[1] + y * y * per_code[0], 0.0)))
    return loss, per_code


@dataclass(frozen=True)
class _LevelsState:
    levels: np.ndarray
    regions: _Regions
    moments: np.ndarray  # per code: W, FW, F2
    distortion: float  # L of the regions with these levels
    loss: float  # L of the regions with their conditional means (the table this state stands for)
    means: np.ndarray


def _levels_state(antiderivative: Antiderivative, scan: _Scan, levels: np.ndarray) -> _LevelsState:
    regions = _regions(scan, levels)
    distortion, moments = regions_loss(antiderivative, regions.boundaries, regions.codes, levels)
    mass = moments[0]
    means = np.where(mass > 0, moments[1] / np.where(mass > 0, mass, 1.0), levels)
    loss = float(np.sum(np.maximum(moments[2] - 2.0 * means * moments[1] + means * means * mass, 0.0)))
    return _LevelsState(levels, regions, moments, distortion, loss, means)


def _levels_newton_terms(scan: _Scan, state: _LevelsState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradient and tridiagonal Hessian of D(y) = E min_c (f'(X) - y_c)^2 in the levels.

    g_c = 2 (y_c W_c - FW_c). Moving the midpoint m_c = (y_c + y_c+1) / 2 moves the mass rho_c = sum over crossings
    x of w(x) / |f''(x)| between codes c and c+1, so H_cc = 2 W_c - (y_c+1 - y_c) rho_c / 2 - (y_c - y_c-1) rho_c-1 / 2
    and H_c,c+1 = -(y_c+1 - y_c) rho_c / 2 (f'' by finite differences at the crossings).
    """
    problem = scan.problem
    y, moments = state.levels, state.moments
    gradient = 2.0 * (y * moments[0] - moments[1])
    rho = np.zeros(max(y.size - 1, 0))
    x = state.regions.crossings
    if x.size:
        minus, plus = _one_sided_span(problem, x)
        curvature = np.abs(problem.df(plus) - problem.df(minus)) / (plus - minus)
        w = problem.weight(x)
        density = np.where(curvature > 0, w / np.where(curvature > 0, curvature, 1.0), 0.0)
        np.add.at(rho, state.regions.crossed, np.minimum(density, 1e12))
    gap = np.diff(y)
    diagonal = 2.0 * moments[0]
    diagonal[:-1] -= gap * rho / 2.0
    diagonal[1:] -= gap * rho / 2.0
    off = -gap * rho / 2.0
    return gradient, diagonal, off


def refine_levelsets(
    antiderivative: Antiderivative,
    scan_grid: np.ndarray,
    levels: np.ndarray,
    *,
    max_iterations: int = _LLOYD_ITERATIONS,
    tolerance: float = _LLOYD_TOLERANCE,
) -> LevelsetsResult:
    """Lloyd's algorithm with Newton steps from ascending ``levels``.

    The state is a set of levels y; its regions are the nearest-level sets and the table it stands for has those
    regions with their conditional means as levels. Each iteration takes a damped Newton step on
    D(y) = E min_c (f'(X) - y_c)^2 (gradient and tridiagonal Hessian from :func:`_levels_newton_terms`) when that
    lowers D, else the plain Lloyd step y <- conditional means (which never raises it). Stops when D falls by less
    than ``tolerance`` relative; returns the best table seen.
    """
    scan = _Scan(antiderivative.problem, scan_grid)
    levels = np.unique(np.asarray(levels, dtype=np.float64))
    state = _levels_state(antiderivative, scan, levels)
    best, start_loss = state, state.loss
    iterations = 0
    while iterations < max_iterations:
        iterations += 1
        gradient, diagonal, off = _levels_newton_terms(scan, state)
        mass = state.moments[0]
        scale = np.maximum(2.0 * mass, 1e-12 * max(float(2.0 * mass.max()), 1e-300))
        accepted = None
        for direction in _newton_directions(gradient, diagonal, off, scale):
            step = direction
            for _ in range(3):
                trial = state.levels + step
                if np.all(np.diff(trial) > 0):
                    candidate = _levels_state(antiderivative, scan, trial)
                    if candidate.distortion < state.distortion:
                        accepted = candidate
                        break
                step = step / 2.0
            if accepted is not None:
                break
        if accepted is None:  # Lloyd step
            means = np.sort(state.means)
            if np.all(np.diff(means) > 0):
                candidate = _levels_state(antiderivative, scan, means)
                if candidate.distortion < state.distortion:
                    accepted = candidate
        if accepted is None:
            break
        decrease = state.distortion - accepted.distortion
        state = accepted
        if state.loss < best.loss:
            best = state
        if decrease <= tolerance * state.distortion:
            break
    order = np.argsort(best.means, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return LevelsetsResult(
        best.regions.boundaries, rank[best.regions.codes], best.means[order], best.loss, start_loss, iterations
    )
