"""Few-bit activations against native on a GPU: forward, backward, forward+backward; CUDA events, medians.

For each activation (GELU, SiLU, ReLU, Tanh, Sigmoid), bit width (1, 2, 3, 4, 8), dtype (bfloat16, float32) and size
(2^24, 2^26, 2^28 elements, 1-D, requires_grad like an activation in training), with native and few-bit interleaved
in the same run (modules and tables as in benchmarks/runtime_speed.py):

* forward:          ``module(x)``;
* backward:         ``torch.autograd.grad(y, x, grad)`` on a graph built once (retained);
* forward+backward: ``torch.autograd.grad(module(x), x, grad)``;

and the parts of the few-bit op: ``quantize`` (the Triton codes kernel and its launcher), ``scale`` (the backward
kernel) and ``nonfinite`` (the forward's non-finite check: one reduction over x and a device-to-host copy of its
result). Each timing: warm-up calls, then ``--repeats`` calls, each between two CUDA events with the L2 cache flushed
before it (a 256 MiB write, outside the events); the median. Ratios are few-bit / native from the same run.

``floor`` is the bandwidth bound of the forward+backward ratio: native moves 5 s bytes per element (forward reads x
and writes y, backward reads x and dy and writes dx; s = element size), few-bit 4 s + b/4 (it writes b bits of codes
in forward and reads them in backward instead of reading x again). The target is 0.9x at 3 bits for GELU and
SiLU; the floor there is 0.84x (float32) and 0.88x (bfloat16).

Rows are appended to the CSV as they are measured (a run stopped by its time limit keeps what it measured), the
most important first (3 bits, then 4, 2, 1, 8); ``--budget-seconds`` stops starting new configurations after that
long. Then a figure: forward+backward ratio against bits, per activation and dtype, at the largest size measured.

    python benchmarks/gpu_speed.py --out OUT/gpu_speed.csv --figure OUT/gpu_speed.png
    python benchmarks/gpu_speed.py --activations gelu,silu --bits 3 --dtypes bfloat16 --sizes 24,28
    python benchmarks/gpu_speed.py --tiny       # a dry run on CPU (tiny sizes; Triton under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from runtime_speed import get_table, modules  # noqa: E402

from fewbit_design.runtime.fewbit import backends  # noqa: E402
from fewbit_design.runtime.fewbit import ops as op  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BIT_PRIORITY = (3, 4, 2, 1, 8, 5, 6, 7)
KINDS = ("forward", "backward", "forward+backward")
FLUSH_BYTES = 256 << 20
COLUMNS = [
    "device",
    "activation",
    "bits",
    "dtype",
    "numel",
    "table",
    "forward_native_ms",
    "forward_fewbit_ms",
    "forward_ratio",
    "backward_native_ms",
    "backward_fewbit_ms",
    "backward_ratio",
    "forward+backward_native_ms",
    "forward+backward_fewbit_ms",
    "forward+backward_ratio",
    "floor_ratio",
    "quantize_ms",
    "scale_ms",
    "nonfinite_ms",
    "forward+backward_native_GBps",
    "repeats",
]


def floor_ratio(bits: int, element_size: int) -> float:
    """Bytes per element few-bit / native for forward+backward (see the module docstring)."""
    return (4 * element_size + bits / 4) / (5 * element_size)


def measure(native, fewbit, table, n: int, dtype, device, repeats: int, timer) -> dict[str, harness.Timings]:
    """Timings of every timed call: per kind ('forward', 'backward', 'forward+backward') native and few-bit
    (baseline: native; rounds alternate which goes first; two warm-up calls each: Triton compilation, allocator),
    and under 'parts' the few-bit op's 'quantize', 'scale' and 'nonfinite' (one warm-up call each)."""
    generator = torch.Generator(device).manual_seed(n)
    x = torch.randn(n, generator=generator, device=device).to(dtype).requires_grad_()
    grad = torch.randn(n, generator=generator, device=device).to(dtype)
    graphs = {"native": native(x), "fewbit": fewbit(x)}
    tensors = backends.table_tensors(table, device)
    boundaries, levels = tensors.for_input(dtype)
    bits = tensors.bits
    packed = backends.quantize(x.detach(), boundaries, tensors.interval_codes, bits)
    runs: dict[str, dict[str, Callable[[], object]]] = {kind: {} for kind in KINDS}
    for key, module in (("native", native), ("fewbit", fewbit)):
        runs["forward"][key] = lambda module=module: module(x)
        runs["backward"][key] = lambda key=key: torch.autograd.grad(graphs[key], x, grad, retain_graph=True)
        runs["forward+backward"][key] = lambda module=module: torch.autograd.grad(module(x), x, grad)
    timings = {
        kind: harness.measure(pair, repeats=repeats, warmup=2, baseline="native", alternate=True, timer=timer)
        for kind, pair in runs.items()
    }
    parts = {
        "quantize": lambda: backends.quantize(x.detach(), boundaries, tensors.interval_codes, bits),
        "scale": lambda: backends.scale(grad, packed, levels, bits),
        "nonfinite": lambda: op.nonfinite_record(x),
    }
    timings["parts"] = harness.measure(parts, repeats=repeats, timer=timer)
    graphs.clear()  # free the retained graphs before the next configuration
    return timings


