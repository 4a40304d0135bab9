"""Converted models train under DistributedDataParallel and FSDP2: ``torchrun --nproc-per-node 2`` on CPU (gloo).

One launch of ``tests/runtime/distributed/train_step.py`` runs every (technique, wrapper) case and writes a JSON
record per case; each test here checks one record: the gradients after one step equal the single-process model's on
the concatenated batch (float64; the tolerance and why are in the script's docstring), or are close to them for the
technique that rounds stochastically. Every technique the planner can choose on the script's models has a
``plan-<technique>`` case (a plan that uses it), and the ones it cannot choose (the LM head, the compressed attention
core) are converted directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "distributed" / "train_step.py"
#: the techniques the planner can choose on the script's models (each gets a plan case)
PLANNED = ("norms", "gated", "exact_attention", "blpa", "dropout", "fewbit", "linear", "offload", "checkpoint")
CASES = ("plain", "fewbit", "blpa", "checkpoint", "offload", "plan", "head", "attention")
CASES += tuple(f"plan-{t}" for t in PLANNED)
WRAPPERS = ("ddp", "fsdp2")
RELATIVE, ABSOLUTE = 1e-10, 1e-12
#: compressed linear inputs round stochastically (8-bit group codes; the processes draw different random numbers),
#: so the weight gradients are close, not equal: measured 0.9% of their largest magnitude (float64, batch 8 x 16)
CLOSE = {"plan-linear": 0.05}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    if not Path(torchrun).exists():
        pytest.skip("torchrun is not installed beside this Python")
    out = tmp_path_factory.mktemp("distributed") / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    command = [
        torchrun,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        str(SCRIPT),
        str(out),
        ",".join(CASES),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    if completed.returncode != 0 or not out.exists():
        raise AssertionError(f"torchrun failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("case", CASES)
def test_one_step_matches_single_process(results, case, wrapper):
    assert results["world_size"] == 2
    key = f"{case}-{wrapper}"
    record = results["cases"][key]
    if record["status"] != "ok":
        raise AssertionError(f"{key}: {record['message']}\n{record.get('traceback', '')}")
    assert record["errors"], f"{key}: no gradients compared"
    relative = CLOSE.get(case, RELATIVE)
    for name, error in record["errors"].items():
        assert error["scale"] > 0, f"{key}: gradient of {name} is zero: the check would be empty"
        bound = relative * error["scale"] + ABSOLUTE
        assert error["max_abs"] <= bound, f"{key}: {name} differs by {error['max_abs']:.3g} > {bound:.3g}"
    if case in ("fewbit", "blpa", "attention") or case in CLOSE:
        assert record["approximate"] is True, key
    if record["approximate"]:  # the approximate gradients are really the approximate ones, not the exact ones
        assert record["differs_from_exact"] is True, key
    if case == "plan":  # the plan converted something
        assert record["how"] != "plan_memory: ", record["how"]
    if case.startswith("plan-"):  # the plan uses its technique on some block
        technique = case.removeprefix("plan-")
        choices = record["how"].split(": ", 1)[1].split(", ")
        assert any(technique in choice.split("+") for choice in choices), record["how"]


def test_every_technique_the_planner_can_choose_has_a_case(results):
    """A newly registered technique that the planner can choose on the script's models fails here until it gets a
    ``plan-<technique>`` case; one it can choose nowhere needs a case of its own (the head: converted directly)."""
    choosable = results["choosable"]
    assert {name for name, kind in choosable.items() if kind is not None} == set(PLANNED)
    assert {name for name, kind in choosable.items() if kind is None} <= set(CASES)
