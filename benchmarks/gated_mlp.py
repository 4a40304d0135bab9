"""Bytes saved for backward and step time of the gated-MLP op (``runtime.gated``) on a LLaMA-style model (float32).

For a Hugging Face ``LlamaForCausalLM`` from a config (random weights), native against ``gated.convert``:

* saved bytes per MLP (one ``LlamaMLP`` on its own, input of ``tokens`` rows) and per decoder layer (the whole
  model with 2 layers minus the same with 1 layer), counted by ``fewbit_design.runtime.memory.saved_bytes``;
  for native eager, converted eager, and both compiled the way inductor partitions (an ``aot_autograd`` backend with
  inductor's decompositions and ``min_cut_rematerialization_partition``, no code generation: what a compiled
  forward saves, counted the same way);
* the training step time (forward + backward of the whole model), native eager and converted eager, interleaved
  (harness.measure), medians and their ratio;

for the exact mode (``gated``, the default) and the compressed and recompute modes at 8 bits.

Prints a table and writes a CSV.

    python benchmarks/gated_mlp.py                 # hidden 256, intermediate 688, batch 4 x 128 tokens
    python benchmarks/gated_mlp.py --quick         # tiny sizes, 3 repeats
    python benchmarks/gated_mlp.py --threads 1 --clock process   # CPU seconds, steadier on a busy machine
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime.gated import convert

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402


def min_cut_backend():
    """torch.compile's partition of saved tensors (inductor's decompositions and min-cut partitioner), no codegen."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def compiler(graph, _inputs):
        return make_boxed_func(graph.forward)

    return aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )


def llama(layers: int, hidden: int, width: int, vocab: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=width, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=vocab, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def saved(module, run, compiled: bool) -> int:
    target = torch.compile(module, backend=min_cut_backend()) if compiled else module
    if compiled:
        run(target)  # compile outside the measured block
    with memory.saved_bytes(module) as counted:
        run(target)
    return counted.total


#: the variants: native, and gated.convert's modes (``gated``: the exact mode, the default)
VARIANTS = {
    "native": {},
    "gated": {},
    "compressed8": {"mode": "compressed", "bits": 8},
    "recompute8": {"mode": "recompute", "bits": 8},
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--width", type=int, default=688, help="intermediate size")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="hidden 32, width 64, 2 x 12 tokens, 3 repeats")
    harness.add_options(parser, out=str(harness.RESULTS / "gated_mlp.csv"), repeats=None, threads=0, clock="wall")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.width, args.batch, args.length = 32, 64, 2, 12
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 21)
    harness.set_threads(args.threads)
    vocab = 256
    tokens = args.batch * args.length
    ids = torch.randint(0, vocab, (args.batch, args.length), generator=torch.Generator().manual_seed(1))

    def step(model):
        return lambda target=model: target(input_ids=ids, labels=ids).loss.backward()

    rows = []
    x = torch.randn(tokens, args.hidden, requires_grad=True)
    native_mlp = llama(1, args.hidden, args.width, vocab).model.layers[0].mlp
    models = {layers: llama(layers, args.hidden, args.width, vocab) for layers in (1, 2)}

    def converted(model, variant):
        return model if variant == "native" else convert(copy.deepcopy(model), **VARIANTS[variant])

    for variant in VARIANTS:
        for compiled in (False, True):
            mlp = converted(native_mlp, variant)
            per_mlp = saved(mlp, lambda target: target(x * 1), compiled)
            totals = {}
            for layers, model in models.items():
                model = converted(model, variant)
                totals[layers] = saved(model, lambda target: target(input_ids=ids, labels=ids).loss, compiled)
            rows.append(
                {
                    "variant": variant,
                    "compiled": "min-cut" if compiled else "eager",
                    "bytes_per_mlp": per_mlp,
                    "bytes_per_layer": totals[2] - totals[1],
                    "per_token_per_mlp": per_mlp / tokens,
                }
            )
    timings = harness.measure(
        {variant: step(converted(models[2], variant)) for variant in VARIANTS},
        repeats=repeats,
        warmup=3,
        baseline="native",
        alternate=True,
        clock=harness.CLOCKS[args.clock],
    )
    for row in rows:
        row["step_ms"] = timings[row["variant"]].median * 1e3 if row["compiled"] == "eager" else ""
    print(
        f"LLaMA float32, hidden {args.hidden}, intermediate {args.width}, {tokens} tokens; "
        f"x + 4I per token = {4 * (args.hidden + 4 * args.width)} B, x + 2I = {4 * (args.hidden + 2 * args.width)} B"
    )
    print(f"{'variant':8} {'mode':8} {'bytes/MLP':>12} {'B/token/MLP':>12} {'bytes/layer':>12} {'step ms':>9}")
    for row in rows:
        step_ms = f"{row['step_ms']:.1f}" if row["step_ms"] != "" else ""
        print(
            f"{row['variant']:8} {row['compiled']:8} {row['bytes_per_mlp']:12d} {row['per_token_per_mlp']:12.0f} "
            f"{row['bytes_per_layer']:12d} {step_ms:>9}"
        )
    base = {row["compiled"]: row for row in rows if row["variant"] == "native"}
    for row in rows:
        if row["variant"] != "native":
            native = base[row["compiled"]]
            print(
                f"{row['variant']} / native {row['compiled']}: "
                f"MLP {row['bytes_per_mlp'] / native['bytes_per_mlp']:.3f}, "
                f"layer {row['bytes_per_layer'] / native['bytes_per_layer']:.3f}"
            )
    for variant in VARIANTS:
        ratio = timings[variant].median / timings["native"].median
        print(f"step time {variant} / native eager: {ratio:.3f} (medians of {timings.rounds} interleaved rounds)")
    harness.write_csv(args.out, rows)


if __name__ == "__main__":
    main()
