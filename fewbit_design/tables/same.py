"""When two tables are "the same table": a definition that holds across machines.

Byte-for-byte equality of a rebuilt table holds only on the same machine with the same versions. Across machines the
last bits of quadrature, grids and refinement differ, and where the optimum is degenerate a table may legitimately
land elsewhere. A shipped table S is the same as a fresh design F of its spec when:

1. **Structure** is exact: activation, params, weight, mode, bits, symmetric, the number of boundaries and of
   levels, and the codes.
2. **The objective first.** S's stored ``error`` equals the error recomputed by quadrature from S's own boundaries
   and levels within ``ERROR_RTOL`` relative (plus ``ERROR_ATOL`` times the signal power, for error-0 tables); and F
   is not better than S by more than ``OBJECTIVE_RTOL`` relative: a shipped table that is worse than a fresh design
   beyond that is a real problem, reported with both errors. (F worse than S is not a problem of S.)
3. **Boundaries and levels where the optimum is unique.** A boundary or level is compared only where the optimum pins
   it: moving it by ``UNIQUE`` of the span (of the spread of f', for a level) would change the error by more than the
   objective tolerance (``OBJECTIVE_RTOL`` of the error; the change is L''/2 x displacement**2 with L'' =
   2 w(t) |y_right - y_left| |f''(t)| for a boundary and 2 x its region's mass for a level). A boundary between two
   equal levels, in a flat run of f' or where the weight vanishes is not pinned, and is not compared. Boundaries
   marked exact (kinks, see :mod:`fewbit_design.design.canonical`) are compared bitwise: they are a pure lookup
   of the kink and its float neighbour. A pinned value may differ by the displacement the objective cannot see,
   sqrt(2 x budget / L'') with budget = ``OBJECTIVE_RTOL`` of the error, and never by less than a floor:
   ``BOUNDARY_RTOL`` times the weight's span (absolute, so a boundary near zero is not compared relatively) and
   ``LEVEL_RTOL`` times the spread of f' over the range. A value that moved further changes the error by more than
   the objective tolerance on its own: that is a different table.

Every number comes from the objective tolerance, and that sits far above the largest difference measured between
designs perturbed the way another machine differs (docs/design.md, Shipped tables; tests/design/test_table_sameness.py
re-measures it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..table import Table

__all__ = [
    "UNIQUE",
    "OBJECTIVE_RTOL",
    "ERROR_RTOL",
    "ERROR_ATOL",
    "BOUNDARY_RTOL",
    "LEVEL_RTOL",
    "boundary_tolerance",
    "level_tolerance",
    "Context",
    "differences",
]

#: A fresh design may be better than the shipped table by at most this, relative.
OBJECTIVE_RTOL = 1e-6
#: The stored error must equal the table's own recomputed error within this, relative ...
ERROR_RTOL = 1e-9
#: ... plus this times the signal power (the integral of f'**2 w), for tables whose error is (nearly) 0.
ERROR_ATOL = 1e-13
#: A value is pinned when a displacement of this fraction of its scale is visible to the objective tolerance.
UNIQUE = 1e-3
#: Pinned boundaries never need to agree closer than this times the weight's span (high - low), absolute.
BOUNDARY_RTOL = 1e-6
#: Pinned levels never need to agree closer than this times the spread of f' over the range (max - min), absolute.
LEVEL_RTOL = 1e-7


class Context:
    """The problem of a table (f', w, range) and the numbers every comparison needs, computed once."""

    def __init__(self, table: Table) -> None:
        from ..design import activations
        from ..design.engine import signal_power
        from ..design.integrals import Problem
        from ..design.weights import weight_from_dict

        self.bound = activations.bind(table.activation, table.params)
        self.weight = weight_from_dict(table.weight)
        w = self.weight
        major = np.asarray(self.bound.breakpoints + w.breakpoints, dtype=np.float64)
        self.problem = Problem(self.bound.df, w, w.low, w.high, breakpoints=major, name=table.activation)
        self.low, self.high = w.low, w.high
        self.span = w.high - w.low
        self.signal = signal_power(self.problem)
        sample = np.linspace(w.low, w.high, 4001)
        values = self.bound.df(sample)
        self.df_spread = float(np.max(values) - np.min(values)) or 1.0

    def error(self, table: Table) -> float:
        """L of the table's own boundaries and levels, by adaptive quadrature."""
        from ..design.engine import table_error

        return table_error(self.problem, table.boundaries, table.codes, table.levels)

    def masses(self, table: Table) -> np.ndarray:
        """The weight's mass in each code's region."""
        from ..design.integrals import integrate, split_at

        edges = np.concatenate([[self.low], np.clip(table.boundaries, self.low, self.high), [self.high]])
        starts, ends, owner = split_at(edges[:-1], edges[1:], self.problem.split_points)
        pieces = integrate(lambda x, k: np.asarray(self.weight(x), dtype=np.float64)[None], starts, ends)[0]
        per_interval = np.bincount(owner, pieces, minlength=edges.size - 1)
        return np.bincount(table.codes, per_interval, minlength=table.levels.size)

    def curvature(self, table: Table, i: int) -> float:
        """d2L/dt2 of boundary i with the levels fixed: 2 w(t) |y_right - y_left| |f''(t)| (inf at a jump of f')."""
        t = float(table.boundaries[i])
        if not self.low < t < self.high:
            return 0.0
        y_left, y_right = table.levels[table.codes[i]], table.levels[table.codes[i + 1]]
        if y_left == y_right:
            return 0.0
        h = 1e-6 * self.span
        kinks = np.asarray(self.bound.breakpoints)
        if kinks.size and np.min(np.abs(kinks - t)) <= h:
            return math.inf
        slope = float((self.bound.df(t + h) - self.bound.df(t - h)) / (2 * h))
        return 2.0 * float(self.weight(np.array([t]))[0]) * abs(y_right - y_left) * abs(slope)


def _allowed(curvature: float, budget: float, scale: float, floor: float) -> float | None:
    """The move a value may make: None where the optimum does not pin it, else max(floor, sqrt(2 budget / L''))."""
    if not 0.5 * curvature * (UNIQUE * scale) ** 2 > budget:
        return None  # not pinned: a move of UNIQUE x scale is invisible to the objective
    if math.isinf(curvature):
        return floor
    return max(floor, math.sqrt(2.0 * budget / curvature))


def boundary_tolerance(context: Context, curvature: float, budget: float) -> float | None:
    """How far a boundary with d2L/dt2 = ``curvature`` may move (None: not pinned, not compared)."""
    return _allowed(curvature, budget, context.span, BOUNDARY_RTOL * context.span)


def level_tolerance(context: Context, mass: float, budget: float) -> float | None:
    """How far a level whose region has weight ``mass`` may move (L'' = 2 x mass; None: not pinned)."""
    return _allowed(2.0 * mass, budget, context.df_spread, LEVEL_RTOL * context.df_spread)


def _exact(table: Table, field: str) -> set[int]:
    exact = table.design.get("exact") if isinstance(table.design.get("exact"), dict) else {}
    return {int(i) for i in exact.get(field, ())}


def differences(shipped: Table, fresh: Table | None, context: Context | None = None) -> list[str]:
    """How ``shipped`` differs from ``fresh`` (a design of the same spec) by the definition above; [] when the same.

    With ``fresh=None`` only the self-consistency of ``shipped`` (its stored error) is checked. Each message names the
    field and both values.
    """
    context = context or Context(shipped)
    problems: list[str] = []
    if fresh is not None:
        a, b = shipped.to_dict(), fresh.to_dict()
        for name in ("activation", "params", "weight", "mode", "bits", "symmetric"):
            if a[name] != b[name]:
                problems.append(f"field {name!r} is {a[name]!r}, recomputed {b[name]!r}")
        for name in ("boundaries", "levels"):
            if len(a[name]) != len(b[name]):
                problems.append(f"field {name!r} has {len(a[name])} entries, recomputed {len(b[name])}")
        if not problems and a["codes"] != b["codes"]:
            i = next(k for k, (x, y) in enumerate(zip(a["codes"], b["codes"], strict=True)) if x != y)
            problems.append(f"field 'codes[{i}]' is {a['codes'][i]}, recomputed {b['codes'][i]}")
        if problems:
            return problems
    own = float(context.error(shipped))
    floor = ERROR_ATOL * context.signal
    if not abs(shipped.error - own) <= ERROR_RTOL * own + floor:
        problems.append(
            f"field 'error' is {float(shipped.error)!r}, recomputed from its own boundaries and levels {own!r} "
            f"(beyond {ERROR_RTOL:g} relative)"
        )
    if fresh is None:
        return problems
    if fresh.error < own - OBJECTIVE_RTOL * own - floor:
        gap = (own - fresh.error) / own
        problems.append(
            f"field 'error' is {own!r}, a fresh design reaches {float(fresh.error)!r} ({gap:.3g} relative lower, "
            f"beyond {OBJECTIVE_RTOL:g}): the shipped table is not optimal"
        )
    budget = OBJECTIVE_RTOL * own + floor  # an error change this small is invisible to the objective
    exact_shipped, exact_fresh = _exact(shipped, "boundaries"), _exact(fresh, "boundaries")
    for i, (s, f) in enumerate(zip(shipped.boundaries.tolist(), fresh.boundaries.tolist(), strict=True)):
        if i in exact_shipped or i in exact_fresh:
            if s != f:  # a kink or its float neighbour: a lookup, identical on every machine
                problems.append(f"field 'boundaries[{i}]' is {s!r}, recomputed {f!r} (a kink: must be identical)")
            continue
        if abs(s - f) <= BOUNDARY_RTOL * context.span:
            continue
        tolerance = boundary_tolerance(context, context.curvature(shipped, i), budget)
        if tolerance is not None and abs(s - f) > tolerance:
            problems.append(
                f"field 'boundaries[{i}]' is {s!r}, recomputed {f!r} (beyond {tolerance:.3g}, the move the objective "
                f"tolerance {OBJECTIVE_RTOL:g} allows; the optimum pins it)"
            )
    masses = None
    for c, (s, f) in enumerate(zip(shipped.levels.tolist(), fresh.levels.tolist(), strict=True)):
        if abs(s - f) <= LEVEL_RTOL * context.df_spread:
            continue
        masses = context.masses(shipped) if masses is None else masses
        tolerance = level_tolerance(context, float(masses[c]), budget)
        if tolerance is not None and abs(s - f) > tolerance:
            problems.append(
                f"field 'levels[{c}]' is {s!r}, recomputed {f!r} (beyond {tolerance:.3g}, the move the objective "
                f"tolerance {OBJECTIVE_RTOL:g} allows; the optimum pins it)"
            )
    return problems


def describe(problems: list[str]) -> Any:  # pragma: no cover - convenience for interactive use
    return "\n".join(problems) or "same"
