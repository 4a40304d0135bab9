"""Ctrl-C (SIGINT to the terminal's process group) stops ``fewbit-design`` at once: within 5 s, exit status 130 and
one line, no worker process left, no temporary or partial file.

Each run is a fresh interpreter in its own session that prints ``ready`` once the CLI is imported (a Ctrl-C during
Python's own start-up is not the CLI's to handle), then runs the command; SIGINT goes to the whole group, as a
terminal sends it, at a few moments after ``ready``.
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fewbit_design.table import load

SCRIPT = "import sys\nfrom fewbit_design.cli import main\nprint('ready', flush=True)\nmain(sys.argv[1:])\n"


def live_processes(session: int) -> list[str]:
    """Processes of ``session`` that are still running (zombies waiting for a reaper do not count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
        if int(fields[3]) == session and fields[0] != "Z":
            found.append(f"{entry.name} {fields[0]} {stat[: stat.rindex(')') + 1]}")
    return found


def interrupt(
    args: list[str], delays: list[float], cwd: Path, script: str = SCRIPT
) -> tuple[int, str, float, list[str]]:
    """Run the CLI, send SIGINT to its process group ``delays`` seconds after ``ready`` (one signal per delay); return
    (exit status, stderr, seconds from the first signal to the exit, processes of the session still running)."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert process.stdout.readline() == "ready\n"
        start = time.monotonic()
        first = None
        for delay in delays:
            time.sleep(max(0.0, start + delay - time.monotonic()))
            if process.poll() is not None:
                break
            os.killpg(process.pid, signal.SIGINT)
            first = first if first is not None else time.monotonic()
        try:
            _, stderr = process.communicate(timeout=5 + (time.monotonic() - first if first else 0))
        except subprocess.TimeoutExpired:
            left = live_processes(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            return None, f"(still running 5 s after SIGINT) {stderr}", math.inf, left
        elapsed = time.monotonic() - first if first is not None else 0.0
        time.sleep(0.2)
        return process.returncode, stderr, elapsed, live_processes(process.pid)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def temporary_files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.name.endswith(".tmp")]


@pytest.mark.parametrize("delays", [[0.05], [0.6], [1.5], [0.3, 0.35]], ids=["early", "mid", "late", "twice"])
def test_tables_build_with_two_jobs_stops_on_sigint(tmp_path, delays):
    out = tmp_path / "tables"
    code, stderr, seconds, left = interrupt(
        ["tables", "build", "--jobs", "2", "--activation", "gelu", "--out", str(out)], delays, tmp_path
    )
    assert code == 130, stderr
    assert seconds < 5.0
    assert "Traceback" not in stderr and stderr.rstrip("\n").splitlines()[-1] == "fewbit-design: interrupted"
    assert left == [], left  # no worker computing on after the parent has gone
    assert temporary_files(tmp_path) == []
    for path in out.rglob("*.json"):  # whatever was written is whole
        if path.name != "index.json":
            load(path)


@pytest.mark.parametrize("delay", [0.1, 0.8])
def test_a_design_stops_on_sigint_and_leaves_no_file(tmp_path, delay):
    out = tmp_path / "gelu.json"
    args = ["gelu", "--bits", "8", "--out", str(out), "--plot", str(tmp_path / "g.png")]
    code, stderr, seconds, left = interrupt(args, [delay], tmp_path)
    assert code == 130, stderr
    assert seconds < 5.0
    assert "Traceback" not in stderr and stderr.rstrip("\n").splitlines()[-1] == "fewbit-design: interrupted"
    assert left == []
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_command(tmp_path, monkeypatch, capsys):
    # A Ctrl-C whose KeyboardInterrupt is raised inside a __del__ is "ignored" by Python (printed, not raised): the
    # command ran on to the end and exited 0. Simulated here by a finalizer that raises it, as the signal would.
    from fewbit_design.cli import main

    name = f"finalizer_acts_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "import numpy as np\n\n"
        "class Interrupted:\n"
        "    def __del__(self):\n"
        "        raise KeyboardInterrupt\n\n"
        "armed = [True]\n\n"
        "def square(x):\n"
        "    if armed:\n"
        "        armed.clear()\n"
        "        Interrupted()\n"
        "    return np.asarray(x) ** 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "square.json"
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["--activation-module", f"{name}:square", "--bits", "8", "--out", str(out)])
    finally:
        sys.modules.pop(name, None)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.rstrip("\n").splitlines()[-1] == "fewbit-design: interrupted"
    assert not out.exists() and temporary_files(tmp_path) == []


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2, 0.5])
def test_ctrl_c_in_the_first_half_second_is_one_line_and_exit_130(tmp_path, delay):
    # ``ready`` comes once `fewbit_design.cli` is imported, which loads the standard library only: these signals
    # land while main() imports click, numpy and the commands (about half a second), then in the design
    args = ["gelu", "--bits", "8", "--out", str(tmp_path / "gelu.json"), "--plot", str(tmp_path / "gelu.png")]
    code, stderr, seconds, left = interrupt(args, [delay], tmp_path)
    assert code == 130, stderr
    assert stderr == "fewbit-design: interrupted\n"
    assert seconds < 5.0 and left == []
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # no output, no temporary file


# Ctrl-C at a chosen moment of the imports, not at a time: a meta-path finder sends SIGINT to its own process when
# the module ``sys.argv[1]`` starts importing, then the console script runs as `fewbit-design` does.
CTRL_C_ON_IMPORT = """
import os, signal, sys

class CtrlCOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCOnImport())
from fewbit_design.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("module", ["click", "numpy", "fewbit_design.cli.snr", "scipy"])
def test_ctrl_c_while_a_module_imports_is_one_line_and_exit_130(tmp_path, module):
    # click, numpy and the command modules were imported with `fewbit_design.cli`, before main() could handle a
    # Ctrl-C: a KeyboardInterrupt traceback from inside the import and death by SIGINT (status -2)
    args = ["gelu", "--bits", "8", "--out", str(tmp_path / "gelu.json"), "--plot", str(tmp_path / "gelu.png")]
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_ON_IMPORT, module, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert (result.returncode, result.stderr) == (130, "fewbit-design: interrupted\n")
    assert result.stdout == "" and sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.mark.parametrize("before", ["default", "ignored"])
def test_the_import_handler_is_there_only_while_the_modules_import(monkeypatch, capsys, before):
    # An ignored SIGINT (a background job) stays ignored; otherwise Ctrl-C exits at once during the imports only.
    cli_main = importlib.import_module("fewbit_design.cli.main")
    initial = signal.default_int_handler if before == "default" else signal.SIG_IGN
    signal.signal(signal.SIGINT, initial)
    seen = []
    real_commands = cli_main.commands

    def commands():
        seen.append(signal.getsignal(signal.SIGINT))
        return real_commands()

    monkeypatch.setattr(cli_main, "commands", commands)
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["list"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert seen == [cli_main._exit_interrupted if before == "default" else signal.SIG_IGN]
    assert signal.getsignal(signal.SIGINT) is initial
