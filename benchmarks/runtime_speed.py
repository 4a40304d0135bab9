"""Few-bit activations against the native torch modules: forward, backward and forward+backward time, saved bytes.

For each activation, bit width and size (float32, 1-D, requires_grad like an activation in training) it times, with
native and few-bit measurements interleaved in the same run:

* forward:           ``module(x)`` (the native module saves x or its output; the few-bit one packs codes);
* backward:          ``torch.autograd.grad(y, x, grad)`` on a graph built once (retained);
* forward+backward:  ``torch.autograd.grad(module(x), x, grad)``;

and reports medians and few-bit / native ratios, plus the bytes saved for backward
(``fewbit_design.runtime.memory.saved_bytes``). Tables: the shipped table when there is one, else one designed now
with ``fewbit_design.design`` (said in the output). Prints a table and writes a CSV.

    python benchmarks/runtime_speed.py                              # gelu,silu,relu,sigmoid,tanh; bits 1-4; 2^16..2^24
    python benchmarks/runtime_speed.py --activations gelu,silu --bits 3 --sizes 24
    python benchmarks/runtime_speed.py --clock process --threads 1  # CPU seconds: robust on a busy machine
    python benchmarks/runtime_speed.py --quick                      # smoke test
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


def measure(native, fewbit, n: int, repeats: int, clock) -> dict[str, harness.Timings]:
    """Timings of forward, backward, forward+backward for both modules (baseline: native), interleaved; rounds
    alternate which module goes first. One warm-up call each (numba compile or cache load, the allocator)."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=generator).requires_grad_()
    grad = torch.randn(n, generator=generator)
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
    parser.add_argument("--bits", default="1,2,3,4", help="comma-separated bit widths")
    parser.add_argument("--sizes", default="16,20,24", help="comma-separated log2 of the number of elements")
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
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one activation, 3 bits: a smoke test")
    args = parser.parse_args(argv)

    if args.quick:
        args.activations, args.bits, args.sizes, args.repeats = "gelu", "3", "12,14", args.repeats or 3
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
            for n in sizes:
                repeats = args.repeats or (25 if n <= 2**16 else 11 if n <= 2**20 else 7)
                timings = measure(native, fewbit, n, repeats, clock)
                row = {"activation": name, "bits": bits, "numel": n, "table": source}
                for kind in KINDS:
                    row[f"{kind}_native_ms"] = 1e3 * timings[kind]["native"].median
                    row[f"{kind}_fewbit_ms"] = 1e3 * timings[kind]["fewbit"].median
                    row[f"{kind}_ratio"] = timings[kind].ratio("fewbit")
                row["saved_native_bytes"] = saved(native, n)
                row["saved_fewbit_bytes"] = saved(fewbit, n)
                row["saved_ratio"] = row["saved_fewbit_bytes"] / row["saved_native_bytes"]
                rows.append(row)
                parts = [f"{name:>10s} {bits}b 2^{n.bit_length() - 1:<2d} ({source}):"]
                for kind, label in (("forward", "fwd"), ("backward", "bwd"), ("forward+backward", "fwd+bwd")):
                    few, nat, ratio = row[f"{kind}_fewbit_ms"], row[f"{kind}_native_ms"], row[f"{kind}_ratio"]
                    parts.append(f"{label} {few:8.2f} / {nat:8.2f} ms = {ratio:.2f}x")
                parts.append(
                    f"saved {row['saved_fewbit_bytes']} / {row['saved_native_bytes']} B = {row['saved_ratio']:.3f}x"
                )
                print("  ".join(parts), flush=True)

    print("\nforward+backward time ratio few-bit / native (median):")
    header = "activation bits " + " ".join(f"{'2^' + str(n.bit_length() - 1):>7s}" for n in sizes)
    print(header)
    for name in names:
        for bits in bit_widths:
            cells = [r["forward+backward_ratio"] for r in rows if r["activation"] == name and r["bits"] == bits]
            print(f"{name:>10s} {bits:4d} " + " ".join(f"{c:7.2f}" for c in cells))

    if 3 in bit_widths and len(bit_widths) > 1:
        print("\nforward+backward time of few-bit at b bits / at 3 bits (median; issue 12: 5-8 bits at most 1.1x):")
        print(header)
        for name in names:
            base = [r["forward+backward_fewbit_ms"] for r in rows if r["activation"] == name and r["bits"] == 3]
            for bits in bit_widths:
                cells = [r["forward+backward_fewbit_ms"] for r in rows if r["activation"] == name and r["bits"] == bits]
                print(f"{name:>10s} {bits:4d} " + " ".join(f"{c / b:7.2f}" for c, b in zip(cells, base, strict=True)))

    out = harness.write_csv(args.out, rows, float_format=".6g")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
