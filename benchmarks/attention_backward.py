"""The compressed attention core's two backward paths in a training step of a tiny LLaMA under ``compress=8``.

``runtime.convert(model, compress=8)`` runs the attention cores through :mod:`fewbit_design.runtime.attention.ops`.
Its backward either recomputes the flash forward from the decoded q, k, v (for the output and log-sum-exp) before
the flash backward (``recompute``), or, when the output projection is a compressed linear, reads the forward's
log-sum-exp and the projection's codes of the output, which the core made and shares (``shared``, the default at 8
bits; the switch is ``attention.convert.SHARED_OUTPUT_BITS``). Timed interleaved in one run (harness.measure), on the
same converted model and batch, against the native model's step:

* ``native``: the unconverted model, ``loss.backward()``;
* ``recompute`` / ``shared``: the converted model with each path.

It prints the medians, the medians of the per-round ratios against native (and shared against recompute), the
flash-forward kernel calls in one backward and the bytes saved for backward per variant, and writes a CSV.

    python benchmarks/attention_backward.py            # 2 blocks, width 256, 4 x 128 tokens, 1 thread, 21 rounds
    python benchmarks/attention_backward.py --quick    # seconds: 1 block, width 64, 2 x 32 tokens
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402
import transformer_memory  # noqa: E402  (exits with a message when transformers is missing)

from fewbit_design import runtime  # noqa: E402
from fewbit_design.runtime import memory  # noqa: E402

attention_convert = importlib.import_module("fewbit_design.runtime.attention.convert")
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
#: the value of attention.convert.SHARED_OUTPUT_BITS per converted variant (9: no core shares its output)
PATHS = {"recompute": 9, "shared": attention_convert.SHARED_OUTPUT_BITS}


class _CountFlash(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is FLASH
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bits", type=int, default=8, help="compress=K (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="seconds: 1 block, width 64, 2 x 32 tokens, 3 rounds")
    default_out = str(harness.RESULTS / "attention_backward.csv")
    harness.add_options(parser, out=default_out, repeats=None, threads=1, clock="wall")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.batch, args.seq = 1, 64, 2, 32
        args.repeats = args.repeats or 3
        if args.out == default_out:
            args.out = str(harness.scratch("attention_backward_quick.csv"))
    harness.set_threads(args.threads)
    transformer_memory.transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    native = transformer_memory.build("llama", args.layers, args.width, 256, args.seq).train()
    converted = transformer_memory.build("llama", args.layers, args.width, 256, args.seq).train()
    converted.load_state_dict(native.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = runtime.convert(converted, bits=3, compress=args.bits)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))
    default_bits = attention_convert.SHARED_OUTPUT_BITS

    def step(model):
        def call():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        return call

    def choose(name: str) -> None:
        attention_convert.SHARED_OUTPUT_BITS = PATHS.get(name, default_bits)

    rows = []
    try:
        facts = {}
        for name, model in (("native", native), ("recompute", converted), ("shared", converted)):
            choose(name)
            with memory.saved_bytes() as saved:
                loss = model(input_ids=ids, labels=ids).loss
            counter = _CountFlash()
            with counter:
                loss.backward()
            model.zero_grad(set_to_none=True)
            facts[name] = (saved.total, counter.calls)
        candidates = {"native": step(native), "recompute": step(converted), "shared": step(converted)}
        timings = harness.measure(
            candidates,
            repeats=args.repeats or 21,
            warmup=2,
            baseline="native",
            alternate=True,
            clock=harness.CLOCKS[args.clock],
            before=choose,
        )
    finally:
        attention_convert.SHARED_OUTPUT_BITS = default_bits

    def ratio(name: str, baseline: str) -> float:
        pairs = zip(timings[name].samples, timings[baseline].samples, strict=True)
        return statistics.median(a / b for a, b in pairs)

    print(f"llama {args.layers} x {args.width}, {args.batch} x {args.seq} tokens, compress={args.bits}, "
          f"{torch.get_num_threads()} thread(s), {timings.rounds} rounds")  # fmt: skip
    print(f"{'variant':>10} {'ms':>8} {'x native':>9} {'x recompute':>12} {'flash fwd in bwd':>17} {'saved bytes':>12}")
    for name in candidates:
        row = {
            "variant": name,
            "layers": args.layers,
            "width": args.width,
            "tokens": args.batch * args.seq,
            "bits": args.bits,
            "threads": torch.get_num_threads(),
            "median_ms": timings[name].median * 1e3,
            "ratio_native": ratio(name, "native"),
            "ratio_recompute": ratio(name, "recompute"),
            "flash_forward_calls": facts[name][1],
            "saved_bytes": facts[name][0],
        }
        rows.append(row)
        print(
            f"{name:>10} {row['median_ms']:>8.2f} {row['ratio_native']:>9.3f} {row['ratio_recompute']:>12.3f}"
            f" {row['flash_forward_calls']:>17d} {row['saved_bytes']:>12d}"
        )
    path = harness.write_csv(args.out, rows, float_format=".6g")
    print(f"(ratios: medians of per-round ratios) wrote {path}")


if __name__ == "__main__":
    main()
