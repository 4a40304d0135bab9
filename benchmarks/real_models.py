"""Real models from Hugging Face configs, trained natively and with few-bit activations: loss, memory, time.

GPT-2 (``gelu_new`` and ``gelu``), LLaMA (SiLU) and BERT (masked LM, GELU) built from ``transformers`` configs (no
weights downloaded), trained from the same seed on the same batches of a byte-level corpus available offline: the
Python standard library's source files (sorted, concatenated; the last 10% held out). Variants per model:

* ``native``: the model as built;
* ``1bit`` .. ``4bit``: ``runtime.convert(model, bits=b, weight='normal')`` (the shipped normal-weight tables;
  a table that is not shipped yet, e.g. gelu with approximate='tanh', is designed now with the same weight and the
  output says so);
* ``calibrated``: 3-bit tables from ``runtime.calibrate`` on the model's pre-activations at initialisation (the
  first training batches), ``convert(model, tables=...)``.

Reported per variant, as ratios against the native run of the same model measured in the same run: final training
loss (mean of the last 10 steps), held-out loss (fixed held-out batches), bytes saved for backward per step (whole
model, and the activation modules only; ``fewbit_design.runtime.memory.saved_bytes``), median step time, and the
relative error of the parameter gradient at initialisation against the exact (native) gradient on one batch.

Training recipe, the same for every variant: AdamW (no weight decay), a linear learning-rate warm-up over the
first ``--warmup`` steps, then constant ``--lr``, and the gradient norm clipped to ``--clip`` (the usual GPT-2
recipe). Without warm-up and clipping the native GPT-2 sat on a loss plateau (about 3.2 nats) for 100 of its 180
steps, and the held-out ratio measured when the plateau ended rather than the activations (3-bit GPT-2 was 0.926x
of native).

    python benchmarks/real_models.py                       # reduced default: 4 layers, width 128, seq 64, 180 steps
    python benchmarks/real_models.py --width 256 --seq 128 --steps 600 --threads 2   # larger
    python benchmarks/real_models.py --quick               # smoke test (a few steps)

Writes ``benchmarks/results/real_models.csv`` and ``docs/figures/real_models.png``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

try:
    import transformers
except ModuleNotFoundError:  # pragma: no cover - the optional 'models' extra
    sys.exit("benchmarks/real_models.py needs transformers: pip install 'fewbit-design[models]'")

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.fewbit.nn import FewBitModule

MODELS = ("gpt2-gelu_new", "gpt2-gelu", "llama", "bert")
VOCAB = 256
MASK = 256  # BERT's mask token: one past the bytes


# ----------------------------------------------------------------------------------------------------------------------
# Data


def corpus(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's .py files (sorted paths), concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def batches(data: torch.Tensor, count: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``count`` batches of ``batch`` random windows of ``seq + 1`` bytes (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (count, batch), generator=generator)
    return [torch.stack([data[s : s + seq + 1] for s in row.tolist()]) for row in starts]


# ----------------------------------------------------------------------------------------------------------------------
# Models


def build(kind: str, layers: int, width: int, seq: int, *, dropout: float = 0.0) -> torch.nn.Module:
    """A ``kind`` model of ``layers`` layers at ``width``, for ``seq`` tokens, built from its config (seeded by the
    caller). ``dropout``: the probability of every dropout place of the config (GPT-2: residual, embedding and
    attention; LLaMA: attention; BERT: hidden and attention); 0 by default."""
    t = transformers
    heads = max(2, width // 32)
    if kind.startswith("gpt2"):
        config = t.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB, n_positions=seq,
            activation_function="gelu_new" if kind == "gpt2-gelu_new" else "gelu",
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return t.GPT2LMHeadModel(config)
    if kind == "llama":
        config = t.LlamaConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=round(width * 11008 / 4096 / 8) * 8,
            num_attention_heads=heads, num_key_value_heads=heads, vocab_size=VOCAB, max_position_embeddings=seq,
            bos_token_id=0, eos_token_id=0, pad_token_id=None, attention_dropout=dropout,
        )  # fmt: skip
        return t.LlamaForCausalLM(config)
    if kind == "bert":
        config = t.BertConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width, num_attention_heads=heads,
            vocab_size=VOCAB + 1, max_position_embeddings=seq + 1, hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout, pad_token_id=0,
        )  # fmt: skip
        return t.BertForMaskedLM(config)
    raise ValueError(kind)


def model_inputs(kind: str, window: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Inputs and labels: next-byte prediction, or for BERT 15% of the bytes masked (seeded per batch)."""
    if kind != "bert":
        return {"input_ids": window[:, :-1], "labels": window[:, :-1]}  # HF shifts the labels itself
    ids = window[:, :-1].clone()
    generator = torch.Generator().manual_seed(seed)
    masked = torch.rand(ids.shape, generator=generator) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    ids[masked] = MASK
    return {"input_ids": ids, "labels": labels}


