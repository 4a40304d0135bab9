"""Perturb a design the way another machine would, and measure how far the tables move.

Another machine differs from this one in the last bits of floating point: library versions, vectorised math
(SIMD widths, FMA), summation order across threads. We cannot run a second machine in a test, so we imitate it:

* ``quadrature``: 20-node instead of 16-node Gauss-Legendre rules in every integral;
* ``grid``: every design grid point (not the breakpoints and range ends) moved by up to 4 ulps;
* ``threads``: the design in a subprocess with one thread for numba, OpenMP and BLAS (``NUMBA_NUM_THREADS=1``,
  ``OMP_NUM_THREADS=1``, ...) where this process uses every core;
* ``nojit``: the design in a subprocess with numba's JIT off (``NUMBA_DISABLE_JIT=1``: the DPs run as Python).

:func:`spread` designs specs with and without a perturbation and returns the largest differences that
:mod:`.same` tolerates: relative error difference, pinned boundary distance / span, pinned level distance / spread
of f', and the largest pinned move as a fraction of the move :mod:`.same` allows it.
``python -m fewbit_design.tables.perturb [--activation NAME ...] [--bits 1,3,8]`` prints them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..table import Table
from .shipped import TableSpec

__all__ = ["KINDS", "perturbed", "design_in_subprocess", "spread"]

KINDS = ("quadrature", "grid", "threads", "nojit")
ONE_THREAD = {name: "1" for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


@contextlib.contextmanager
def perturbed(kind: str, *, seed: int = 0) -> Iterator[None]:
    """In-process perturbations (``quadrature``, ``grid``) for the duration of the block."""
    from ..design import engine, integrals

    if kind == "quadrature":
        saved = integrals._NODES, integrals._WEIGHTS
        integrals._NODES, integrals._WEIGHTS = np.polynomial.legendre.leggauss(20)
        try:
            yield
        finally:
            integrals._NODES, integrals._WEIGHTS = saved
    elif kind == "grid":
        original = engine.make_grid
        rng = np.random.default_rng(seed)

        def shifted(low: float, high: float, points: int, *, breakpoints: Any = (), density: Any = None) -> np.ndarray:
            grid = original(low, high, points, breakpoints=breakpoints, density=density)
            fixed = np.isin(grid, np.asarray(breakpoints, dtype=np.float64)) | (grid == low) | (grid == high)
            ulps = rng.integers(-4, 5, grid.size)
            moved = grid + ulps * np.spacing(grid)
            out = np.where(fixed, grid, moved)
            return np.unique(out)

        engine.make_grid = shifted
        try:
            yield
        finally:
            engine.make_grid = original
    else:
        raise ValueError(f"kind must be 'quadrature' or 'grid' in-process, got {kind!r}")


def design_in_subprocess(spec: TableSpec, env: dict[str, str], timeout: float = 600.0) -> Table:
    """Design ``spec`` in a fresh Python with extra environment variables (thread counts, NUMBA_DISABLE_JIT)."""
    code = (
        "import sys, json; from fewbit_design.tables import TableSpec\n"
        "a = json.loads(sys.argv[1])\n"
        "spec = TableSpec(*a[:5], tuple(tuple(p) for p in a[5]))\n"
        "sys.stdout.write(spec.design().to_json())"
    )
    argument = json.dumps([spec.activation, spec.bits, spec.mode, spec.symmetric, spec.weight, list(spec.params)])
    result = subprocess.run(
        [sys.executable, "-c", code, argument],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"design of {spec.file} in a subprocess failed: {result.stderr[-2000:]}")
    return Table.from_dict(json.loads(result.stdout), source=f"<{spec.file} {env}>")


def _distances(base: Table, other: Table) -> dict[str, float]:
    """Largest pinned boundary and level distances (scaled) and the relative error difference."""
    from . import same

    context = same.Context(base)
    result = {"error": 0.0, "boundary": 0.0, "level": 0.0, "structure": 0.0, "of_tolerance": 0.0}
    if len(base.boundaries) != len(other.boundaries) or not np.array_equal(base.codes, other.codes):
        result["structure"] = 1.0
        return result
    scale = max(base.error, same.ERROR_ATOL * context.signal)
    result["error"] = abs(other.error - base.error) / scale if scale > 0 else 0.0
    own = context.error(base)
    budget = same.OBJECTIVE_RTOL * own + same.ERROR_ATOL * context.signal
    for i, (a, b) in enumerate(zip(base.boundaries, other.boundaries, strict=True)):
        tolerance = same.boundary_tolerance(context, context.curvature(base, i), budget)
        if tolerance is not None:
            result["boundary"] = max(result["boundary"], abs(a - b) / context.span)
            result["of_tolerance"] = max(result["of_tolerance"], abs(a - b) / tolerance)
    masses = context.masses(base)
    for c, (a, b) in enumerate(zip(base.levels, other.levels, strict=True)):
        tolerance = same.level_tolerance(context, float(masses[c]), budget)
        if tolerance is not None:
            result["level"] = max(result["level"], abs(a - b) / context.df_spread)
            result["of_tolerance"] = max(result["of_tolerance"], abs(a - b) / tolerance)
    return result


def spread(specs: Sequence[TableSpec], kinds: Sequence[str] = ("quadrature", "grid")) -> dict[str, dict[str, float]]:
    """For each perturbation kind, the largest distances over ``specs`` between the plain and perturbed designs."""
    base = {spec: spec.design() for spec in specs}
    out: dict[str, dict[str, float]] = {}
    for kind in kinds:
        worst = {"error": 0.0, "boundary": 0.0, "level": 0.0, "structure": 0.0, "of_tolerance": 0.0}
        for spec in specs:
            if kind in ("quadrature", "grid"):
                with perturbed(kind):
                    table = spec.design()
            elif kind == "threads":
                table = design_in_subprocess(spec, ONE_THREAD)
            else:
                table = design_in_subprocess(spec, {"NUMBA_DISABLE_JIT": "1"})
            for key, value in _distances(base[spec], table).items():
                worst[key] = max(worst[key], value)
        out[kind] = worst
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print the spread of the perturbations over a set of specs (and write it as CSV with ``--csv``)."""
    import argparse

    from .shipped import table_specs

    parser = argparse.ArgumentParser(prog="python -m fewbit_design.tables.perturb")
    parser.add_argument("--activation", action="append", default=None)
    parser.add_argument("--bits", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--kinds", default="quadrature,grid")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    bits = {int(b) for b in args.bits.split(",")}
    specs = [s for s in table_specs(args.activation) if s.bits in bits]
    kinds = args.kinds.split(",")
    rows = []
    for spec in specs:
        result = spread([spec], kinds)
        for kind, worst in result.items():
            rows.append((spec.file, kind, worst))
            print(
                f"{spec.file:50s} {kind:10s} error {worst['error']:.2e} boundary/span {worst['boundary']:.2e} "
                f"level/spread {worst['level']:.2e} of tolerance {worst['of_tolerance']:.2e} "
                f"structure {'differs' if worst['structure'] else 'same'}",
                flush=True,
            )
    for kind in kinds:
        mine = [w for _, k, w in rows if k == kind]
        print(
            f"MAX {kind:10s} error {max(w['error'] for w in mine):.2e} "
            f"boundary/span {max(w['boundary'] for w in mine):.2e} level/spread {max(w['level'] for w in mine):.2e} "
            f"of tolerance {max(w['of_tolerance'] for w in mine):.2e} "
            f"structure differs {sum(w['structure'] > 0 for w in mine)}/{len(mine)}"
        )
    if args.csv:
        lines = ["file,kind,error_rel,boundary_over_span,level_over_spread,of_tolerance,structure_differs"]
        lines += [
            f"{f},{k},{w['error']:.3e},{w['boundary']:.3e},{w['level']:.3e},{w['of_tolerance']:.3e},"
            f"{int(w['structure'] > 0)}"
            for f, k, w in rows
        ]
        with open(args.csv, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
