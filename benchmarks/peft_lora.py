"""LoRA fine-tuning (PEFT) of tiny byte-level LLaMA and GPT-2, converted: bytes saved for backward and held-out loss
against the same PEFT model unconverted, and against Hugging Face gradient checkpointing.

The corpus, models and training recipe are those of :mod:`real_models` (imported, not copied): byte-level next-token
prediction on the standard library's source, AdamW with warm-up and clipping. Per model and seed, the base model is
first trained natively (``--pretrain`` steps on the first part of the corpus: a LoRA fine-tune of a random model
would learn little), then wrapped by ``peft.get_peft_model`` (LoRA of rank ``--rank`` on the attention and MLP
projections: LLaMA's q, k, v, o, gate, up and down; GPT-2's ``c_attn``, ``c_proj`` and ``c_fc``; the base frozen),
and each variant fine-tunes the same PEFT model on the same batches of the next part of the corpus:

* ``native``: the PEFT model as built;
* ``hf-checkpointing``: ``model.gradient_checkpointing_enable()`` (non-reentrant), Hugging Face's own;
* ``exact``: ``runtime.convert(model, activations=False)`` (the exact techniques only);
* ``convert``: ``runtime.convert(model)`` (its defaults: few-bit 3-bit activations too);
* ``compress8`` / ``compress4``: ``runtime.convert(model, compress=K)``.

Reported per model, seed and variant, as ratios against the native run of the same model and seed: bytes saved for
backward by one training step (``memory.saved_bytes``), held-out loss (the last 10% of the corpus), final training
loss (mean of the last 10 steps), median step time (a loaded machine: indicative only), and the relative error of
the LoRA parameters' gradient on one batch against native's. Then the mean and spread (half the range) over seeds.

    python benchmarks/peft_lora.py --seeds 0,1,2     # 2 layers, width 128, seq 64, batch 8, 300 LoRA steps, 3 seeds
    python benchmarks/peft_lora.py --quick           # smoke test (a few steps of a tiny model)

Writes ``benchmarks/results/peft_lora.csv``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and real_models.py beside this file
import harness  # noqa: E402
import real_models  # noqa: E402  (exits with a message when transformers is missing)

from fewbit_design import runtime  # noqa: E402
from fewbit_design.runtime import memory  # noqa: E402

try:
    import peft
except ModuleNotFoundError:  # pragma: no cover - the optional 'peft' extra
    sys.exit("benchmarks/peft_lora.py needs peft: pip install 'fewbit-design[peft]'")

MODELS = ("llama", "gpt2-gelu_new")
VARIANTS = ("native", "hf-checkpointing", "exact", "convert", "compress8", "compress4")
#: LoRA's target modules: the attention and MLP projections
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}  # fmt: skip


def lora(model: torch.nn.Module, kind: str, rank: int) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model``: LoRA on the attention and MLP projections, the base frozen."""
    family = "llama" if kind == "llama" else "gpt2"
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS[family], lora_dropout=0.0, fan_in_fan_out=family == "gpt2"
    )
    with warnings.catch_warnings():  # GPT-2's Conv1D: peft warns that fan_in_fan_out is set, as it must be
        warnings.simplefilter("ignore", UserWarning)
        return peft.get_peft_model(model, config)


def apply(model: torch.nn.Module, variant: str) -> torch.nn.Module:
    """``model`` (a PEFT model) prepared for ``variant``, in place."""
    options = {"exact": {"activations": False}, "convert": {}, **{f"compress{k}": {"compress": k} for k in (8, 4)}}
    if variant == "hf-checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif variant in options:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            runtime.convert(model, **options[variant])
    return model


