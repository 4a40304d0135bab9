"""Integrals of the approximation problem: grids, prefix integrals (eqs. 8-9) and accurate moments over intervals.

Terms (see also :mod:`fewbit_design`):

* **problem**: a derivative f' and a weight w on a range [low, high]; its three **densities** are
  w(x), f'(x) w(x) and f'(x)**2 w(x). Their integrals over an interval [a, b] are the **moments** W, FW, F2 of that
  interval: the optimal level there is y = FW / W (eq. 4) and its error is F2 - FW**2 / W.
* **symmetric** problem: the quantizer acts on u = |x| on [0, max(|A|, |B|)] and codes are shared by x and -x. The
  densities fold both sides, w(u) + w(-u), f'(u) w(u) + f'(-u) w(-u), f'(u)**2 w(u) + f'(-u)**2 w(-u), which is exact
  for any f' and is the paper's approach for even derivatives (sigmoid, tanh).
* **grid**: sorted points A = t_0 < ... < t_n = B that contain every breakpoint of f' and w inside [A, B], so no grid
  cell straddles a jump or a kink; each cell is integrated with a 16-node Gauss-Legendre rule.
* **prefix integrals** F2(i), W(i), FW(i): the moments of [t_0, t_i] (eqs. 8-9), O(n) memory.

:func:`integrate` is a vectorised adaptive Gauss-Legendre quadrature (16 nodes against the two 16-node halves,
bisecting until they agree), used for moments over arbitrary intervals and for the final error of a table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numba
import numpy as np

from ..errors import FewBitError

__all__ = [
    "Problem",
    "make_grid",
    "cell_integrals",
    "prefix_integrals",
    "integrate",
    "moments",
    "Antiderivative",
    "GAUSS_NODES",
    "graded",
]

#: Gauss-Legendre nodes per grid cell (and per panel of the adaptive quadrature).
GAUSS_NODES = 16
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(GAUSS_NODES)
# Cells evaluated per chunk (bounds the temporary memory of cell integrals at ~ 3 x 16 x 8 x this bytes).
_CHUNK = 1 << 15


class Problem:
    """A derivative f' and a weight w on [low, high]: the densities whose integrals every design step needs.

    ``df`` and ``weight`` are vectorised callables (float64 in, float64 out). ``breakpoints`` are the points where
    f' or w jump or kink; those strictly inside the range are kept (sorted, unique). ``split_points`` are extra points
    where adaptive quadrature splits (for example a grid that follows a narrow weight). With ``symmetric`` the problem
    lives on u = |x| (see the module header): ``low`` and ``high`` are then the range of |x| over [A, B].

    >>> p = Problem(lambda x: (x > 0).astype(float), lambda x: np.ones_like(x), -1.0, 1.0, breakpoints=[0.0])
    >>> p.densities(np.array([-0.5, 0.5])).tolist()
    [[1.0, 1.0], [0.0, 1.0], [0.0, 1.0]]
    """

    def __init__(
        self,
        df: Callable[[np.ndarray], np.ndarray],
        weight: Callable[[np.ndarray], np.ndarray],
        low: float,
        high: float,
        *,
        breakpoints: Iterable[float] = (),
        symmetric: bool = False,
        name: str = "f'",
        split_points: Iterable[float] = (),
    ) -> None:
        self.df = df
        self.weight = weight
        self.x_low, self.x_high = float(low), float(high)
        self.symmetric = bool(symmetric)
        self.name = name
        points = np.asarray(sorted({float(b) for b in breakpoints}), dtype=np.float64)
        if self.symmetric:
            a, b = self.x_low, self.x_high
            self.low = 0.0 if a < 0.0 < b else min(abs(a), abs(b))
            self.high = max(abs(a), abs(b))
            # The weight's edges fold onto the half-line too (w(-u) ends at u = -A).
            points = np.unique(np.abs(np.concatenate([points, [a, b]])))
        else:
            self.low, self.high = self.x_low, self.x_high
        self.breakpoints = points[(points > self.low) & (points < self.high)]
        extra = np.asarray(list(split_points), dtype=np.float64)
        extra = np.abs(extra) if self.symmetric else extra
        #: Where adaptive quadrature splits every interval: the breakpoints plus optional points that resolve a
        #: narrow weight (an adaptive rule cannot find a peak that none of its first nodes sees).
        self.split_points = np.union1d(self.breakpoints, extra[(extra > self.low) & (extra < self.high)])

    def _side(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """w(x) and f'(x), f' evaluated only where w > 0 (0 elsewhere: it may be non-finite where it does not count)."""
        w = np.asarray(self.weight(x), dtype=np.float64)
        derivative = np.zeros_like(w)
        where = w > 0
        if where.any():
            xs = x[where]
            d = np.asarray(self.df(xs), dtype=np.float64)
            if not np.all(np.isfinite(d)):
                bad = float(xs[~np.isfinite(d)][0])
                raise FewBitError(f"{self.name} is not finite at x={bad:g} inside the design range")
            derivative[where] = d
        return w, derivative

    def error_density(self, x: np.ndarray, level: np.ndarray) -> np.ndarray:
        """(f'(x) - level)**2 w(x) (folded over both sides when symmetric), without cancellation."""
        x = np.asarray(x, dtype=np.float64)
        w, d = self._side(x)
        out = (d - level) ** 2 * w
        if self.symmetric:
            w, d = self._side(-x)
            out += (d - level) ** 2 * w
        return out

    def densities(self, x: np.ndarray) -> np.ndarray:
        """The three densities at ``x``: an array of shape ``(3, *x.shape)`` holding w, f' w and f'**2 w."""
        x = np.asarray(x, dtype=np.float64)
        w, d = self._side(x)
        out = np.empty((3, *x.shape), dtype=np.float64)
        out[0] = w
        out[1] = d * w
        out[2] = d * d * w
        if self.symmetric:
            w, d = self._side(-x)
            out[0] += w
            out[1] += d * w
            out[2] += d * d * w
        return out


def make_grid(
    low: float,
    high: float,
    points: int,
    *,
    breakpoints: Sequence[float] | np.ndarray = (),
    density: Callable[[np.ndarray], np.ndarray] | None = None,
    uniform_share: float = 0.5,
) -> np.ndarray:
    """About ``points`` sorted grid points from ``low`` to ``high`` that contain every breakpoint inside the range.

    Without ``density`` the points are uniform. With it, a share ``1 - uniform_share`` of the points follows
    ``density(x)**(1/3)`` (the point density of an optimal fine quantizer), so narrow weights are resolved; the
    rest stays uniform. Grid points closer than a quarter cell to a breakpoint are dropped in favour of it.

    >>> make_grid(0.0, 1.0, 5, breakpoints=[0.3]).tolist()
    [0.0, 0.3, 0.5, 0.75, 1.0]
    """
    low, high = float(low), float(high)
    points = max(int(points), 2)
    cells = points - 1
    if density is None:
        grid = np.linspace(low, high, points)
    else:
        fine = np.linspace(low, high, 16 * cells + 1)
        rho = np.cbrt(np.maximum(np.asarray(density(fine), dtype=np.float64), 0.0))
        cumulative = np.concatenate([[0.0], np.cumsum((rho[1:] + rho[:-1]) / 2.0)])
        total = cumulative[-1]
        mix = (fine - low) / (high - low)
        if total > 0:
            mix = uniform_share * mix + (1.0 - uniform_share) * cumulative / total
        mix[0], mix[-1] = 0.0, 1.0
        mix = np.maximum.accumulate(mix)
        grid = np.interp(np.linspace(0.0, 1.0, points), mix, fine)
        grid[0], grid[-1] = low, high
    bps = np.asarray(breakpoints, dtype=np.float64)
    bps = bps[(bps > low) & (bps < high)]
    if bps.size:
        spacing = np.diff(grid)
        index = np.clip(np.searchsorted(grid, bps), 1, grid.size - 1)
        local = np.maximum(spacing[index - 1], spacing[np.minimum(index, spacing.size - 1)])
        keep = np.ones(grid.size, dtype=bool)
        for b, h in zip(bps, local, strict=True):
            keep &= np.abs(grid - b) > 0.25 * h
        keep[0] = keep[-1] = True
        grid = np.union1d(grid[keep], bps)
    grid = np.unique(grid)
    return grid


def _cell_rule(problem: Problem, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """16-node Gauss-Legendre integrals of the densities over cells [left, right]: shape (3, cells)."""
    half = (right - left) / 2.0
    x = (left + half)[:, None] + half[:, None] * _NODES[None, :]
    values = problem.densities(x)
    return np.einsum("kcn,n->kc", values, _WEIGHTS) * half[None, :]


def cell_integrals(problem: Problem, grid: np.ndarray) -> np.ndarray:
    """Moments W, FW, F2 of every grid cell [t_i, t_{i+1}]: shape (3, n) for n cells."""
    grid = np.asarray(grid, dtype=np.float64)
    cells = grid.size - 1
    out = np.empty((3, cells), dtype=np.float64)
    for start in range(0, cells, _CHUNK):
        stop = min(start + _CHUNK, cells)
        out[:, start:stop] = _cell_rule(problem, grid[start:stop], grid[start + 1 : stop + 1])
    return out


@numba.njit(cache=True)
def _compensated_cumsum(values: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Prefix sums with a leading 0, by Neumaier's compensated summation (rows of a 2-D array)."""
    rows, n = values.shape
    out = np.zeros((rows, n + 1))
    for r in range(rows):
        total = 0.0
        compensation = 0.0
        for i in range(n):
            v = values[r, i]
            t = total + v
            if abs(total) >= abs(v):
                compensation += (total - t) + v
            else:
                compensation += (v - t) + total
            total = t
            out[r, i + 1] = total + compensation
    return out


def prefix_integrals(problem: Problem, grid: np.ndarray) -> np.ndarray:
    """Prefix integrals of eqs. 8-9 on ``grid``: rows W(i), FW(i), F2(i) for i = 0..n, with W(0) = 0.

    Each cell is integrated with a 16-node Gauss-Legendre rule and the cells are summed with compensated summation.
    """
    return _compensated_cumsum(cell_integrals(problem, grid))


#: Intervals integrated together by :func:`integrate` (bounds its memory), and the most panels one batch may grow to.
_BATCH = 1 << 13
MAX_PANELS = 1 << 16


def integrate(
    func: Callable[[np.ndarray, np.ndarray], np.ndarray],
    a: np.ndarray,
    b: np.ndarray,
    *,
    components: int = 1,
    atol: float = 1e-15,
    rtol: float = 1e-12,
    max_depth: int = 48,
) -> np.ndarray:
    """Integrals of ``func`` over many intervals [a_k, b_k] at once, by vectorised adaptive quadrature.

    ``func(x, index)`` gets nodes ``x`` of shape (panels, nodes) and, per panel, the ``index`` k of the interval it
    belongs to; it returns an array of shape (components, panels, nodes). A panel is accepted when its 16-node
    Gauss-Legendre value and the sum over its two halves agree within ``atol * width + rtol * |value|``; otherwise it
    is bisected. Returns shape (components, len(a)). Intervals should not straddle jumps of the integrand (split
    them at the breakpoints first); a panel that never converges is accepted at ``max_depth``.

    The work is bounded: intervals go in batches of 8192, and a batch whose panels would grow beyond
    :data:`MAX_PANELS`, or a non-finite value of ``func``, raises a :class:`FewBitError` at once (an overflowing
    integrand used to bisect every panel to ``max_depth``, doubling the panels at each level until memory ran out).

    >>> float(integrate(lambda x, k: np.exp(x)[None], np.array([0.0]), np.array([1.0]))[0, 0] - (np.e - 1)) < 1e-15
    True
    """
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    result = np.zeros((components, a.size), dtype=np.float64)
    index = np.flatnonzero(b > a)
    for start in range(0, index.size, _BATCH):
        batch = index[start : start + _BATCH]
        _adaptive(func, a[batch], b[batch], batch, result, components, atol, rtol, max_depth)
    return result


def _adaptive(func, left, right, index, result, components, atol, rtol, max_depth) -> None:
    """:func:`integrate` on one batch of intervals, adding into ``result``."""

    def rule(lo: np.ndarray, hi: np.ndarray, idx: np.ndarray) -> np.ndarray:
        half = (hi - lo) / 2.0
        x = (lo + half)[:, None] + half[:, None] * _NODES[None, :]
        values = np.asarray(func(x, idx), dtype=np.float64).reshape(components, lo.size, _NODES.size)
        if not np.all(np.isfinite(values)):
            panel = int(np.flatnonzero(~np.all(np.isfinite(values), axis=(0, 2)))[0])
            raise FewBitError(
                f"the integrand is not finite on [{lo[panel]:.6g}, {hi[panel]:.6g}] (an overflow): "
                "nothing can be integrated there"
            )
        return np.einsum("cpn,n->cp", values, _WEIGHTS) * half[None, :]

    coarse = rule(left, right, index)
    depth = 0
    while left.size:
        if left.size > MAX_PANELS:
            raise FewBitError(
                f"adaptive quadrature did not converge within {MAX_PANELS} panels on [{left.min():.6g}, "
                f"{right.max():.6g}]: the integrand is too irregular (noise or oscillation finer than 2**-{depth} "
                "of an interval)"
            )
        middle = (left + right) / 2.0
        left_half = rule(left, middle, index)
        right_half = rule(middle, right, index)
        fine = left_half + right_half
        difference = np.max(np.abs(coarse - fine), axis=0)
        tolerance = atol * (right - left) + rtol * np.max(np.abs(fine), axis=0)
        done = (difference <= tolerance) | (depth >= max_depth)
        if done.any():
            for c in range(components):
                np.add.at(result[c], index[done], fine[c, done])
        todo = ~done
        if not todo.any():
            break
        # The halves' own values are the coarse estimates of the children.
        left, middle, right, index = left[todo], middle[todo], right[todo], index[todo]
        coarse = np.concatenate([left_half[:, todo], right_half[:, todo]], axis=1)
        left, right = np.concatenate([left, middle]), np.concatenate([middle, right])
        index = np.concatenate([index, index])
        depth += 1


def split_at(a: np.ndarray, b: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split intervals [a_k, b_k] at the ``points`` inside them: (piece starts, piece ends, interval of each piece)."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    points = np.asarray(points, dtype=np.float64)
    if points.size == 0:
        return a, b, np.arange(a.size)
    first = np.searchsorted(points, a, side="right")
    last = np.searchsorted(points, b, side="left")
    inner = np.maximum(last - first, 0)
    counts = inner + 1
    owner = np.repeat(np.arange(a.size), counts)
    offsets = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    # Piece p of interval k runs from edge p to edge p + 1 of [a_k, points[first_k:last_k], b_k].
    starts = np.where(offsets == 0, a[owner], points[np.minimum(first[owner] + offsets - 1, points.size - 1)])
    ends = np.where(offsets == inner[owner], b[owner], points[np.minimum(first[owner] + offsets, points.size - 1)])
    return starts, ends, owner


#: Geometric grading of :func:`graded`: pieces down to 2**-GRADING of an interval's width at both of its ends.
GRADING = 44


def graded(a: np.ndarray, b: np.ndarray, owner: np.ndarray, depth: int = GRADING) -> tuple[np.ndarray, ...]:
    """Split every interval [a_k, b_k] geometrically toward both ends, at a + (b - a) 2**-j and b - (b - a) 2**-j
    for j = 1..depth: (piece starts, piece ends, ``owner`` of each piece).

    An adaptive rule started on a whole interval sees only its first nodes: a boundary layer of the integrand thinner
    than the gap between the outermost node and the end (f' of softplus with beta = 1e4 beside a table boundary at 0,
    or gelu's bend at the end of an interval 3000 wide) was never seen, and a table's error came out 0 ("exact") or
    five times too small. Graded pieces resolve a layer down to 2**-depth of the width; empty pieces (below the float
    resolution of x) are dropped.

    >>> starts, ends, owner = graded(np.array([0.0]), np.array([1.0]), np.array([0]), depth=2)
    >>> starts.tolist(), ends.tolist()
    ([0.0, 0.25, 0.5, 0.75], [0.25, 0.5, 0.75, 1.0])
    """
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    steps = 2.0 ** -np.arange(depth, 0, -1)  # 2**-depth ... 1/2
    fractions = np.concatenate([steps, 1.0 - steps[::-1][1:]])
    edges = np.concatenate([a[:, None], a[:, None] + (b - a)[:, None] * fractions[None, :], b[:, None]], axis=1)
    edges = np.minimum(np.maximum.accumulate(edges, axis=1), b[:, None])
    starts, ends = edges[:, :-1].ravel(), edges[:, 1:].ravel()
    owner = np.repeat(np.asarray(owner), fractions.size + 1)
    keep = ends > starts
    return starts[keep], ends[keep], owner[keep]


def moments(problem: Problem, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Moments W, FW, F2 over intervals [a_k, b_k] (clipped to the range) by adaptive quadrature: shape (3, m)."""
    a = np.clip(np.asarray(a, dtype=np.float64).ravel(), problem.low, problem.high)
    b = np.clip(np.asarray(b, dtype=np.float64).ravel(), problem.low, problem.high)
    starts, ends, owner = split_at(a, b, problem.split_points)
    pieces = integrate(lambda x, k: problem.densities(x), starts, ends, components=3)
    out = np.zeros((3, a.size), dtype=np.float64)
    for c in range(3):
        np.add.at(out[c], owner, pieces[c])
    return out


class Antiderivative:
    """Cumulative moments P(x) = (W, FW, F2) of [low, x], accurate anywhere in O(1) per point.

    A fine panel grid (containing the breakpoints) carries compensated prefix sums of 16-node Gauss-Legendre
    integrals; P(x) adds the rule on the partial panel [t_k, x]. Moments of [a, b] are P(b) - P(a). Used by the
    refinements, which evaluate moments at moving boundaries many times.
    """

    def __init__(self, problem: Problem, grid: np.ndarray) -> None:
        self.problem = problem
        self.grid = np.asarray(grid, dtype=np.float64)
        self.prefix = prefix_integrals(problem, self.grid)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.clip(np.asarray(x, dtype=np.float64).ravel(), self.problem.low, self.problem.high)
        k = np.clip(np.searchsorted(self.grid, x, side="right") - 1, 0, self.grid.size - 2)
        partial = _cell_rule(self.problem, self.grid[k], x)
        return self.prefix[:, k] + partial

    def moments(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Moments of the intervals [a_k, b_k]: shape (3, m)."""
        a = np.asarray(a, dtype=np.float64).ravel()
        both = self(np.concatenate([a, np.asarray(b, dtype=np.float64).ravel()]))
        return both[:, a.size :] - both[:, : a.size]
