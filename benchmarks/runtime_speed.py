"""Few-bit activations against the native torch modules: forward, backward and forward+backward time, saved bytes.

For each activation, bit width, dtype and size (1-D, requires_grad like an activation in training) it times, with
native and few-bit measurements interleaved in the same run:

* forward:           ``module(x)`` (the native module saves x or its output; the few-bit one packs codes);
* backward:          ``torch.autograd.grad(y, x, grad)`` on a graph built once (retained);
* forward+backward:  ``torch.autograd.grad(module(x), x, grad)``;

and reports medians and few-bit / native ratios (the ratio of medians, and the quartiles of the per-round ratios:
the spread over repeats), plus the bytes saved for backward (``fewbit_design.runtime.memory.saved_bytes``).

Each ratio is printed beside its traffic limit: with s bytes per element and b bits per code, native moves
2s per element forward (read x, write y) and 3s backward (read grad and x or y, write the gradient); few-bit moves
2s + b/8 forward (codes written) and 2s + b/8 backward (codes read), so the ideal ratios of a bandwidth-bound op are
(2s + b/8) / 2s forward, (2s + b/8) / 3s backward and (4s + b/4) / 5s over both (0.81 in float32 at 1 bit).
Activations whose derivative is costly (GELU) can beat the limit, since few-bit's backward skips f'.

Tables: the shipped table when there is one, else one designed now with ``fewbit_design.design`` (said in the
output). Prints a table and writes a CSV.

    python benchmarks/runtime_speed.py                              # 5 activations, bits 1-4 and 8, float32 and
                                                                    # bfloat16, 2^14..2^26 (the full mode: hours)
    python benchmarks/runtime_speed.py --activations gelu,silu --bits 3 --dtypes bfloat16 --sizes 18,22
    python benchmarks/runtime_speed.py --clock process --threads 1  # CPU seconds: robust on a busy machine
    python benchmarks/runtime_speed.py --quick                      # seconds: gelu, 3 bits, both dtypes, 2^12, 2^14
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from fewbit_design.design import activations
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fewbit_nn
from fewbit_design.runtime.tables import load_table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

DEFAULT_ACTIVATIONS = "gelu,silu,relu,sigmoid,tanh"
KINDS = ("forward", "backward", "forward+backward")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def traffic_limit(kind: str, element_bytes: int, bits: int) -> float:
    """The few-bit / native ratio of bytes moved per element (see the module docstring)."""
    codes = bits / 8
    native = {"forward": 2, "backward": 3, "forward+backward": 5}[kind] * element_bytes
    fewbit = {"forward": 2 * element_bytes + codes, "backward": 2 * element_bytes + codes}
    fewbit["forward+backward"] = fewbit["forward"] + fewbit["backward"]
    return fewbit[kind] / native


def round_ratios(timings: harness.Timings) -> tuple[float, float]:
    """Quartiles of the per-round ratios few-bit / native (rounds are interleaved, so each pair shares its spell of
    machine load)."""
    ratios = [f / n for f, n in zip(timings["fewbit"].samples, timings["native"].samples, strict=True)]
    return harness.Timing(tuple(ratios)).quartiles


def get_table(name: str, bits: int) -> tuple[object, str]:
    """The shipped table, or a freshly designed one (with where it came from)."""
    try:
        return load_table(name, bits=bits), "shipped"
    except FewBitError:
        from fewbit_design.design import design

        return design(name, bits), "designed now"


def modules(name: str, table) -> tuple[torch.nn.Module, torch.nn.Module]:
    entry = activations.get(name)
    native_class = getattr(torch.nn, entry.torch_name)
    fewbit_class = getattr(fewbit_nn, entry.torch_name)
    if name == "threshold":
        return native_class(0.0, 0.0), fewbit_class(0.0, 0.0, table=table)
    return native_class(), fewbit_class(table=table)


def measure(native, fewbit, n: int, dtype: torch.dtype, repeats: int, clock) -> dict[str, harness.Timings]:
    """Timings of forward, backward, forward+backward for both modules (baseline: native), interleaved; rounds
    alternate which module goes first. One warm-up call each (numba compile or cache load, the allocator)."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(n, generator=generator).to(dtype)
    candidates = {"native": native, "fewbit": fewbit}
    graphs = {key: module(x) for key, module in candidates.items()}
    runs = {
        "forward": lambda key: candidates[key](x),
        "backward": lambda key: torch.autograd.grad(graphs[key], x, grad, retain_graph=True),
        "forward+backward": lambda key: torch.autograd.grad(candidates[key](x), x, grad),
    }
    return {
        kind: harness.measure(
            {key: functools.partial(run, key) for key in candidates},
            repeats=repeats,
            baseline="native",
            alternate=True,
            clock=clock,
        )
        for kind, run in runs.items()
    }


