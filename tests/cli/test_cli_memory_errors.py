"""``fewbit-design memory``: every bad model, input or output is one line on stderr and exit status 2,
checked before the model is profiled."""

from __future__ import annotations

import sys

import pytest

from fewbit_design.cli import main

MODELS = """
import sys
import torch

def mlp():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

def embedding():
    return torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 16), torch.nn.GELU())

def exits():
    sys.exit(3)

def exits_quietly():
    sys.exit()
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    name = f"memory_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODELS)
    (tmp_path / f"{name}_broken.py").write_text("raise ValueError('no such layer')\n")
    (tmp_path / f"{name}_exits.py").write_text("import sys\nsys.exit('bye')\n")
    monkeypatch.chdir(tmp_path)
    yield name
    for module in (name, f"{name}_broken", f"{name}_exits"):
        sys.modules.pop(module, None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{m}:mlp", "--input-shape", "4,31"],
         "model '{m}:mlp' cannot run on the example inputs (4x31, random floats): RuntimeError: mat1 and mat2 shapes"),
        (["{m}:embedding", "--input-shape", "4,8", "--vocab", "1000"],
         "IndexError: index out of range in self; --vocab 1000 is beyond the model's embedding of 100 rows"),
        (["{m}:mlp", "--input-shape", "1000000000000,32"], "GiB, more than this machine's"),
        (["{m}:mlp", "--input-shape", "99999999999999999999999,32"], "has more than 2**62 elements"),
        (["{m}:embedding", "--input-shape", "4,8", "--vocab", "99999999999999999999"], "--vocab must be a positive"),
        (["{m}:mlp", "--input-shape", "4,32", "--save", "p" * 300 + ".json"], "has a name of 305 bytes"),
        (["{m}:exits", "--input-shape", "4,32"], "model factory '{m}:exits' called sys.exit(3) instead of returning"),
        (["{m}:exits_quietly", "--input-shape", "4,32"], "called sys.exit(None) instead of returning a model"),
        (["{m}_broken:f", "--input-shape", "4,32"],
         "importing model factory module '{m}_broken' failed: raised ValueError: no such layer"),
        (["{m}_exits:f", "--input-shape", "4,32"], "importing model factory module '{m}_exits' failed: called sys"),
    ],
    ids=["shape", "vocab", "huge", "beyond-int64", "vocab-int64", "long-name", "exit", "exit-none", "import",
         "import-exit"],
)  # fmt: skip
def test_memory_bad_input_is_one_line_and_exit_2(models, capsys, tmp_path, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["memory"] + [a.format(m=models) for a in args])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("fewbit-design: error: ")
    assert message.format(m=models) in captured.err
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".py") and p.name != "__pycache__") == []


@pytest.mark.parametrize(
    "arguments", [["mod:f", "--input-shape", "2,3"], ["--hf-config", "llama-3-8b", "--seq", "128"]]
)
def test_memory_without_torch_is_one_line_naming_the_install(tmp_path, arguments):
    """In an environment without torch (a shadow package that fails as a missing one does), both forms of the
    command say what to install in one line, exit status 2, no traceback."""
    import subprocess

    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    code = "from fewbit_design.cli.main import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", code, "memory", *arguments],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path[1:])}", "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "needs torch" in result.stderr and "scripts/setup.sh" in result.stderr
