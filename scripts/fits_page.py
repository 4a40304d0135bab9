"""Write docs/fits.md ("What fits where") and docs/figures/fits.png from the shipped configs.

    python scripts/fits_page.py [--configs llama-3-8b,...] [--out docs/fits.md] [--figure docs/figures/fits.png]

For every shipped config (fewbit_design/configs) at 4K, 8K and 32K tokens (those the config allows; BERT, GPT-2 and
ViT at their own longest sequence), batch 1, bfloat16 with float32 master weights and AdamW, on one H100 80 GB and on
eight with FSDP2: the rows ``fewbit-design memory --hf-config NAME --seq N [--gpus 8 --fsdp]`` prints (the same
function, :func:`fewbit_design.runtime.estimate.estimate`), beside reference rows computed the same way:

* eager PyTorch and full-block checkpointing: the command's ``eager`` and ``checkpointing`` rows;
* a Liger-style block: SwiGLU keeping gate and up (the project's gated op, which keeps them and x, as the linear
  layers before it do anyway) and RMSNorm / LayerNorm keeping its input and its row statistics (a module written
  here, as Liger-Kernel's saves them), measured under fake mode like the rest;
* the exact floor without recomputing a matrix product: the norms' outputs, q, k and v at the key/value heads, the
  attention output, and gate and up (a plain MLP: its first linear's output), in the dtype; counted from the config.

Bytes are measured (fake mode, exact for the tensors); times are predicted (roofline at the datasheet's peaks).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import warnings

import torch

from fewbit_design.runtime.estimate import config_names, estimate, load_config, sequence_limit

SEQUENCES = (4096, 8192, 32768)
SETTINGS = ((1, False), (8, True))
DEVICE = "h100-80gb"


class _InputKeepingNorm(torch.autograd.Function):
    """A norm that keeps its input and its rows' statistics for backward (Liger-Kernel's RMSNorm and LayerNorm)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, centred):
        compute = x.float()
        mean = compute.mean(-1, keepdim=True) if centred else None
        centred_x = compute - mean if centred else compute
        rstd = torch.rsqrt(centred_x.pow(2).mean(-1, keepdim=True) + eps)
        y = (centred_x * rstd).to(x.dtype) * weight
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x, weight, rstd, *(() if mean is None else (mean,)))
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd, *_ = ctx.saved_tensors
        xhat = (x.float() * rstd).to(grad.dtype)
        grad_weight = (grad * xhat).reshape(-1, x.shape[-1]).sum(0)
        grad_bias = grad.reshape(-1, x.shape[-1]).sum(0) if ctx.has_bias else None
        return (grad * weight).to(x.dtype), grad_weight, grad_bias, None, None


