"""Process RSS beside live tensor bytes: a planned GPT-2 training step, on CPU.

For each variant, in a fresh process of its own (RSS depends on what the process did before), a small GPT-2
(``benchmarks/planner.py``'s model) is planned at its smallest feasible peak, the plan applied, ``--warmup``
steps run, and then ``--steps`` steps measured one by one under ``memory.peak``: ``live`` is the peak of live
tensor bytes the step allocated (what the planner predicts), ``rss`` the process's peak RSS during the step above
its RSS before it (``memory.peak``'s ``rss_peak_bytes``, Linux: with the allocator's cache warm from the steps
before), and ``rss_total`` the process's peak RSS over all the steps (warm-up included) above its RSS just before
the first step, after planning (its garbage collected and returned to the system with glibc's ``malloc_trim``):
what training costs the process beyond the model, the plan and the code. Variants:

* ``unconverted``: no plan (planned all the same, so that every process ran the same profiling first);
* ``exact``: checkpointing and offloading (exact gradients), offload packing small tensors (``pack_bytes``);
* ``exact-unpooled``: the same with offload's staging buffers freed after every step (what a fresh allocation
  per step costs: the "before" of the staging pool);
* ``fewbit``: the plan may use few-bit and BLPA too;
* ``unconverted+mmap``, ``exact+mmap``: the same, with glibc told to serve blocks from 64 KiB up with their own
  mappings and to give freed memory back at once (``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``), so that
  RSS follows the live bytes; ``seconds`` shows what that costs in step time (page faults).

Each child also times ``--steps`` steps without the instrument (``seconds``, wall clock, one torch thread). The
variants run in turn, ``--rounds`` times (A B C ... A B C ...), and the step-time ratio is the median over rounds of
the ratio against ``unconverted`` of the same round. Prints per variant the medians over steps and the ratios
against ``unconverted``; writes a CSV. ``--quick`` runs a
dry run in seconds (tiny model, one step); the full mode is the CPU default shape. The machine may be loaded: RSS
is not a timing, but allocator behaviour under other processes' pressure is not controlled either.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import harness  # noqa: E402

VARIANTS = ("unconverted", "exact", "exact-unpooled", "fewbit", "unconverted+mmap", "exact+mmap")
MMAP_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
MIB = 2.0**20


def _status_bytes(name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} in /proc/self/status")


def child(variant: str, shape: str, warmup: int, steps: int) -> dict:
    import time

    import torch

    torch.set_num_threads(1)
    from planner import GPT2_SHAPES, gpt2

    from fewbit_design.runtime import memory, planner
    from fewbit_design.runtime.offload import session

    _, _, _, context, batch = GPT2_SHAPES[shape]
    ids = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(1))
    model = gpt2(0, shape)
    variant = variant.split("+")[0]  # (+mmap: the environment differs, not the code)
    allow = ("checkpoint", "offload") if variant != "fewbit" else planner.TECHNIQUES
    plan = planner.plan_memory(  # (unconverted too: profiling warms the process the same way; its plan is unused)
        model,
        ids,
        objective="memory",
        allow=allow,
        approximate="allowed",
        offload_min_bytes=0,
        offload_pack_bytes=1 << 20,
        repeats=1,
    )
    if variant != "unconverted":
        model = plan.apply(gpt2(0, shape))
    if variant == "exact-unpooled":
        release = session.Staging.release

        def release_and_free(self, lease):  # the buffer is dropped: the next step allocates a fresh one
            release(self, lease)
            self.trim()

        session.Staging.release = release_and_free
    parameters = list(model.parameters())
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what planning freed goes back to the system
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
        clear_refs.write("5")  # the high-water mark restarts from here
    rss_before_steps = _status_bytes("VmRSS")

    def step():
        for parameter in parameters:
            parameter.grad = None
        model(ids).backward()

    for _ in range(warmup):
        step()
    rows, high = [], 0
    for _ in range(steps):
        high = max(high, _status_bytes("VmHWM"))  # (memory.peak resets the mark at entry: read it first)
        with memory.peak(model, ids) as measured:
            step()
        high = max(high, _status_bytes("VmHWM"))
        rows.append({"live": measured.peak_bytes, "rss": measured.rss_peak_bytes})
    for row in rows:
        row["rss_total"] = high - rss_before_steps
    for row in rows:
        start = time.perf_counter()
        step()
        row["seconds"] = time.perf_counter() - start
    return {"variant": variant, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a dry run in seconds (tiny model, one step)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per variant (default 5; quick 1)")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over the variants (default 3; quick 1)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    harness.add_options(parser, out=None)
    args = parser.parse_args()
    shape = "tiny" if args.quick else "small"
    steps = args.steps or (1 if args.quick else 5)
    if args.child is not None:
        print(json.dumps(child(args.child, shape, args.warmup, steps)))
        return
    out = args.out or (harness.scratch("rss.csv") if args.quick else harness.RESULTS / "rss.csv")
    rounds = args.rounds or (1 if args.quick else 3)
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    time_ratios: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):
        seconds = {}
        for variant in VARIANTS:  # one process each: RSS depends on the process's history
            command = [sys.executable, __file__, "--child", variant, "--steps", str(steps)]
            command += ["--warmup", str(args.warmup)] + (["--quick"] if args.quick else [])
            environment = {**os.environ, **(MMAP_ENVIRONMENT if variant.endswith("+mmap") else {})}
            output = subprocess.run(command, check=True, capture_output=True, text=True, env=environment).stdout
            measured = json.loads(output.strip().splitlines()[-1])["steps"]
            results[variant] += measured
            seconds[variant] = statistics.median(r["seconds"] for r in measured)
        for variant in VARIANTS:
            time_ratios[variant].append(seconds[variant] / seconds["unconverted"])
    rows = []
    keys = ("live", "rss", "rss_total", "seconds")
    base = {key: statistics.median(r[key] for r in results["unconverted"]) for key in keys}
    print(f"rss: GPT-2 shape {shape}, {rounds} rounds of {steps} steps after {args.warmup} warm-up steps, medians")
    print(
        f"{'variant':<18} {'live MiB':>9} {'rss MiB':>8} {'rss_total MiB':>14} {'live x':>7} {'rss x':>7} {'time x':>7}"
    )
    for variant, steps_measured in results.items():
        row = {"variant": variant, "shape": shape}
        for key in keys:
            row[key + ("" if key == "seconds" else "_bytes")] = statistics.median(r[key] for r in steps_measured)
        row["live_reduction"] = base["live"] / max(row["live_bytes"], 1)
        row["rss_reduction"] = base["rss_total"] / max(row["rss_total_bytes"], 1)
        row["time_ratio"] = statistics.median(time_ratios[variant])
        row["time_ratio_min"], row["time_ratio_max"] = min(time_ratios[variant]), max(time_ratios[variant])
        rows.append(row)
        print(
            f"{variant:<18} {row['live_bytes'] / MIB:9.2f} {row['rss_bytes'] / MIB:8.2f} "
            f"{row['rss_total_bytes'] / MIB:14.2f} {row['live_reduction']:7.2f} {row['rss_reduction']:7.2f} "
            f"{row['time_ratio']:7.2f}"
        )
    harness.write_csv(out, rows, float_format=".6g")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