def configurations(names: list[str], bit_widths: list[int], dtypes: list[str], sizes: list[int]):
    """(activation, bits, dtype, numel) in the order they are measured: by bit priority, then as given."""
    order = sorted(bit_widths, key=lambda b: BIT_PRIORITY.index(b) if b in BIT_PRIORITY else len(BIT_PRIORITY))
    for bits in order:
        for name in names:
            for dtype in dtypes:
                for n in sizes:
                    yield name, bits, dtype, n


def write_figure(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        mine = [r for r in rows if r["dtype"] == dtype]
        largest = max(r["numel"] for r in mine)
        mine = [r for r in mine if r["numel"] == largest]
        for name in dict.fromkeys(r["activation"] for r in mine):
            points = sorted((r["bits"], r["forward+backward_ratio"]) for r in mine if r["activation"] == name)
            ax.plot([b for b, _ in points], [v for _, v in points], "o-", label=name)
        floor = sorted({(r["bits"], r["floor_ratio"]) for r in mine})
        ax.plot([b for b, _ in floor], [v for _, v in floor], "k--", label="bandwidth floor")
        ax.axhline(0.9, color="grey", linestyle=":", label="target 0.9x (3 bits, gelu/silu)")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_xticks(sorted({r["bits"] for r in mine}))
        ax.set_xlabel("bits")
        ax.set_ylabel("forward+backward time, few-bit / native")
        ax.set_title(f"{dtype}, 2^{largest.bit_length() - 1} elements ({mine[0]['device']})")
        ax.legend(fontsize=8)
    harness.save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activations", default="gelu,silu,relu,tanh,sigmoid")
    parser.add_argument("--bits", default="1,2,3,4,8")
    parser.add_argument("--dtypes", default="bfloat16,float32", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--sizes", default="24,26,28", help="comma-separated log2 of the number of elements")
    parser.add_argument("--budget-seconds", type=float, default=math.inf, help="start no configuration after this")
    harness.add_options(
        parser,
        repeats=15,
        out=None,
        figure=None,
        help_texts={
            "repeats": "timed calls per measurement (median)",
            "out": "CSV (default: benchmarks/results/gpu_speed.csv; --tiny: temp)",
            "figure": "PNG output path (default: none)",
        },
    )
    parser.add_argument("--tiny", "--dry-run", action="store_true", help="CPU dry run: tiny sizes, few configurations")
    args = parser.parse_args(argv)

    if args.tiny:
        args.activations, args.bits, args.dtypes, args.sizes, args.repeats = "gelu,relu", "1,3", "bfloat16", "8,10", 2
    if args.out is None:  # a dry run never overwrites measured results
        args.out = harness.scratch("gpu_speed-tiny.csv") if args.tiny else harness.RESULTS / "gpu_speed.csv"
    device = harness.gpu_or_dry_run("gpu_speed", args.tiny)
    if device is None:
        return 2
    # on CPU the dry run goes through the Triton launchers (interpreted) when it can: the code path of the GPU
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    backend = "triton" if device.type == "cpu" and interpreted else None
    names = args.activations.split(",")
    bit_widths = [int(b) for b in args.bits.split(",")]
    dtypes = args.dtypes.split(",")
    sizes = [2 ** int(s) for s in args.sizes.split(",")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"gpu_speed: {name}, torch {torch.__version__}, backend {backend or backends.backend_for(device)}, "
        f"median of {args.repeats} interleaved calls"
    )
    # CUDA events around each call, the L2 cache flushed before it; on CPU (the dry run) the wall clock
    timer = harness.CudaEvents(device, FLUSH_BYTES) if device.type == "cuda" else None
    rows: list[dict] = []
    start = time.perf_counter()
    with harness.CsvWriter(args.out, COLUMNS, float_format=".6g") as writer, backends.use_backend(backend):
        for activation, bits, dtype_name, n in configurations(names, bit_widths, dtypes, sizes):
            if time.perf_counter() - start > args.budget_seconds:
                print(f"gpu_speed: time budget of {args.budget_seconds:.0f} s spent; stopping before {activation} "
                      f"{bits}b {dtype_name} 2^{n.bit_length() - 1}")  # fmt: skip
                break
            dtype = DTYPES[dtype_name]
            table, source = get_table(activation, bits)
            native, fewbit = (module.to(device) for module in modules(activation, table))
            timings = measure(native, fewbit, table, n, dtype, device, args.repeats, timer)
            element = torch.empty((), dtype=dtype).element_size()
            row = {"device": name, "activation": activation, "bits": bits, "dtype": dtype_name, "numel": n}
            row["table"] = source
            for kind in KINDS:
                row[f"{kind}_native_ms"] = 1e3 * timings[kind]["native"].median
                row[f"{kind}_fewbit_ms"] = 1e3 * timings[kind]["fewbit"].median
                row[f"{kind}_ratio"] = timings[kind].ratio("fewbit")
            row["floor_ratio"] = floor_ratio(bits, element)
            for part in ("quantize", "scale", "nonfinite"):
                row[f"{part}_ms"] = 1e3 * timings["parts"][part].median
            native_seconds = timings["forward+backward"]["native"].median
            row["forward+backward_native_GBps"] = 5 * element * n / native_seconds / 1e9
            row["repeats"] = args.repeats
            rows.append(row)
            writer.write(row)
            print(
                f"{activation:>8s} {bits}b {dtype_name:>8s} 2^{n.bit_length() - 1:<2d}  "
                f"fwd {row['forward_ratio']:.2f}x  bwd {row['backward_ratio']:.2f}x  "
                f"fwd+bwd {row['forward+backward_fewbit_ms']:.3f} / {row['forward+backward_native_ms']:.3f} ms "
                f"= {row['forward+backward_ratio']:.2f}x (floor {row['floor_ratio']:.2f}x)  "
                f"parts: quantize {row['quantize_ms']:.3f} scale {row['scale_ms']:.3f} "
                f"nonfinite {row['nonfinite_ms']:.3f} ms",
                flush=True,
            )
    print(f"wrote {args.out} ({len(rows)} rows)")
    if rows:
        print("\nforward+backward few-bit / native (median), largest size per dtype:")
        for dtype_name in dtypes:
            mine = [r for r in rows if r["dtype"] == dtype_name]
            if not mine:
                continue
            largest = max(r["numel"] for r in mine)
            for r in (r for r in mine if r["numel"] == largest):
                target = " (target 0.9x)" if r["bits"] == 3 and r["activation"] in ("gelu", "silu") else ""
                print(f"  {dtype_name:>8s} 2^{largest.bit_length() - 1} {r['activation']:>8s} {r['bits']}b: "
                      f"{r['forward+backward_ratio']:.3f}x, floor {r['floor_ratio']:.3f}x{target}")  # fmt: skip
        if args.figure:
            write_figure(rows, Path(args.figure))
            print(f"wrote {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
