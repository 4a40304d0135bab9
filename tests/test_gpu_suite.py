"""The GPU suite (scripts/gpu_suite.sh) on CPU: its benchmarks' dry runs (--tiny), the whole suite's --dry-run and the
script's own machinery (stage order, the time budget, files, exit status), so that none of it rots between the rare
runs on a GPU.

The benchmarks run in this process (their ``main``), on CPU with the Triton launchers interpreted (conftest.py sets
TRITON_INTERPRET=1); the numbers they print are meaningless here, so only what they write is checked.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_suite.sh"


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_gpu_speed_dry_run(tmp_path):
    out, figure = tmp_path / "speed.csv", tmp_path / "speed.png"
    assert benchmark("gpu_speed").main(["--tiny", "--out", str(out), "--figure", str(figure)]) == 0
    rows = read_csv(out)
    # gelu and relu at 1 and 3 bits, bfloat16, 2^8 and 2^10 elements, 3 bits first
    assert [(r["activation"], r["bits"], r["numel"]) for r in rows[:2]] == [("gelu", "3", "256"), ("gelu", "3", "1024")]
    assert len(rows) == 8 and {r["device"] for r in rows} == {"cpu"}
    for row in rows:
        for kind in ("forward", "backward", "forward+backward"):
            assert float(row[f"{kind}_ratio"]) > 0
        assert float(row["floor_ratio"]) == pytest.approx((4 * 2 + int(row["bits"]) / 4) / (5 * 2))
    assert figure.stat().st_size > 0


def test_gpu_offload_dry_run(tmp_path):
    out = tmp_path / "offload.csv"
    assert benchmark("gpu_offload").main(["--tiny", "--out", str(out)]) == 0
    rows = {row["mode"]: row for row in read_csv(out)}
    assert list(rows) == ["none", "save_on_cpu", "offload"]
    assert int(rows["offload"]["offloaded_tensors"]) > 0 and int(rows["none"]["offloaded_tensors"]) == 0
    assert float(rows["none"]["peak_ratio"]) == 1.0 and float(rows["offload"]["peak_gib"]) > 0
    assert all(float(row["step_s"]) > 0 for row in rows.values())


def test_planner_dry_run(tmp_path, one_torch_thread):
    out, figure = tmp_path / "planner.csv", tmp_path / "planner.png"
    benchmark("planner").main(["--tiny", "--threads", "1", "--csv", str(out), "--figure", str(figure)])
    rows = read_csv(out)
    assert {row["model"] for row in rows} == {"gpt2"} and {row["device"] for row in rows} == {"cpu"}
    assert sum(row["kind"] == "plan" for row in rows) == 5
    assert all(float(row["measured_peak_mib"]) > 0 for row in rows)
    assert all(math.isnan(float(row["cuda_peak_mib"])) for row in rows)  # no allocator figure without CUDA
    assert figure.stat().st_size > 0


def run_suite(*args: str, timeout: int = 120, **environment: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **environment)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def summary(done: subprocess.CompletedProcess) -> str:
    return done.stdout[done.stdout.index("=== gpu_suite summary") :]


def test_suite_usage_errors_exit_2(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    assert run_suite(str(tmp_path), "--fast").returncode == 2
    assert run_suite(str(tmp_path), str(tmp_path / "second"), "--dry-run").returncode == 2


@pytest.mark.skipif(sys.platform != "linux", reason="the suite runs on the Linux GPU machines")
def test_the_whole_dry_run_passes_within_its_budget_into_at_most_8_files(tmp_path):
    # `bash scripts/gpu_suite.sh --dry-run` as written: OUTDIR defaults to $OUT (the device tool's folder)
    done = run_suite("--dry-run", timeout=600, OUT=str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "budget 360s" in done.stdout
    stages = ["env", "kernels", "speed", "offload", "planner", "tests"]
    lines = [line.strip() for line in summary(done).splitlines()[1:] if ": " in line]
    assert [line.split(":")[0] for line in lines[: len(stages)]] == stages  # in the order of their value
    assert all(": ok (" in line for line in lines[: len(stages)]), lines
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(
        ["log.txt", "env.txt", "kernels.xml", "tests.xml", "gpu_speed.csv", "gpu_offload.csv", "gpu_planner.csv"]
        + ["more.tar.gz"]
    )
    with tarfile.open(tmp_path / "more.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["gpu_planner.png", "gpu_speed.png"]


def test_quick_runs_the_first_four_stages_within_3_minutes(tmp_path):
    done = run_suite(str(tmp_path), "--dry-run", "--quick", SUITE_STAGES="env")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "budget 180s" in done.stdout and "env: ok" in summary(done)
    # its stages (with no time to run them: the order and the choice only)
    planned = run_suite(str(tmp_path / "plan"), "--dry-run", "--quick", SUITE_BUDGET_S="5")
    assert "stages: env kernels speed offload\n" in planned.stdout


def test_no_stage_starts_once_the_budget_is_spent(tmp_path):
    # each stage gets at most the budget left less 5 s for stopping it: with 5 s in all, none starts
    done = run_suite(str(tmp_path), "--dry-run", SUITE_BUDGET_S="5")
    assert done.returncode == 1
    for stage in ("env", "kernels", "speed", "offload", "planner", "tests"):
        assert f"{stage}: not run (the 5s budget is spent)" in summary(done)


@pytest.mark.skipif(sys.platform != "linux", reason="the suite runs on the Linux GPU machines")
def test_suite_runs_its_stages_and_keeps_at_most_8_files(tmp_path):
    for name in ("stray-1.txt", "stray-2.txt"):  # what a stage might leave: bundled with the figures
        (tmp_path / name).write_text("x")
    done = run_suite(str(tmp_path), "--dry-run", SUITE_STAGES="env")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "env: ok" in summary(done) and "tests: not run (SUITE_STAGES)" in summary(done)
    assert "device: none" in (tmp_path / "env.txt").read_text()
    assert (tmp_path / "log.txt").read_text() == done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.txt", "log.txt", "more.tar.gz"]
    with tarfile.open(tmp_path / "more.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["stray-1.txt", "stray-2.txt"]


def test_suite_without_cuda_and_without_dry_run_stops_with_one_line(tmp_path):
    done = run_suite(str(tmp_path))
    assert done.returncode == 2
    assert "no CUDA device" in done.stdout and "--dry-run" in done.stdout
