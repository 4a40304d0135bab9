"""Bytes one real-width layer saves for backward with its default config (dropout as users fine-tune), native against
``runtime.convert`` and ``runtime.convert(compress=8)``, and the targets they are held to.

    python benchmarks/real_width_layers.py [--layers bert-large gpt2-xl llama-3-8b ...] [--tokens 4096] [--compiled]
        [--kernels cpu|cuda] [--merge]

Each layer is the one block of a 1-layer Hugging Face model built from the named width (``memory.saved_bytes`` on the
block, a batch of one sequence, bfloat16, real tensors: bytes are exact and scale with depth): BERT-large (1024, 16
heads, dropout 0.1) at 512 tokens, GPT-2-XL (1600, 25 heads, dropout 0.1) at 1024, Llama-3-8B (4096, 32 heads, 8
key/value heads, intermediate 14336, no dropout) at 1024; and without targets, Mistral-7B (Llama-3-8B's layer
shapes, rope theta 1e6) at 1024 and 4096, T5-large (1024, 16 heads, 4096 ReLU MLP, dropout 0.1, relative position
bias in its first layer) at 512 and ViT-L/16 (1024, 16 heads, no dropout) at its 197 tokens (224 px). Layers whose
block takes more than hidden states (T5, ViT, Mistral) run once inside their model, which records the block's
arguments, then alone on them. ``runtime.convert`` converts the whole model (its probe
decides what stays), then the block runs alone on random hidden states that are not a leaf (as the previous layer's
output: counted where the block keeps it). Candidates: native;
``convert`` with ``attention=False`` (what the attention core adds) and with ``dropout=False`` (without the 1-bit
dropout masks of ``runtime.dropout``); ``convert``; the same three under ``compress=8``. With ``--compiled`` each
block is also run under ``torch.compile`` (``aot_eager_decomp_partition``: inductor's decompositions and
partitioner, the saved set inductor keeps) and should keep at most what it keeps in eager.

With ``--kernels cuda`` the layers are built and measured under ``runtime.fake.fake_mode(kernels="cuda")``: fake
tensors with a GPU's kernel choices, where they keep other tensors than this CPU's (native SDPA with dropout in a
fused kernel, nothing of size S x S; native dropout with a bool mask): exact bytes for those choices, eager only,
not a run on a GPU. The targets below were set, and are checked, on the CPU's kernels.

Prints KiB per token and the ratio to native, checks the targets below, writes a CSV (``--out``, default
benchmarks/results/real_width_layers.csv; column ``kernels``). No timings: the bytes are what this measures.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

#: name -> (tokens, {candidate: (bound, "x" of native or "KiB" per token)})
TARGETS = {
    "bert-large": (512, {"convert": (0.25, "x"), "compress=8": (0.12, "x")}),
    "gpt2-xl": (1024, {"convert": (0.15, "x"), "compress=8": (0.08, "x")}),
    "llama-3-8b": (1024, {"convert": (94.0, "KiB"), "compress=8": (0.22, "x")}),
}
#: name -> tokens measured (the first also where the name has a target)
TOKENS = {
    "bert-large": (512,),
    "gpt2-xl": (1024,),
    "llama-3-8b": (1024, 4096),
    "mistral-7b": (1024, 4096),
    "t5-large": (512,),
    "vit-l-16": (197,),
}
#: candidate -> runtime.convert keywords (None: native)
CANDIDATES = {
    "native": None,
    "convert, attention=False": {"attention": False},
    "convert, dropout=False": {"dropout": False},
    "convert": {},
    "compress=8, attention=False": {"compress": 8, "attention": False},
    "compress=8, dropout=False": {"compress": 8, "dropout": False},
    "compress=8": {"compress": 8},
    "compress=4": {"compress": 4},
}


def build(name: str, fake: bool = False):
    """A 1-layer model of the named width in bfloat16, training mode, its default dropout (``fake``: built under
    fake mode, in bfloat16 from the start: fake parameters cannot be cast in place)."""
    import torch

    torch.manual_seed(0)
    if fake:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return _build(name).train()
        finally:
            torch.set_default_dtype(previous)
    return _build(name).to(torch.bfloat16).train()


def _build(name: str):
    import transformers as t

    common = dict(vocab_size=256, attn_implementation="sdpa")
    if name == "bert-large":
        config = t.BertConfig(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, num_hidden_layers=1,
                              **common)  # fmt: skip
        model = t.BertModel(config)
    elif name == "gpt2-xl":
        config = t.GPT2Config(n_embd=1600, n_head=25, n_layer=1, n_positions=1024, use_cache=False, **common)
        model = t.GPT2LMHeadModel(config)
    elif name == "t5-large":
        config = t.T5Config(d_model=1024, d_kv=64, d_ff=4096, num_heads=16, num_layers=1, **common)
        model = t.T5EncoderModel(config)
    elif name == "vit-l-16":
        config = t.ViTConfig(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, num_hidden_layers=1,
                             image_size=224, patch_size=16, attn_implementation="sdpa")  # fmt: skip
        model = t.ViTModel(config, add_pooling_layer=False)
    else:
        theta = 500000.0 if name == "llama-3-8b" else 1e6
        config = t.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                               num_hidden_layers=1, max_position_embeddings=8192, rope_theta=theta,
                               use_cache=False, **common)  # fmt: skip
        model = t.LlamaForCausalLM(config)
    return model


def _block_of(name: str, model):
    blocks = {
        "bert-large": lambda: model.encoder.layer[0],
        "gpt2-xl": lambda: model.transformer.h[0],
        "t5-large": lambda: model.encoder.block[0],
        "vit-l-16": lambda: model.layers[0],
    }
    return blocks.get(name, lambda: model.model.layers[0])()


def _model_input(name: str, model, tokens: int):
    """Keywords of one batch of ``tokens`` tokens for the whole model (ViT: one 224 px image)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    if name == "vit-l-16":
        return {"pixel_values": torch.randn(1, 3, 224, 224, generator=generator).to(torch.bfloat16)}
    return {"input_ids": torch.randint(0, 256, (1, tokens), generator=generator)}


