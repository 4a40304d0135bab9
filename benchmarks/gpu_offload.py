"""CUDA offload on a GPT-2-small-shaped stack: peak memory and step time against no offload and against
``torch.autograd.graph.save_on_cpu(pin_memory=True)``, in one run.

Model: ``transformers.GPT2Model``, 12 layers, width 768, 12 heads (``--layers``, ``--width``), GELU with the tanh
approximation, no dropout; float32 parameters, optionally bfloat16 autocast (``--autocast``). Input: random token ids,
``batch x seq`` (``--seq`` 1024, batch = 8 x ``--scale``); loss: mean of the squared last hidden state. A layer saves
54 MiB per sequence of 1024 tokens for backward in float32 (47 MiB under bfloat16 autocast; measured with
``memory.saved_bytes`` on CPU), so the stack saves about 0.65 GiB per sequence. Modes, the
same training step each (forward + backward, then the gradients are dropped), interleaved step by step:

* ``none``: no offloading (the baseline of every ratio);
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: synchronous copies into pinned memory
  allocated per tensor;
* ``offload``: ``fewbit_design.runtime.offload.saved_tensors(target="cuda-host", prefetch=2)``: copies on a side
  stream into a reused pinned pool, read back ahead of backward.

Peak: ``torch.cuda.max_memory_allocated()`` over the step (reset at its start): absolute (parameters, inputs and all
the step allocates) and above the step's start. Time: median over the timed steps (the device synchronised before and
after each). After every offload step the pinned pool's in-use bytes are recorded (0: no buffer is kept once the
graph is freed). Targets: offload peak at most 0.4x of none's, step time at most 1.15x.

Rows go to the CSV as each mode is finished. ``--budget-seconds`` stops the timed steps early (at least one per mode).

    python benchmarks/gpu_offload.py --out OUT/gpu_offload.csv     # batch 8: about 5 GiB saved for backward
    python benchmarks/gpu_offload.py --scale 4 --steps 3             # batch 32: about 20 GiB
    python benchmarks/gpu_offload.py --tiny    # a dry run on CPU: tiny stack; offload to disk, save_on_cpu a no-op,
                                               # peak from memory.peak
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # fewbit_design from this checkout; harness.py beside this file

import harness  # noqa: E402

from fewbit_design.runtime import memory, offload  # noqa: E402

GIB = float(1 << 30)
MODES = ("none", "save_on_cpu", "offload")
COLUMNS = [
    "device",
    "mode",
    "layers",
    "width",
    "batch",
    "seq",
    "autocast",
    "saved_gib",
    "offloaded_gib",
    "offloaded_tensors",
    "peak_gib",
    "peak_above_start_gib",
    "peak_ratio",
    "step_s",
    "time_ratio",
    "step_s_all",
    "pinned_in_use_after",
    "pinned_held",
]


def gpt2_stack(layers: int, width: int, heads: int, seq: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        vocab_size=vocab,
        bos_token_id=0,
        eos_token_id=0,
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        n_positions=seq,
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2Model(config)


def region(mode: str, options: dict):
    if mode == "none":
        return contextlib.nullcontext()
    if mode == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return offload.saved_tensors(prefetch=2, **options)  # target 'auto': cuda-host on CUDA, disk on CPU


def step(model, ids, mode: str, autocast: bool, options: dict):
    device = ids.device
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp, region(mode, options) as stats:
        loss = model(input_ids=ids).last_hidden_state.float().square().mean()
    loss.backward()
    del loss
    for parameter in model.parameters():
        parameter.grad = None
    return stats if mode == "offload" else None


def pinned_bytes() -> tuple[int, int]:
    """(in use, held) bytes of the CUDA target's pinned pools."""
    if not torch.cuda.is_available():
        return 0, 0
    from fewbit_design.runtime.offload import cuda

    pools = list(cuda._POOLS.values())
    return sum(p.in_use_bytes for p in pools), sum(p.held_bytes for p in pools)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--scale", type=float, default=1.0, help="batch = 8 x scale sequences")
    parser.add_argument("--autocast", action="store_true", help="bfloat16 autocast in forward")
    parser.add_argument("--min-bytes", type=int, default=1 << 20, help="offload saved tensors of at least this size")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (median)")
    parser.add_argument("--budget-seconds", type=float, default=math.inf, help="no new round of steps after this")
    harness.add_options(
        parser, out=None, help_texts={"out": "CSV (default: benchmarks/results/gpu_offload.csv; --tiny: temp)"}
    )
    parser.add_argument("--tiny", "--dry-run", action="store_true", help="CPU dry run: a tiny stack")
    args = parser.parse_args(argv)

    if args.tiny:
        args.layers, args.width, args.heads, args.seq, args.scale, args.steps = 2, 64, 2, 32, 0.25, 2
        args.vocab = 256
        args.min_bytes = 0
    if args.out is None:  # a dry run never overwrites measured results
        args.out = harness.scratch("gpu_offload-tiny.csv") if args.tiny else harness.RESULTS / "gpu_offload.csv"
    device = harness.gpu_or_dry_run("gpu_offload", args.tiny)
    if device is None:
        return 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    batch = max(1, round(8 * args.scale))
    torch.manual_seed(0)
    model = gpt2_stack(args.layers, args.width, args.heads, args.seq, args.vocab).to(device).train()
    ids = torch.randint(0, model.config.vocab_size, (batch, args.seq), device=device)
    options = {"directory": tempfile.gettempdir(), "min_bytes": args.min_bytes}
    with memory.saved_bytes(model) as saved:
        amp = torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
        with amp:
            model(input_ids=ids).last_hidden_state.float().square().mean()
    print(
        f"gpu_offload: {name}, torch {torch.__version__}; GPT-2 stack {args.layers} x {args.width}, batch {batch} x "
        f"seq {args.seq}, {'bfloat16 autocast' if args.autocast else 'float32'}: "
        f"{saved.total / GIB:.2f} GiB saved for backward in {saved.tensors} storages",
        flush=True,
    )

    peaks: dict[str, list[tuple[int, int]]] = {mode: [] for mode in MODES}
    stats: dict[str, offload.Stats | None] = {}
    pinned: dict[str, tuple[int, int]] = {}
    entry: dict[str, int] = {}

    def before(mode: str) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            entry[mode] = torch.cuda.memory_allocated(device)

    def after(mode: str, result) -> None:
        stats[mode] = result
        if device.type == "cuda":
            top = torch.cuda.max_memory_allocated(device)
            peaks[mode].append((top, top - entry[mode]))
        pinned[mode] = pinned_bytes()

    # one warm-up step per mode (kernels, allocator, the pinned pool), then the modes interleaved step by step,
    # every other round in reverse order; the device synchronised before and after each timed step
    timings = harness.measure(
        {mode: lambda mode=mode: step(model, ids, mode, args.autocast, options) for mode in MODES},
        repeats=args.steps,
        baseline="none",
        alternate=True,
        synchronize=harness.cuda_synchronize(device),
        before=before,
        after=after,
        budget_seconds=args.budget_seconds,
    )
    if timings.rounds < args.steps:
        print(f"gpu_offload: time budget of {args.budget_seconds:.0f} s spent after {timings.rounds} steps per mode")
    if device.type == "cpu":  # memory.peak in a separate step (the instrument slows operators)
        for mode in MODES:
            with memory.peak(model, ids) as p:
                step(model, ids, mode, args.autocast, options)
            peaks[mode].append((p.max_bytes, p.peak_bytes))

    rows = []
    for mode in MODES:
        top, above = max(peaks[mode])
        offloaded = stats.get(mode)
        rows.append(
            {
                "device": name,
                "mode": mode,
                "layers": args.layers,
                "width": args.width,
                "batch": batch,
                "seq": args.seq,
                "autocast": "bfloat16" if args.autocast else "none",
                "saved_gib": round(saved.total / GIB, 4),
                "offloaded_gib": round(offloaded.bytes / GIB, 4) if offloaded else 0.0,
                "offloaded_tensors": offloaded.tensors if offloaded else 0,
                "peak_gib": round(top / GIB, 4),
                "peak_above_start_gib": round(above / GIB, 4),
                "step_s": round(timings[mode].median, 4),
                "step_s_all": " ".join(f"{t:.4f}" for t in timings[mode].samples),
                "pinned_in_use_after": pinned[mode][0],
                "pinned_held": pinned[mode][1],
            }
        )
    base = rows[0]
    for row in rows:
        row["peak_ratio"] = round(row["peak_gib"] / base["peak_gib"], 4)
        row["time_ratio"] = round(row["step_s"] / base["step_s"], 4)
    out = harness.write_csv(args.out, rows, columns=COLUMNS)
    for row in rows:
        print(
            f"  {row['mode']:<12s} peak {row['peak_gib']:8.3f} GiB (x{row['peak_ratio']:.3f}; above start "
            f"{row['peak_above_start_gib']:.3f})  step {row['step_s']:.3f} s (x{row['time_ratio']:.3f})  "
            f"offloaded {row['offloaded_gib']} GiB in {row['offloaded_tensors']} tensors  "
            f"pinned in use after {row['pinned_in_use_after']} B"
        )
    target = rows[2]
    print(
        f"offload against none: peak x{target['peak_ratio']:.3f} (target <= 0.4), step x{target['time_ratio']:.3f} "
        f"(target <= 1.15); pinned buffers in use after the steps: {target['pinned_in_use_after']} B (must be 0)"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
