"""Set-up: which torch ``scripts/setup.sh`` installs and why, and the message when the runtime has no torch.

Nothing is installed: the decision logic (``scripts/torch_install.py``) runs in a subprocess with ``--dry-run``
or with a fake pip that records its arguments. A missing torch is simulated by a ``torch`` package on
PYTHONPATH that raises ImportError, an NVIDIA driver by a fake ``nvidia-smi`` on PATH, the PyTorch CPU index by a
local HTTP server (reachable) or http://127.0.0.1:9 (nothing listens there: unreachable, refused at once).
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "scripts" / "torch_install.py"
UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"
RUNTIME_MESSAGE = (
    "fewbit_design.runtime needs PyTorch: pip install 'fewbit-design[runtime]' "
    "(or install the torch build for your machine first)"
)


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def no_torch(tmp_path: Path) -> Path:
    """A PYTHONPATH entry on which ``import torch`` fails, as in an environment without torch."""
    shadow = tmp_path / "no_torch"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text('raise ImportError("simulated: torch is not installed")\n')
    return shadow


@pytest.fixture
def cpu_index(tmp_path: Path):
    """A local index that serves a torch project page, like https://download.pytorch.org/whl/cpu."""
    root = tmp_path / "index"
    (root / "simple" / "torch").mkdir(parents=True)
    (root / "simple" / "torch" / "index.html").write_text('<a href="torch-2.13.0+cpu.whl">torch</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()
    server.server_close()


def _bin(tmp_path: Path, nvidia_smi_exit: int | None) -> Path:
    """A PATH folder holding a fake nvidia-smi that exits with nvidia_smi_exit (None: no nvidia-smi at all)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    if nvidia_smi_exit is not None:
        _executable(folder / "nvidia-smi", f"#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\nexit {nvidia_smi_exit}\n")
    return folder


def _environment(path: str, *, pythonpath: Path | None = None, **variables: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("FEWBIT_", "PIP_INDEX"))}
    environment.pop("PIP_EXTRA_INDEX_URL", None)
    environment["PATH"] = path
    if pythonpath is not None:
        environment["PYTHONPATH"] = str(pythonpath)
    environment.update(variables)
    return environment


def _helper(environment: dict[str, str], *arguments: str) -> subprocess.CompletedProcess[str]:
    # The timeout only guards against a hang; no test asserts a wall time.
    return subprocess.run(
        [sys.executable, str(HELPER), *arguments],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _fake_pip(tmp_path: Path, *, fail_when: str) -> tuple[str, Path]:
    """A pip stand-in that appends its arguments (JSON) to a log and fails when an argument contains fail_when."""
    log = tmp_path / "pip_calls.jsonl"
    script = _executable(
        tmp_path / "fake_pip.py",
        "import json, sys\n"
        f"with open({str(log)!r}, 'a') as log:\n"
        "    log.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"sys.exit(1 if any({fail_when!r} in argument for argument in sys.argv[1:]) else 0)\n",
    )
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}", log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_existing_torch_is_kept(tmp_path: Path) -> None:
    result = _helper(_environment(str(_bin(tmp_path, 0))), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "already installed: kept" in result.stderr
    assert result.stdout == ""


def test_nvidia_driver_present_installs_the_default_build(tmp_path: Path, no_torch: Path, cpu_index: str) -> None:
    environment = _environment(str(_bin(tmp_path, 0)), pythonpath=no_torch, FEWBIT_TORCH_CPU_INDEX=cpu_index)
    result = _helper(environment, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "setup: no torch, NVIDIA driver found (nvidia-smi: GPU 0: Fake GPU" in result.stderr
    assert "installing the default build torch==2.13.0 from the default index" in result.stderr
    command = shlex.split(result.stdout)
    assert command[-3:] == ["install", "--quiet", "torch==2.13.0"]
    assert "--index-url" not in command


@pytest.mark.parametrize("nvidia_smi_exit", [None, 9], ids=["no-nvidia-smi", "nvidia-smi-fails"])
def test_no_driver_and_cpu_index_reachable_installs_the_cpu_build(
    tmp_path: Path, no_torch: Path, cpu_index: str, nvidia_smi_exit: int | None
) -> None:
    environment = _environment(
        str(_bin(tmp_path, nvidia_smi_exit)),
        pythonpath=no_torch,
        FEWBIT_TORCH_CPU_INDEX=cpu_index,
        PIP_INDEX_URL="https://mirror.example/simple",
        PIP_EXTRA_INDEX_URL="file:///opt/extra/simple",
    )
    result = _helper(environment, "--dry-run")
    assert result.returncode == 0, result.stderr
    why = "nvidia-smi not on PATH" if nvidia_smi_exit is None else "nvidia-smi failed with exit code 9"
    assert (
        f"setup: no torch and no NVIDIA driver ({why}): installing the CPU build torch==2.13.0 "
        f"from the PyTorch CPU index {cpu_index}"
    ) in result.stderr
    command = shlex.split(result.stdout)
    assert command[command.index("install") :] == [
        "install",
        "--quiet",
        "torch==2.13.0",
        "--index-url",
        cpu_index,
        "--extra-index-url",
        "https://mirror.example/simple",
        "--extra-index-url",
        "file:///opt/extra/simple",
    ]


def test_no_driver_and_cpu_index_unreachable_falls_back_to_the_default_index(tmp_path: Path, no_torch: Path) -> None:
    environment = _environment(str(_bin(tmp_path, None)), pythonpath=no_torch, FEWBIT_TORCH_CPU_INDEX=UNREACHABLE_INDEX)
    result = _helper(environment, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"the PyTorch CPU index {UNREACHABLE_INDEX} is unreachable (" in result.stderr
    assert "falling back to the default index for torch==2.13.0" in result.stderr
    command = shlex.split(result.stdout)
    assert command[-3:] == ["install", "--quiet", "torch==2.13.0"]
    assert "--index-url" not in command


def test_failed_install_from_the_cpu_index_falls_back_to_the_default_index(
    tmp_path: Path, no_torch: Path, cpu_index: str
) -> None:
    pip, log = _fake_pip(tmp_path, fail_when="--index-url")
    environment = _environment(
        str(_bin(tmp_path, None)), pythonpath=no_torch, FEWBIT_TORCH_CPU_INDEX=cpu_index, FEWBIT_PIP=pip
    )
    result = _helper(environment)
    assert result.returncode == 0, result.stderr
    calls = _calls(log)
    assert len(calls) == 2
    assert calls[0][:4] == ["install", "--quiet", "torch==2.13.0", "--index-url"]
    assert calls[1] == ["install", "--quiet", "torch==2.13.0"]
    assert "installing from the PyTorch CPU index failed (pip exit code 1): falling back" in result.stderr
    assert "setup: installed torch " in result.stderr


def test_install_failing_everywhere_fails_set_up(tmp_path: Path, no_torch: Path) -> None:
    pip, log = _fake_pip(tmp_path, fail_when="torch")
    environment = _environment(
        str(_bin(tmp_path, None)), pythonpath=no_torch, FEWBIT_TORCH_CPU_INDEX=UNREACHABLE_INDEX, FEWBIT_PIP=pip
    )
    result = _helper(environment)
    assert result.returncode == 1
    assert len(_calls(log)) == 1
    assert "setup: could not install torch==2.13.0 (pip exit code 1)" in result.stderr


def test_setup_script_runs_the_decision_then_installs_the_test_extra(tmp_path: Path, no_torch: Path) -> None:
    """``bash scripts/setup.sh test`` end to end, with pip faked so that nothing is installed."""
    pip, log = _fake_pip(tmp_path, fail_when="never")
    python = _executable(
        tmp_path / "python",
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; exec {pip} "$@"; fi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n',
    )
    bin_folder = _bin(tmp_path, 1)
    environment = _environment(
        f"{bin_folder}:/usr/bin:/bin",
        pythonpath=no_torch,
        PYTHON=str(python),
        FEWBIT_PIP=pip,
        FEWBIT_TORCH_CPU_INDEX=UNREACHABLE_INDEX,
    )
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "test"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "setup: no torch and no NVIDIA driver (nvidia-smi failed with exit code 1), but" in result.stderr
    assert _calls(log) == [["install", "--quiet", "torch==2.13.0"], ["install", "--quiet", "-e", ".[test]"]]


@pytest.mark.parametrize(
    "argument, installs",
    [
        ([], [["install", "--quiet", "torch==2.13.0"], ["install", "--quiet", "-e", ".[models]"]]),
        (["design"], [["install", "--quiet", "-e", "."]]),
    ],
    ids=["default", "design"],
)
def test_setup_script_installs_the_runtime_by_default_and_the_design_toolkit_alone_on_request(
    tmp_path: Path, no_torch: Path, argument: list[str], installs: list[list[str]]
) -> None:
    """The README's set-up command (no argument) installs torch for the machine and the ``models`` extra, so that
    its Python example (transformers, runtime.convert) runs right after; ``design`` installs the toolkit alone."""
    pip, log = _fake_pip(tmp_path, fail_when="never")
    python = _executable(
        tmp_path / "python",
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; exec {pip} "$@"; fi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n',
    )
    environment = _environment(
        f"{_bin(tmp_path, 1)}:/usr/bin:/bin",
        pythonpath=no_torch,
        PYTHON=str(python),
        FEWBIT_PIP=pip,
        FEWBIT_TORCH_CPU_INDEX=UNREACHABLE_INDEX,
    )
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), *argument],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert _calls(log) == installs


def test_the_models_extra_brings_torch() -> None:
    """``pip install "fewbit-design[models]"`` from a wheel gets torch too (setup.cfg's extra)."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    models = [line.strip() for line in config["options.extras_require"]["models"].splitlines()]
    assert any(line.startswith("torch") for line in models)
    assert any(line.startswith("transformers") for line in models)


def test_default_indexes_follow_the_pip_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("torch_install", HELPER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "torch_install", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_pip_config", dict)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    assert module.default_indexes() == ["https://pypi.org/simple"]
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///a file:///b")
    assert module.default_indexes() == ["https://mirror.example/simple", "file:///a", "file:///b"]
    assert module.probe_index(UNREACHABLE_INDEX, timeout_s=2.0) is not None


def _import_runtime_nn(
    prelude: str, tmp_path: Path, pythonpath: Path | None = None
) -> subprocess.CompletedProcess[str]:
    script = prelude + "\nimport fewbit_design.runtime.nn\n"
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(str(path) for path in (pythonpath, ROOT) if path is not None)
    return subprocess.run(
        [sys.executable, "-c", script], env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "prelude",
    [
        "import sys; sys.modules['torch'] = None",
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTorch())",
    ],
    ids=["sys-modules-none", "meta-path-finder"],
)
def test_runtime_without_torch_says_what_to_install(prelude: str, tmp_path: Path) -> None:
    result = _import_runtime_nn(prelude, tmp_path)
    assert result.returncode == 1
    assert result.stderr.rstrip().splitlines()[-1] == f"ModuleNotFoundError: {RUNTIME_MESSAGE}"


def test_runtime_with_a_broken_torch_keeps_the_real_error(tmp_path: Path) -> None:
    """A module missing inside torch is not reported as 'torch is not installed'."""
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("import fewbit_missing_torch_dependency\n")
    result = _import_runtime_nn("", tmp_path, pythonpath=broken)
    assert result.returncode == 1
    last = result.stderr.rstrip().splitlines()[-1]
    assert last == "ModuleNotFoundError: No module named 'fewbit_missing_torch_dependency'"


def test_wheel_ships_every_table_without_packaging_warnings(tmp_path: Path) -> None:
    """setup.cfg lists the data-only table folders (no "absent from the packages configuration") and ships the JSON.

    Builds in a copy of the package so that the shared working tree gets no build/ or egg-info folders.
    """
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        (source / name).write_bytes((ROOT / name).read_bytes())
    shutil.copytree(ROOT / "fewbit_design", source / "fewbit_design", ignore=shutil.ignore_patterns("*.pyc"))
    stray = source / "fewbit_design" / "tables" / "__pycache__"
    stray.mkdir(exist_ok=True)
    (stray / "stray.pyc").write_bytes(b"")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-v"]
        + ["-w", str(tmp_path / "wheels")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "absent from the" not in result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("fewbit_design-*.whl")
    shipped = {path.relative_to(ROOT).as_posix() for path in (ROOT / "fewbit_design" / "tables").rglob("*.json")}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "fewbit_design/tables/index.json" in shipped
    assert shipped - names == set()
    assert not [name for name in names if "__pycache__" in name]

    # `pip install -e .` (what scripts/setup.sh runs): the same backend call pip makes, warnings shown.
    editable = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import setuptools.build_meta as b; b.build_editable('editable')"],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert editable.returncode == 0, editable.stderr[-2000:]
    for warning in ("absent from the", "Editable installation", "meta path finder"):
        assert warning not in editable.stdout + editable.stderr
