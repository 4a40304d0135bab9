"""Every figure option writes the format its file's suffix names, or refuses the name up front in one line that lists
the accepted suffixes (``design --plot``, ``plot --out`` and ``curves --out`` wrote PNG bytes into any name)."""

from __future__ import annotations

import pytest

from fewbit_design.cli import main
from fewbit_design.errors import FewBitError
from fewbit_design.plots import FIGURE_FORMATS, figure_format

# The first bytes of each format (its file signature).
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "jpeg": b"\xff\xd8\xff"}

FACTORY = """
import torch

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def command(name: str, tmp_path, monkeypatch) -> tuple[list[str], str]:
    """A quick command line of ``name`` and its figure option (the figure path follows that option)."""
    if name == "memory":
        module = f"formats_models_{tmp_path.name.replace('-', '_')}"
        (tmp_path / f"{module}.py").write_text(FACTORY)
        monkeypatch.chdir(tmp_path)
        return ["memory", f"{module}:mlp", "--input-shape", "2,4", "--allow", "checkpoint"], "--plot"
    return {
        "design": (["relu6", "--bits", "1"], "--plot"),
        "plot": (["plot", "relu6", "--bits", "1"], "--out"),
        "curves": (["curves", "relu6", "--bits", "1"], "--out"),
        "snr": (["snr", "--bits", "1", "relu6"], "--out"),
    }[name]


def check_format(data: bytes, form: str) -> None:
    if form == "svg":
        assert b"<svg" in data[:1000] and data.rstrip().endswith(b"</svg>")
    else:
        assert data.startswith(MAGIC[form]), data[:16]


@pytest.mark.parametrize("name", ["design", "plot", "curves", "snr", "memory"])
@pytest.mark.parametrize("suffix", [".pdf", ".svg", ".jpg", ".JPEG", ".png"])
def test_the_suffix_names_the_format_written(capsys, tmp_path, monkeypatch, name, suffix):
    args, option = command(name, tmp_path, monkeypatch)
    path = tmp_path / f"figure{suffix}"
    code, _, err = run(capsys, *args, option, str(path))
    assert code == 0, err
    check_format(path.read_bytes(), FIGURE_FORMATS[suffix.lower()])


@pytest.mark.parametrize("name", ["design", "plot", "curves", "snr", "memory"])
@pytest.mark.parametrize("file_name", ["figure.json", "figure.gif", "figure.txt", "figure"])
def test_another_suffix_is_refused_up_front_in_one_line(capsys, tmp_path, monkeypatch, name, file_name):
    args, option = command(name, tmp_path, monkeypatch)
    before = sorted(p.name for p in tmp_path.iterdir())
    other = tmp_path / ("table.json" if name == "design" else "numbers.csv")
    extra = {"design": ["--out", str(other)], "curves": ["--csv", str(other)], "snr": ["--csv", str(other)]}
    code, stdout, err = run(capsys, *args, *extra.get(name, []), option, str(tmp_path / file_name))
    assert code == 2 and stdout == ""
    assert err == (
        f"fewbit-design: error: {option} must end in .png, .pdf, .svg, .jpg or .jpeg (the figure's format), "
        f"got {str(tmp_path / file_name)!r}\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, not even the other output


def test_a_device_without_a_suffix_gets_png(tmp_path):
    assert figure_format("/dev/null", option="--plot") == "png"
    with pytest.raises(FewBitError, match="--plot must end in"):
        figure_format(tmp_path / "figure", option="--plot")
