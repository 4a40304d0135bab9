"""Speed of the design engine's dynamic programs against the plain O(n^2 K) DP, measured in the same run.

* intervals DP (eq. 7) with K = 16 at growing grid sizes n, including the prefix integrals (GELU', uniform weight);
* level-sets DP (exact weighted 1-D k-means: sort, merge, divide and conquer) with K = 16 and K = 256 at growing
  sample counts (values f'(X), X ~ N(0, 1), GELU);
* ``fewbit-design gelu --bits 3 --weight normal`` wall time, Python start-up and numba cache loading included.

The fast DPs run serially and with all numba threads; the plain DP (serial) runs where it finishes in reasonable
time and is skipped beyond (said so in the table). Medians of several runs after a warm-up (numba cache warm).

    python benchmarks/design_speed.py            # full sizes, CSV in benchmarks/results/design_speed.csv
    python benchmarks/design_speed.py --quick    # small sizes (a smoke test)
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np

from fewbit_design.design import activations, dp
from fewbit_design.design.integrals import Problem, make_grid, prefix_integrals
from fewbit_design.design.weights import make_weight

# The plain DP runs only up to this many cost evaluations (n^2 K / 2); beyond, it is skipped.
PLAIN_LIMIT = 2e9


def median_time(function, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def with_threads(threads: int, function):
    def run():
        previous = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            return function()
        finally:
            numba.set_num_threads(previous)

    return run


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
        fast(False)  # warm-up (compilation or cache load)
        fast(True)
        serial = median_time(lambda: fast(False), repeat)
        parallel = median_time(with_threads(threads, lambda: fast(True)), repeat)
        plain = None
        if n * n * K / 2 <= PLAIN_LIMIT:

            def reference(n=n):
                grid = make_grid(-10.0, 10.0, n + 1)
                return dp.intervals_dp_reference(prefix_integrals(problem, grid), K)

            reference()
            plain = median_time(reference, max(1, repeat // 2))
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

        fast(False)
        fast(True)
        serial = median_time(lambda: fast(False), repeat)
        parallel = median_time(with_threads(threads, lambda: fast(True)), repeat)
        plain = None
        if n * n * K / 2 <= PLAIN_LIMIT:
            plain = median_time(lambda values=values, K=K: dp.kmeans_1d(values, K=K, reference=True),
                                max(1, repeat // 2))  # fmt: skip
            assert abs(dp.kmeans_1d(values, K=K, reference=True)[0] - fast(False)[0]) <= 1e-9 * fast(False)[0]
        rows.append({"dp": "levelsets", "K": K, "n": n, "serial_s": serial, "parallel_s": parallel,
                     "threads": threads, "plain_s": plain})  # fmt: skip
    return rows


def cli_rows(repeat: int) -> list[dict]:
    script = shutil.which("fewbit-design")
    if script is None:
        return []
    command = [script, "gelu", "--bits", "3", "--weight", "normal"]
    subprocess.run(command, check=True, capture_output=True)  # warm the numba cache
    seconds = median_time(lambda: subprocess.run(command, check=True, capture_output=True), repeat)
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
    parser.add_argument("--repeat", type=int, default=None, help="runs per measurement (median)")
    parser.add_argument("--csv", default=str(Path(__file__).parent / "results" / "design_speed.csv"))
    args = parser.parse_args(argv)
    repeat = args.repeat or (2 if args.quick else 5)
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
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
