"""``fewbit-design ACTIVATION ...`` and ``fewbit-design list``, called in-process through fewbit_design.cli.main."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy.integrate import quad

from fewbit_design import table
from fewbit_design.cli import main
from fewbit_design.design import activations, design


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_summary(capsys):
    code, out, err = run(capsys, "gelu", "--bits", "2", "--weight", "normal")
    assert code == 0 and err == ""
    assert "activation: gelu(approximate='none')" in out
    assert "mode: levelsets" in out and "weight: normal(loc=0, scale=1) on [-10, 10]" in out
    assert "error L = " in out and "SNR = " in out and "time: " in out and "grid error" in out
    t = design("gelu", 2, weight="normal")
    rows = [line for line in out.splitlines() if line.startswith("  (") or line.startswith("  [")]
    assert len(rows) == len(t.codes)
    assert rows[0].split()[0] == "(-inf," and rows[-1].split()[1] == "inf)"
    assert f"{t.error:.6g}" in out


def test_json_is_the_table_and_nothing_else(capsys):
    code, out, err = run(capsys, "silu", "--bits", "3", "--mode", "intervals", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    expected = design("silu", 3, mode="intervals")
    assert out == expected.to_json()
    assert data["error"] == pytest.approx(expected.error)
    code, out, _ = run(capsys, "sigmoid", "--bits", "2", "--mode", "intervals", "--symmetric", "--json",
                       "--weight", "laplace", "--scale", "2", "--range", "-8", "8")  # fmt: skip
    assert code == 0
    t = table.loads(out)
    assert t.symmetric and t.weight == {"kind": "laplace", "loc": 0.0, "scale": 2.0, "low": -8.0, "high": 8.0}


def test_paper_recipe_from_the_command_line(capsys):
    # The paper's Table 1, GELU 1 bit: uniform grid of step 0.02, grid DP only.
    argv = ["gelu", "--bits", "1", "--mode", "intervals", "--grid", "1001", "--spacing", "uniform", "--no-refine"]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0 and round(json.loads(out)["error"], 4) == 0.1410


def test_params_grid_and_no_refine(capsys):
    code, out, _ = run(capsys, "leaky_relu", "--param", "negative_slope=0.2", "--bits", "1", "--json")
    assert code == 0 and json.loads(out)["params"] == {"negative_slope": 0.2}
    code, out, _ = run(capsys, "gelu", "--bits", "2", "--mode", "intervals", "--grid", "101", "--no-refine", "--json")
    data = json.loads(out)
    assert data["design"]["grid"] == 101 and data["design"]["refined"] is False
    assert data["error"] == pytest.approx(data["design"]["grid_error"], rel=1e-9)


def test_out_force_and_atomic(capsys, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / "gelu.json"
    code, out, _ = run(capsys, "gelu", "--bits", "2", "--out", str(path))
    assert code == 0 and f"wrote {path}" in out
    assert table.load(path).to_json() == design("gelu", 2).to_json()
    before = path.read_bytes()
    code, out, err = run(capsys, "gelu", "--bits", "3", "--out", str(path))
    assert code == 2 and "exists" in err and "--force" in err and out == ""
    assert path.read_bytes() == before
    code, _, _ = run(capsys, "gelu", "--bits", "3", "--out", str(path), "--force")
    assert code == 0 and table.load(path).bits == 3
    # A failure during the design leaves no file behind (no partial or temporary file either).
    failing = folder / "failing.json"
    code, _, err = run(capsys, "--activation-module", "_fewbit_cli_test_module:explodes", "--out", str(failing))
    assert code == 2 and "boom" in err and not failing.exists()
    assert sorted(p.name for p in folder.iterdir()) == ["gelu.json"]


@pytest.fixture(autouse=True)
def _user_module(tmp_path, monkeypatch):
    module = tmp_path / "user_mods" / "_fewbit_cli_test_module.py"
    module.parent.mkdir()
    module.write_text(
        "import numpy as np\n"
        "def square_relu(x, power=2):\n"
        "    return np.maximum(x, 0.0) ** power\n"
        "def explodes(x):\n"
        "    if np.size(x) > 50:\n"
        "        raise RuntimeError('boom')\n"
        "    return np.tanh(x)\n"
    )
    monkeypatch.syspath_prepend(str(module.parent))
    monkeypatch.setattr(activations, "_torch_available", lambda: False)
    yield
    sys.modules.pop("_fewbit_cli_test_module", None)


def test_activation_module(capsys):
    code, out, err = run(capsys, "--activation-module", "_fewbit_cli_test_module:square_relu", "--param", "power=2",
                         "--bits", "2", "--mode", "intervals", "--json")  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["activation"] == "_fewbit_cli_test_module:square_relu" and data["params"] == {"power": 2}
    # f' = 2 max(x, 0) (by finite differences): the stored error is L of the table with that f', by quad.
    t = table.loads(out)
    edges = np.concatenate([[-10.0], t.boundaries, [10.0]])
    expected = 0.0
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        level = float(t.q((a + b) / 2))
        points = [0.0] if a < 0 < b else None
        expected += quad(lambda x, y=level: (2 * max(x, 0.0) - y) ** 2, a, b, points=points)[0]
    assert data["error"] == pytest.approx(expected, rel=1e-7)


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gelu.png"
    code, out, err = run(capsys, "gelu", "--bits", "3", "--weight", "normal", "--plot", str(path))
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run(capsys, "gelu", "--bits", "3", "--plot", str(path))
    assert code == 2 and "exists" in err


def test_list(capsys):
    code, out, err = run(capsys, "list")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[0] == "activation"
    names = [line.split()[0] for line in lines[1:]]
    assert names == activations.names()
    assert any("negative_slope=0.01" in line for line in lines)
    assert any("approximate='none' (none|tanh)" in line for line in lines)
    # Aligned: the parameters column starts at the same offset on every line.
    offsets = {line.index(line.split()[1], len(line.split()[0])) for line in lines}
    assert len(offsets) == 1


BAD_INPUT = [
    (["gelx"], "unknown activation 'gelx'; did you mean 'gelu'"),
    (["gelu", "--bits", "0"], "--bits must be an integer from 1 to 8, got 0"),
    (["gelu", "--bits", "9"], "--bits must be an integer from 1 to 8, got 9"),
    (["gelu", "--bits", "two"], "'two' is not a valid integer"),
    (["gelu", "--range", "1", "-1"], "--range must satisfy A < B"),
    (["gelu", "--range", "0", "0"], "--range must satisfy A < B"),
    (["gelu", "--weight", "normal", "--scale", "-1"], "scale must be > 0"),
    (["gelu", "--weight", "uniform", "--loc", "1"], "loc applies only to weights"),
    (["gelu", "--weight", "student-t"], "needs df"),
    (["gelu", "--weight", "cauchy"], "--weight must be"),
    (["gelu", "--weight", "empirical"], "needs samples"),
    (["gelu", "--weight", "empirical", "--samples", "/nonexistent/x.npy"], "does not exist"),
    (["gelu", "--param", "approximate"], "--param must look like KEY=VALUE, got 'approximate'"),
    (["gelu", "--param", "=1"], "--param must look like KEY=VALUE"),
    (["gelu", "--param", "alpha=1"], "has no parameter 'alpha'"),
    (["gelu", "--param", "approximate=fast"], "approximate must be 'none' or 'tanh'"),
    (["gelu", "--mode", "fast"], "--mode must be 'levelsets' or 'intervals', got 'fast'"),
    (["gelu", "--symmetric"], "--symmetric applies only to --mode intervals"),
    (["gelu", "--grid", "3"], "--grid must be at least 2**bits + 1 = 9, got 3"),
    (["gelu", "--spacing", "log"], "--spacing must be 'adaptive' or 'uniform', got 'log'"),
    (["gelu", "--out", "/nonexistent-dir/t.json"], "does not exist"),
    (["--bits", "2"], "missing ACTIVATION"),
    (["gelu", "--activation-module", "math:tanh"], "not both"),
    (["--activation-module", "no_such_module_xyz:f"], "cannot import"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT)
def test_bad_input_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("fewbit-design: error: ") and err.endswith("\n") and err.count("\n") == 1
    assert message in err
    assert "Traceback" not in err


def test_unwritable_output_directory(capsys):
    # /sys refuses new files for every user, root included (a chmod-ed folder would not stop root)
    code, out, err = run(capsys, "gelu", "--out", "/sys/fewbit-test.json")
    assert code == 2 and out == ""
    assert "is not writable" in err and err.count("\n") == 1


def test_unwritable_directory_without_access_bits(capsys, tmp_path, monkeypatch):
    # what a non-root user sees for a folder without write permission
    monkeypatch.setattr("os.access", lambda path, mode: False)
    code, _, err = run(capsys, "gelu", "--out", str(tmp_path / "t.json"))
    assert code == 2 and "is not writable" in err
    assert not (tmp_path / "t.json").exists()


def test_installed_script_smoke():
    script = shutil.which("fewbit-design")
    if script is None:
        pytest.skip("fewbit-design is not installed on PATH")
    result = subprocess.run([script, "relu6", "--bits", "1", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    # relu6'(0) = 0 is the left piece's value, so the boundary is the float after 0 (the canonical kink placement)
    assert data["error"] == 0.0 and data["boundaries"] == [5e-324, 6.0] and data["codes"] == [0, 1, 0]