def trainable_gradient(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The gradient of the parameters that require grad (LoRA's), flattened, on one batch."""
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat


def run(kind: str, variant: str, base: torch.nn.Module, seed: int, args, data: dict) -> dict[str, float]:
    torch.manual_seed(seed)  # LoRA's A is drawn at random (B starts at zero): the same adapters for every variant
    model = apply(lora(copy.deepcopy(base), kind, args.rank), variant)
    model.train()
    probe = real_models.model_inputs(kind, data["tune"][0], seed=0)
    with memory.saved_bytes(model) as saved:
        loss = model(**probe).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    gradient = trainable_gradient(model, probe)
    torch.manual_seed(seed + 1)  # the same stream for every variant's training (stochastic rounding)
    recipe = argparse.Namespace(lr=args.lora_lr, warmup=args.warmup, clip=args.clip)
    result = real_models.train_and_evaluate(model, kind, recipe, data["tune"], data["held_out"])
    return {**result, "saved_bytes": saved.total, "gradient": gradient}


def pretrained(kind: str, seed: int, args, data: dict) -> torch.nn.Module:
    """The base model of ``kind`` at ``seed``, trained natively on the pre-training batches."""
    torch.manual_seed(seed)
    model = real_models.build(kind, args.layers, args.width, args.seq)
    if args.pretrain:
        recipe = argparse.Namespace(lr=args.lr, warmup=args.warmup, clip=args.clip)
        real_models.train_and_evaluate(model, kind, recipe, data["pretrain"], data["held_out"][:1])
    model.config.use_cache = False
    return model


RATIOS = ("saved_bytes", "held_out_loss", "final_loss", "step_seconds")


def run_seed(kind: str, seed: int, args, data: dict) -> list[dict]:
    """Every variant of ``kind`` at ``seed``; ratios against the first variant (the baseline) of this seed."""
    harness.set_threads(args.threads)
    real_models.transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, not results
    base = pretrained(kind, seed, args, data)
    rows, baseline = [], None
    for variant in args.variants.split(","):
        result = run(kind, variant, base, seed, args, data)
        baseline = baseline or result
        error = (result["gradient"] - baseline["gradient"]).norm() / baseline["gradient"].norm().clamp_min(1e-30)
        row = {"model": kind, "variant": variant, "seed": seed, "lora_grad_rel_error": float(error)}
        row.update({key: result[key] for key in RATIOS})
        row.update({f"{key}_ratio": result[key] / baseline[key] for key in RATIOS})
        rows.append(row)
        print(
            f"{kind:14s} seed {seed} {variant:16s} saved {result['saved_bytes']:9d} (x{row['saved_bytes_ratio']:.3f})"
            f"  held-out {result['held_out_loss']:.4f} (x{row['held_out_loss_ratio']:.4f})"
            f"  final x{row['final_loss_ratio']:.4f}  step x{row['step_seconds_ratio']:.2f}"
            f"  LoRA grad err {row['lora_grad_rel_error']:.2e}",
            flush=True,
        )
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per model and variant: the mean over seeds +- the spread (half the range) of each ratio."""
    lines = ["mean over seeds +- spread (half the range), ratios against the unconverted PEFT model:"]
    for kind in dict.fromkeys(row["model"] for row in rows):
        for variant in dict.fromkeys(row["variant"] for row in rows if row["model"] == kind):
            chosen = [row for row in rows if row["model"] == kind and row["variant"] == variant]
            parts = []
            for key in ("saved_bytes_ratio", "held_out_loss_ratio", "final_loss_ratio", "lora_grad_rel_error"):
                values = [float(row[key]) for row in chosen]
                parts.append(f"{key} {statistics.fmean(values):.4f} +- {(max(values) - min(values)) / 2:.4f}")
            seeds = ",".join(str(row["seed"]) for row in chosen)
            lines.append(f"  {kind:14s} {variant:16s} seeds {seeds}: " + ", ".join(parts))
    return lines


#: the variants drawn, in order, with their labels
_DRAWN = {
    "native": "unconverted PEFT",
    "hf-checkpointing": "HF checkpointing",
    "exact": "convert (exact)",
    "convert": "convert()",
    "compress8": "compress=8",
    "compress4": "compress=4",
}


def figure(rows: list[dict], path: str) -> None:
    """Bytes saved for backward against the unconverted PEFT model (left) and held-out loss ratio (right), mean over
    the seeds with the range as error bars, one group of bars per model."""
    plt = harness.pyplot()
    models = list(dict.fromkeys(row["model"] for row in rows))
    variants = [name for name in _DRAWN if any(row["variant"] == name for row in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(models)
    for panel, (key, title) in zip(
        axes, (("saved_bytes_ratio", "bytes saved for backward (x unconverted)"),
               ("held_out_loss_ratio", "held-out loss (x unconverted)")), strict=True
    ):  # fmt: skip
        for index, kind in enumerate(models):
            values = [[float(r[key]) for r in rows if r["model"] == kind and r["variant"] == v] for v in variants]
            means = [statistics.fmean(v) for v in values]
            spread = [[max(0.0, m - min(v)) for m, v in zip(means, values, strict=True)],
                      [max(0.0, max(v) - m) for m, v in zip(means, values, strict=True)]]  # fmt: skip
            x = [position + (index - (len(models) - 1) / 2) * width for position in range(len(variants))]
            panel.bar(x, means, width, yerr=spread, capsize=2, label=kind)
        panel.set_xticks(range(len(variants)), [_DRAWN[name] for name in variants], rotation=25, ha="right")
        panel.set_title(title, fontsize=10)
        panel.grid(axis="y", alpha=0.3)
    axes[1].set_ylim(0.98, 1.02)
    axes[0].legend()
    fig.suptitle("LoRA rank 8, tiny byte-level models, float32, 2-core CPU (measured; mean of the seeds)", fontsize=10)
    print(f"wrote {harness.save_figure(fig, path, dpi=110)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; the first is the baseline")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--pretrain", type=int, default=200, help="native steps of the base model before LoRA")
    parser.add_argument("--steps", type=int, default=300, help="LoRA fine-tuning steps")
    parser.add_argument("--held-out", type=int, default=8, help="held-out batches")
    parser.add_argument("--lr", type=float, default=2e-3, help="pre-training learning rate")
    parser.add_argument("--lora-lr", type=float, default=5e-3, help="LoRA learning rate")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seeds", default="0", help="comma-separated model seeds (the batches use --data-seed)")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    harness.add_options(parser, threads=1, out=str(harness.RESULTS / "peft_lora.csv"))
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model: a smoke test")
    parser.add_argument("--figure", default=None, help="also draw the rows as a PNG")
    parser.add_argument("--from-csv", default=None, help="draw --figure from this CSV instead of measuring")
    args = parser.parse_args(argv)
    if args.from_csv is not None:
        figure(harness.read_csv(args.from_csv), args.figure or "peft_lora.png")
        return
    if args.quick:
        args.pretrain, args.steps, args.width, args.seq, args.batch, args.held_out = 4, 4, 64, 32, 4, 2
        args.corpus_bytes = min(args.corpus_bytes, 200_000)
        args.out = args.out.replace(".csv", "-quick.csv")
    harness.set_threads(args.threads)
    corpus = torch.tensor(list(real_models.corpus(args.corpus_bytes)), dtype=torch.int64)
    first, second = int(corpus.numel() * 0.45), int(corpus.numel() * 0.9)
    data = {
        "pretrain": real_models.batches(corpus[:first], args.pretrain, args.batch, args.seq, seed=args.data_seed),
        "tune": real_models.batches(corpus[first:second], args.steps, args.batch, args.seq, seed=args.data_seed + 1),
        "held_out": real_models.batches(corpus[second:], args.held_out, args.batch, args.seq, seed=args.data_seed + 2),
    }
    print(
        f"corpus {corpus.numel()} bytes of stdlib source; {args.layers} layers, width {args.width}, seq {args.seq}, "
        f"batch {args.batch}; {args.pretrain} native pre-training steps, then LoRA rank {args.rank} for "
        f"{args.steps} steps; seeds {args.seeds}, {args.threads} threads"
    )
    began = time.perf_counter()
    rows = [
        row
        for seed in (int(seed) for seed in args.seeds.split(","))
        for kind in args.models.split(",")
        for row in run_seed(kind, seed, args, data)
    ]
    print("\n".join(summary(rows)))
    print(f"total {time.perf_counter() - began:.0f} s")
    print(f"wrote {harness.write_csv(args.out, rows)}")
    if args.figure is not None:
        figure(rows, args.figure)


if __name__ == "__main__":
    main()
