"""Transformer blocks: bytes saved for backward and step time, native eager and compiled against each technique.

Per model family (tiny Hugging Face configs, no weights downloaded), the bytes ONE decoder/encoder block saves for
backward are measured as the difference between a 2-block and a 1-block model of the same config, so that the
embedding, the head and the loss cancel (``fewbit_design.runtime.memory.saved_bytes`` over one training step, the
model's parameters excluded; it also counts what a compiled forward saves, since AOTAutograd saves through
``ctx.save_for_backward``). Variants:

* ``native``: the model as built;
* one variant per registered module technique that changes the model (``fewbit``, ``norms``, ``gated``,
  ``linear``, ...; applied through ``fewbit_design.runtime.registry``), and ``exact`` (every exact module technique)
  and ``exact+fewbit``, which is ``runtime.convert(model)`` (what a user calls: norms, gated op, few-bit
  activations, each measured on a probe and left out where it saves nothing), and ``exact+fewbit+linear``, which is
  ``runtime.convert(model, compress=8)`` (``--linear-bits``);

each run eager and compiled: ``torch.compile(backend="aot_eager_decomp_partition")`` is inductor's decompositions
and min-cut rematerialisation partitioner without code generation (the saved set inductor would keep, much faster
on CPU), at ``activation_memory_budget`` 1.0 (the default) and 0.5. ``--inductor`` compiles with inductor itself
instead (slow on CPU). Step time: median of interleaved eager training steps of the 2-block models, ratio against
native eager in the same run.

    python benchmarks/transformer_memory.py                       # llama and gpt2
    python benchmarks/transformer_memory.py --families llama mistral qwen2 phi3 gemma gpt2
    python benchmarks/transformer_memory.py --families llama-gqa   # LLaMA-3-style GQA (H_kv = H / 4, I = 3.5 H)
    python benchmarks/transformer_memory.py --quick               # smoke test: tiny sizes, no compile
    python benchmarks/transformer_memory.py --dtype bfloat16      # the model in bfloat16 (float16 too)
    python benchmarks/transformer_memory.py --variants exact+fewbit   # native and runtime.convert only

Writes ``benchmarks/results/transformer_memory.csv`` (``transformer_memory_<dtype>.csv`` with ``--dtype``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # fewbit_design from this checkout; harness.py beside this file
import harness  # noqa: E402

try:
    import transformers
except ModuleNotFoundError:  # pragma: no cover - the optional 'models' extra
    sys.exit("benchmarks/transformer_memory.py needs transformers: pip install 'fewbit-design[models]'")

from fewbit_design import runtime  # noqa: E402
from fewbit_design.runtime import memory, registry  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FAMILIES = ("llama", "llama-gqa", "mistral", "qwen2", "phi3", "gemma", "gpt2")
HEADS = 4
KIB = 1024.0


def build(family: str, layers: int, width: int, vocab: int, seq: int) -> torch.nn.Module:
    """A tiny causal LM of ``family`` (LLaMA-style intermediate size 8/3 x width, rounded to 8; ``llama-gqa``:
    LLaMA-3-style, a quarter of the heads for keys and values and intermediate size 3.5 x width)."""
    intermediate = -(-(8 * width // 3) // 8) * 8
    kv_heads = HEADS
    if family == "llama-gqa":
        family, intermediate, kv_heads = "llama", -(-(7 * width // 2) // 8) * 8, HEADS // 4
    common = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=HEADS, hidden_size=width)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_layer=layers, n_head=HEADS, n_embd=width, n_positions=seq, use_cache=False
        )
        config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
        config.bos_token_id = config.eos_token_id = 0  # inside the tiny vocabulary
        return transformers.GPT2LMHeadModel(config)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    }
    config_class, model_class = classes[family]
    extra = {"head_dim": width // 4} if family == "gemma" else {}
    config = config_class(
        **common,
        intermediate_size=intermediate,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        use_cache=False,
        **extra,
    )
    if hasattr(config, "pad_token_id") and family == "phi3":
        config.pad_token_id = 0
    return model_class(config)


def variants(settings: dict) -> dict[str, tuple[str, ...]]:
    """Variant name -> registered module techniques applied (in registry order)."""
    module = [t for t in registry.techniques() if t.seam == "module" and t.name != "blpa"]
    exact = tuple(t.name for t in module if t.exact)
    names = {t.name for t in module}
    found: dict[str, tuple[str, ...]] = {"native": ()}
    for t in module:
        found[t.name] = (t.name,)
    if exact:
        found["exact"] = exact
    if "fewbit" in names:
        found["exact+fewbit"] = ("convert",)
        if "linear" in names:
            found["exact+fewbit+linear"] = ("convert", "compress")
    return found


def convert(model: torch.nn.Module, techniques: tuple[str, ...], settings: dict) -> torch.nn.Module:
    if "convert" in techniques:  # what a user calls
        compress = settings["linear_bits"] if "compress" in techniques else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return runtime.convert(model, bits=settings["bits"], compress=compress)
    for technique in registry.techniques():
        if technique.name in techniques:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                model = technique.apply(model, technique.config(settings))
    return model


def step_saved_bytes(model: torch.nn.Module, forward: Callable, ids: torch.Tensor) -> int:
    # with the model: its parameters' storages are excluded (views of weights that eager linears save included);
    # its per-module hooks are new at each entry, so a compiled model recompiles for each measured step (time only)
    with memory.saved_bytes(model) as saved:
        loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return int(saved.total)


def compiled(model: torch.nn.Module, mode: str, inductor: bool) -> Callable:
    import torch._functorch.config as functorch_config

    budget = {"compiled": 1.0, "compiled@0.5": 0.5}[mode]
    torch._dynamo.reset()
    function = torch.compile(model, backend="inductor" if inductor else "aot_eager_decomp_partition")

    def run(**kwargs):
        with functorch_config.patch(activation_memory_budget=budget):
            return function(**kwargs)

    return run


def block_bytes(family: str, techniques: tuple[str, ...], mode: str, args, settings: dict) -> int:
    """Saved bytes of one block: 2-block model minus 1-block model (same seed, same input)."""
    totals = []
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    for layers in (2, 1):
        torch.manual_seed(0)
        model = build(family, layers, args.width, args.vocab, args.seq).train().to(DTYPES[args.dtype])
        model = convert(model, techniques, settings)
        forward = model if mode == "eager" else compiled(model, mode, args.inductor)
        step_saved_bytes(model, forward, ids)  # warm-up (compilation)
        totals.append(step_saved_bytes(model, forward, ids))
    return totals[0] - totals[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "gpt2"], choices=FAMILIES)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--linear-bits", type=int, default=8)
    parser.add_argument("--bits", type=int, default=3, help="few-bit table bits (default 3)")
    parser.add_argument("--variants", nargs="+", help="only these variants (default: all; 'native' always runs)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="model dtype (default float32)")
    parser.add_argument("--inductor", action="store_true", help="compile with inductor (slow on CPU)")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, eager only, 2 repeats")
    harness.add_options(parser, out=str(harness.RESULTS / "transformer_memory.csv"), repeats=9, threads=0)
    args = parser.parse_args()
    if args.dtype != "float32" and args.out == parser.get_default("out"):  # keep the float32 CSV
        args.out = str(harness.RESULTS / f"transformer_memory_{args.dtype}.csv")
    harness.set_threads(args.threads)
    if args.quick:
        args.width, args.seq, args.batch, args.repeats = 64, 32, 2, 2
    settings = {"bits": args.bits, "linear_bits": args.linear_bits}
    modes = ("eager",) if args.quick else ("eager", "compiled", "compiled@0.5")
    rows = []
    for family in args.families:
        chosen = variants(settings)
        if args.variants:
            unknown = sorted(set(args.variants) - set(chosen))
            if unknown:
                parser.error(f"unknown variants {unknown}: choose from {sorted(chosen)}")
            chosen = {name: chosen[name] for name in chosen if name == "native" or name in args.variants}
        saved = {}
        for name, techniques in chosen.items():
            for mode in modes:
                try:
                    saved[name, mode] = block_bytes(family, techniques, mode, args, settings)
                except Exception as error:  # a variant that fails is reported, the others still run
                    print(f"[{family}] {name} {mode}: failed: {type(error).__name__}: {error}", file=sys.stderr)
                    saved[name, mode] = None
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))
        models = {}
        for name, techniques in chosen.items():
            torch.manual_seed(0)
            model = build(family, 2, args.width, args.vocab, args.seq).train().to(DTYPES[args.dtype])
            models[name] = convert(model, techniques, settings)

        def step(model, ids=ids):
            def run():
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)

            return run

        timings = harness.measure(
            {name: step(m) for name, m in models.items()}, repeats=args.repeats, baseline="native", alternate=True
        )
        for name in chosen:
            row = {"family": family, "dtype": args.dtype, "variant": name, "techniques": "+".join(chosen[name]) or "-"}
            for mode in modes:
                value, base = saved[name, mode], saved["native", mode]
                row[f"{mode}_kib"] = None if value is None else value / KIB
                row[f"{mode}_vs_native_{mode}"] = None if value is None or not base else value / base
                if mode != "eager":
                    eager = saved["native", "eager"]
                    row[f"{mode}_vs_native_eager"] = None if value is None or not eager else value / eager
            native_compiled = saved.get(("native", "compiled"))
            if native_compiled and saved.get((name, "eager")) is not None:
                row["eager_vs_native_compiled"] = saved[name, "eager"] / native_compiled
            row["step_ms"] = timings[name].median * 1e3
            row["step_vs_native_eager"] = timings.ratio(name)
            rows.append(row)
            cells = "  ".join(
                f"{mode} {row[f'{mode}_kib']:8.1f} KiB ({row[f'{mode}_vs_native_{mode}']:.2f}x)"
                if row[f"{mode}_kib"] is not None
                else f"{mode} failed"
                for mode in modes
            )
            print(f"[{family}] {name:<22} {cells}  step {row['step_ms']:7.1f} ms ({row['step_vs_native_eager']:.2f}x)")
        del models
    path = harness.write_csv(args.out, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
