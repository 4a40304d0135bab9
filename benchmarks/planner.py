"""The memory planner on two models: a sweep of budgets against each technique alone.

For a small GPT-2 (``transformers.GPT2Config``; its ``gelu_new`` activations swapped for the identical
``nn.GELU(approximate="tanh")`` so few-bit recognises them) and a small CNN (blocks of BatchNorm -> ReLU -> Conv,
which BLPA fuses, then BatchNorm -> SiLU -> Conv, which few-bit converts), on synthetic data (a Markov chain of
tokens; class templates plus noise), this script:

1. profiles the model once (:func:`fewbit_design.runtime.plan_memory`), then plans from that profile
   (``plan.replan``) for five budgets from the unconverted peak down to the smallest feasible one, and for each
   technique alone (every block where it helps, at that technique's smallest peak);
2. for each plan, applies it to a fresh copy of the model (same seed), measures one step with
   ``memory.peak()`` (peak of live tensor bytes, exact on CPU), then trains ``--steps`` steps (Adam) and reports
   the median step time and the held-out loss;
3. writes ``benchmarks/results/planner.csv`` and the figure ``docs/figures/planner.png`` (step time against
   measured peak: the Pareto front of the plans, the techniques alone as points).

Target checks printed at the end: measured peak <= budget + 10%, predicted peak within 10% of measured, and
each plan at least as fast as the fastest single technique whose measured peak fits the same budget (times
measured in this run; on a shared machine they are noisy, so ratios within ~10% are ties).

    python benchmarks/planner.py                 # reduced default (~5 minutes on 2 cores)
    python benchmarks/planner.py --steps 60 --models gpt2
    python benchmarks/planner.py --device cuda --models gpt2 --gpt2-shape gpt2-small --tolerance 0.05  # on a GPU
    python benchmarks/planner.py --tiny          # a dry run (tiny GPT-2, one step; writes to the temp folder)
    python benchmarks/planner.py --baselines [--quick]  # against the baselines a user would reach for (below)

``--baselines`` runs benchmarks/planner_baselines.py instead (its options follow): a 12-layer LLaMA and GPT-2 whose
memory is activations, the planner's sweep (eager and compiled) against HF ``gradient_checkpointing_enable()``,
``torch.compile`` with ``activation_memory_budget`` 1.0..0.1, ``save_on_cpu`` and each technique alone, same run.

On CUDA each row also has ``cuda_peak_mib``: ``torch.cuda.max_memory_allocated`` over the measured step, above its
start, plus the parameters, buffers and inputs (what ``memory.peak`` counts as alive at entry).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # fewbit_design from this checkout; harness.py beside this file

import harness  # noqa: E402

from fewbit_design.runtime.planner import TECHNIQUES, MemoryPlan, plan_memory  # noqa: E402

MIB = 2.0**20


# --- models and data ----------------------------------------------------------------------------------------
class LanguageModel(nn.Module):
    """A tiny GPT-2 whose forward returns the next-token loss."""

    def __init__(self, vocab: int, layers: int, width: int, context: int, heads: int = 4) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab,
            n_positions=context,
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
        self.gpt = GPT2LMHeadModel(config)
        for block in self.gpt.transformer.h:
            block.mlp.act = nn.GELU(approximate="tanh")  # gelu_new, as a torch.nn activation

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=ids, labels=ids).loss


GPT2_SHAPES = {  # (layers, width, heads, context, batch)
    "small": (4, 128, 4, 64, 8),  # the CPU default
    "tiny": (2, 32, 2, 16, 2),  # --tiny: a dry run
    "gpt2-small": (12, 768, 12, 256, 8),  # GPT-2 small's stack (on a GPU)
}


def gpt2(seed: int, shape: str = "small") -> LanguageModel:
    torch.manual_seed(seed)
    layers, width, heads, context, _ = GPT2_SHAPES[shape]
    return LanguageModel(vocab=256, layers=layers, width=width, context=context, heads=heads)


def cnn(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    width = 32
    blocks: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1, bias=False)]
    for _ in range(4):
        blocks.append(
            nn.Sequential(
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.Conv2d(width, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.SiLU(),
                nn.Conv2d(width, width, 3, padding=1, bias=False),
            )
        )
    blocks.append(
        nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    )
    return nn.Sequential(*blocks)


class Tokens:
    """A Markov chain over the vocabulary: each token has 4 likely successors."""

    def __init__(self, vocab: int, context: int, batch: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=generator)
        top = logits.topk(4, dim=1).indices
        self.transition = torch.full((vocab, vocab), 0.02 / vocab)
        self.transition.scatter_(1, top, 0.245)
        self.vocab, self.context, self.batch = vocab, context, batch

    def sample(self, generator: torch.Generator) -> tuple[torch.Tensor]:
        ids = torch.empty(self.batch, self.context, dtype=torch.long)
        ids[:, 0] = torch.randint(0, self.vocab, (self.batch,), generator=generator)
        for t in range(1, self.context):
            ids[:, t] = torch.multinomial(self.transition[ids[:, t - 1]], 1, generator=generator).squeeze(1)
        return (ids,)


class Images:
    """Ten classes: a fixed smooth template each, plus noise."""

    def __init__(self, batch: int, size: int = 32, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        coarse = torch.randn(10, 3, 4, 4, generator=generator)
        self.templates = nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
        self.batch = batch

    def sample(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, 10, (self.batch,), generator=generator)
        noise = torch.randn(self.batch, *self.templates.shape[1:], generator=generator)
        return (self.templates[labels] + 1.5 * noise, labels)


def cnn_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def lm_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(*batch)


def on(device: torch.device, batch: tuple) -> tuple:
    return tuple(t.to(device) for t in batch)


def alive_tensors(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))]


# --- one configuration --------------------------------------------------------------------------------------
def run(name: str, plan: MemoryPlan, build, data, loss, steps: int, seed: int, device: str = "cpu") -> dict:
    device = torch.device(device)
    model = plan.apply(build(seed).to(device)).train()
    example = on(device, data.sample(torch.Generator().manual_seed(1)))
    inputs = example[:1]

    def loss_fn(output):
        return output if output.dim() == 0 else nn.functional.cross_entropy(output, example[1])

    cuda = device.type == "cuda"
    synchronize = harness.cuda_synchronize(device)
    if cuda:  # the allocator's peak of the measured step, beside memory.peak's
        synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        entry = torch.cuda.memory_allocated(device)
    measured = plan.measure(model, *inputs, loss_fn=loss_fn, steps=0)
    if cuda:
        synchronize()
        # plus what memory.peak counts as alive at entry (parameters, buffers, inputs), so both are whole-step peaks
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive_tensors(model, inputs)}
        cuda_peak = sum(storages.values()) + torch.cuda.max_memory_allocated(device) - entry
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed + 100)
    batches = iter([on(device, data.sample(generator)) for _ in range(steps)])
    # ``steps`` training steps, each timed call the forward and backward pass of the next batch (the device
    # synchronised before and after); resetting the gradients and the optimizer step are outside the timed call
    timings = harness.measure(
        {name: lambda: loss(model, next(batches)).backward()},
        repeats=steps,
        warmup=0,
        synchronize=synchronize,
        before=lambda _: optimizer.zero_grad(set_to_none=True),
        after=lambda _, __: optimizer.step(),
    )
    model.eval()
    held_out = torch.Generator().manual_seed(999)
    with torch.no_grad():
        losses = [float(loss(model, on(device, data.sample(held_out)))) for _ in range(4)]
    handle = getattr(model, "fewbit_offload", None)
    if handle is not None:
        handle.remove()
    return {
        "config": name,
        "techniques": "+".join(sorted(plan.techniques_used())) or "none",
        "choices": " ".join(plan.choices),
        "budget_mib": plan.budget_bytes / MIB,
        "predicted_peak_mib": plan.predicted_peak_bytes / MIB,
        "measured_peak_mib": measured["peak_bytes"] / MIB,
        "cuda_peak_mib": cuda_peak / MIB if cuda else math.nan,
        "predicted_step_ms": plan.predicted_step_seconds * 1e3,
        "step_ms": timings[name].median * 1e3,
        "held_out_loss": statistics.mean(losses),
    }


def sweep(model_name: str, steps: int, repeats: int, device: str = "cpu", shape: str = "small") -> list[dict]:
    device = torch.device(device)
    if model_name == "gpt2":
        _, _, _, context, batch = GPT2_SHAPES[shape]
        build, loss = functools.partial(gpt2, shape=shape), lm_loss
        data = Tokens(vocab=256, context=context, batch=batch)
    else:
        build, data, loss = cnn, Images(batch=16 if shape != "tiny" else 4), cnn_loss
    example = on(device, data.sample(torch.Generator().manual_seed(1)))
    labels = example[1] if len(example) > 1 else None

    def loss_fn(output):
        return output if labels is None else nn.functional.cross_entropy(output, labels)

    start = time.perf_counter()
    base = plan_memory(
        build(0).to(device),
        *example[:1],
        budget=None,
        offload_min_bytes=1 << 18,
        loss_fn=loss_fn,
        repeats=repeats,
        approximate="allowed",  # the fastest plan at each budget, few-bit included (docs/techniques/planner.md's table)
    )
    print(
        f"[{model_name}] profiled in {time.perf_counter() - start:.1f} s; "
        f"chain {base.chain!r}, {len(base.choices)} blocks"
    )
    unconverted, smallest = base.unconverted_peak_bytes, base.facts["minimum_budget_bytes"]
    budgets = [round(unconverted - k * (unconverted - smallest) / 4) for k in range(5)]
    configs: list[tuple[str, str, MemoryPlan, float]] = [
        ("unconverted", "unconverted", base.replan(None, allow=()), math.nan)
    ]
    for technique in TECHNIQUES:
        if any(technique in o.option.split("+") for b in base.costs.blocks for o in b.options):
            configs.append((f"{technique} alone", "single", base.replan("min", allow=(technique,)), math.nan))
    for k, budget in enumerate(budgets):
        configs.append((f"plan @ budget {k + 1}/5", "plan", base.replan(budget), budget))
    rows = []
    for name, kind, plan, _ in configs:
        row = run(name, plan, build, data, loss, steps, seed=0, device=device)
        row.update(model=model_name, kind=kind)
        rows.append(row)
        print(
            f"[{model_name}] {name:<22} {row['techniques']:<32} peak {row['measured_peak_mib']:7.2f} MiB "
            f"(pred. {row['predicted_peak_mib']:7.2f}, budget {row['budget_mib']:7.2f}) step {row['step_ms']:7.1f} ms "
            f"loss {row['held_out_loss']:.4f}"
        )
    reference = rows[0]["step_ms"]
    singles = [r for r in rows if r["kind"] == "single"]
    for row in rows:
        row["step_vs_unconverted"] = row["step_ms"] / reference
        row["measured_vs_budget"] = row["measured_peak_mib"] / row["budget_mib"]
        row["predicted_vs_measured"] = row["predicted_peak_mib"] / row["measured_peak_mib"]
        row["predicted_vs_cuda"] = row["predicted_peak_mib"] / row["cuda_peak_mib"]
        if row["kind"] == "plan":
            fitting = [s for s in singles if s["measured_peak_mib"] <= row["budget_mib"]]
            best = min(fitting, key=lambda s: s["step_ms"]) if fitting else None
            row["best_single_fitting"] = best["config"] if best else "none fits"
            row["plan_vs_best_single_time"] = row["step_ms"] / best["step_ms"] if best else math.nan
    return rows


COLUMNS = [
    "device",
    "model",
    "kind",
    "config",
    "techniques",
    "choices",
    "budget_mib",
    "predicted_peak_mib",
    "measured_peak_mib",
    "cuda_peak_mib",
    "measured_vs_budget",
    "predicted_vs_measured",
    "predicted_vs_cuda",
    "predicted_step_ms",
    "step_ms",
    "step_vs_unconverted",
    "held_out_loss",
    "best_single_fitting",
    "plan_vs_best_single_time",
]


def figure(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    markers = {
        "unconverted": "s",
        "fewbit alone": "^",
        "blpa alone": "v",
        "checkpoint alone": "D",
        "offload alone": "P",
    }
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        plans = sorted((r for r in mine if r["kind"] == "plan"), key=lambda r: r["measured_peak_mib"])
        ax.plot(
            [r["measured_peak_mib"] for r in plans], [r["step_ms"] for r in plans], "o-", color="black", label="plans"
        )
        for r in plans:
            ax.axvline(r["budget_mib"], color="grey", linewidth=0.5, linestyle=":")
        for r in mine:
            if r["kind"] != "plan":
                ax.plot(
                    r["measured_peak_mib"], r["step_ms"], markers.get(r["config"], "x"), markersize=9, label=r["config"]
                )
        ax.set_xlabel("measured peak (MiB, memory.peak)")
        ax.set_ylabel("step time (ms, median)")
        ax.set_title(f"{model} ({mine[0]['device']}): step time against peak memory (dotted: budgets)")
        ax.legend(fontsize=8)
    harness.save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--baselines" in argv:  # against HF checkpointing, torch.compile, save_on_cpu (its own options)
        import planner_baselines

        argv.remove("--baselines")
        planner_baselines.main(argv)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated, of gpt2 and cnn (default both; --tiny: gpt2)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per configuration")
    harness.add_options(
        parser,
        repeats=2,
        out=None,
        figure=None,
        threads=2,
        help_texts={
            "repeats": "timed runs per profiled option",
            "out": "default: benchmarks/results/planner.csv (--tiny: temp)",
            "figure": "default: docs/figures/planner.png (--tiny: temp)",
        },
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the models, data and plans on that device)")
    parser.add_argument("--gpt2-shape", default="small", choices=sorted(GPT2_SHAPES), help="the GPT-2 stack's size")
    parser.add_argument("--tolerance", type=float, default=0.10, help="predicted vs measured peak, target check")
    parser.add_argument("--tiny", "--dry-run", action="store_true", help="a dry run: tiny models, one step")
    args = parser.parse_args(argv)
    if args.tiny:
        args.gpt2_shape, args.steps, args.repeats, args.models = "tiny", 1, 1, args.models or "gpt2"
    args.models = args.models or "gpt2,cnn"
    if args.tiny:  # a dry run never overwrites measured results
        args.out = args.out or harness.scratch("planner-tiny.csv")
        args.figure = args.figure or harness.scratch("planner-tiny.png")
    args.out = args.out or harness.RESULTS / "planner.csv"
    args.figure = args.figure or harness.FIGURES / "planner.png"
    harness.set_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"planner: {name}, torch {torch.__version__}, GPT-2 shape {args.gpt2_shape} {GPT2_SHAPES[args.gpt2_shape]}")
    rows = []
    for model in args.models.split(","):
        rows += sweep(model.strip(), args.steps, args.repeats, device, args.gpt2_shape)
    for row in rows:
        row["device"] = name
    harness.write_csv(args.out, rows, columns=COLUMNS, float_format=".4g", extrasaction="ignore")
    figure(rows, Path(args.figure))
    print(f"wrote {args.out} and {args.figure}")
    print("target checks (plans):")
    for row in rows:
        if row["kind"] != "plan":
            continue
        fits = row["measured_vs_budget"] <= 1.10
        close = abs(row["predicted_vs_measured"] - 1) <= args.tolerance
        ratio = row.get("plan_vs_best_single_time", math.nan)
        print(
            f"  {row['model']:<5} {row['config']:<18} measured/budget {row['measured_vs_budget']:.3f} "
            f"[{'ok' if fits else 'FAIL'}]  predicted/measured {row['predicted_vs_measured']:.3f} "
            f"[{'ok' if close else 'FAIL'}]  time vs best single that fits ({row['best_single_fitting']}) "
            f"{ratio:.2f}x"
            + ("" if math.isnan(row["cuda_peak_mib"]) else f"  predicted/allocator {row['predicted_vs_cuda']:.3f}")
        )


if __name__ == "__main__":
    main()
