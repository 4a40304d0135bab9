"""BLPA memory and time per sample for the paper's pre-activation ResNets on CIFAR-size inputs (Table 2 shape).

For each depth and mode (exact fused baseline, 8-bit, 4-bit) it measures the bytes saved for backward per sample
with ``fewbit_design.runtime.memory.saved_bytes`` (32x32 inputs, a small batch, training mode), the implied
maximum batch size under a memory budget (activation bytes only: budget / saved bytes per sample), and the
forward+backward CPU time per sample (process time, median of interleaved repeats, 1 thread by default) as a
ratio against exact measured in the same run. Process time is deliberate: with one torch thread it is the step's
compute time, and unlike the wall clock other processes on a busy shared machine do not inflate it (``--clock wall``
times the wall clock instead).
Prints a table and writes a CSV.

    python benchmarks/blpa_memory.py                     # depths 164, 254, 488, 1001
    python benchmarks/blpa_memory.py --quick             # depth 164 only (median of 3): results/blpa_memory_quick.csv
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from fewbit_design.runtime import blpa, memory

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

MODES = {"exact": None, "8-bit": 8, "4-bit": 4}


def build(depth: int, bits, *, batch: int, width: int = 1, seed: int = 0):
    """A seeded model and batch; returns (model, x, target, saved bytes per sample)."""
    torch.manual_seed(seed)
    model = blpa.preact_resnet(depth, bits=bits, width=width)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 32, 32, generator=generator)
    target = torch.randint(0, 10, (batch,), generator=generator)
    with memory.saved_bytes(model) as saved:
        loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()  # also the warm-up for the timing
    return model, x, target, saved.total / batch


def step(model, x, target) -> None:
    """One forward+backward."""
    torch.nn.functional.cross_entropy(model(x), target).backward()


def time_steps(built: dict[str, tuple], repeats: int, clock) -> harness.Timings:
    """Forward+backward of every mode, interleaved so that slow drifts of the machine hit every mode alike, the
    gradients reset before each (outside the timed call). No warm-up call: build() ran a step of each."""
    return harness.measure(
        {mode: functools.partial(step, *built[mode][:3]) for mode in built},
        repeats=repeats,
        warmup=0,
        clock=clock,
        before=lambda mode: built[mode][0].zero_grad(set_to_none=True),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="164,254,488,1001", help="comma-separated depths 9n + 2")
    parser.add_argument("--width", type=int, default=1, help="channel multiplier (the paper's '1001 (4x)' is 4)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget-gib", type=float, default=11.0, help="memory budget (default 11: a 1080Ti)")
    harness.add_options(
        parser,
        repeats=3,
        threads=1,
        clock="process",
        out=None,
        help_texts={
            "repeats": "timed forward+backward passes per configuration",
            "out": "default: results/blpa_memory.csv (--quick: results/blpa_memory_quick.csv)",
        },
    )
    parser.add_argument("--backend", default="auto", help="element-wise BLPA work: auto, torch or numba")
    parser.add_argument("--quick", action="store_true", help="depth 164 only (still a median of --repeats)")
    args = parser.parse_args(argv)
    depths = [164] if args.quick else [int(d) for d in args.depths.split(",") if d.strip()]
    repeats = args.repeats
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    if args.out is None:
        args.out = harness.RESULTS / ("blpa_memory_quick.csv" if args.quick else "blpa_memory.csv")
    harness.set_threads(args.threads)
    blpa.set_backend(args.backend)
    for depth in depths:  # validate before any long work
        if depth < 11 or (depth - 2) % 9:
            parser.error(f"depth must be 9n + 2, got {depth}")
    budget = args.budget_gib * 2**30

    rows = []
    for depth in depths:
        built = {mode: build(depth, bits, batch=args.batch, width=args.width) for mode, bits in MODES.items()}
        timings = time_steps(built, repeats, harness.CLOCKS[args.clock])
        exact_bytes = built["exact"][3]
        exact_seconds = timings["exact"].median / args.batch
        for mode in MODES:
            per_sample = built[mode][3]
            seconds = timings[mode].median / args.batch
            row = {
                "depth": depth,
                "width": args.width,
                "mode": mode,
                "saved_mib_per_sample": per_sample / 2**20,
                "memory_ratio_vs_exact": per_sample / exact_bytes,
                "max_batch": int(budget // per_sample),
                "ms_per_sample": 1000 * seconds,
                "time_ratio_vs_exact": seconds / exact_seconds,
                "batch": args.batch,
                "threads": torch.get_num_threads(),
                "backend": blpa.quant.get_backend(),
            }
            rows.append(row)
            print(
                f"depth {depth:>4} {mode:<5}: {row['saved_mib_per_sample']:8.3f} MiB/sample saved "
                f"({row['memory_ratio_vs_exact']:.4f} of exact), max batch {row['max_batch']:>6} in "
                f"{args.budget_gib:g} GiB, {row['ms_per_sample']:8.1f} ms/sample ({row['time_ratio_vs_exact']:.2f}x)",
                flush=True,
            )
        del built
    out = harness.write_csv(args.out, rows)

    print(
        f"\nTable 2 shape (bytes saved for backward; budget {args.budget_gib:g} GiB; "
        f"CPU ms/sample, backend {args.backend}):"
    )
    header = "| | " + " | ".join(str(d) for d in depths) + " |"
    print(header)
    print("|---" * (len(depths) + 1) + "|")
    for label, key, fmt in (
        ("saved MiB/sample", "saved_mib_per_sample", "{:.2f}"),
        ("ratio vs exact", "memory_ratio_vs_exact", "{:.3f}"),
        ("max batch", "max_batch", "{}"),
        ("ms/sample", "ms_per_sample", "{:.1f}"),
        ("time vs exact", "time_ratio_vs_exact", "{:.2f}x"),
    ):
        for mode in MODES:
            cells = [fmt.format(r[key]) for d in depths for r in rows if r["depth"] == d and r["mode"] == mode]
            print(f"| {label}, {mode} | " + " | ".join(cells) + " |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
