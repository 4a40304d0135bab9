"""The planner's predictions against measurement on the benchmark GPT-2 (``benchmarks/planner.py``'s model): over a
sweep of batch sizes and budgets, predicted and measured peak (``memory.peak``) and step time (median of timed
steps), and the measured peak against the budget. Writes ``benchmarks/results/planner_accuracy.csv``.

    python benchmarks/planner_accuracy.py            # full: 4 layers, width 128, context 256, batches 2 and 4
    python benchmarks/planner_accuracy.py --quick    # seconds: width 64, context 64, one batch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import harness  # noqa: E402
import planner  # noqa: E402

from fewbit_design.runtime.planner import plan_memory  # noqa: E402

MIB = 2.0**20


def sweep(layers: int, width: int, context: int, batch: int, steps: int, repeats: int) -> list[dict]:
    def build():
        torch.manual_seed(0)
        return planner.LanguageModel(vocab=256, layers=layers, width=width, context=context, heads=4)

    data = planner.Tokens(vocab=256, context=context, batch=batch)
    example = data.sample(torch.Generator().manual_seed(1))
    base = plan_memory(build(), *example, budget=None, loss_fn=lambda o: o, repeats=repeats)
    unconverted, smallest = base.unconverted_peak_bytes, base.facts["minimum_budget_bytes"]
    rows = []
    for k in range(5):
        plan = base.replan(round(unconverted - k * (unconverted - smallest) / 4))
        model = plan.apply(build())
        measured = plan.measure(model, *example, loss_fn=lambda o: o, steps=steps)
        handle = getattr(model, "fewbit_offload", None)
        if handle is not None:
            handle.remove()
        rows.append(
            {
                "shape": f"L{layers} w{width} c{context} b{batch}",
                "budget_mib": plan.budget_bytes / MIB,
                "predicted_peak_mib": plan.predicted_peak_bytes / MIB,
                "measured_peak_mib": measured["peak_bytes"] / MIB,
                "measured_vs_budget": measured["peak_bytes"] / plan.budget_bytes,
                "predicted_vs_measured_peak": plan.predicted_peak_bytes / measured["peak_bytes"],
                "predicted_step_ms": plan.predicted_step_seconds * 1e3,
                "measured_step_ms": measured["step_seconds"] * 1e3,
                "predicted_vs_measured_time": plan.predicted_step_seconds / measured["step_seconds"],
                "choices": " ".join(plan.choices),
            }
        )
        print({key: (f"{v:.3f}" if isinstance(v, float) else v) for key, v in rows[-1].items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and one batch (seconds)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per profiled option (at least)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    harness.set_threads(args.threads)
    shapes = [(4, 64, 64, 4)] if args.quick else [(4, 128, 256, 2), (4, 128, 256, 4)]
    rows = [row for shape in shapes for row in sweep(*shape, args.steps, args.repeats)]
    out = args.out or (
        harness.scratch("planner_accuracy.csv") if args.quick else harness.RESULTS / "planner_accuracy.csv"
    )
    harness.write_csv(out, rows, columns=list(rows[0]), float_format=".4g")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