def _arguments(name: str, model, tokens: int) -> tuple[tuple, dict]:
    """The block's positional and keyword arguments, recorded in one forward of the whole model (the hidden states
    replaced by random ones that are not a leaf, as the previous layer's output: counted where the block keeps them)."""
    import torch

    block, recorded = _block_of(name, model), {}

    def record(_module, arguments, keywords):
        recorded["call"] = (arguments, dict(keywords))

    handle = block.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**_model_input(name, model, tokens))
    finally:
        handle.remove()
    arguments, keywords = recorded["call"]
    shape = arguments[0].shape if arguments else keywords["hidden_states"].shape
    hidden = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    hidden = hidden.requires_grad_() * 1.0
    if arguments:
        return (hidden, *arguments[1:]), keywords
    return (), {**keywords, "hidden_states": hidden}


def _produced(name: str, model, arguments: tuple, keywords: dict, compiled: bool) -> tuple[tuple, dict]:
    """The block's arguments with its hidden states made by the module that makes them in a model, where the block
    reads them before normalising them itself: a post-norm block (BERT) reads the previous layer's output norm, here
    the embeddings' LayerNorm of the same width, converted as the model is (a compressed norm hands its output's codes
    to the linears reading it; compiled, as the previous layer would be). Pre-norm blocks: unchanged."""
    import torch

    if name != "bert-large":
        return arguments, keywords
    producer = model.embeddings.LayerNorm
    if compiled:
        producer = torch.compile(producer, backend="aot_eager_decomp_partition")
    return (producer(arguments[0]), *arguments[1:]), keywords


def block_bytes(name: str, model, tokens: int, compiled: bool) -> int:
    """Bytes the model's block saves for backward on one sequence of ``tokens`` tokens (forward only: what is saved
    is saved in forward)."""
    import torch

    from fewbit_design.runtime import memory

    block = _block_of(name, model)
    arguments, keywords = _arguments(name, model, tokens)
    forward = block
    if compiled:
        torch._dynamo.reset()
        forward = torch.compile(block, backend="aot_eager_decomp_partition")
        compiling, compiling_keywords = _produced(name, model, arguments, keywords, compiled)
        forward(*compiling, **compiling_keywords)  # compiles
        del compiling, compiling_keywords
    torch.manual_seed(2)
    arguments, keywords = _produced(name, model, arguments, keywords, compiled)
    with memory.saved_bytes(block) as saved:
        out = forward(*arguments, **keywords)
    del out
    if compiled:
        torch._dynamo.reset()
    return saved.total


