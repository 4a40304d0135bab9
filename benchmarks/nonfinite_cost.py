"""Cost of the non-finite rule (issue 16.1): few-bit forward time with and without the check for NaN / +-inf.

The check is one reduction over x (``sum``; ``aminmax`` for float16): a finite result proves every element finite;
the sparse record (int64 positions + values) is built only otherwise. This script times, interleaved in one run, on
float32, float16 and bfloat16 inputs of 2^20 and 2^22 elements (GELU, 3 bits):

* native:    ``torch.nn.GELU()(x)`` with autograd recording (saves x);
* unchecked: the few-bit forward with the check switched off (``ops.nonfinite_record`` replaced by ``None``);
* checked:   the few-bit forward as shipped;

and prints checked / unchecked and checked / native ratios (medians of process time), plus the bytes saved for
backward with 0 and with 3 non-finite elements. One torch thread by default (``--threads``), so that process
time is robust on a busy machine. Writes ``benchmarks/results/nonfinite_cost.csv``.

    python benchmarks/nonfinite_cost.py            # sizes 2^20, 2^22
    python benchmarks/nonfinite_cost.py --quick    # 2^16, few repeats
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from pathlib import Path

import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fewbit_nn
from fewbit_design.runtime.fewbit import ops


def _time(function, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        function()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: process time is then robust)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [16] if args.quick else [20, 22]
    repeats = 3 if args.quick else 15
    few_bit = fewbit_nn.GELU(bits=3)
    native = torch.nn.GELU()
    original = ops.nonfinite_record
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for power in sizes:
            x = torch.randn(1 << power).to(dtype).requires_grad_()
            timings = {"native": [], "unchecked": [], "checked": []}
            for _ in range(3):  # interleave the variants
                timings["native"].append(_time(lambda x=x: native(x), repeats))
                ops.nonfinite_record = lambda tensor: None
                try:
                    timings["unchecked"].append(_time(lambda x=x: few_bit(x), repeats))
                finally:
                    ops.nonfinite_record = original
                timings["checked"].append(_time(lambda x=x: few_bit(x), repeats))
            medians = {name: statistics.median(values) for name, values in timings.items()}
            with memory.saved_bytes() as finite_bytes:
                few_bit(x)
            y = x.detach().clone()
            y[[0, len(y) // 2, len(y) - 1]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
            with memory.saved_bytes() as nonfinite_bytes:
                few_bit(y.requires_grad_())
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "numel": 1 << power,
                "native_ms": round(medians["native"] * 1e3, 3),
                "unchecked_ms": round(medians["unchecked"] * 1e3, 3),
                "checked_ms": round(medians["checked"] * 1e3, 3),
                "checked_over_unchecked": round(medians["checked"] / medians["unchecked"], 3),
                "checked_over_native": round(medians["checked"] / medians["native"], 3),
                "saved_bytes_finite": finite_bytes.total,
                "saved_bytes_3_nonfinite": nonfinite_bytes.total,
            }
            rows.append(row)
            print(", ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    out = Path(__file__).parent / "results" / ("nonfinite_cost-quick.csv" if args.quick else "nonfinite_cost.csv")
    out.parent.mkdir(exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
