"""Canonical tables: one deterministic representative where the optimum is degenerate, exact values at kinks.

A designed table is post-processed in this order (every step leaves the error unchanged or lowers it):

1. **Kinks.** A boundary that sits at a jump of f' (a registry ``breakpoint`` b where the float neighbours of b give
   different f') is placed where the runtime's convention "x belongs to the interval on the right of a boundary
   (x >= boundary)" reproduces torch's own derivative *at* b: at b when torch's f'(b) is the right piece's value, at
   ``nextafter(b, +inf)`` when it is the left piece's (relu'(0) = 0 -> boundary 5e-324). The runtime rounds
   boundaries up when it casts them to float32/16, so ``x >= boundary`` stays exact there.
2. **Exact constants.** A code whose whole region (inside the design range) has one constant f' (sampled at 33
   points per piece between breakpoints, all bitwise equal) gets that constant as its level, exactly
   (relu' = 1, hardsigmoid' = 1/6). Tables of piecewise-constant derivatives are then exact (error 0).
3. **Flat runs.** In ``intervals`` mode, a boundary between two intervals with the same exact constant level can be
   anywhere between its neighbours without changing q; the inner boundaries of such a run are spread evenly between
   the run's outer boundaries (the design range closing the first and last intervals). When every level is exact
   (f' piecewise constant and enough intervals), which run gets the spare intervals is arbitrary too: the last run
   (on the half line x >= 0 for a symmetric table) gets them all.
4. **Mirror images.** When w is even and f'(-x) = c - f'(x) for a constant c (gelu, silu, hardswish, relu,
   softplus, logsigmoid, ...), the mirror image of a table (x -> -x, y -> c - y) has exactly the same error, and two
   machines can land on either. Of the two, the one whose boundaries (inside the range) have the larger sum is kept;
   when the sums agree within 1e-9 of the range, the table is (nearly) its own mirror image and is kept as it is.

``exact`` markers (indices of boundaries and levels that are exact values) go into the table's ``design`` record, so
:meth:`fewbit_design.table.Table.to_dict` writes them at full precision instead of 12 significant digits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Canonical", "jump_placements", "mirror_constant", "canonicalize"]

#: A boundary within this fraction of the range of a jump of f' is taken to be at the jump.
SNAP = 1e-7
#: Sample points per piece when testing that f' is constant on a region.
CONSTANT_SAMPLES = 33


@dataclass
class Canonical:
    """A table's parts with the indices of exact boundaries and levels."""

    boundaries: np.ndarray
    codes: np.ndarray
    levels: np.ndarray
    exact_boundaries: list[int] = field(default_factory=list)
    exact_levels: list[int] = field(default_factory=list)


def jump_placements(df: Callable, breakpoints: tuple[float, ...] | np.ndarray) -> dict[float, float]:
    """For each breakpoint where f' jumps: the boundary that gives torch's f' at the kink itself.

    ``b`` when f'(b) is the right piece's value (x >= b takes the right level), ``nextafter(b, +inf)`` when it is the
    left piece's. Breakpoints where f' is continuous (elu at 0 with alpha = 1, softsign) are left out.

    >>> from fewbit_design.design.activations import bind
    >>> jump_placements(bind("relu").df, (0.0,))
    {0.0: 5e-324}
    >>> jump_placements(bind("relu6").df, (0.0, 6.0))
    {0.0: 5e-324, 6.0: 6.0}
    """
    result: dict[float, float] = {}
    for b in breakpoints:
        b = float(b)
        left_x, right_x = np.nextafter(b, -np.inf), np.nextafter(b, np.inf)
        left, at, right = (float(v) for v in df(np.array([left_x, b, right_x])))
        scale = max(1.0, abs(left), abs(right))
        if abs(right - left) <= 1e-9 * scale:
            continue
        result[b] = b if abs(at - right) <= abs(at - left) else float(right_x)
    return result


def mirror_constant(df: Callable, low: float, high: float) -> float | None:
    """c when f'(-x) = c - f'(x) on [low, high] (to 1e-12), else None."""
    half = min(abs(low), abs(high))
    if half <= 0:
        return None
    x = np.linspace(0.0, half, 257)[1:]
    x = np.concatenate([x, x * (1.0 - 1e-3) + 1e-3 * half * 0.5])
    sums = df(x) + df(-x)
    c = float(np.median(sums))
    scale = max(1.0, float(np.max(np.abs(df(x)))))
    if np.all(np.abs(sums - c) <= 1e-12 * scale):
        return c
    return None


