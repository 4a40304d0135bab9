"""Progress on long work: a bar on a terminal (run through a pseudo-terminal), nothing but one label line in a pipe;
the first design's numba compile announced on a terminal; ``tables build`` without ``--out`` refuses to rewrite an
installed package's tables."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pty = pytest.importorskip("pty", reason="pseudo-terminals are POSIX")

BUILD = ["tables", "build", "--activation", "relu", "--jobs", "1"]


def _cli(*arguments: str) -> list[str]:
    return [sys.executable, "-c", "from fewbit_design.cli import main; main()", *arguments]


def run_on_a_terminal(arguments: list[str], environment: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    """(exit status, everything written to the terminal) of the CLI run with a pseudo-terminal as its stdio."""
    master, slave = pty.openpty()
    process = subprocess.Popen(_cli(*arguments), stdin=slave, stdout=slave, stderr=slave, env=environment)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 4096)
            except OSError:  # the other end closed
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    os.close(master)
    return process.wait(timeout=10), b"".join(chunks).decode(errors="replace")


def test_tables_build_draws_a_bar_on_a_terminal_and_not_in_a_pipe(tmp_path):
    status, seen = run_on_a_terminal([*BUILD, "--out", str(tmp_path / "tty")])
    assert status == 0, seen
    assert "designing tables  [" in seen and "32/32" in seen  # the bar, with its count
    piped = subprocess.run(_cli(*BUILD, "--out", str(tmp_path / "pipe")), capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == "designing tables\n" and "[" not in piped.stderr  # one label line, no bar


def test_the_first_design_says_it_compiles_on_a_terminal_only(tmp_path):
    environment = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cold")}  # an empty numba cache
    status, seen = run_on_a_terminal(["relu", "--bits", "1", "--grid", "65"], environment)
    assert status == 0, seen
    assert "compiling the design kernels with numba (once per installation" in seen
    piped = subprocess.run(
        _cli("relu", "--bits", "1", "--grid", "65"), capture_output=True, text=True, env=environment, timeout=120
    )
    assert piped.returncode == 0 and "compiling" not in piped.stderr


def test_tables_build_without_out_refuses_an_installed_package(monkeypatch):
    from click.testing import CliRunner

    from fewbit_design.cli import tables as command
    from fewbit_design.cli.main import commands

    assert command.installed_package(Path("/usr/lib/python3/dist-packages/fewbit_design/tables"))
    assert not command.installed_package(Path(__file__).resolve().parents[2] / "fewbit_design" / "tables")
    monkeypatch.setattr(command, "installed_package", lambda folder: True)
    result = CliRunner().invoke(commands(), ["tables", "build", "--activation", "relu"])
    assert result.exit_code != 0
    assert "inside the installed package" in str(result.exception) and "--out DIR" in str(result.exception)


def test_memory_names_its_stages_on_a_terminal_and_not_in_a_pipe(tmp_path):
    """``memory --hf-config`` measures several models under fake mode (tens of seconds at real sizes): each stage is
    a line on a terminal; in a pipe stderr stays empty and stdout holds only the table."""
    import json

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 256,
        "max_position_embeddings": 1024,
    }))  # fmt: skip
    arguments = ["memory", "--hf-config", str(config), "--seq", "64"]
    status, seen = run_on_a_terminal(arguments, timeout=300)
    assert status == 0, seen
    assert "measuring eager" in seen and "under fake mode ..." in seen
    piped = subprocess.run(_cli(*arguments), capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == "" and "measuring" not in piped.stdout
