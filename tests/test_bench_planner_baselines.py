"""benchmarks/planner_baselines.py: its quick mode runs every baseline and the planner's sweep and writes
what it promises (the timings it prints are meaningless under test: only structure is checked), and its target
checks decide right on rows given by hand."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


KINDS = {"eager", "hf-checkpoint", "save_on_cpu", "compiled", "single", "plan", "plan-compiled"}


def test_quick_run_through_planner_py(tmp_path, one_torch_thread):
    out, figure = tmp_path / "baselines.csv", tmp_path / "baselines.png"
    argv = ["--baselines", "--quick", "--models", "llama", "--out", str(out), "--figure", str(figure)]
    load("planner").main(argv)
    harness = load("harness")
    rows = harness.read_csv(out)
    assert {row["kind"] for row in rows} == KINDS
    assert not [row["note"] for row in rows if row["note"]]  # no baseline or plan failed
    by_config = {row["config"]: row for row in rows}
    eager = by_config["eager"]
    assert float(eager["peak_vs_eager"]) == 1.0 and float(eager["activation_reduction"]) == 1.0
    # on CPU save_on_cpu keeps the saved tensors where they are: eager's peak, exactly
    assert float(by_config["save_on_cpu"]["peak_mib"]) == float(eager["peak_mib"])
    assert float(by_config["hf checkpointing"]["activation_mib"]) < float(eager["activation_mib"])
    for row in rows:
        assert 0 < float(row["activation_mib"]) < float(row["peak_mib"])  # parameters, gradients, Adam's state
        assert float(row["step_ms"]) > 0 and float(row["step_vs_eager_q1"]) <= float(row["step_vs_eager_q3"])
    assert figure.stat().st_size > 0


def row(config, kind, peak, step, activation_reduction=1.0, spread=0.0):
    return {
        "model": "m", "config": config, "kind": kind, "peak_mib": peak, "activation_mib": 100.0 / activation_reduction,
        "activation_reduction": activation_reduction, "step_ms": step, "step_vs_eager": step,
        "step_vs_eager_q1": step - spread, "step_vs_eager_q3": step + spread,
    }  # fmt: skip


@pytest.fixture(scope="module")
def target_checks():
    return load("planner_baselines").target_checks


def test_target_checks_hold_and_name_the_row(target_checks):
    rows = [
        row("eager", "eager", 100.0, 1.0),
        row("hf checkpointing", "hf-checkpoint", 30.0, 1.3, 3.5),
        row("compiled amb=0.5", "compiled", 60.0, 0.9, 2.0),
        row("plan /3", "plan", 35.0, 0.99, 3.2),
        row("plan /6", "plan", 25.0, 1.08, 6.0),
        row("plan /3 compiled", "plan-compiled", 40.0, 0.85, 3.0),
    ]
    lines = target_checks(rows)
    assert lines[0].startswith("m: >= 5x less activation memory at <= 1.10x step time: holds (plan /6: 6.00x")
    assert lines[1].startswith("m: >= 3x less activation memory at <= 1.00x step time: holds (plan /3 compiled")
    assert "hf checkpointing's peak (30.00 MiB) at least as fast: holds (plan /6" in lines[2]
    assert "compiled amb=0.5's peak (60.00 MiB) at least as fast: holds (plan /3 compiled" in lines[3]


def test_target_checks_say_why_one_does_not_hold(target_checks):
    rows = [
        row("eager", "eager", 100.0, 1.0),
        row("hf checkpointing", "hf-checkpoint", 20.0, 1.3, 5.0),
        row("compiled amb=0.5", "compiled", 60.0, 0.9, 2.0),
        row("plan /3", "plan", 35.0, 1.05, 3.2),
        row("plan /3 compiled", "plan-compiled", 50.0, 0.95, 2.9, spread=0.1),
        row("broken", "plan", math.nan, math.nan),
    ]
    lines = target_checks(rows)
    assert lines[0].endswith("DOES NOT HOLD: no plan reaches 5x (largest 3.20x)")
    assert lines[1].endswith("DOES NOT HOLD: the fastest plan reaching 3x takes 1.050x")  # the compiled plan: 2.9x
    assert lines[2].endswith("DOES NOT HOLD: no plan reaches that peak (smallest 35.00 MiB)")
    expected = "at least as fast: DOES NOT HOLD (plan /3 compiled: 50.00 MiB at 0.950x against 0.900x; within the"
    assert expected in lines[3]
