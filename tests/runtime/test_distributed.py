"""Converted models train under DistributedDataParallel and FSDP2: ``torchrun --nproc-per-node 2`` on CPU (gloo).

One launch of ``tests/runtime/distributed/train_step.py`` runs every (technique, wrapper) case and writes a JSON
record per case; each test here checks one record: the gradients after one step equal the single-process model's on
the concatenated batch (float64; the tolerance and why are in the script's docstring).
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
CASES = ("plain", "fewbit", "blpa", "checkpoint", "offload", "plan")
WRAPPERS = ("ddp", "fsdp2")
RELATIVE, ABSOLUTE = 1e-10, 1e-12

# Known failures, skipped with the exact error they raise (any other outcome fails the test).
KNOWN = {
    "blpa-fsdp2": "RuntimeError: Trying to resize storage that is not resizable",
    "offload-fsdp2": "RuntimeError: Attempted to access the data pointer on an invalid python storage.",
}


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
        if KNOWN.get(key) == record["message"]:
            pytest.skip(f"{key}: {record['message']} (known; see docs/techniques/planner.md, Distributed training)")
        raise AssertionError(f"{key}: {record['message']}\n{record.get('traceback', '')}")
    assert record["errors"], f"{key}: no gradients compared"
    for name, error in record["errors"].items():
        assert error["scale"] > 0, f"{key}: gradient of {name} is zero: the check would be empty"
        bound = RELATIVE * error["scale"] + ABSOLUTE
        assert error["max_abs"] <= bound, f"{key}: {name} differs by {error['max_abs']:.3g} > {bound:.3g}"
    if case == "fewbit":  # the few-bit gradients are really the approximate ones, not the exact ones
        assert record["differs_from_exact"] is True
    if case == "plan":  # the plan converted something
        assert record["how"] != "plan_memory: ", record["how"]
