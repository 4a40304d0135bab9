"""Where offload's step-time cost goes on the planner benchmark models: eager against offload of every
block, synchronous (the planner's default, ``prefetch=0``) and with transfers on the target's thread (``prefetch``
1 and 2, ``blockwise`` as under the planner).

Per row: the median step time (forward + backward, one torch thread) with its quartiles and the median of per-round
ratios against eager, by two clocks in two interleaved passes:

* ``wall``: ``time.perf_counter``, what training sees; on a loaded machine it also measures the load;
* ``thread``: ``time.thread_time`` of the training thread, which other processes do not inflate: what the step
  costs the training thread itself. On a machine with a free core, transfers on the thread approach it in wall
  time; where they do not lower it, handing the copies to a thread cannot pay.

and, from ``getrusage`` over a few more steps, the process's minor page faults and system CPU per step (the kernel
copies of ``pwrite``/``preadv`` are system time).

    python benchmarks/offload_overhead.py --quick          # tiny models (seconds; writes to the temp folder)
    python benchmarks/offload_overhead.py                  # the 12-layer LLaMA- and GPT-2-style models of
                                                           # planner_baselines.py (a few minutes)

Writes ``benchmarks/results/offload_overhead.csv``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # fewbit_design from this checkout; harness.py beside this file

import harness  # noqa: E402
import planner_baselines  # noqa: E402

from fewbit_design.runtime import offload  # noqa: E402

VARIANTS = {
    "eager": None,
    "offload sync (planner default)": {"prefetch": 0},
    "offload prefetch 1 blockwise": {"prefetch": 1},
    "offload prefetch 2 blockwise": {"prefetch": 2},
}
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def build(model_name: str, shape: tuple[int, ...], options: dict | None, min_bytes: int) -> torch.nn.Module:
    model = planner_baselines.build(model_name, shape, torch.float32)
    if options is not None:
        blocks = list(model.model.layers) if model_name == "llama" else list(model.transformer.h)
        offload.apply(model, blocks, min_bytes=min_bytes, blockwise=True, **options)
    return model


def run_model(model_name: str, args) -> list[dict]:
    shape = planner_baselines.SHAPES[args.mode]
    data = planner_baselines.batches(shape, count=4)
    models = {name: build(model_name, shape, options, args.min_bytes) for name, options in VARIANTS.items()}
    position = [0]

    def step(model: torch.nn.Module) -> None:
        ids = data[position[0] % len(data)]
        position[0] += 1
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    rows = {name: {"model": model_name, "config": name} for name in models}
    for clock_name, clock in CLOCKS.items():
        calls = {name: (lambda model=model: step(model)) for name, model in models.items()}
        timings = harness.measure(calls, repeats=args.repeats, warmup=2, alternate=True, clock=clock, baseline="eager")
        reference = timings["eager"].samples
        for name in models:
            timing = timings[name]
            ratios = [t / r for t, r in zip(timing.samples, reference, strict=True)]
            low, high = harness.Timing(tuple(ratios)).quartiles
            rows[name].update({
                f"{clock_name}_ms": timing.median * 1e3,
                f"{clock_name}_vs_eager": statistics.median(ratios),
                f"{clock_name}_vs_eager_q1": low,
                f"{clock_name}_vs_eager_q3": high,
            })  # fmt: skip
    for name, model in models.items():
        steps = max(2, args.repeats // 2)
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(steps):
            step(model)
        after = resource.getrusage(resource.RUSAGE_SELF)
        rows[name].update(
            minor_faults_per_step=(after.ru_minflt - before.ru_minflt) / steps,
            system_ms_per_step=(after.ru_stime - before.ru_stime) / steps * 1e3,
            user_ms_per_step=(after.ru_utime - before.ru_utime) / steps * 1e3,
        )
    for row in rows.values():
        print(f"[{model_name}] {row['config']:<32} wall {row['wall_ms']:7.1f} ms ({row['wall_vs_eager']:.3f}x, "
              f"quartiles {row['wall_vs_eager_q1']:.3f}-{row['wall_vs_eager_q3']:.3f}); training thread "
              f"{row['thread_ms']:7.1f} ms ({row['thread_vs_eager']:.3f}x, quartiles {row['thread_vs_eager_q1']:.3f}-"
              f"{row['thread_vs_eager_q3']:.3f}); faults {row['minor_faults_per_step']:.0f}/step, system "
              f"{row['system_ms_per_step']:.1f} ms, user {row['user_ms_per_step']:.1f} ms per step")  # fmt: skip
    return list(rows.values())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps: seconds (writes to temp)")
    parser.add_argument("--models", default="llama,gpt2", help="comma-separated, of llama and gpt2")
    parser.add_argument("--min-bytes", type=int, default=None, help="offload's min_bytes (default 64 KiB; quick 0)")
    harness.add_options(parser, out=None, repeats=None, threads=1)
    args = parser.parse_args(argv)
    args.mode = "quick" if args.quick else "full"
    args.repeats = args.repeats or (2 if args.quick else 12)
    args.min_bytes = args.min_bytes if args.min_bytes is not None else (0 if args.quick else 1 << 16)
    if args.quick:
        args.out = args.out or harness.scratch("offload_overhead-quick.csv")
    args.out = Path(args.out or harness.RESULTS / "offload_overhead.csv")
    harness.set_threads(args.threads)
    print(f"offload overhead: {args.mode} shapes {planner_baselines.SHAPES[args.mode]}, min_bytes {args.min_bytes}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}")  # fmt: skip
    rows = []
    for model_name in (m.strip() for m in args.models.split(",")):
        if model_name not in ("llama", "gpt2"):
            parser.error(f"--models: unknown model {model_name!r} (llama, gpt2)")
        rows += run_model(model_name, args)
        harness.write_csv(args.out, rows, float_format=".4g")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
