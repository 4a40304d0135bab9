"""Step time of the exact ops (memory-sharing norms, the exact gated-MLP op) against the native modules they replace.

Two tables, every time a ratio against native measured in the same run (interleaved, ``harness.measure``, medians):

* ``op``: one module alone, forward + backward (the input and the parameters need gradients), for LayerNorm
  (``torch.nn.LayerNorm``), ``torch.nn.RMSNorm``, LlamaRMSNorm and the LLaMA MLP (SwiGLU), at the shape of
  ``benchmarks/transformer_memory.py``'s block (width 256, intermediate 688, 4 x 128 tokens) and 4x the tokens;
* ``block``: a training step (forward, loss, backward) of the 2-block tiny LLaMA and GPT-2 of
  ``transformer_memory.py``, native against ``norms``, ``gated`` and ``runtime.convert`` (what a user calls).

Times are the CPU seconds of this process (``--clock process``, the default here: on a busy shared machine other
processes do not inflate them), torch on one thread (``--threads 1``), so they are the op's own cost.

    python benchmarks/exact_ops_speed.py                    # float32 and bfloat16, both tables
    python benchmarks/exact_ops_speed.py --quick            # seconds: small sizes, few repeats
    python benchmarks/exact_ops_speed.py --tables block --dtypes float32

Writes ``benchmarks/results/exact_ops_speed.csv``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # fewbit_design from this checkout; harness.py beside this file
import harness  # noqa: E402
import transformer_memory  # noqa: E402

from fewbit_design.runtime import gated, norms  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _op_modules(name: str, width: int, intermediate: int, dtype: torch.dtype):
    """(native module, converted module) for one op."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    native = {
        "LayerNorm": lambda: torch.nn.LayerNorm(width),
        "RMSNorm": lambda: torch.nn.RMSNorm(width, eps=1e-6),
        "LlamaRMSNorm": lambda: LlamaRMSNorm(width, eps=1e-6),
        "LlamaMLP": lambda: LlamaMLP(LlamaConfig(hidden_size=width, intermediate_size=intermediate)),
    }[name]().to(dtype)
    with torch.no_grad():
        for parameter in native.parameters():  # weights away from 1 and biases away from 0, as after training
            parameter.add_(torch.randn(parameter.shape, dtype=dtype) * 0.1)
    holder = torch.nn.Sequential(native)  # converted in place: holder[0] is replaced, sharing the parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted = gated.convert(holder) if name == "LlamaMLP" else norms.convert(holder)
    assert type(converted[0]) is not type(native), f"{name} was not converted"
    return native, converted[0]


def _op_step(module: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor):
    def run():
        module(x).backward(upstream)
        x.grad = None
        module.zero_grad(set_to_none=True)

    return run


def op_rows(args, dtype_name: str) -> list[dict]:
    dtype = DTYPES[dtype_name]
    rows = []
    for tokens in (args.tokens, 4 * args.tokens):
        for name in ("LayerNorm", "RMSNorm", "LlamaRMSNorm", "LlamaMLP"):
            native, ours = _op_modules(name, args.width, args.intermediate, dtype)
            generator = torch.Generator().manual_seed(1)
            x = torch.randn(tokens, args.width, generator=generator).to(dtype).requires_grad_()
            upstream = torch.randn(tokens, args.width, generator=generator).to(dtype)
            timings = harness.measure(
                {"native": _op_step(native, x, upstream), "ours": _op_step(ours, x, upstream)},
                repeats=args.repeats * (1 if name == "LlamaMLP" else 10),
                warmup=3,
                baseline="native",
                alternate=True,
                clock=harness.CLOCKS[args.clock],
            )
            row = {"table": "op", "dtype": dtype_name, "what": name, "tokens": tokens}
            row.update(native_us=timings["native"].median * 1e6, ours_us=timings["ours"].median * 1e6)
            row["ratio"] = timings.ratio("ours")
            rows.append(row)
            print(
                f"[op {dtype_name}] {name:<13} {tokens:5d} tokens: native {row['native_us']:9.1f} us, "
                f"ours {row['ours_us']:9.1f} us ({row['ratio']:.3f}x)"
            )
    return rows


def block_rows(args, dtype_name: str) -> list[dict]:
    rows = []
    settings = {"bits": 3, "linear_bits": 8}
    variants = {"native": (), "norms": ("norms",), "gated": ("gated",), "convert": ("convert",)}
    batch, seq = args.batch, args.tokens // args.batch
    for family in args.families:
        ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(2))
        models, steps = {}, {}
        for name, techniques in variants.items():
            if family == "gpt2" and name == "gated":
                continue
            torch.manual_seed(0)
            model = transformer_memory.build(family, 2, args.width, 256, seq).train().to(DTYPES[dtype_name])
            models[name] = transformer_memory.convert(model, techniques, settings)

            def step(model=models[name], ids=ids):
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)

            steps[name] = step
        timings = harness.measure(
            steps, repeats=args.repeats, warmup=2, baseline="native", alternate=True, clock=harness.CLOCKS[args.clock]
        )
        for name in steps:
            row = {"table": "block", "dtype": dtype_name, "what": f"{family} {name}", "tokens": args.tokens}
            row.update(native_us=timings["native"].median * 1e6, ours_us=timings[name].median * 1e6)
            row["ratio"] = timings.ratio(name)
            quartiles = timings[name].quartiles
            rows.append(row)
            print(
                f"[block {dtype_name}] {family:<5} {name:<8} {row['ours_us'] / 1e3:8.2f} ms ({row['ratio']:.3f}x "
                f"native; quartiles {quartiles[0] * 1e3:.2f}-{quartiles[1] * 1e3:.2f} ms)"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", nargs="+", default=["op", "block"], choices=["op", "block"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--families", nargs="+", default=["llama", "gpt2"], choices=["llama", "gpt2"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per step (the op table also runs 4x)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="seconds: width 64, 64 tokens, 3 repeats")
    harness.add_options(parser, out=str(harness.RESULTS / "exact_ops_speed.csv"), repeats=21, threads=1)
    parser.add_argument("--clock", choices=sorted(harness.CLOCKS), default="process", help="timer (default process)")
    args = parser.parse_args()
    if args.quick:
        args.width, args.intermediate, args.tokens, args.batch, args.repeats = 64, 176, 64, 2, 3
    harness.set_threads(args.threads)
    rows = []
    for dtype_name in args.dtypes:
        if "op" in args.tables:
            rows += op_rows(args, dtype_name)
        if "block" in args.tables:
            rows += block_rows(args, dtype_name)
    print(f"wrote {harness.write_csv(args.out, rows)}")


if __name__ == "__main__":
    main()