def saved(module, n: int) -> int:
    # a non-leaf input, as inside a network (runtime.memory leaves out leaf tensors, which are alive anyway)
    x = torch.randn(n, requires_grad=True) * 1.0
    with memory.saved_bytes() as m:
        module(x)
    return m.total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activations", default=DEFAULT_ACTIVATIONS, help="comma-separated names, or 'all'")
    parser.add_argument("--bits", default="1,2,3,4,8", help="comma-separated bit widths")
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument(
        "--sizes", default="14,16,18,20,22,24,26", help="comma-separated log2 of the number of elements"
    )
    harness.add_options(
        parser,
        out=harness.RESULTS / "runtime_speed.csv",
        repeats=0,
        threads=0,
        clock="wall",
        help_texts={
            "repeats": "timed repeats per measurement (0: by size)",
            "threads": "torch (and few-bit kernel) threads; 0: torch default",
        },
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, gelu, 3 bits, both dtypes: seconds")
    args = parser.parse_args(argv)

    if args.quick:
        args.activations, args.bits, args.sizes, args.repeats = "gelu", "3", "12,14", args.repeats or 3
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtypes takes {', '.join(DTYPES)}, got {unknown[0]!r}")
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    names = (
        activations.names()
        if args.activations == "all"
        else [activations.get(n).name for n in args.activations.split(",")]
    )
    bit_widths = [int(b) for b in args.bits.split(",")]
    sizes = [2 ** int(s) for s in args.sizes.split(",")]
    harness.set_threads(args.threads)
    clock = harness.CLOCKS[args.clock]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock: {args.clock}, median of interleaved runs"
    )

    rows = []
    for name in names:
        for bits in bit_widths:
            table, source = get_table(name, bits)
            native, fewbit = modules(name, table)
            for dtype in dtypes:
                element = torch.empty((), dtype=dtype).element_size()
                for n in sizes:
                    repeats = args.repeats or (25 if n <= 2**16 else 11 if n <= 2**20 else 7)
                    timings = measure(native, fewbit, n, dtype, repeats, clock)
                    row = {"activation": name, "bits": bits, "dtype": str(dtype)[6:], "numel": n, "table": source}
                    for kind in KINDS:
                        row[f"{kind}_native_ms"] = 1e3 * timings[kind]["native"].median
                        row[f"{kind}_fewbit_ms"] = 1e3 * timings[kind]["fewbit"].median
                        row[f"{kind}_ratio"] = timings[kind].ratio("fewbit")
                        row[f"{kind}_ratio_q1"], row[f"{kind}_ratio_q3"] = round_ratios(timings[kind])
                        row[f"{kind}_limit"] = traffic_limit(kind, element, bits)
                    row["saved_native_bytes"] = saved(native, n)
                    row["saved_fewbit_bytes"] = saved(fewbit, n)
                    row["saved_ratio"] = row["saved_fewbit_bytes"] / row["saved_native_bytes"]
                    rows.append(row)
                    parts = [f"{name:>8s} {bits}b {row['dtype']:>8s} 2^{n.bit_length() - 1:<2d}:"]
                    for kind, label in (("forward", "fwd"), ("backward", "bwd"), ("forward+backward", "f+b")):
                        parts.append(
                            f"{label} {row[f'{kind}_fewbit_ms']:7.2f}/{row[f'{kind}_native_ms']:7.2f} ms "
                            f"{row[f'{kind}_ratio']:.2f}x [{row[f'{kind}_ratio_q1']:.2f}-{row[f'{kind}_ratio_q3']:.2f}]"
                            f" (limit {row[f'{kind}_limit']:.2f})"
                        )
                    parts.append(f"saved {row['saved_ratio']:.3f}x ({source})")
                    print("  ".join(parts), flush=True)

    header = "activation bits    dtype " + " ".join(f"{'2^' + str(n.bit_length() - 1):>7s}" for n in sizes)
    for kind in KINDS:
        print(f"\n{kind} time ratio few-bit / native (median; traffic limit in the last column):")
        print(header + "   limit")
        for name in names:
            for bits in bit_widths:
                for dtype in dtypes:
                    cells = [
                        r
                        for r in rows
                        if r["activation"] == name and r["bits"] == bits and r["dtype"] == str(dtype)[6:]
                    ]
                    line = " ".join(f"{r[f'{kind}_ratio']:7.2f}" for r in cells)
                    print(f"{name:>10s} {bits:4d} {str(dtype)[6:]:>8s} {line} {cells[0][f'{kind}_limit']:7.2f}")

    out = harness.write_csv(args.out, rows, float_format=".6g")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
