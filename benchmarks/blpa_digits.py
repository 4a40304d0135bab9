"""BLPA on a real small image set: a pre-activation ResNet trained on scikit-learn's digits (8x8, 10 classes).

Trains the same network (same initialization, same data order per seed) exactly, with BLPA at 8 and 4 bits, and
with the paper's naive 8-bit baseline (quantized activations also in the forward pass), and prints test accuracy
per mode (mean over seeds) and the difference to exact. Writes a CSV with one row per (mode, seed).

    python benchmarks/blpa_digits.py            # depth 38, 5 epochs, 1 seed, 4 modes: a few minutes on 2 cores
    python benchmarks/blpa_digits.py --full     # the docs' run: depth 38, 20 epochs, 5 seeds, 4 modes (~1 hour)
    python benchmarks/blpa_digits.py --quick    # smoke test: depth 11, 4 epochs, 1 seed

--depth, --epochs and --seeds given explicitly override the preset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fewbit_design.runtime import blpa

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this file, however this file is loaded
import harness  # noqa: E402

MODES = {  # name: (bits, naive)
    "exact": (None, False),
    "blpa-8bit": (8, False),
    "blpa-4bit": (4, False),
    "naive-8bit": (8, True),
    "naive-4bit": (4, True),
}
DEFAULT_MODES = ("exact", "blpa-8bit", "blpa-4bit", "naive-8bit")
COLUMNS = ("mode", "seed", "depth", "epochs", "accuracy", "final_train_loss", "seconds")
PRESETS = {  # name: (depth, epochs, seeds)
    "default": (38, 5, 1),
    "full": (38, 20, 5),
    "quick": (11, 4, 1),
}


def load_digits_split(seed: int = 0, test_fraction: float = 0.25):
    """Standardized digits as (N, 1, 8, 8) float32 tensors: train_x, train_y, test_x, test_y (stratified split)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    train_index, test_index = train_test_split(
        list(range(len(labels))), test_size=test_fraction, random_state=seed, stratify=labels.numpy()
    )
    train_x, test_x = images[train_index], images[test_index]
    mean, std = train_x.mean(), train_x.std()
    return (train_x - mean) / std, labels[train_index], (test_x - mean) / std, labels[test_index]


def train_and_evaluate(
    data, *, depth: int, bits, naive: bool, seed: int, epochs: int, width: int = 1, batch_size: int = 64, lr=0.1
) -> dict:
    """Train a preact_resnet from a seed-fixed initialization; return test accuracy (percent) and loss curve."""
    train_x, train_y, test_x, test_y = data
    torch.manual_seed(seed)
    model = blpa.preact_resnet(depth, num_classes=10, bits=bits, width=width, naive=naive, in_channels=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    steps_per_epoch = -(-len(train_y) // batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.15
    )
    order_generator = torch.Generator().manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for _ in range(epochs):
        model.train()
        permutation = torch.randperm(len(train_y), generator=order_generator)
        total = 0.0
        for step in range(steps_per_epoch):
            index = permutation[step * batch_size : (step + 1) * batch_size]
            if len(index) < 2:
                continue
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += float(loss.detach()) * len(index)
        losses.append(total / len(train_y))
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        predictions = model(test_x).argmax(dim=1)
    accuracy = 100.0 * float((predictions == test_y).float().mean())
    return {"accuracy": accuracy, "final_train_loss": losses[-1], "seconds": seconds, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=None, help="9n + 2 (default 38)")
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=None, help="default 5 (--full: 20, --quick: 4)")
    parser.add_argument("--seeds", type=int, default=None, help="default 1 (--full: 5)")
    parser.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help="comma-separated subset of " + ", ".join(MODES)
    )
    harness.add_options(
        parser,
        threads=1,
        out=None,
        help_texts={
            "threads": "torch threads (0: torch's default; 1 is robust on a busy machine)",
            "out": "default: results/blpa_digits.csv for --full, results/blpa_digits_<preset>.csv otherwise",
        },
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--full", action="store_true", help="the docs' run: depth 38, 20 epochs, 5 seeds")
    preset.add_argument("--quick", action="store_true", help="smoke test: depth 11, 4 epochs, 1 seed")
    args = parser.parse_args(argv)
    preset_name = "full" if args.full else "quick" if args.quick else "default"
    depth, epochs, seeds = PRESETS[preset_name]
    if args.out is None:
        suffix = "" if preset_name == "full" else f"_{preset_name}"
        args.out = harness.RESULTS / f"blpa_digits{suffix}.csv"
    args.depth = depth if args.depth is None else args.depth
    args.epochs = epochs if args.epochs is None else args.epochs
    args.seeds = seeds if args.seeds is None else args.seeds
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    harness.set_threads(args.threads)

    run_start, cpu_start = time.perf_counter(), time.process_time()
    data = load_digits_split(seed=0)
    print(
        f"digits: {len(data[1])} train / {len(data[3])} test images, preact_resnet depth {args.depth} width "
        f"{args.width}, {args.epochs} epochs, seeds 0..{args.seeds - 1}"
    )
    rows = []
    for mode in modes:
        bits, naive = MODES[mode]
        for seed in range(args.seeds):
            result = train_and_evaluate(
                data, depth=args.depth, bits=bits, naive=naive, seed=seed, epochs=args.epochs, width=args.width
            )
            rows.append(
                {
                    "mode": mode,
                    "seed": seed,
                    "depth": args.depth,
                    "epochs": args.epochs,
                    **{k: v for k, v in result.items() if k != "losses"},
                }
            )
            print(
                f"  {mode:<11} seed {seed}: test accuracy {result['accuracy']:6.2f}%  final train loss "
                f"{result['final_train_loss']:.4f}  ({result['seconds']:.1f} s)",
                flush=True,
            )
    out = harness.write_csv(args.out, rows, columns=COLUMNS)

    def mean_of(mode, key):
        return statistics.mean(r[key] for r in rows if r["mode"] == mode)

    exact = mean_of("exact", "accuracy") if "exact" in modes else None
    print(f"\n| mode | test accuracy (mean of {args.seeds}) | vs exact | final train loss | time vs exact |")
    print("|---|---|---|---|---|")
    for mode in modes:
        accuracy = mean_of(mode, "accuracy")
        delta = f"{accuracy - exact:+.2f}" if exact is not None else "-"
        ratio = f"{mean_of(mode, 'seconds') / mean_of('exact', 'seconds'):.2f}x" if exact is not None else "-"
        print(f"| {mode} | {accuracy:.2f}% | {delta} | {mean_of(mode, 'final_train_loss'):.4f} | {ratio} |")
    wall, cpu = time.perf_counter() - run_start, time.process_time() - cpu_start
    print(f"\nwrote {out}; the whole run took {wall:.0f} s wall, {cpu:.0f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
