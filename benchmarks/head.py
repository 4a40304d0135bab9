"""The chunked LM head (runtime.head) against the native Hugging Face loss on a tiny LLaMA with a LLaMA-size vocabulary:
peak of live tensor bytes over one training step (``memory.peak``: forward + backward) and step time (medians of
interleaved runs), native vs converted, in the same run.

    python benchmarks/head.py [--vocab 32000 --hidden 64 --seq 128 --batch 4 --layers 2] [--repeats 15]

Prints the ratios and writes a CSV (``--out``, default benchmarks/results/head.csv). The shipped CSV was taken with
``--threads 1 --clock process`` (CPU seconds of one thread: the 2-core dev machine is shared, and other processes
do not inflate that clock; see harness.py): the defaults above, float32, 15 interleaved rounds.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk-rows", type=int, default=None)
    harness.add_options(parser, out=str(harness.RESULTS / "head.csv"), repeats=15, threads=0, clock="wall")
    args = parser.parse_args(argv)
    harness.set_threads(args.threads)

    import torch
    import transformers

    from fewbit_design.runtime import memory
    from fewbit_design.runtime.head import convert

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=args.seq, use_cache=False,
    )  # fmt: skip
    native = transformers.LlamaForCausalLM(config)
    converted = convert(copy.deepcopy(native), chunk_rows=args.chunk_rows)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    models = {"native": native, "head": converted}

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=input_ids, labels=input_ids).loss.backward()

        return run

    peaks = {}
    for name, model in models.items():
        step(model)()  # gradients exist: the measured step is a steady-state one
        model.zero_grad(set_to_none=True)
        with memory.peak(model, input_ids) as peak:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        peaks[name] = peak.peak_bytes
    timings = harness.measure(
        {n: step(m) for n, m in models.items()},
        repeats=args.repeats,
        baseline="native",
        alternate=True,
        clock=harness.CLOCKS[args.clock],
    )
    logits_bytes = args.batch * args.seq * args.vocab * 4
    rows = []
    for name in models:
        timing = timings[name]
        rows.append(
            dict(
                model=name, peak_mib=peaks[name] / 2**20, peak_ratio=peaks[name] / peaks["native"],
                step_ms=timing.median * 1e3, step_q1_ms=timing.quartiles[0] * 1e3, step_q3_ms=timing.quartiles[1] * 1e3,
                time_ratio=timings.ratio(name), logits_mib=logits_bytes / 2**20,
            )
        )  # fmt: skip
        print(
            f"{name:7s} peak {peaks[name] / 2**20:8.2f} MiB ({peaks[name] / peaks['native']:.3f}x)  step "
            f"{timing.median * 1e3:7.1f} ms [q1 {timing.quartiles[0] * 1e3:.1f}, q3 {timing.quartiles[1] * 1e3:.1f}] "
            f"({timings.ratio(name):.3f}x)"
        )
    print(f"float32 logits of the batch: {logits_bytes / 2**20:.2f} MiB; chunk rows {converted.head_report.chunk_rows}")
    harness.write_csv(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
