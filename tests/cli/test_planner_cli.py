"""``fewbit-design memory MODULE:FACTORY``: report, saved plan that loads back identical, figure, one-line errors."""

from __future__ import annotations

import pytest

from fewbit_design.cli import main
from fewbit_design.runtime.planner import load_plan

FACTORY = """
import torch

def mlp():
    torch.manual_seed(0)
    nn = torch.nn
    blocks = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(3)]
    return torch.nn.Sequential(*blocks)

def not_a_model():
    return 3

def broken():
    raise RuntimeError("no weights here")
"""


@pytest.fixture
def factory(tmp_path, monkeypatch):
    name = f"planner_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    return name


def _run(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_memory_command_plans_saves_and_plots(factory, tmp_path, capsys):
    plan_path, figure = tmp_path / "plan.json", tmp_path / "plan.png"
    args = ["memory", f"{factory}:mlp", "--input-shape", "128,32", "--budget", "0.8", "--measure"]
    code, out, err = _run(args + ["--save", str(plan_path), "--plot", str(figure)], capsys)
    assert code == 0, err
    assert "predicted peak" in out and "measured peak" in out and "reversible" in out
    plan = load_plan(plan_path)
    assert plan.to_json() == plan_path.read_text()
    assert load_plan(plan_path) == plan
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = _run(args + ["--save", str(plan_path)], capsys)  # exists, no --force
    assert code == 2 and "exists" in err
    assert plan.settings["approximate"] == "if-needed"


def test_memory_command_passes_the_approximate_rule(factory, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    args = ["memory", f"{factory}:mlp", "--input-shape", "128,32", "--budget", "min", "--approximate", "allowed"]
    code, out, err = _run(args + ["--save", str(plan_path)], capsys)
    assert code == 0, err
    assert load_plan(plan_path).settings["approximate"] == "allowed"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{m}:missing", "--input-shape", "4,32"], "has no callable 'missing'"),
        (["{m}", "--input-shape", "4,32"], "MODULE:FUNCTION"),
        (["no_such_module_xyz:f", "--input-shape", "4,32"], "cannot import"),
        (["{m}:not_a_model", "--input-shape", "4,32"], "must return a torch.nn.Module"),
        (["{m}:broken", "--input-shape", "4,32"], "raised RuntimeError: no weights here"),
        (["{m}:mlp", "--input-shape", "4,0"], "--input-shape"),
        (["{m}:mlp", "--input-shape", "4,32", "--allow", "fewbit,magic"], "--allow"),
        (["{m}:mlp", "--input-shape", "4,32", "--budget", "lots"], "budget"),
        (["{m}:mlp", "--input-shape", "4,32", "--plot", "x.gif"], "--plot"),
        (["{m}:mlp", "--input-shape", "4,32", "--approximate", "always"], "--approximate"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(factory, capsys, args, message):
    code, _, err = _run(["memory"] + [a.format(m=factory) for a in args], capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1, err