class _LigerStyleNorm(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight, self.bias = norm.weight, getattr(norm, "bias", None)
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.centred = isinstance(norm, torch.nn.LayerNorm)

    def forward(self, x):
        return _InputKeepingNorm.apply(x, self.weight, self.bias, self.eps, self.centred)


def liger_style(model: torch.nn.Module) -> torch.nn.Module:
    """The model with Liger-style norms and the gated-MLP op (exact mode) in place of the native modules."""
    from fewbit_design.runtime.gated.convert import convert as gated_convert

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gated_convert(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            is_norm = isinstance(child, torch.nn.LayerNorm) or type(child).__name__.endswith("RMSNorm")
            if is_norm and getattr(child, "weight", None) is not None and child.weight.dim() == 1:
                setattr(parent, name, _LigerStyleNorm(child))
    return model


def floor_bytes_per_token_per_layer(config, dtype_size: int = 2) -> int:
    """The exact floor without recomputing a matrix product (module docstring), per token and layer."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    gated = getattr(config, "hidden_act", None) in ("silu", "swish") and config.model_type not in ("bert", "vit")
    mlp = 2 * width if gated else width
    return dtype_size * (2 * hidden + heads * head_dim + 2 * kv + heads * head_dim + mlp)


def _sequences(config) -> list[int]:
    limit = sequence_limit(config)
    allowed = [s for s in SEQUENCES if limit is None or s <= limit]
    return allowed or [limit]


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f}"


def _table(results: list, floor: int) -> list[str]:
    head = (
        "| variant | KiB/token/layer (measured) | peak GB, 1 GPU (measured) | fits | max seq | max batch "
        "| step s, 1 GPU (predicted) | peak GB, 8 GPUs FSDP2 (measured) | fits | max seq | max batch "
        "| step s, 8 GPUs (predicted) |"
    )
    lines = [head, "|" + "---|" * 12]
    single, sharded = results
    for one, eight in zip(single.variants, sharded.variants, strict=True):
        kept = f"{one.bytes_per_token_per_layer / 1024:.1f}"
        if eight.bytes_per_token_per_layer != one.bytes_per_token_per_layer:  # the plan: fewer layers checkpointed
            kept += f" (8 GPUs: {eight.bytes_per_token_per_layer / 1024:.1f})"
        cells = [one.name, kept]
        for item in (one, eight):
            seq = f"{item.max_seq}{'*' if item.seq_capped else ''}"
            cells += [_gb(item.peak_bytes), "yes" if item.fits else "no", seq, str(item.max_batch),
                      f"{item.predicted_step_s:.3g}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"| exact floor (counted) | {floor / 1024:.1f} | | | | | | | | | | |")
    return lines


def _figure(per_model: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_model)
    variants = list(next(iter(per_model.values())))
    figure, axis = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(variants)
    for k, variant in enumerate(variants):
        values = [per_model[name].get(variant, 0.0) / 1024 for name in names]
        axis.bar([i + k * width for i in range(len(names))], values, width, label=variant)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    axis.set_ylabel("KiB kept per token per layer (measured; floor counted)")
    axis.set_title("Bytes kept for backward per token and layer, bfloat16, at 8K tokens (or the config's longest)")
    axis.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(config_names()))
    parser.add_argument("--out", default="docs/fits.md")
    parser.add_argument("--figure", default="docs/figures/fits.png")
    args = parser.parse_args(argv)
    page = io.StringIO()
    page.write(PAGE_HEAD)
    per_model: dict[str, dict[str, float]] = {}
    for name in args.configs.split(","):
        config = load_config(name)
        page.write(f"\n## {name}\n")
        for sequence in _sequences(config):
            start = time.perf_counter()
            results = [
                estimate(
                    config,
                    batch=1,
                    sequence=sequence,
                    device=DEVICE,
                    gpus=gpus,
                    fsdp=fsdp,
                    transforms={"liger-style": liger_style},
                )  # fmt: skip
                for gpus, fsdp in SETTINGS
            ]
            floor = floor_bytes_per_token_per_layer(config)
            page.write(f"\n### {name}, {sequence} tokens ({results[0].parameters / 1e9:.2f}B parameters)\n\n")
            page.write("\n".join(_table(results, floor)) + "\n")
            if sequence == 8192 or sequence == _sequences(config)[-1] and 8192 not in _sequences(config):
                per_model[name] = {v.name: v.bytes_per_token_per_layer for v in results[0].variants}
                per_model[name]["exact floor"] = floor
            print(f"{name} {sequence}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    table = ["| | `accelerate estimate-memory` | `fewbit-design memory --hf-config` |", "|---|---|---|"]
    table += [f"| {what} | {theirs} | {ours} |" for what, theirs, ours in ACCELERATE]
    page.write(PAGE_TAIL.replace("{accelerate}", "\n".join(table)))
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(page.getvalue())
    os.makedirs(os.path.dirname(args.figure), exist_ok=True)
    _figure(per_model, args.figure)


PAGE_HEAD = """# What fits where

Generated by `python scripts/fits_page.py` from the shipped configs (`fewbit_design/configs`); each table holds the
rows `fewbit-design memory --hf-config NAME --seq N --batch 1 --dtype bfloat16 --device h100-80gb` prints, and
with `--gpus 8 --fsdp` (FSDP2 over eight H100 80 GB), beside reference rows computed the same way. Training is
AdamW with float32 master weights (16 bytes per parameter before activations), batch 1 per GPU.

How to read the numbers:

* **measured**: bytes, found under fake mode on a model of two real-width layers (nothing allocated) and replayed
  over the config's depth: exact for the tensors the step holds (see
  [Memory measurement](memory.md#fake-mode-real-sizes-without-the-hardware) for what fake mode cannot see:
  allocator rounding and cache, fragmentation, kernels' workspace), with a GPU's kernel choices where they keep
  other tensors than the CPU's (`fake_mode(kernels="cuda")`: native SDPA with dropout in a fused kernel, no
  sequence x sequence tensor kept; native dropout with a bool mask). *fits* compares
  the peak with the datasheet's 80 GB; *max seq* (a multiple of 128; `*`: the config's own limit) and *max batch*
  are where the same measurements cross it.
* **predicted**: step times, a roofline at the H100's datasheet peaks (989 TFLOP/s bfloat16, 3.35 TB/s): a lower
  bound, for comparing the variants of one model, not a benchmark. Checked where it can be, on this CPU
  (`python benchmarks/estimate_accuracy.py`, the roofline at the CPU's measured peaks): for a 4-layer LLaMA and GPT-2
  of width 512 every variant's predicted ratio to eager is within 9% of the measured one; at width 256 the
  compressed variants run 11-19% slower than predicted (their CPU paths' extra operators), so the ratios hold where
  matrix products dominate the step. No GPU has checked them yet.
* **counted**: the exact floor, from the config's sizes.

Variants: `eager` (native PyTorch), `checkpointing` (every layer, as `gradient_checkpointing_enable()`),
`checkpoint-offload` (checkpointed layers' inputs in host memory), `convert`, `convert(compress=8)`,
`convert(compress=4)` (`runtime.convert`), `plan` (the planner's exact choice of plain or checkpointed converted
layers: the fastest that fits), `liger-style` (reference: SwiGLU keeping gate and up, norms keeping their input and
statistics), and the exact floor without recomputing a matrix product (norm outputs, q, k, v at the key/value heads,
the attention output, gate and up).

![Bytes per token per layer by technique](figures/fits.png)
"""

#: the comparison with accelerate estimate-memory: (what, accelerate, this command)
ACCELERATE = (
    ("parameters", "counted on the meta device", "counted on the fake-mode model (two layers, scaled to the depth)"),
    ("training state", "the largest part, bfloat16: 8 bytes per parameter",
     "every part together: bfloat16 weights 2 + float32 master 4 + AdamW states 8 (+ gradients 2 during the step): "
     "16 bytes per parameter, 12 without master weights"),
    ("activations", "none",
     "measured under fake mode for the batch and sequence, per variant (eager, checkpointing, offload, convert, "
     "compress, plan)"),
    ("LM head", "none", "its logits (batch x sequence x vocabulary in the dtype, and the loss's float32 copy)"),
    ("sharding", "none", "FSDP2 over N GPUs: state divided by N, plus the layers in flight and the root's parameters"),
    ("device", "none",
     "a datasheet device: whether it fits, the longest sequence and the largest batch that do, a predicted step time"),
)  # fmt: skip

PAGE_TAIL = """
## Beside `accelerate estimate-memory`

`accelerate estimate-memory MODEL` builds the model on the meta device and prints, per dtype, the parameters' size
and "Training using Adam": the largest of four parts it sizes from the float32 parameter bytes (the model, the
gradients, Adam's two states, and a step of four times the model in float32), not their sum. For Llama-3-8B
(8.03B parameters) that is 64.2 GB in bfloat16 (Adam's states, 8 bytes per parameter) and 128.5 GB in float32
(16 bytes per parameter), for any batch and sequence.

{accelerate}

Both agree on the parameter count; the training state differs by design (accelerate's is a rule of thumb for
choosing a GPU, this one the sum a mixed-precision AdamW step holds), and activations, which dominate long
sequences (eager Llama-3-8B keeps about 200 KiB per token per layer: 50 GB at 8K tokens), are only in this one.

## What the numbers leave out

The optimizer step's temporaries (AdamW's foreach update holds one more float32 value per parameter it updates at
once), communication buffers of FSDP beyond the gathered layers, the CUDA context (about 0.5 GB) and the caching
allocator's reserve. Compressed variants (`compress=8`, `compress=4`) run the project's custom ops, whose scratch
space inside one operator fake mode does not see (a few hundred MB for a 7B layer at 8K tokens); on CPU their
attention keeps a little more than fake mode shows (the log-sum-exp of its shared-output path). The plan's bytes per
token per layer are the average over its layers, plain or checkpointed.
"""


if __name__ == "__main__":
    main()
