"""Activation memory and time of reversible networks against a plain ResNet of similar size, at growing depth.

For each depth and architecture (``resnet`` baseline, ``revnet``, ``layerwise``, ``hybrid`` from
``fewbit_design.runtime.reversible``) it measures, in training mode on CIFAR-size inputs:

* the bytes saved for backward by the forward pass (``fewbit_design.runtime.memory.saved_bytes``: parameters
  excluded) and the same per input pixel (batch x height x width), the paper's M_z';
* the peak of the bytes that the recomputations inside backward keep alive at once (the "local bottleneck" of
  section 3.4: a RevNet block holds all hidden activations of its f or g; the hybrid only one layer's);
* the forward+backward time per sample (median of repeats, the architectures of a depth interleaved) and its ratio
  to the ResNet of the same depth (``--repeats 0``: memory only).

Prints a table and writes a CSV.

    python benchmarks/reversible_memory.py                 # depths 4, 8, 16, 32, 64
    python benchmarks/reversible_memory.py --quick         # depths 4 and 8, one timed repeat
"""

from __future__ import annotations

import argparse
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime import reversible as R

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

ARCHS = ("resnet", "revnet", "layerwise", "hybrid")


class _Held:
    """What the backward-peak hook stores in the graph in place of a tensor (its lifetime is the tensor's)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class BackwardPeak:
    """Peak bytes of tensors saved by graphs built while backward runs (the recomputations), live at once.

    Each saved tensor is wrapped in a holder whose collection (when autograd frees that graph node) lowers the
    live count. Storages saved twice are counted twice, so this is an upper bound of the true peak.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def pack(self, tensor: torch.Tensor) -> _Held:
        held = _Held(tensor)
        if not (isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad)):
            nbytes = tensor.untyped_storage().nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(held, self._release, nbytes)
        return held

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.tensor


def build(arch: str, depth: int, channels: int, size: int) -> torch.nn.Module:
    if arch == "resnet":
        return R.resnet(depth, channels, input_size=(size, size))
    builder = {"revnet": R.revnet, "layerwise": R.layerwise_net, "hybrid": R.hybrid_net}[arch]
    return builder(depth, channels, input_size=(size, size))


def measure(
    arch: str, depth: int, *, channels: int, batch: int, size: int, seed: int = 0
) -> tuple[dict, torch.nn.Module, Callable[[], None]]:
    """The memory figures of one architecture (a CSV row, time to be filled in), its model and its training step."""
    torch.manual_seed(seed)
    model = build(arch, depth, channels, size).train()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=generator)
    target = torch.randint(0, 10, (batch,), generator=generator)
    with memory.saved_bytes(model) as saved:
        loss = torch.nn.functional.cross_entropy(model(x), target)
    peak = BackwardPeak()
    with torch.autograd.graph.saved_tensors_hooks(peak.pack, peak.unpack):
        loss.backward()  # also the warm-up of the timing

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), target).backward()

    row = {
        "arch": arch,
        "depth": depth,
        "parameters": sum(p.numel() for p in model.parameters()),
        "saved_bytes": saved.total,
        "bytes_per_pixel": saved.total / (batch * size * size),
        "backward_peak_bytes": peak.peak,
        "ms_per_sample": float("nan"),
    }
    return row, model, step


def time_steps(measured: dict[str, tuple], repeats: int) -> harness.Timings:
    """The training steps of the architectures interleaved, the gradients reset before each (outside the timed
    call). No warm-up call: measure() ran a step of each."""
    return harness.measure(
        {arch: step for arch, (_, _, step) in measured.items()},
        repeats=repeats,
        warmup=0,
        before=lambda arch: measured[arch][1].zero_grad(set_to_none=True),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4,8,16,32,64", help="comma-separated depths (blocks or units)")
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated subset of " + ", ".join(ARCHS))
    parser.add_argument("--channels", type=int, default=16, help="channels after the stem (divisible by 4)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=32, help="input height and width (divisible by 4)")
    harness.add_options(
        parser,
        repeats=3,
        threads=1,
        out=harness.RESULTS / "reversible_memory.csv",
        help_texts={"repeats": "timed forward+backward passes per configuration (0: no timing)"},
    )
    parser.add_argument("--quick", action="store_true", help="depths 4 and 8, one timed repeat")
    args = parser.parse_args(argv)
    try:
        depths = [4, 8] if args.quick else [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--depths must be integers, got {args.depths!r}")
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    for arch in archs:
        if arch not in ARCHS:
            parser.error(f"--archs entries must be among {', '.join(ARCHS)}, got {arch!r}")
    if "resnet" not in archs:
        archs.insert(0, "resnet")  # the baseline of every ratio
    if min(depths) < 1 or args.channels % 4 or args.size % 4 or args.batch < 1:
        parser.error("depths must be >= 1, --channels and --size divisible by 4, --batch >= 1")
    repeats = 1 if args.quick else args.repeats
    harness.set_threads(args.threads)

    rows = []
    for depth in depths:
        measured = {
            arch: measure(arch, depth, channels=args.channels, batch=args.batch, size=args.size) for arch in archs
        }
        if repeats > 0:
            timings = time_steps(measured, repeats)
            for arch, (row, _, _) in measured.items():
                row["ms_per_sample"] = 1e3 * timings[arch].median / args.batch
        baseline = None
        for arch, (row, _, _) in measured.items():
            baseline = baseline or row
            row["saved_vs_resnet"] = row["saved_bytes"] / baseline["saved_bytes"]
            row["time_vs_resnet"] = row["ms_per_sample"] / baseline["ms_per_sample"]
            rows.append(row)
            print(
                f"{arch:>9} depth {depth:3d}: {row['saved_bytes'] / 2**20:8.3f} MiB saved "
                f"({row['bytes_per_pixel']:7.1f} B/pixel, x{row['saved_vs_resnet']:.3f} of resnet), "
                f"backward peak {row['backward_peak_bytes'] / 2**20:7.3f} MiB, "
                f"{row['ms_per_sample']:7.2f} ms/sample (x{row['time_vs_resnet']:.2f})",
                file=sys.stderr,
            )
        del measured
    out = harness.write_csv(args.out, rows)
    print(f"\ninput {args.batch}x3x{args.size}x{args.size}, {args.channels} channels, pooling channel then batch")
    header = (
        f"{'arch':>9} {'depth':>5} {'params':>8} {'saved MiB':>10} {'B/pixel':>9} {'vs resnet':>9} "
        f"{'bwd peak MiB':>12} {'ms/sample':>9} {'time vs resnet':>14}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['arch']:>9} {row['depth']:>5} {row['parameters']:>8} {row['saved_bytes'] / 2**20:>10.3f} "
            f"{row['bytes_per_pixel']:>9.1f} {row['saved_vs_resnet']:>9.3f} "
            f"{row['backward_peak_bytes'] / 2**20:>12.3f} {row['ms_per_sample']:>9.2f} {row['time_vs_resnet']:>14.2f}"
        )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
