"""Checkpoint plans on chains of n blocks: measured peak memory and step time per strategy, against no checkpointing.

For each block type (``mlp``: x + Linear(GELU(Linear(LayerNorm(x)))); ``transformer``: a pre-norm attention +
MLP block on sequences of 64, 32-wide heads), width 128 by default, and each depth n, it profiles the chain once,
plans every strategy of ``fewbit_design.runtime.checkpoint`` (``optimal`` without a budget: its smallest peak), and
measures in the same run:

* the peak of live tensor bytes over a training step (``memory.peak()``: forward + backward, exact on CPU) against
  the plan's predicted peak. By default the parameters' gradients are allocated before the step and zeroed in place
  (``--grads allocated``, as with ``zero_grad(set_to_none=False)`` or gradient accumulation), so the peak is the
  feature maps', the memory Chen et al.'s O(sqrt(n)) is about; ``--grads fresh`` lets the backward pass create them
  (torch's default), and the peak then also holds n blocks' gradients, which grow linearly whatever the plan;
* the step time (forward + backward, median of repeats, without the memory instrument) and its ratio to no
  checkpointing at the same n.

Then the log-log slope of measured peak against n over n = 16 .. 256 per strategy (sqrt(n) growth is 0.5, linear
is 1.0). Writes ``benchmarks/results/checkpoint_memory.csv`` and ``docs/figures/checkpoint_memory.png`` (the figure
only in the default configuration: all n, width 128, gradients allocated; ``--out`` and ``--figure`` write elsewhere).

    python benchmarks/checkpoint_memory.py            # n = 8 .. 256, both block types
    python benchmarks/checkpoint_memory.py --quick    # n = 8 .. 64 (a few minutes)
    python benchmarks/checkpoint_memory.py --width 32 # narrow blocks (writes checkpoint_memory_w32.csv)

The time overhead of recomputation is the share of the step spent in the forward pass of the recomputed blocks. At
width 32 a block's matrix products are so small that GELU and LayerNorm take most of its forward pass, the forward
is 34-37% of the step, and "sqrt" cost 1.28-1.46x in one run; at width 128 the matrix products dominate, as in
real models, and it costs about one extra forward (see docs/techniques/checkpoint.md for the measured figures, and
for how glibc's allocator makes the step without checkpointing slower).

Timings use one torch thread by default (``--threads``): on a shared 2-core machine two OpenMP threads spin against
other processes and a step gets ten times slower and erratic.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from fewbit_design.runtime import checkpoint, memory

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

STRATEGIES = ("none", "sqrt", "greedy", "recursive", "optimal")


class MLPBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TransformerBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


def make_chain(kind: str, n: int, width: int = 128) -> tuple[torch.nn.Sequential, torch.Tensor]:
    """n blocks and an input with 2**16 values per feature map whatever the width: 2**16 / width rows (MLP), or
    2**16 / (64 width) sequences of 64 (transformer)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(*[MLPBlock(width) for _ in range(n)]), torch.randn(2**16 // width, width)
    length = 64
    blocks = [TransformerBlock(width, heads=max(2, width // 32)) for _ in range(n)]
    return torch.nn.Sequential(*blocks), torch.randn(max(1, 2**16 // (length * width)), length, width)


def zero_grads(model: torch.nn.Module, allocated: bool) -> None:
    """Before a step: gradients None (created by the backward pass), or allocated and zeroed in place."""
    for parameter in model.parameters():
        if not allocated:
            parameter.grad = None
        elif parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        else:
            parameter.grad.zero_()


def step(model: torch.nn.Module, x: torch.Tensor, allocated: bool = False) -> None:
    zero_grads(model, allocated)
    model(x).sum().backward()


def measure_peak(model: torch.nn.Module, x: torch.Tensor, allocated: bool) -> int:
    zero_grads(model, allocated)
    with memory.peak() as p:
        model(x).sum().backward()
    return p.peak_bytes


def measure_times(
    models: dict[str, torch.nn.Module], x: torch.Tensor, repeats: int, allocated: bool
) -> dict[str, float]:
    """Median step time per model, the models timed in turn (round robin) so that load changes hit all alike. No
    warm-up call: measure_peak has just run every model once."""
    candidates = {name: lambda model=model: step(model, x, allocated) for name, model in models.items()}
    return harness.measure(candidates, repeats=repeats, warmup=0).medians()


def slope(ns: list[int], peaks: list[int]) -> float:
    return float(np.polyfit(np.log(ns), np.log(peaks), 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 8 .. 64 only")
    harness.add_options(
        parser,
        repeats=3,
        threads=1,
        out=None,
        figure=harness.FIGURES / "checkpoint_memory.png",
        help_texts={
            "repeats": "timed steps per plan (median)",
            "threads": "torch threads (1: stable timings on a shared machine)",
            "out": "output CSV (default: benchmarks/results/checkpoint_memory[_quick][_wWIDTH][_fresh_grads].csv)",
            "figure": "output PNG, drawn for all n at width 128 with gradients allocated (default: {})",
        },
    )
    parser.add_argument(
        "--grads",
        choices=("allocated", "fresh"),
        default="allocated",
        help="parameters' gradients before a step: allocated and zeroed in place (the peak is the feature maps'), or "
        "None and created by the backward pass (the peak also holds them)",
    )
    parser.add_argument(
        "--width", type=int, default=128, help="feature width (the batch shrinks so a feature map stays 2**16 values)"
    )
    args = parser.parse_args()
    harness.set_threads(args.threads)
    allocated = args.grads == "allocated"
    ns = [8, 16, 32, 64] if args.quick else [8, 16, 32, 64, 128, 256]
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, width {args.width}, gradients {args.grads}")
    print(
        f"{'block':<12}{'n':>5} {'strategy':<10}{'predicted':>12}{'measured':>12}{'pred/meas':>10}{'step s':>9}"
        f"{'x none':>8}{'peak/none':>10}"
    )
    for kind in ("mlp", "transformer"):
        for n in ns:
            blocks, x = make_chain(kind, n, args.width)
            profile = checkpoint.profile(blocks, x, grads_allocated=allocated)
            plans = {strategy: checkpoint.plan(profile, strategy=strategy) for strategy in STRATEGIES}
            models = {strategy: checkpoint.apply(blocks, plan) for strategy, plan in plans.items()}
            peaks = {strategy: measure_peak(model, x, allocated) for strategy, model in models.items()}
            seconds = measure_times(models, x, args.repeats, allocated)
            for strategy, plan in plans.items():
                peak = peaks[strategy]
                row = {
                    "block": kind,
                    "n": n,
                    "strategy": strategy,
                    "predicted_peak_bytes": plan.peak_bytes,
                    "measured_peak_bytes": peak,
                    "predicted_over_measured": plan.peak_bytes / peak,
                    "step_seconds": seconds[strategy],
                    "time_ratio_to_none": seconds[strategy] / seconds["none"],
                    "peak_ratio_to_none": peak / peaks["none"],
                    "predicted_extra_seconds": plan.extra_seconds,
                    "forward_seconds": plan.forward_seconds,
                    "checkpointed_segments": len(plan.checkpointed),
                }
                rows.append(row)
                print(
                    f"{kind:<12}{n:>5} {strategy:<10}{plan.peak_bytes / 2**20:>10.2f}Mi{peak / 2**20:>10.2f}Mi"
                    f"{row['predicted_over_measured']:>10.3f}{row['step_seconds']:>9.3f}"
                    f"{row['time_ratio_to_none']:>8.2f}{row['peak_ratio_to_none']:>10.3f}",
                    flush=True,
                )
    name = "checkpoint_memory" + ("_quick" if args.quick else "") + ("" if args.width == 128 else f"_w{args.width}")
    name += "" if allocated else "_fresh_grads"
    name += ".csv"
    results = harness.write_csv(args.out or harness.RESULTS / name, rows)
    print(f"wrote {results}")
    fit = [n for n in ns if n >= 16]
    print("\nlog-log slope of measured peak against n over n = " + ", ".join(map(str, fit)))
    for kind in ("mlp", "transformer"):
        slopes = []
        for strategy in STRATEGIES:
            peaks = [r["measured_peak_bytes"] for r in rows if r["block"] == kind and r["strategy"] == strategy]
            slopes.append(f"{strategy} {slope(fit, peaks[-len(fit) :]):.2f}")
        worst = max(abs(r["predicted_over_measured"] - 1) for r in rows if r["block"] == kind)
        sqrt_times = [r["time_ratio_to_none"] for r in rows if r["block"] == kind and r["strategy"] == "sqrt"]
        print(
            f"  {kind:<12}" + ", ".join(slopes) + f"; worst |predicted/measured - 1| {worst:.3f}; "
            f"sqrt step time {min(sqrt_times):.2f}-{max(sqrt_times):.2f}x none "
            f"(median {statistics.median(sqrt_times):.2f})"
        )
    if not args.quick and args.width == 128 and allocated:
        plot(rows, ns, Path(args.figure))


def plot(rows: list[dict], ns: list[int], path: Path) -> None:
    plt = harness.pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for axis, kind in zip(axes, ("mlp", "transformer"), strict=True):
        for strategy in STRATEGIES:
            peaks = [r["measured_peak_bytes"] / 2**20 for r in rows if r["block"] == kind and r["strategy"] == strategy]
            predicted = [
                r["predicted_peak_bytes"] / 2**20 for r in rows if r["block"] == kind and r["strategy"] == strategy
            ]
            (line,) = axis.plot(ns, peaks, "o-", label=f"{strategy} (measured)")
            axis.plot(ns, predicted, "x", color=line.get_color(), markersize=8)
        sqrt_peaks = [r["measured_peak_bytes"] / 2**20 for r in rows if r["block"] == kind and r["strategy"] == "sqrt"]
        reference = [sqrt_peaks[1] * math.sqrt(n / ns[1]) for n in ns]
        axis.plot(ns, reference, "k--", linewidth=1, label="∝ √n")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("blocks n")
        axis.set_ylabel("peak of a training step (MiB)")
        axis.set_title(f"{kind} blocks (x: predicted)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    print(f"wrote {harness.save_figure(figure, path, dpi=120)}")


if __name__ == "__main__":
    main()
