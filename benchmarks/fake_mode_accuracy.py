"""Fake mode against real tensors on a real-width layer: the bytes a Llama-3-8B-width layer saves for backward, and
the peak of one training step, measured once with real tensors and once under ``runtime.fake.fake_mode()``.

    python benchmarks/fake_mode_accuracy.py [--tokens 256] [--candidates native convert compress=8] [--no-peak]

The model has benchmarks/real_width_layers.py's Llama-3-8B width (hidden 4096, 32 heads, 8 key/value heads,
intermediate 14336, one decoder layer, vocabulary 256, bfloat16, training mode), made in bfloat16 the same way under
both modes (the same seed; under fake mode nothing is allocated). For each candidate (native, ``runtime.convert``,
``runtime.convert(compress=8)``, ``runtime.convert(compress=4)``):

* saved bytes: ``memory.saved_bytes`` on the decoder layer alone, run on hidden states that are not a leaf with the
  model's rotary position embeddings and no mask (as real_width_layers.py measures a layer's real bytes);
* step peak: ``memory.peak`` of one training step of the whole 1-layer model (token ids and labels, its loss,
  backward), above the parameters and inputs alive at entry (``baseline``), caches off (as the estimate measures);
* what ``runtime.convert`` applied (its report's statuses), which must be the same decisions.

Prints real and fake side by side, whether they are equal, and the difference; writes a CSV (``--out``, default
benchmarks/results/fake_mode_accuracy.csv). Byte counts are exact on both sides (whole storages of known shapes and
dtypes), so any difference is something one side allocated or kept and the other did not. The seconds each side
took (building, converting and measuring; wall clock, on a shared machine) are printed for scale, not compared.

Measured on the 2-core development CPU at 256 tokens (benchmarks/results/fake_mode_accuracy.csv): saved bytes equal
for all four (51,546,112 native = 196.6 KiB/token; convert 90.6; compress=8 20.8; compress=4 11.8), the same convert
decisions, and the step peak equal for all four. Under ``compress=8`` and ``compress=4`` fake mode's peak was
14,731,264 bytes (3.2%) below the real one while the compressed norm's backward ran as its custom op under fake mode:
the real peak falls inside the backward of the layer's input RMSNorm, whose float32 temporaries (about 3.5 copies of
the 256 x 4096 rows) the op's fake kernel does not allocate. Under fake mode, outside compilation, the norm's (and
the gated op's recompute mode's) backward now runs its eager body, whose allocations fake mode sees.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

LAYER = "llama-3-8b"
#: candidate -> runtime.convert keywords (None: native)
CANDIDATES = {"native": None, "convert": {}, "compress=8": {"compress": 8}, "compress=4": {"compress": 4}}


def build():
    """The 1-layer Llama-3-8B-width model of real_width_layers.py, made in bfloat16 (both modes alike: a fake model's
    parameters cannot be swapped for converted ones, so ``.to(torch.bfloat16)`` after building fails under fake
    mode), training mode."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                           num_hidden_layers=1, max_position_embeddings=8192, rope_theta=500000.0, use_cache=False,
                           vocab_size=256, attn_implementation="sdpa")  # fmt: skip
    return t.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).train()


def layer_saved_bytes(model, tokens: int) -> int:
    """Bytes the model's decoder layer saves for backward on one sequence of ``tokens`` tokens: the layer alone, on
    random hidden states that are not a leaf (the previous layer's output, counted where the layer keeps it), with
    the model's rotary position embeddings and no mask (a full batch: SDPA's causal kernel)."""
    import torch

    from fewbit_design.runtime import memory

    layer = model.model.layers[0]
    hidden = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    hidden = hidden.to(torch.bfloat16).requires_grad_() * 1.0
    positions = model.model.rotary_emb(hidden, torch.arange(tokens)[None])
    torch.manual_seed(2)
    with memory.saved_bytes(layer) as saved:
        out = layer(hidden, position_embeddings=positions, attention_mask=None)
    del out
    return saved.total


def measure(candidate: str, fake: bool, tokens: int, peak: bool) -> dict:
    """The layer's saved bytes, the step's peak and baseline, and convert's decisions for one candidate, under fake
    mode or with real tensors."""
    import torch

    from fewbit_design import runtime
    from fewbit_design.runtime import memory
    from fewbit_design.runtime.fake import fake_mode, is_fake
    from fewbit_design.runtime.probe import caches_disabled, step_loss

    started = time.perf_counter()
    with fake_mode() if fake else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build()
        keywords = CANDIDATES[candidate]
        if keywords is not None:
            model = runtime.convert(model, **keywords)
        assert all(is_fake(p) for p in model.parameters()) == fake
        report = getattr(model, "convert_report", None)
        statuses = {item.name: item.status for item in report.techniques} if report is not None else {}
        saved = layer_saved_bytes(model, tokens)
        result = {"saved": saved, "peak": None, "baseline": None, "convert": statuses}
        if peak:
            ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(3))
            inputs = {"input_ids": ids, "labels": ids.clone()}
            with caches_disabled(model):
                with memory.peak(model, *inputs.values()) as measured:
                    step_loss(model(**inputs)).backward()
            result["peak"], result["baseline"] = measured.peak_bytes, measured.baseline_bytes
    del model
    gc.collect()
    result["seconds"] = time.perf_counter() - started
    return result


def _difference(real: int | None, fake: int | None) -> str:
    if real is None or fake is None:
        return "-"
    return f"{fake - real:+d} B ({(fake - real) / real:+.3%})" if real else f"{fake - real:+d} B"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="sequence length (default 256)")
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--no-peak", dest="peak", action="store_false", help="saved bytes only (no backward pass)")
    harness.add_options(parser, out=str(harness.RESULTS / "fake_mode_accuracy.csv"), threads=0)
    args = parser.parse_args(argv)
    harness.set_threads(args.threads)
    import transformers  # noqa: F401  (before fake_mode(): it adapts Hugging Face's masks only if it is loaded)

    rows = []
    for candidate in args.candidates:
        fake = measure(candidate, True, args.tokens, args.peak)
        real = measure(candidate, False, args.tokens, args.peak)
        for quantity in ("saved", "peak", "baseline"):
            if real[quantity] is None:
                continue
            equal = real[quantity] == fake[quantity]
            rows.append(dict(
                layer=LAYER, tokens=args.tokens, dtype="bfloat16", candidate=candidate, quantity=quantity,
                real_bytes=real[quantity], fake_bytes=fake[quantity], equal=equal,
                difference_bytes=fake[quantity] - real[quantity],
                same_convert_decisions=real["convert"] == fake["convert"],
                real_seconds=real["seconds"], fake_seconds=fake["seconds"],
            ))  # fmt: skip
            print(
                f"{candidate:11s} {quantity:8s} real {real[quantity]:>12d}  fake {fake[quantity]:>12d}  "
                f"{'equal' if equal else 'DIFFER ' + _difference(real[quantity], fake[quantity])}"
                f"  ({real[quantity] / args.tokens / 1024:.1f} KiB/token real)"
            )
        same = real["convert"] == fake["convert"]
        decisions = "the same" if same else f"DIFFERENT: {real['convert']} {fake['convert']}"
        print(f"{candidate:11s} convert decisions {decisions}; seconds: real {real['seconds']:.1f}, "
              f"fake {fake['seconds']:.1f} (wall clock, shared machine)")  # fmt: skip
    harness.write_csv(args.out, rows, float_format=".4g")
    return rows


if __name__ == "__main__":
    main()
