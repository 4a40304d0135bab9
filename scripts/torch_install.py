"""Installs torch for ``scripts/setup.sh``: the right build for this machine, and one log line saying which and why.

Run by ``bash scripts/setup.sh test`` with the target environment's Python; it uses the standard library only.

* A torch that imports is kept, whatever its build (say a CUDA build you installed yourself).
* No torch and an NVIDIA driver (``nvidia-smi -L`` succeeds): the default build from the default index.
* No torch and no NVIDIA driver: the CPU build from the PyTorch CPU wheel index, so that a CPU machine never
  downloads the multi-GB CUDA build that a plain package index serves on Linux. When that index cannot be
  reached (probed with a 5 s timeout) or installing from it fails, the default index is used instead.

Usage: ``python scripts/torch_install.py [--dry-run]``; ``--dry-run`` logs the decision and prints the pip
command instead of running it. Log lines go to stderr and start with ``setup:``.

Environment, for tests and unusual set-ups:

* ``FEWBIT_TORCH_CPU_INDEX``: the CPU wheel index (default ``https://download.pytorch.org/whl/cpu``).
* ``FEWBIT_PIP``: the pip command to run (default ``<this python> -m pip``); tests put a fake here.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

TORCH_REQUIREMENT = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI_INDEX = "https://pypi.org/simple"
PROBE_TIMEOUT_S = 5.0

__all__ = ["Plan", "plan", "main"]


@dataclass(frozen=True)
class Plan:
    """What to install and why: ``commands`` are pip argument lists to try in order (empty: install nothing)."""

    reason: str
    commands: tuple[tuple[str, ...], ...]


def _log(message: str) -> None:
    print(f"setup: {message}", file=sys.stderr, flush=True)


def installed_torch() -> str | None:
    """The version of the torch this Python imports, or None when ``import torch`` fails."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def nvidia_driver() -> tuple[bool, str]:
    """Whether an NVIDIA driver answers (``nvidia-smi -L`` exits 0), and what was seen, for the log."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return False, "nvidia-smi not on PATH"
    try:
        result = subprocess.run([executable, "-L"], capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"nvidia-smi failed: {error}"
    if result.returncode != 0:
        return False, f"nvidia-smi failed with exit code {result.returncode}"
    first_gpu = result.stdout.strip().splitlines()[0] if result.stdout.strip() else "no GPU listed"
    return True, f"nvidia-smi: {first_gpu}"


def probe_index(index: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the index serves a torch project page, else why not. Never takes much longer than timeout_s.

    The request runs in a daemon thread so that a slow name lookup (which socket timeouts do not cover)
    cannot hold set-up up either.
    """
    url = index.rstrip("/") + "/torch/"
    outcome: list[str | None] = []

    def request() -> None:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                response.read(1)
            outcome.append(None)
        except urllib.error.HTTPError as error:
            outcome.append(f"HTTP {error.code}")
        except Exception as error:  # any failure only means: do not use this index
            reason = getattr(error, "reason", error)
            outcome.append(f"{type(error).__name__}: {reason}")

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if not outcome:
        return f"no answer within {timeout_s:g} s"
    return outcome[0]


def _pip_config() -> dict[str, str]:
    """pip's configuration as ``{key: value}`` (``pip config list``), or {} when pip cannot say."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    config = {}
    for line in result.stdout.splitlines():
        key, separator, value = line.partition("=")
        if separator:
            config[key.strip()] = value.strip().strip("'\"")
    return config


def default_indexes() -> list[str]:
    """The index pip uses by default followed by its configured extra indexes.

    Passing ``--index-url`` and ``--extra-index-url`` on the command line replaces the configured ones, so they
    are passed on again: torch's own dependencies still resolve where they would without the CPU index.
    """
    config = _pip_config()
    index = os.environ.get("PIP_INDEX_URL")
    extras = os.environ.get("PIP_EXTRA_INDEX_URL")
    for section in (":env:", "install", "global"):
        index = index or config.get(f"{section}.index-url")
        extras = extras or config.get(f"{section}.extra-index-url")
    return [index or PYPI_INDEX, *(extras or "").split()]


def _installed_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown: no torch metadata found)"


def _pip() -> list[str]:
    configured = os.environ.get("FEWBIT_PIP")
    return shlex.split(configured) if configured else [sys.executable, "-m", "pip"]


def plan() -> Plan:
    """Decides what to install, probing the machine (torch, NVIDIA driver, CPU index); installs nothing."""
    version = installed_torch()
    if version is not None:
        return Plan(f"torch {version} already installed: kept", ())
    install = (*_pip(), "install", "--quiet", TORCH_REQUIREMENT)
    has_driver, driver_note = nvidia_driver()
    if has_driver:
        return Plan(
            f"no torch, NVIDIA driver found ({driver_note}): installing the default build {TORCH_REQUIREMENT} "
            "from the default index",
            (install,),
        )
    cpu_index = os.environ.get("FEWBIT_TORCH_CPU_INDEX", CPU_INDEX)
    unreachable = probe_index(cpu_index)
    if unreachable is not None:
        return Plan(
            f"no torch and no NVIDIA driver ({driver_note}), but the PyTorch CPU index {cpu_index} is unreachable "
            f"({unreachable}): falling back to the default index for {TORCH_REQUIREMENT}",
            (install,),
        )
    extra = [argument for index in default_indexes() for argument in ("--extra-index-url", index)]
    from_cpu_index = (*install, "--index-url", cpu_index, *extra)
    return Plan(
        f"no torch and no NVIDIA driver ({driver_note}): installing the CPU build {TORCH_REQUIREMENT} "
        f"from the PyTorch CPU index {cpu_index}",
        (from_cpu_index, install),
    )


def main(argv: list[str] | None = None) -> int:
    """Logs the decision and runs it (or prints the first pip command with ``--dry-run``); returns the exit code."""
    arguments = sys.argv[1:] if argv is None else argv
    if arguments not in ([], ["--dry-run"]):
        print(f"usage: {sys.argv[0]} [--dry-run] (got {shlex.join(arguments)})", file=sys.stderr)
        return 2
    decision = plan()
    _log(decision.reason)
    if not decision.commands:
        return 0
    if arguments == ["--dry-run"]:
        print(shlex.join(decision.commands[0]))
        return 0
    returncode = 1
    for attempt, command in enumerate(decision.commands):
        if attempt:
            _log(
                f"installing from the PyTorch CPU index failed (pip exit code {returncode}): falling back to the "
                f"default index for {TORCH_REQUIREMENT}"
            )
        returncode = subprocess.run(command, check=False).returncode
        if returncode == 0:
            _log(f"installed torch {_installed_version()}")
            return 0
    _log(f"could not install {TORCH_REQUIREMENT} (pip exit code {returncode})")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
