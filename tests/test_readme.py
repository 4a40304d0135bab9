"""Every command in the README is run by CI or by a test, and the README stays short.

The README's shell commands (fenced ``bash`` blocks, and inline code that starts with a command) are each listed in
``WHERE_RUN`` with the file that runs them; the test checks that the file really contains the command, so a command
added to the README, or dropped from CI, fails here. The README's Python example runs here as written.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
COMMAND = re.compile(r"^(bash|python3?|pip|fewbit-design|mkdocs|ruff|pytest)\s")

# command -> (file that runs it, text of that file that shows it does)
WHERE_RUN = {
    # .ci/run reads these two from the README lines marked "# main job" and "# tests" (test_ci_reads_the_quick_start)
    "bash scripts/setup.sh && fewbit-design gelu --bits 3 --weight normal": (".ci/run", "# main job"),
    "bash scripts/test.sh": (".ci/run", "# tests"),
    "python3 -m venv .venv && . .venv/bin/activate": (
        ".ci/run",
        "python3 -m venv .venv\n# shellcheck disable=SC1091\n. .venv/bin/activate",
    ),
    "fewbit-design tables verify": (".ci/run", "\nfewbit-design tables verify\n"),
    "mkdocs build --strict": ("tests/test_docs.py", '"mkdocs", "build", "--strict"'),
    "bash scripts/setup.sh design": ("tests/test_setup_script.py", '(["design"], [["install", "--quiet", "-e", "."]])'),
    'pip install "fewbit-design[models]"': ("tests/test_setup_script.py", "def test_the_models_extra_brings_torch"),
    "fewbit-design memory --hf-config llama-3-8b --seq 8192 --gpus 8 --fsdp": (
        "tests/test_readme.py",
        '["memory", "--hf-config", "llama-3-8b", "--seq", "8192", "--gpus", "8", "--fsdp"',
    ),
}


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def readme_commands(text: str) -> list[str]:
    commands = []
    for block in _blocks(text, "bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if COMMAND.match(span):
            commands.append(span)
    return commands


def test_readme_is_at_most_250_lines() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_every_readme_command_is_run_by_ci_or_a_test() -> None:
    commands = readme_commands(README.read_text())
    assert "bash scripts/test.sh" in commands
    unlisted = [command for command in commands if command not in WHERE_RUN]
    assert unlisted == [], "README commands that nothing runs: add them to CI or a test, and to WHERE_RUN"
    for command in commands:
        path, evidence = WHERE_RUN[command]
        assert evidence in (ROOT / path).read_text(), f"{path} no longer runs {command!r}"


def test_the_command_extraction_sees_inline_and_fenced_commands() -> None:
    text = "x\n\n```bash\nfoo --bar   # note\n# only a comment\n```\n\nRun `pip install\nthis` or `not a command`.\n"
    assert readme_commands(text) == ["foo --bar", "pip install this"]


def test_ci_reads_the_quick_start_commands_from_the_readme() -> None:
    """The same extraction as .ci/run's grep/sed, on the README: both commands found, exactly as WHERE_RUN lists."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "grep -m1 -E '^[^#].*# main job$' README.md" in ci and "grep -m1 -E '^[^#].*# tests$' README.md" in ci
    lines = README.read_text().splitlines()
    found = {}
    for marker in ("# main job", "# tests"):
        line = next(line for line in lines if not line.startswith("#") and line.endswith(marker))
        found[marker] = re.sub(rf"\s*{marker}$", "", line)
    assert found == {
        "# main job": "bash scripts/setup.sh && fewbit-design gelu --bits 3 --weight normal",
        "# tests": "bash scripts/test.sh",
    }


def test_the_readme_python_example_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (example,) = _blocks(README.read_text(), "python")
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replaced 2 module(s)" in result.stdout


@pytest.mark.slow
def test_the_readme_fits_table_is_what_the_command_prints(tmp_path: Path) -> None:
    """The README's Llama-3-8B table: the peaks (measured) and step times (predicted) the memory command prints, and
    the one-GPU state (counted) from the same parameters."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fewbit_design.cli import main
    from fewbit_design.runtime.estimate import parameter_bytes

    path = tmp_path / "rows.json"
    with pytest.raises(SystemExit) as exited:
        main(["memory", "--hf-config", "llama-3-8b", "--seq", "8192", "--gpus", "8", "--fsdp", "--json", str(path)])
    assert exited.value.code in (0, None)
    data = json.loads(path.read_text())
    rows = {row["name"]: row for row in data["rows"]}
    names = ("eager", "checkpointing", "convert", "convert(compress=8)")
    peaks = [f"{rows[n]['peak_bytes'] / 1e9:.1f}{'' if rows[n]['fits'] else ' (does not fit)'}" for n in names]
    times = [f"{rows[n]['predicted_step_s']:.3g}" for n in names]
    text = README.read_text()
    assert f"| step peak, GB (measured, fake mode) | {' | '.join(peaks)} |" in text
    assert f"| step time, s (predicted, roofline) | {' | '.join(times)} |" in text
    state = sum(parameter_bytes(data["parameters"], dtype_size=2, master_weights=True, shards=1).values())
    assert state > 80 * 10**9 and f"optimizer state alone are {state / 1e9:.1f} GB" in " ".join(text.split())
