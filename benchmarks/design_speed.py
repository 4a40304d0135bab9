"""Speed of the design engine's dynamic programs against the plain O(n^2 K) DP, measured in the same run.

* intervals DP (eq. 7) with K = 16 at growing grid sizes n, including the prefix integrals (GELU', uniform weight);
* level-sets DP (exact weighted 1-D k-means: sort, merge, divide and conquer) with K = 16 and K = 256 at growing
  sample counts (values f'(X), X ~ N(0, 1), GELU);
* ``fewbit-design gelu --bits 3 --weight normal`` wall time, Python start-up and numba cache loading included.

The fast DPs run serially and with all numba threads; the plain DP (serial) runs where it finishes in reasonable
time and is skipped beyond (said so in the table). Medians of several runs after a warm-up (numba cache warm). Serial
and parallel runs are timed in separate blocks, not interleaved: a serial call between two parallel ones would let
numba's OpenMP workers go idle, and every parallel call would then pay for waking them.

    python benchmarks/design_speed.py            # full sizes, CSV in benchmarks/results/design_speed.csv
    python benchmarks/design_speed.py --quick    # small sizes (a smoke test)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np

from fewbit_design.design import activations, dp
from fewbit_design.design.integrals import Problem, make_grid, prefix_integrals
from fewbit_design.design.weights import make_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

# The plain DP runs only up to this many cost evaluations (n^2 K / 2); beyond, it is skipped.
PLAIN_LIMIT = 2e9


def with_threads(threads: int, function):
    def run():
        previous = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            return function()
        finally:
            numba.set_num_threads(previous)

    return run


def serial_and_parallel(fast, threads: int, repeat: int) -> tuple[float, float]:
    """Median seconds of ``fast(False)`` and of ``fast(True)`` on ``threads`` threads, each after a warm-up call
    (compilation or cache load), in separate blocks (see the module docstring)."""
    serial = harness.measure({"serial": lambda: fast(False)}, repeats=repeat)
    parallel = harness.measure({"parallel": with_threads(threads, lambda: fast(True))}, repeats=repeat)
    return serial["serial"].median, parallel["parallel"].median


def intervals_rows(sizes: list[int], K: int, repeat: int) -> list[dict]:
    gelu = activations.bind("gelu")
    weight = make_weight("uniform")
    problem = Problem(gelu.df, weight, -10.0, 10.0)
    threads = numba.config.NUMBA_NUM_THREADS
    rows = []
    for n in sizes:

        def fast(parallel: bool, n=n):
            grid = make_grid(-10.0, 10.0, n + 1)
            return dp.intervals_dp(prefix_integrals(problem, grid), K, parallel=parallel)

        prefix = prefix_integrals(problem, make_grid(-10.0, 10.0, n + 1))
        serial, parallel = serial_and_parallel(fast, threads, repeat)
        plain = None
        if n * n * K / 2 <= PLAIN_LIMIT:

            def reference(n=n):
                grid = make_grid(-10.0, 10.0, n + 1)
                return dp.intervals_dp_reference(prefix_integrals(problem, grid), K)

            plain = harness.measure({"plain": reference}, repeats=max(1, repeat // 2))["plain"].median
            assert dp.intervals_dp_reference(prefix, K)[1].tolist() == dp.intervals_dp(prefix, K)[1].tolist()
        rows.append({"dp": "intervals", "K": K, "n": n, "serial_s": serial, "parallel_s": parallel,
                     "threads": threads, "plain_s": plain})  # fmt: skip
    return rows


def levelsets_rows(cases: list[tuple[int, int]], repeat: int) -> list[dict]:
    rng = np.random.default_rng(0)
    gelu = activations.bind("gelu")
    threads = numba.config.NUMBA_NUM_THREADS
    rows = []
    for K, n in cases:
        values = gelu.df(rng.standard_normal(n))

        def fast(parallel: bool, values=values, K=K):
            return dp.kmeans_1d(values, K=K, parallel=parallel)

        serial, parallel = serial_and_parallel(fast, threads, repeat)
        plain = None
        if n * n * K / 2 <= PLAIN_LIMIT:
            reference = {"plain": lambda values=values, K=K: dp.kmeans_1d(values, K=K, reference=True)}
            plain = harness.measure(reference, repeats=max(1, repeat // 2))["plain"].median
            assert abs(dp.kmeans_1d(values, K=K, reference=True)[0] - fast(False)[0]) <= 1e-9 * fast(False)[0]
        rows.append({"dp": "levelsets", "K": K, "n": n, "serial_s": serial, "parallel_s": parallel,
                     "threads": threads, "plain_s": plain})  # fmt: skip
    return rows


def cli_rows(repeat: int) -> list[dict]:
    script = shutil.which("fewbit-design")
    if script is None:
        return []
    command = [script, "gelu", "--bits", "3", "--weight", "normal"]
    # one warm-up run (the numba cache)
    timings = harness.measure({"cli": lambda: subprocess.run(command, check=True, capture_output=True)}, repeats=repeat)
    seconds = timings["cli"].median
    return [{"dp": "cli: fewbit-design gelu --bits 3 --weight normal", "K": 8, "n": "", "serial_s": seconds,
             "parallel_s": None, "threads": "", "plain_s": None}]  # fmt: skip


def fmt(value) -> str:
    if value is None:
        return "skipped"
    return f"{value:.3f}"


def print_table(rows: list[dict]) -> None:
    header = f"{'dp':<10} {'K':>4} {'n':>9} {'fast 1 thread s':>16} {'fast all threads s':>19} {'plain s':>9} "
    header += f"{'plain/fast':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if row["dp"].startswith("cli"):
            continue
        best = min(row["serial_s"], row["parallel_s"])
        ratio = "-" if row["plain_s"] is None else f"{row['plain_s'] / best:.1f}x"
        threads = f"{fmt(row['parallel_s'])} ({row['threads']})"
        print(f"{row['dp']:<10} {row['K']:>4} {row['n']:>9} {fmt(row['serial_s']):>16} {threads:>19} "
              f"{fmt(row['plain_s']):>9} {ratio:>11}")  # fmt: skip
    for row in rows:
        if row["dp"].startswith("cli"):
            print(f"{row['dp']}: {row['serial_s']:.2f} s wall (median, Python start-up included)")
    print(f"plain DP skipped where n^2 K / 2 > {PLAIN_LIMIT:.0e} cost evaluations")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke test)")
    harness.add_options(
        parser,
        repeats=None,
        out=harness.RESULTS / "design_speed.csv",
        help_texts={"repeats": "runs per measurement (median; default 5, --quick: 2)"},
    )
    args = parser.parse_args(argv)
    repeat = args.repeats or (2 if args.quick else 5)
    if args.quick:
        interval_sizes = [1000, 3000]
        level_cases = [(16, 10**4), (256, 3000)]
    else:
        interval_sizes = [1000, 3000, 10**4, 3 * 10**4]
        level_cases = [(16, 10**4), (16, 10**5), (16, 10**6), (256, 3000), (256, 10**4), (256, 10**5)]
    print(f"numba {numba.__version__}, {os.cpu_count()} CPUs, numba threads {numba.config.NUMBA_NUM_THREADS}, "
          f"threading layer after first parallel call; medians of {repeat} runs")  # fmt: skip
    rows = intervals_rows(interval_sizes, 16, repeat)
    rows += levelsets_rows(level_cases, repeat)
    rows += cli_rows(3 if not args.quick else 1)
    print(f"threading layer: {numba.threading_layer()}")
    print_table(rows)
    path = harness.write_csv(args.out, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
