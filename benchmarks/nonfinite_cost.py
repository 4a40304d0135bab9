"""Cost of the non-finite rule: few-bit forward time with and without the check for NaN / +-inf.

The check is one reduction over x (``sum``; ``aminmax`` for float16): a finite result proves every element finite;
the sparse record (int64 positions + values) is built only otherwise. This script times, interleaved in one run, on
float32, float16 and bfloat16 inputs of 2^20 and 2^22 elements (GELU, 3 bits):

* native:    ``torch.nn.GELU()(x)`` with autograd recording (saves x);
* unchecked: the few-bit forward with the check switched off (``ops.nonfinite_record`` replaced by ``None``);
* checked:   the few-bit forward as shipped;

and prints checked / unchecked and checked / native ratios (medians of process time over 45 calls each, the
three variants called in turn after one warm-up call each), plus the bytes saved for backward with 0 and with 3
non-finite elements. Process time is deliberate: the differences measured are a few percent, which the load of other
processes on a busy shared machine would drown in wall time; with one torch thread (the default, ``--threads``)
process time is the forward's compute time (``--clock wall`` times the wall clock instead). Writes
``benchmarks/results/nonfinite_cost.csv``.

    python benchmarks/nonfinite_cost.py            # sizes 2^20, 2^22
    python benchmarks/nonfinite_cost.py --quick    # 2^16, few repeats (writes nonfinite_cost-quick.csv)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fewbit_nn
from fewbit_design.runtime.fewbit import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402


def unchecked(function):
    """``function`` with the few-bit forward's non-finite check switched off while it runs (the switch, two attribute
    assignments, is timed with it: well under a microsecond against a forward of 2^16 elements or more)."""

    def run():
        original = ops.nonfinite_record
        ops.nonfinite_record = lambda tensor: None
        try:
            return function()
        finally:
            ops.nonfinite_record = original

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    harness.add_options(
        parser,
        threads=1,
        clock="process",
        repeats=None,
        out=None,
        help_texts={
            "threads": "torch threads (default 1: process time is then robust)",
            "repeats": "timed calls per variant (default 45; --quick: 9)",
            "out": "output CSV (default: benchmarks/results/nonfinite_cost.csv; --quick: nonfinite_cost-quick.csv)",
        },
    )
    args = parser.parse_args()
    harness.set_threads(args.threads)
    sizes = [16] if args.quick else [20, 22]
    repeats = args.repeats or (9 if args.quick else 45)
    few_bit = fewbit_nn.GELU(bits=3)
    native = torch.nn.GELU()
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for power in sizes:
            x = torch.randn(1 << power).to(dtype).requires_grad_()
            variants = {
                "native": lambda x=x: native(x),
                "unchecked": unchecked(lambda x=x: few_bit(x)),
                "checked": lambda x=x: few_bit(x),
            }
            timings = harness.measure(variants, repeats=repeats, clock=harness.CLOCKS[args.clock])
            medians = timings.medians()
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
    name = "nonfinite_cost-quick.csv" if args.quick else "nonfinite_cost.csv"
    out = harness.write_csv(args.out or harness.RESULTS / name, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