def measure(name: str, tokens: int, compiled: bool, candidates: dict, kernels: str = "cpu") -> list[dict]:
    """The rows of one layer at ``tokens``: real tensors (``kernels="cpu"``), or fake tensors with a GPU's kernel
    choices (``"cuda"``: :func:`fewbit_design.runtime.fake.fake_mode`)."""
    import contextlib

    from fewbit_design.runtime.fake import fake_mode

    with fake_mode(kernels="cuda") if kernels == "cuda" else contextlib.nullcontext():
        return _measure(name, tokens, compiled, candidates, kernels)


def _measure(name: str, tokens: int, compiled: bool, candidates: dict, kernels: str) -> list[dict]:
    from fewbit_design import runtime
    from fewbit_design.runtime.fake import deepcopy_module

    native = build(name, fake=kernels == "cuda")
    rows, found = [], {}
    for candidate, keywords in candidates.items():
        model = native if keywords is None else runtime.convert(deepcopy_module(native), **keywords)
        for mode in ("eager", "compiled") if compiled else ("eager",):
            total = block_bytes(name, model, tokens, mode == "compiled")
            found[candidate, mode] = total
            ratio = total / found["native", mode]
            rows.append(dict(layer=name, tokens=tokens, dtype="bfloat16", kernels=kernels, candidate=candidate,
                             mode=mode, kib_per_token=total / tokens / 1024, ratio=ratio))  # fmt: skip
            print(f"{name} {tokens} {kernels} {mode:8s} {candidate:28s} {total / tokens / 1024:8.1f} KiB/token "
                  f"({ratio:.3f}x)")  # fmt: skip
        if model is not native:
            del model
            gc.collect()
    return rows


def check(rows: list[dict]) -> list[str]:
    """One line per target: the eager value against its bound."""
    lines = []
    for row in rows:
        tokens, targets = TARGETS.get(row["layer"], (None, {}))
        if row["mode"] != "eager" or row["candidate"] not in targets or row["tokens"] != tokens:
            continue
        if row.get("kernels", "cpu") != "cpu":  # the targets are held on this machine's kernels (see the docstring)
            continue
        bound, unit = targets[row["candidate"]]
        value = row["ratio"] if unit == "x" else row["kib_per_token"]
        verdict = "meets" if value <= bound else "MISSES"
        lines.append(f"{row['layer']}: {row['candidate']} {value:.3f} {unit} {verdict} the target <= {bound} {unit}")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=list(TARGETS), choices=list(TOKENS))
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens (default: TOKENS of each layer)")
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--compiled", action="store_true", help="also run each block under torch.compile")
    parser.add_argument("--merge", action="store_true", help="keep the rows of --out that this run does not redo")
    parser.add_argument(
        "--kernels",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: real tensors on this machine; cuda: fake tensors with a GPU's kernel choices (runtime.fake)",
    )
    harness.add_options(parser, out=str(harness.RESULTS / "real_width_layers.csv"), threads=0)
    args = parser.parse_args(argv)
    if args.kernels == "cuda" and args.compiled:
        parser.error("--kernels cuda measures eager blocks under fake mode: drop --compiled")
    harness.set_threads(args.threads)
    candidates = {name: CANDIDATES[name] for name in ("native", *args.candidates)}
    rows = []
    for name in args.layers:
        for tokens in args.tokens or TOKENS[name]:
            rows.extend(measure(name, tokens, args.compiled, candidates, args.kernels))
    for line in check(rows):
        print(line)
    if args.merge and Path(args.out).exists():

        def key(row: dict) -> tuple:
            return row["layer"], str(row["tokens"]), row.get("kernels") or "cpu", row["candidate"], row["mode"]

        redone = {key(row) for row in rows}
        kept = [{**row, "kernels": row.get("kernels") or "cpu"} for row in harness.read_csv(args.out)
                if key(row) not in redone]  # fmt: skip
        rows = kept + rows
    harness.write_csv(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