def activation_names(model: torch.nn.Module) -> set[str]:
    """Names of the activation modules (native ones convert would replace, or few-bit ones)."""
    from fewbit_design.runtime.fewbit.matching import _Candidate, _recognise

    names = set()
    for name, module in model.named_modules():
        if isinstance(module, FewBitModule) or isinstance(_recognise(module), _Candidate):
            if not any(name.startswith(f"{other}.") for other in names):
                names.add(name)
    return names


def normal_tables(model: torch.nn.Module, bits: int, notes: set[str]) -> dict[str, object]:
    """{module name: normal-weight table}: the shipped one, or designed now when not shipped (noted)."""
    from fewbit_design.runtime.fewbit.matching import _Candidate, _recognise

    tables = {}
    for name, module in model.named_modules():
        candidate = _recognise(module)
        if not isinstance(candidate, _Candidate):
            continue
        tables[name] = normal_table(candidate.activation, tuple(sorted(candidate.params.items())), bits, notes)
    return tables


_DESIGNED: dict[tuple, object] = {}


def normal_table(activation: str, params: tuple, bits: int, notes: set[str]):
    key = (activation, params, bits)
    if key not in _DESIGNED:
        try:
            _DESIGNED[key] = runtime.load_table(activation, params=dict(params), bits=bits, weight="normal")
        except FewBitError:
            from fewbit_design.design import design

            notes.add(f"{activation}{dict(params)} {bits}-bit normal-weight table designed now (not shipped yet)")
            _DESIGNED[key] = design(activation, bits, params=dict(params), weight="normal")
    return _DESIGNED[key]


# ----------------------------------------------------------------------------------------------------------------------
# One run


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def run(kind: str, variant: str, args, train: list, held_out: list, notes: set[str]) -> dict[str, float]:
    torch.manual_seed(args.seed)
    model = build(kind, args.layers, args.width, args.seq)
    exact_model = None
    if variant != "native":
        exact_model = build(kind, args.layers, args.width, args.seq)
        exact_model.load_state_dict(model.state_dict())
        if variant == "calibrated":
            calibration = [model_inputs(kind, window, seed=-1 - i) for i, window in enumerate(train[:4])]
            calibration = [{"input_ids": item["input_ids"]} for item in calibration]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tables = runtime.calibrate(model, calibration, bits=3)
        else:
            tables = normal_tables(model, int(variant[0]), notes)
        runtime.convert(model, tables=tables, only_if_smaller=False)
    probe = model_inputs(kind, train[0], seed=0)
    # bytes saved for backward by one training forward
    with memory.saved_bytes(model) as saved:
        _ = model(**probe).loss
    names = activation_names(model)
    activation_bytes = sum(value for name, value in saved.by_module.items() if name in names)
    # gradient error at initialisation against the exact gradient on one batch
    grad_error = 0.0
    if exact_model is not None:
        exact_model(**probe).loss.backward()
        model(**probe).loss.backward()
        exact, approx = flat_grad(exact_model), flat_grad(model)
        grad_error = float((approx - exact).norm() / exact.norm())
        model.zero_grad(set_to_none=True)
    return {**train_and_evaluate(model, kind, args, train, held_out), "saved_bytes": saved.total,
            "activation_bytes": activation_bytes, "grad_rel_error": grad_error}  # fmt: skip