def _even_weight(weight: Callable, low: float, high: float) -> bool:
    if low != -high:
        return False
    x = np.linspace(0.0, high, 129)
    a, b = weight(x), weight(-x)
    return bool(np.all(np.abs(a - b) <= 1e-14 * max(float(np.max(np.abs(a))), 1e-300)))


def _pieces(boundaries: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    edges_left = np.concatenate([[-np.inf], boundaries])
    edges_right = np.concatenate([boundaries, [np.inf]])
    return np.clip(edges_left, low, high), np.clip(edges_right, low, high)


def _constant_value(df: Callable, a: float, b: float, breakpoints: np.ndarray) -> float | None:
    """f' on (a, b) when it is one constant there (bitwise equal at the sample points), else None."""
    cuts = np.concatenate([[a], breakpoints[(breakpoints > a) & (breakpoints < b)], [b]])
    values = []
    for left, right in zip(cuts[:-1], cuts[1:], strict=True):
        if right - left <= 1e-12 * max(1.0, abs(left), abs(right)):
            continue  # a sliver between a kink and its float neighbour: no mass
        x = left + (right - left) * (np.arange(1, CONSTANT_SAMPLES + 1) / (CONSTANT_SAMPLES + 1))
        values.append(df(x))
    if not values:
        return None
    values = np.concatenate(values)
    return float(values[0]) if np.all(values == values[0]) else None


def _snap(parts: Canonical, placements: dict[float, float], low: float, high: float) -> None:
    b = parts.boundaries.copy()
    tolerance = SNAP * (high - low)
    for kink, place in placements.items():
        near = np.flatnonzero(np.abs(b - kink) <= tolerance)
        if near.size == 0:
            continue
        i = int(near[np.argmin(np.abs(b[near] - kink))])
        if parts.codes[i] == parts.codes[i + 1]:
            continue
        if (i > 0 and b[i - 1] >= place) or (i + 1 < b.size and b[i + 1] <= place):
            continue  # another boundary in the way (a sliver interval): leave it
        b[i] = place
        parts.exact_boundaries.append(i)
    parts.boundaries = b


def _exact_levels(parts: Canonical, df: Callable, breakpoints: np.ndarray, low: float, high: float) -> None:
    lefts, rights = _pieces(parts.boundaries, low, high)
    levels = parts.levels.copy()
    exact = []
    for code in np.unique(parts.codes):
        values = set()
        for m in np.flatnonzero(parts.codes == code):
            if rights[m] > lefts[m]:
                values.add(_constant_value(df, float(lefts[m]), float(rights[m]), breakpoints))
        if len(values) == 1 and None not in values:
            levels[code] = values.pop()
            exact.append(int(code))
    used = np.unique(parts.codes)
    # unused codes repeat the last used level
    if used.size < levels.size and int(used.max()) == used.size - 1:
        levels[used.size :] = levels[used.size - 1]
    parts.levels = levels
    parts.exact_levels = sorted(exact)


def _lay_out(b: np.ndarray, y: np.ndarray, exact: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """Canonical boundaries and per-interval levels of one line of intervals (``y`` and ``exact`` per interval).

    Runs of adjacent intervals with one exact level have their inner boundaries spread evenly between the run's
    ends. When every level is exact (a piecewise-constant f' the bits can represent), the spare intervals all go to
    the last run: every other run keeps one interval.
    """
    n = y.size
    starts = [0] + [m for m in range(1, n) if not (exact[m] and exact[m - 1] and y[m] == y[m - 1])]
    runs = [(start, end) for start, end in zip(starts, starts[1:] + [n], strict=True)]
    if np.all(exact) and len(runs) > 1:
        edges = [b[end - 1] for _, end in runs[:-1]]  # the boundaries between runs (kinks)
        counts = [1] * (len(runs) - 1) + [n - len(runs) + 1]
        new_y = np.concatenate([np.full(count, y[start]) for (start, _), count in zip(runs, counts, strict=True)])
        new_b, position = [], 0
        for k, count in enumerate(counts):
            position += count
            if k < len(edges):
                new_b.extend([np.nan] * (count - 1) + [edges[k]])
            else:
                new_b.extend([np.nan] * (count - 1))
        b, y = np.array(new_b, dtype=np.float64), new_y
        starts = [0] + list(np.cumsum(counts)[:-1])
        runs = [(start, end) for start, end in zip(starts, starts[1:] + [n], strict=True)]
    b = b.copy()
    for start, end in runs:
        count = end - start
        if count < 2 or not exact[start] and not np.all(exact):
            continue
        left = b[start - 1] if start > 0 else low
        right = b[end - 1] if end - 1 < b.size else high
        if not right > left:
            continue
        inner = left + (right - left) * (np.arange(1, count) / count)
        if np.all(np.diff(np.concatenate([[left], inner, [right]])) > 0):
            b[start : end - 1] = inner
    return b, y


def _spread_flat_runs(parts: Canonical, low: float, high: float, symmetric: bool) -> None:
    """Intervals mode: the canonical place of boundaries that q does not depend on (see :func:`_lay_out`)."""
    exact_codes = np.isin(parts.codes, parts.exact_levels)
    if not symmetric:
        b, y = _lay_out(parts.boundaries, parts.levels[parts.codes], exact_codes, low, high)
        if not np.any(np.isnan(b)):
            parts.boundaries, parts.levels = b, y
        return
    # Symmetric: codes K-1 .. 1 0 1 .. K-1; lay out the half line x >= 0 (code 0 from 0) and mirror it.
    K = parts.levels.size
    half = parts.boundaries[K - 1 :]
    y = parts.levels[np.arange(K)]
    b, y = _lay_out(half, y, np.isin(np.arange(K), parts.exact_levels), 0.0, high)
    if not np.any(np.isnan(b)):
        parts.boundaries, parts.levels = np.concatenate([-b[::-1], b]), y


def _mirror(parts: Canonical, c: float, mode: str) -> Canonical:
    b = -parts.boundaries[::-1]
    if mode == "intervals":
        levels = (c - parts.levels[parts.codes])[::-1]
        return Canonical(b, np.arange(levels.size), levels)
    used = int(parts.codes.max()) + 1
    levels = (c - parts.levels[:used])[::-1]
    codes = (used - 1 - parts.codes)[::-1]
    levels = np.concatenate([levels, np.full(parts.levels.size - used, levels[-1])])
    return Canonical(b, codes, levels)


def _steps(parts: Canonical, df, breakpoints, placements, low, high, mode, symmetric=False) -> Canonical:
    _snap(parts, placements, low, high)
    _exact_levels(parts, df, breakpoints, low, high)
    if mode == "intervals":
        _spread_flat_runs(parts, low, high, symmetric)
        parts.exact_boundaries = []
        _snap(parts, placements, low, high)  # the laid-out (or mirrored) kinks get their exact place again
    parts.exact_boundaries = sorted(set(parts.exact_boundaries))
    return parts


def canonicalize(
    boundaries: np.ndarray,
    codes: np.ndarray,
    levels: np.ndarray,
    *,
    df: Callable,
    breakpoints: tuple[float, ...],
    weight: Callable,
    low: float,
    high: float,
    mode: str,
    symmetric: bool,
) -> Canonical:
    """The canonical form of a designed table (see the module header)."""
    kinks = np.asarray(breakpoints, dtype=np.float64)
    placements = jump_placements(df, kinks[(kinks > low) & (kinks < high)])
    parts = Canonical(np.asarray(boundaries, np.float64), np.asarray(codes, np.int64), np.asarray(levels, np.float64))
    parts = _steps(parts, df, kinks, placements, low, high, mode, symmetric)
    if symmetric or parts.boundaries.size == 0:
        return parts
    c = mirror_constant(df, low, high)
    if c is None or not _even_weight(weight, low, high):
        return parts
    mirrored = _steps(_mirror(parts, c, mode), df, kinks, placements, low, high, mode)
    own = float(np.clip(parts.boundaries, low, high).sum())
    other = float(np.clip(mirrored.boundaries, low, high).sum())
    if other > own + 1e-9 * (high - low):
        return mirrored
    return parts
