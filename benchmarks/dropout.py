"""Compact dropout (runtime.dropout) against torch's dropout: bytes a GPT-2-XL-width layer saves for backward
(``memory.saved_bytes`` on the layer, its default dropout 0.1) and the step time of a small GPT-2 (medians of
interleaved steps), native vs converted, in the same run.

    python benchmarks/dropout.py [--tokens 256 1024] [--dtype bfloat16] [--repeats 15] [--threads 1]

Bytes: one GPT-2-XL layer (width 1600, 25 heads, MLP 6400, SDPA attention) on a batch of one sequence; only its
dropout modules change (``dropout.convert``), so the difference is what the masks keep: native CPU dropout keeps its
noise (x's dtype), native CUDA dropout a bool mask (a byte an element), compact dropout a bit ("bits") or the
generator state ("seed"). The attention core's dropout is SDPA's, not a module: the same in every row. Times: a
4-layer GPT-2 of width 256 with dropout 0.1, batch 4 x 128 tokens, float32, one training step (forward, backward),
the three candidates interleaved. Writes a CSV (``--out``, default benchmarks/results/dropout.csv).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

MODES = ("bits", "seed")


def _gpt2(width: int, heads: int, layers: int, dtype):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=width, n_head=heads, n_layer=layers, vocab_size=256, n_positions=1024, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(dtype).train()


def layer_bytes(tokens: int, dtype) -> dict[str, int]:
    """Bytes one GPT-2-XL layer saves for backward on ``tokens`` tokens: native and each mode."""
    import torch

    from fewbit_design.runtime import memory
    from fewbit_design.runtime.dropout.convert import convert

    native = _gpt2(1600, 25, 1, dtype).transformer.h[0]
    layers = {"native": native, **{mode: convert(copy.deepcopy(native), mode=mode) for mode in MODES}}
    hidden = torch.randn(1, tokens, 1600, dtype=dtype, requires_grad=True)
    found = {}
    for name, layer in layers.items():
        torch.manual_seed(1)
        with memory.saved_bytes(layer) as saved:
            layer(hidden)[0].float().sum().backward()
        found[name] = saved.total
    return found


def step_times(repeats: int, clock) -> harness.Timings:
    import torch

    from fewbit_design.runtime.dropout.convert import convert

    native = _gpt2(256, 4, 4, torch.float32)
    models = {"native": native, **{mode: convert(copy.deepcopy(native), mode=mode) for mode in MODES}}
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(2))

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()

        return run

    return harness.measure(
        {name: step(model) for name, model in models.items()},
        repeats=repeats,
        warmup=2,
        baseline="native",
        alternate=True,
        clock=clock,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    harness.add_options(parser, out=str(harness.RESULTS / "dropout.csv"), repeats=15, threads=0, clock="wall")
    args = parser.parse_args(argv)
    harness.set_threads(args.threads)
    import torch

    dtype = getattr(torch, args.dtype)
    rows = []
    for tokens in args.tokens:
        found = layer_bytes(tokens, dtype)
        for name, total in found.items():
            rows.append(dict(what=f"GPT-2-XL layer, {tokens} tokens, {args.dtype}", candidate=name,
                             kib_per_token=total / tokens / 1024, ratio=total / found["native"]))  # fmt: skip
            print(f"{rows[-1]['what']}: {name:6s} {total / tokens / 1024:8.2f} KiB/token ({rows[-1]['ratio']:.3f}x)")
    timings = step_times(args.repeats, harness.CLOCKS[args.clock])
    for name in timings.by_candidate:
        timing = timings[name]
        rows.append(dict(what="GPT-2 4 x 256, 4 x 128 tokens, float32: step seconds", candidate=name,
                         step_ms=timing.median * 1e3, step_q1_ms=timing.quartiles[0] * 1e3,
                         step_q3_ms=timing.quartiles[1] * 1e3, ratio=timings.ratio(name)))  # fmt: skip
        print(f"step {name:6s} {timing.median * 1e3:7.1f} ms ({timings.ratio(name):.3f}x)")
    harness.write_csv(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