def train_and_evaluate(model: torch.nn.Module, kind: str, args, train: list, held_out: list) -> dict[str, float]:
    """The training recipe (module docstring) on ``train``, then the loss on ``held_out``: final training loss (mean
    of the last 10 steps), held-out loss and median step time. ``args``: ``lr``, ``warmup``, ``clip``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    losses, times = [], []
    model.train()
    for step, window in enumerate(train):
        inputs = model_inputs(kind, window, seed=step)
        start = time.perf_counter()
        loss = model(**inputs).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        schedule.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
    model.eval()
    with torch.no_grad():
        held = [float(model(**model_inputs(kind, window, seed=10_000 + i)).loss) for i, window in enumerate(held_out)]
    tail = min(10, len(losses))
    return {
        "final_loss": statistics.fmean(losses[-tail:]),
        "held_out_loss": statistics.fmean(held),
        "step_seconds": statistics.median(times[min(5, len(times) - 1) :]),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Main


def plot(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    variants = [v for v in dict.fromkeys(row["variant"] for row in rows) if v != "native"]
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, column, title in zip(
        axes,
        ("held_out_loss_ratio", "saved_bytes_ratio", "step_time_ratio"),
        ("held-out loss / native", "saved bytes per step / native", "step time / native"),
        strict=True,
    ):
        width = 0.8 / len(models)
        for index, model in enumerate(models):
            values = [next(r[column] for r in rows if r["model"] == model and r["variant"] == v) for v in variants]
            axis.bar([x + index * width for x in range(len(variants))], values, width, label=model)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(variants))], variants)
        axis.set_title(title)
    ratios = [r["held_out_loss_ratio"] for r in rows]
    axes[0].set_ylim(min(0.95, min(ratios) - 0.01), max(1.05, max(ratios) + 0.01))  # every bar visible
    axes[0].legend(fontsize=8)
    figure.suptitle("Few-bit activations in Hugging Face models (byte-level stdlib corpus, 2-core CPU)", fontsize=10)
    harness.save_figure(figure, path, dpi=110)


def run_model(kind: str, args, train: list, held_out: list) -> tuple[list[dict], set[str]]:
    """Every variant of one model, as CSV rows with ratios against its native run (and the notes)."""
    harness.set_threads(args.threads)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*loss_type.*")
    rows, notes, native = [], set(), None
    for variant in args.variants.split(","):
        result = run(kind, variant, args, train, held_out, notes)
        native = native or result
        row = {"model": kind, "variant": variant, **result}
        row["final_loss_ratio"] = result["final_loss"] / native["final_loss"]
        row["held_out_loss_ratio"] = result["held_out_loss"] / native["held_out_loss"]
        row["saved_bytes_ratio"] = result["saved_bytes"] / native["saved_bytes"]
        row["activation_bytes_ratio"] = result["activation_bytes"] / max(1, native["activation_bytes"])
        row["step_time_ratio"] = result["step_seconds"] / native["step_seconds"]
        rows.append(row)
        print(
            f"{kind:14s} {variant:10s} held-out {result['held_out_loss']:.4f} "
            f"(x{row['held_out_loss_ratio']:.3f}) final x{row['final_loss_ratio']:.3f}  "
            f"saved x{row['saved_bytes_ratio']:.3f} (activations x{row['activation_bytes_ratio']:.3f})  "
            f"step x{row['step_time_ratio']:.2f}  grad err {result['grad_rel_error']:.4f}",
            flush=True,
        )
    return rows, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--variants", default="native,1bit,2bit,3bit,4bit,calibrated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--jobs", type=int, default=2, help="models trained in parallel processes")
    parser.add_argument("--held-out", type=int, default=8, help="held-out batches")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up (0: none)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    harness.add_options(
        parser,
        threads=1,
        out=str(harness.RESULTS / "real_models.csv"),
        figure=str(harness.FIGURES / "real_models.png"),
        help_texts={"threads": "torch threads (1: fair on a shared machine)"},
    )
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.width, args.seq, args.batch, args.held_out = 6, 64, 32, 4, 2
        args.out = args.out.replace(".csv", "-quick.csv")
        args.figure = args.figure.replace(".png", "-quick.png")
    harness.set_threads(args.threads)
    transformers.logging.set_verbosity_error()
    data = torch.tensor(list(corpus(args.corpus_bytes)), dtype=torch.int64)
    split = int(data.numel() * 0.9)
    train = batches(data[:split], args.steps, args.batch, args.seq, seed=args.seed)
    held_out = batches(data[split:], args.held_out, args.batch, args.seq, seed=args.seed + 1)
    print(
        f"corpus {data.numel()} bytes of stdlib source; {args.layers} layers, width {args.width}, seq {args.seq}, "
        f"batch {args.batch}, {args.steps} steps, {args.threads} threads"
    )
    began = time.perf_counter()
    kinds = args.models.split(",")
    if args.jobs > 1:  # one process per model (each with --threads threads); ratios are taken within a process
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            outcomes = list(
                pool.map(run_model, kinds, [args] * len(kinds), [train] * len(kinds), [held_out] * len(kinds))
            )
    else:
        outcomes = [run_model(kind, args, train, held_out) for kind in kinds]
    rows = [row for model_rows, _ in outcomes for row in model_rows]
    notes = set().union(*(model_notes for _, model_notes in outcomes))
    for note in sorted(notes):
        print(f"note: {note}")
    print(f"total {time.perf_counter() - began:.0f} s")
    out = harness.write_csv(args.out, rows)
    plot(rows, Path(args.figure))
    print(f"wrote {out} and {args.figure}")


if __name__ == "__main__":
    main()
