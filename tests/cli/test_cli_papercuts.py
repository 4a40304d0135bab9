"""Papercuts a new user found in ``fewbit-design``: one regression test each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from fewbit_design.cli import for_shell, main
from fewbit_design.cli._options import fold_name


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_no_arguments_prints_usage_and_commands_not_one_error_line(capsys):
    code, out, err = run(capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0] == "Usage: fewbit-design ACTIVATION [OPTIONS] | COMMAND [ARGS]..."
    assert "error" not in lines[0]
    assert len(lines) > 8  # a short help over several lines, not the whole help flattened into one
    commands = {line.split()[0] for line in lines if line.startswith("  ") and line.split()}
    assert {"ACTIVATION", "list", "tables", "plot", "curves", "snr"} <= commands
    assert "design" not in commands
    assert "--help" in err


def test_a_subgroup_without_arguments_prints_its_own_short_help(capsys):
    code, out, err = run(capsys, "tables")
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("Usage: fewbit-design tables ")
    commands = {line.split()[0] for line in lines if line.startswith("  ") and line.split()}
    assert {"build", "verify"} <= commands and "ACTIVATION" not in commands


def test_help_of_the_default_command_does_not_name_the_hidden_design_subcommand(capsys):
    code, out, err = run(capsys, "gelu", "--help")
    assert code == 0 and err == ""
    usage = out.splitlines()[0]
    assert usage == "Usage: fewbit-design ACTIVATION [OPTIONS]"
    assert "fewbit-design design" not in out
    assert "--bits" in out and "--weight" in out
    # the group's command list names the default command by what the user types, and hides `design`
    code, out, _ = run(capsys, "--help")
    assert code == 0
    listed = [line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.startswith("  ")]
    assert "ACTIVATION" in listed and "design" not in listed
    # the registered name still works for anyone who typed it
    code, out, _ = run(capsys, "design", "relu6", "--bits", "1", "--json")
    assert code == 0 and json.loads(out)["activation"] == "relu6"


@pytest.mark.parametrize("spelling", ["Normal", "NORMAL", " normal "])
def test_weight_names_fold_case(capsys, spelling):
    code, out, err = run(capsys, "relu6", "--bits", "1", "--weight", spelling, "--json")
    assert code == 0, err
    assert json.loads(out)["weight"]["kind"] == "normal"


def test_weight_and_mode_names_fold_case_and_underscores(capsys):
    code, out, err = run(capsys, "relu6", "--bits", "1", "--weight", "Student_T", "--df", "3", "--mode", "Intervals",
                         "--spacing", "Uniform", "--json")  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["weight"]["kind"] == "student-t" and data["mode"] == "intervals"


def test_an_unknown_weight_is_still_rejected_quoting_what_was_typed(capsys):
    code, out, err = run(capsys, "gelu", "--weight", "Cauchy")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "got 'Cauchy'" in err


def test_fold_name():
    choices = ("uniform", "normal", "student-t")
    assert fold_name("UNIFORM", choices) == "uniform"
    assert fold_name("student_t", choices) == "student-t"
    assert fold_name("cauchy", choices) == "cauchy"
    assert fold_name(None, choices) is None


def test_existing_output_says_force_option_not_python_keyword(capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{}")
    code, out, err = run(capsys, "relu6", "--bits", "1", "--out", str(path))
    assert code == 2 and out == ""
    assert "--force" in err and "force=True" not in err
    assert path.read_text() == "{}"


def test_for_shell_translates_python_keywords():
    assert for_shell("pass --force (force=True) to overwrite it") == "pass --force to overwrite it"
    assert for_shell("pass force=True to overwrite it") == "pass --force to overwrite it"
    assert for_shell("use --force") == "use --force"
    assert for_shell("no_force=True stays") == "no_force=True stays"


def test_activation_module_help_says_current_directory(capsys):
    code, out, _ = run(capsys, "gelu", "--help")
    assert code == 0
    assert "current directory" in " ".join(out.split())


def test_activation_module_from_the_current_directory_with_the_installed_script(tmp_path):
    # The installed console script has its own bin folder first on sys.path, not the current directory: this is
    # the case a new user hits (python -m would work; the script did not).
    script = shutil.which("fewbit-design")
    if script is None:
        pytest.skip("fewbit-design is not installed on PATH")
    package = tmp_path / "mypkg_papercut"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "acts.py").write_text("def square(x):\n    return x * x\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [script, "--activation-module", "mypkg_papercut.acts:square", "--bits", "1", "--mode", "intervals", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["activation"] == "mypkg_papercut.acts:square"


def test_activation_module_in_process_puts_cwd_first(capsys, tmp_path, monkeypatch):
    package = tmp_path / "mypkg_papercut_inproc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "acts.py").write_text("def cube(x):\n    return x * x * x\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        code, out, err = run(capsys, "--activation-module", "mypkg_papercut_inproc.acts:cube", "--bits", "1",
                             "--mode", "intervals", "--json")  # fmt: skip
    finally:
        for name in ("mypkg_papercut_inproc", "mypkg_papercut_inproc.acts"):
            sys.modules.pop(name, None)
    assert code == 0, err
    assert json.loads(out)["activation"] == "mypkg_papercut_inproc.acts:cube"
    assert sys.path[0] == str(tmp_path)
