"""Bytes one real-width layer saves for backward with its default config (dropout as users fine-tune), native against
``runtime.convert`` and ``runtime.convert(compress=8)``, and the targets they are held to.

    python benchmarks/real_width_layers.py [--layers bert-large gpt2-xl llama-3-8b] [--compiled] [--threads 0]

Each layer is the one block of a 1-layer Hugging Face model built from the named width (``memory.saved_bytes`` on the
block, a batch of one sequence, bfloat16, real tensors: bytes are exact and scale with depth): BERT-large (1024, 16
heads, dropout 0.1) at 512 tokens, GPT-2-XL (1600, 25 heads, dropout 0.1) at 1024, Llama-3-8B (4096, 32 heads, 8
key/value heads, intermediate 14336, no dropout) at 1024. ``runtime.convert`` converts the whole model (its probe
decides what stays), then the block runs alone on random hidden states that are not a leaf (as the previous layer's
output: counted where the block keeps it). Candidates: native;
``convert`` with ``attention=False`` (what the attention core adds) and with ``dropout=False`` (without the 1-bit
dropout masks of ``runtime.dropout``); ``convert``; the same three under ``compress=8``. With ``--compiled`` each
block is also run under ``torch.compile`` (``aot_eager_decomp_partition``: inductor's decompositions and
partitioner, the saved set inductor keeps) and should keep at most what it keeps in eager.

Prints KiB per token and the ratio to native, checks the targets below, writes a CSV (``--out``, default
benchmarks/results/real_width_layers.csv). No timings: the bytes are what this measures.
"""

from __future__ import annotations

import argparse
import copy
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
#: candidate -> runtime.convert keywords (None: native)
CANDIDATES = {
    "native": None,
    "convert, attention=False": {"attention": False},
    "convert, dropout=False": {"dropout": False},
    "convert": {},
    "compress=8, attention=False": {"compress": 8, "attention": False},
    "compress=8, dropout=False": {"compress": 8, "dropout": False},
    "compress=8": {"compress": 8},
}


def build(name: str):
    """A 1-layer model of the named width in bfloat16, training mode, its default dropout."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    common = dict(vocab_size=256, attn_implementation="sdpa")
    if name == "bert-large":
        config = t.BertConfig(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, num_hidden_layers=1,
                              **common)  # fmt: skip
        model = t.BertModel(config)
    elif name == "gpt2-xl":
        config = t.GPT2Config(n_embd=1600, n_head=25, n_layer=1, n_positions=1024, use_cache=False, **common)
        model = t.GPT2LMHeadModel(config)
    else:
        config = t.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                               num_hidden_layers=1, max_position_embeddings=8192, rope_theta=500000.0,
                               use_cache=False, **common)  # fmt: skip
        model = t.LlamaForCausalLM(config)
    return model.to(torch.bfloat16).train()


def _block_of(name: str, model):
    return {"bert-large": lambda: model.encoder.layer[0], "gpt2-xl": lambda: model.transformer.h[0]}.get(
        name, lambda: model.model.layers[0]
    )()


def _keywords(name: str, model, hidden):
    import torch

    if name != "llama-3-8b":
        return {}
    positions = torch.arange(hidden.shape[1])[None]
    return {"position_embeddings": model.model.rotary_emb(hidden, positions), "attention_mask": None}


def block_bytes(name: str, model, tokens: int, compiled: bool) -> int:
    """Bytes the model's block saves for backward on one sequence of ``tokens`` tokens (forward only: what is saved
    is saved in forward)."""
    import torch

    from fewbit_design.runtime import memory

    block = _block_of(name, model)
    hidden = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    # not a leaf: the previous layer's output, which the block's bytes include where the block keeps it
    hidden = hidden.to(torch.bfloat16).requires_grad_() * 1.0
    keywords = _keywords(name, model, hidden)
    forward = block
    if compiled:
        torch._dynamo.reset()
        forward = torch.compile(block, backend="aot_eager_decomp_partition")
        forward(hidden, **keywords)  # compiles
    torch.manual_seed(2)
    with memory.saved_bytes(block) as saved:
        out = forward(hidden, **keywords)
    del out
    if compiled:
        torch._dynamo.reset()
    return saved.total


def measure(name: str, compiled: bool) -> list[dict]:
    from fewbit_design import runtime

    tokens, _ = TARGETS[name]
    native = build(name)
    rows, found = [], {}
    for candidate, keywords in CANDIDATES.items():
        model = native if keywords is None else runtime.convert(copy.deepcopy(native), **keywords)
        for mode in ("eager", "compiled") if compiled else ("eager",):
            total = block_bytes(name, model, tokens, mode == "compiled")
            found[candidate, mode] = total
            ratio = total / found["native", mode]
            rows.append(dict(layer=name, tokens=tokens, dtype="bfloat16", candidate=candidate, mode=mode,
                             kib_per_token=total / tokens / 1024, ratio=ratio))  # fmt: skip
            print(f"{name} {tokens} {mode:8s} {candidate:28s} {total / tokens / 1024:8.1f} KiB/token ({ratio:.3f}x)")
        if model is not native:
            del model
            gc.collect()
    return rows


def check(rows: list[dict]) -> list[str]:
    """One line per target: the eager value against its bound."""
    lines = []
    for row in rows:
        targets = TARGETS[row["layer"]][1]
        if row["mode"] != "eager" or row["candidate"] not in targets:
            continue
        bound, unit = targets[row["candidate"]]
        value = row["ratio"] if unit == "x" else row["kib_per_token"]
        verdict = "meets" if value <= bound else "MISSES"
        lines.append(f"{row['layer']}: {row['candidate']} {value:.3f} {unit} {verdict} the target <= {bound} {unit}")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--compiled", action="store_true", help="also run each block under torch.compile")
    harness.add_options(parser, out=str(harness.RESULTS / "real_width_layers.csv"), threads=0)
    args = parser.parse_args(argv)
    harness.set_threads(args.threads)
    rows = []
    for name in args.layers:
        rows.extend(measure(name, args.compiled))
    for line in check(rows):
        print(line)
    harness.write_csv(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
