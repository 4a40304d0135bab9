"""Disk offloading on CPU: peak memory and step time against no offload and synchronous copies, in one run.

For each model, three modes run the same training step (forward + backward, then the gradients are dropped):

* ``none``: no offloading (the baseline of every ratio);
* ``sync``: ``offload.saved_tensors(target="disk", prefetch=0)``: every saved tensor is written in its pack hook
  and read back in its unpack hook, with no overlap (``torch.autograd.graph.save_on_cpu``-style synchronous copies;
  ``save_on_cpu`` itself is a no-op for CPU tensors);
* ``offload``: ``offload.saved_tensors(target="disk", prefetch=2)``: writes behind forward and reads ahead of
  backward on a background thread.

Peak: ``memory.peak(model, x)``: the largest bytes of live tensors (parameters, input and everything allocated in
the step, forward and backward) in one step. Beside it, the growth of the process's resident memory during that
step (peak VmHWM, reset before the step, minus VmRSS at its start; the page cache that holds the file is not
resident memory of the process).
Time: median of the timed steps, the modes interleaved (the peak is measured in a separate step, since the
instrument slows operators). Ratios are against ``none`` from the same run.

    python benchmarks/offload.py            # --quick: MLP chain with 256 MiB of saved activations + small CNN
    python benchmarks/offload.py --full     # MLP chain with >= 1 GiB of saved activations + small CNN
    python benchmarks/offload.py --tiny     # a dry run: 4 layers, small inputs, one step, 8 MiB disk probe; temp CSV

Writes benchmarks/results/offload.csv (``--quick`` writes offload-quick.csv).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # fewbit_design from this checkout; harness.py beside this file

import harness  # noqa: E402

from fewbit_design.runtime import memory, offload  # noqa: E402

MiB = 1 << 20


def mlp_chain(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def small_cnn(channels: int) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, channels),
        *block(channels, channels),
        nn.MaxPool2d(2),
        *block(channels, 2 * channels),
        *block(2 * channels, 2 * channels),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, 10),
    )


def vm_hwm_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def disk_bandwidth(directory: str, nbytes: int = 256 * MiB, chunk: int = 32 * MiB) -> tuple[float, float]:
    """Write and read back ``nbytes`` in ``chunk`` pieces with os.pwrite / os.preadv (as the disk target does)."""
    fd, path = tempfile.mkstemp(dir=directory)
    os.unlink(path)
    data = torch.randint(0, 256, (chunk,), dtype=torch.uint8).numpy()
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pwrite(fd, memoryview(data), offset)
        middle = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.preadv(fd, [memoryview(data)], offset)
        end = time.perf_counter()
    finally:
        os.close(fd)
    return nbytes / (middle - start) / 1e9, nbytes / (end - middle) / 1e9


def step(model: nn.Module, x: torch.Tensor, mode: str, directory: str) -> offload.Stats | None:
    if mode == "none":
        model(x).float().square().mean().backward()
        stats = None
    else:
        prefetch = 0 if mode == "sync" else 2
        with offload.saved_tensors(target="disk", prefetch=prefetch, directory=directory) as stats:
            loss = model(x).float().square().mean()
        loss.backward()
        del loss
    for parameter in model.parameters():
        parameter.grad = None
    return stats


def measure(name: str, model: nn.Module, x: torch.Tensor, steps: int, directory: str) -> list[dict]:
    with memory.saved_bytes(model) as saved:
        model(x).float().square().mean()
    mib = saved.total / MiB
    print(f"\n{name}: input {tuple(x.shape)}, {mib:.0f} MiB saved for backward in {saved.tensors} storages")
    modes = ("none", "sync", "offload")
    offloaded: dict[str, offload.Stats | None] = {}
    # one warm-up step per mode, then the modes interleaved, so that a slow spell of the shared machine hits them all
    timings = harness.measure(
        {mode: lambda mode=mode: step(model, x, mode, directory) for mode in modes},
        repeats=steps,
        baseline="none",
        after=offloaded.__setitem__,
    )
    rows = []
    for mode in modes:
        has_hwm = vm_hwm_reset()
        rss_entry = status_mib("VmRSS")
        with memory.peak(model, x) as peak:
            step(model, x, mode, directory)
        stats = offloaded[mode]
        rows.append(
            {
                "model": name,
                "mode": mode,
                "saved_mib": round(saved.total / MiB, 1),
                "offloaded_mib": round(stats.bytes / MiB, 1) if stats else 0.0,
                "offloaded_tensors": stats.tensors if stats else 0,
                "peak_mib": round(peak.max_bytes / MiB, 1),
                "rss_step_mib": round(status_mib("VmHWM") - rss_entry, 1) if has_hwm else "",
                "step_s": round(timings[mode].median, 3),
                "step_s_all": " ".join(f"{t:.2f}" for t in timings[mode].samples),
            }
        )
    base = rows[0]
    for row in rows:
        row["peak_ratio"] = round(row["peak_mib"] / base["peak_mib"], 3)
        row["time_ratio"] = round(row["step_s"] / base["step_s"], 3)
        print(
            f"  {row['mode']:8s} peak {row['peak_mib']:8.1f} MiB (x{row['peak_ratio']:.3f})  "
            f"rss +{row['rss_step_mib']} MiB  step {row['step_s']:.3f} s (x{row['time_ratio']:.3f})  "
            f"offloaded {row['offloaded_mib']} MiB in {row['offloaded_tensors']} tensors"
        )
    sync, none = rows[1], rows[0]
    extra = sync["step_s"] - none["step_s"]
    if extra > 0 and sync["offloaded_mib"]:
        print(f"  synchronous disk round trip: {2 * sync['offloaded_mib'] * MiB / extra / 1e9:.2f} GB/s effective")
    return rows


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # a fixed mmap threshold makes glibc return every large block to the system when it is freed, so that the
        # process's peak resident memory (VmHWM) follows the live tensors instead of the allocator's free lists
        environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
        os.execve(sys.executable, [sys.executable, *sys.argv], environment)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="256 MiB of saved activations (default)")
    size.add_argument("--full", action="store_true", help=">= 1 GiB of saved activations")
    size.add_argument("--tiny", "--dry-run", action="store_true", help="a dry run: tiny inputs, one step, temp CSV")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (median)")
    harness.add_options(
        parser,
        threads=2,
        out=None,
        help_texts={"threads": "torch threads", "out": "output CSV (default: benchmarks/results/offload[-quick].csv)"},
    )
    parser.add_argument("--directory", default=None, help="folder of the offload files (default: temp folder)")
    args = parser.parse_args()
    harness.set_threads(args.threads)
    torch.manual_seed(0)
    directory = args.directory or tempfile.gettempdir()
    batch = 65536 if args.full else 2048 if args.tiny else 16384  # MLP: 32 / 8 / 1 MiB per activation, width 128
    depth, images = (4, (4, 3, 64, 64)) if args.tiny else (32, (32, 3, 64, 64))
    probe = 8 * MiB if args.tiny else 256 * MiB
    steps = 1 if args.tiny else args.steps
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} cores, offload folder {directory}")
    write, read = disk_bandwidth(directory, probe, min(probe, 32 * MiB))
    print(f"disk: pwrite {write:.2f} GB/s, preadv {read:.2f} GB/s ({probe // MiB} MiB, page cache)")
    rows = measure("mlp-chain", mlp_chain(128, depth), torch.randn(batch, 128), steps, directory)
    rows += measure("small-cnn", small_cnn(32), torch.randn(*images), steps, directory)
    if args.out is None:  # a dry run never overwrites measured results
        name = "offload.csv" if args.full else "offload-quick.csv"
        args.out = harness.scratch("offload-tiny.csv") if args.tiny else harness.RESULTS / name
    out = harness.write_csv(args.out, rows)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
