"""CompressedLinear (K-bit saved inputs) against nn.Linear: forward+backward time, and the quantizer alone.

For each width (in = out features), row count and dtype it times, interleaved in the same run (harness.measure):

* ``nn.Linear``:        ``layer(x).backward(grad)``;
* ``CompressedLinear``: the same with the input kept as ``--bits``-bit group codes (stochastic rounding);
* ``quantize`` / ``dequantize``: ``quant.quantize_groups`` and ``quant.dequantize_groups`` alone (what the
  compressed layer adds to the native one: one quantize in forward, one dequantize in backward).

It prints medians, the ratio of medians against nn.Linear and the quartiles of the per-round ratios (the spread),
and writes a CSV. An 8-bit quantize reads x once and writes a quarter of it (float32), a dequantize the reverse:
against the three matmuls of a linear layer's forward and backward they should cost a few percent.

    python benchmarks/linear_speed.py                 # widths 128..768, 4k and 16k rows, float32 and bfloat16
    python benchmarks/linear_speed.py --threads 1     # one torch thread (the kernels use torch's thread count)
    python benchmarks/linear_speed.py --quick         # seconds: width 256, 1024 rows, both dtypes
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from fewbit_design.runtime.linear import CompressedLinear, quant

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def measure_case(width: int, rows: int, dtype: torch.dtype, bits: int, repeats: int, clock) -> dict[str, object]:
    """One row of the table: medians (ms) and ratios against nn.Linear."""
    torch.manual_seed(0)
    native = torch.nn.Linear(width, width, dtype=dtype)
    compressed = CompressedLinear(width, width, bits=bits, dtype=dtype)
    compressed.load_state_dict(native.state_dict())
    x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, width, dtype=dtype)
    packed, scales = quant.quantize_groups(x.detach(), bits, quant.GROUP_SIZE, stochastic=True, seed=1)

    def step(layer):
        def call():
            layer(x).backward(grad)
            x.grad = None
            layer.zero_grad(set_to_none=True)

        return call

    candidates = {
        "linear": step(native),
        "compressed": step(compressed),
        "quantize": lambda: quant.quantize_groups(x.detach(), bits, quant.GROUP_SIZE, stochastic=True, seed=1),
        "dequantize": lambda: quant.dequantize_groups(packed, scales, width, bits, quant.GROUP_SIZE, dtype),
    }
    timings = harness.measure(candidates, repeats=repeats, warmup=2, baseline="linear", clock=clock)
    per_round = [c / n for c, n in zip(timings["compressed"].samples, timings["linear"].samples, strict=True)]
    spread = statistics.quantiles(per_round, n=4, method="inclusive") if len(per_round) > 1 else per_round * 3
    return {
        "width": width,
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "bits": bits,
        "threads": torch.get_num_threads(),
        "linear_ms": timings["linear"].median * 1e3,
        "compressed_ms": timings["compressed"].median * 1e3,
        "quantize_ms": timings["quantize"].median * 1e3,
        "dequantize_ms": timings["dequantize"].median * 1e3,
        "ratio": timings.ratio("compressed"),
        "ratio_q1": spread[0],
        "ratio_q3": spread[-1],
        "quantize_share": timings.ratio("quantize"),
        "dequantize_share": timings.ratio("dequantize"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="128,256,512,768", help="in = out features (default %(default)s)")
    parser.add_argument("--rows", default="4096,16384", help="rows of x (default %(default)s)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="default %(default)s")
    parser.add_argument("--bits", type=int, default=8, help="bits per saved code (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="seconds: width 256, 1024 rows, 3 repeats")
    harness.add_options(parser, out=str(harness.RESULTS / "linear_speed.csv"), repeats=None, threads=1, clock="wall")
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.rows, args.repeats = "256", "1024", args.repeats or 3
        if args.out == str(harness.RESULTS / "linear_speed.csv"):
            args.out = str(harness.scratch("linear_speed_quick.csv"))
    repeats = args.repeats or 15
    harness.set_threads(args.threads)
    clock = harness.CLOCKS[args.clock]
    rows_out = []
    print(f"{'dtype':>9} {'width':>5} {'rows':>6} {'linear ms':>10} {'compr. ms':>10} {'ratio':>6} {'[q1, q3]':>14}"
          f" {'quant.':>7} {'dequant.':>8}")  # fmt: skip
    for dtype_name in args.dtypes.split(","):
        for rows in _ints(args.rows):
            for width in _ints(args.widths):
                row = measure_case(width, rows, DTYPES[dtype_name], args.bits, repeats, clock)
                rows_out.append(row)
                print(
                    f"{row['dtype']:>9} {width:>5} {rows:>6} {row['linear_ms']:>10.2f} {row['compressed_ms']:>10.2f}"
                    f" {row['ratio']:>6.3f} [{row['ratio_q1']:.3f}, {row['ratio_q3']:.3f}]"
                    f" {row['quantize_share']:>7.3f} {row['dequantize_share']:>8.3f}",
                    flush=True,
                )
    path = harness.write_csv(args.out, rows_out, float_format=".6g")
    print(f"(quant. and dequant.: the quantizer's time over nn.Linear's forward+backward) wrote {path}")


if __name__ == "__main__":
    main()
