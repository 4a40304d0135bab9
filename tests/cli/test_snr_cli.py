"""``fewbit-design snr``: figures and CSV of both modes, and one-line errors with exit status 2 before any work."""

from __future__ import annotations

import csv
import sys

import pytest

from fewbit_design.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run(capsys):
    def invoke(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        captured = capsys.readouterr()
        return exit_info.value.code, captured.out, captured.err

    return invoke


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_reconstruction_figure_and_csv(run, tmp_path):
    out, table = tmp_path / "snr.png", tmp_path / "snr.csv"
    code, stdout, _ = run(
        "snr", "--depth", "1,2", "--slope", "0.5", "--batch", "2", "--size", "4", "--out", str(out), "--csv", str(table)
    )
    assert code == 0 and "wrote" in stdout
    assert out.read_bytes().startswith(PNG_MAGIC)
    rows = read_csv(table)
    panels = {row["panel"] for row in rows}
    assert panels == {"alpha_slope", "alpha_bn_toy", "input_vs_depth", "per_layer"}
    depth_rows = [row for row in rows if row["panel"] == "input_vs_depth"]
    assert sorted((row["arch"], row["depth"]) for row in depth_rows) == [
        ("hybrid", "1"),
        ("hybrid", "2"),
        ("layerwise", "1"),
        ("layerwise", "2"),
    ]
    slope_row = next(row for row in rows if row["panel"] == "alpha_slope")
    assert float(slope_row["theory"]) == pytest.approx(1.5625)  # (1 + 0.25)^2 / (4 * 0.25)
    assert float(slope_row["measured"]) == pytest.approx(1.5625, rel=0.03)


def test_bits_mode_plots_the_design_engines_snr(run, tmp_path):
    design = pytest.importorskip("fewbit_design.design").design
    out, table = tmp_path / "bits.svg", tmp_path / "bits.csv"
    code, _, _ = run("snr", "--bits", "1-3", "gelu", "--out", str(out), "--csv", str(table))
    assert code == 0
    assert b"<svg" in out.read_bytes()[:400]
    rows = read_csv(table)
    assert [int(row["bits"]) for row in rows] == [1, 2, 3]
    snrs = [float(row["snr_db"]) for row in rows]
    assert snrs == sorted(snrs) and snrs[0] < snrs[-1]  # more bits, less error
    assert snrs[1] == pytest.approx(design("gelu", 2).snr_db, rel=1e-9)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--slope", "0"], "--slope value must be > 0"),
        (["--slope", "a,b"], "--slope must be a comma-separated list"),
        (["--depth", "0-3"], "depth must be from 1 to 256"),
        (["--arch", "deep"], "--arch must be 'layerwise', 'hybrid' or 'both', got 'deep'"),
        (["--channels", "6"], "--channels must be divisible by 4"),
        (["--size", "5"], "--size must be an even number"),
        (["--bits", "1-3"], "--bits needs at least one ACTIVATION"),
        (["--bits", "1-3", "gelu", "--slope", "0.5"], "--slope apply to the reconstruction mode"),
        (["--bits", "0-3", "gelu"], "bits must be from 1 to 8"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_without_output(run, tmp_path, args, message):
    out = tmp_path / "f.png"
    code, stdout, stderr = run("snr", *args, "--out", str(out))
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("fewbit-design: error: ") and message in stderr
    assert not out.exists()


def test_output_paths_are_checked_before_any_work(run, tmp_path):
    existing = tmp_path / "done.png"
    existing.write_bytes(b"keep")
    code, _, stderr = run("snr", "--out", str(existing))
    assert code == 2 and "exists; pass --force" in stderr and existing.read_bytes() == b"keep"
    code, _, stderr = run("snr", "--out", str(tmp_path / "f.txt"))
    assert code == 2 and "--out must end in .png, .pdf, .svg" in stderr
    code, _, stderr = run("snr", "--out", str(tmp_path / "missing" / "f.png"))
    assert code == 2 and "does not exist" in stderr


def test_without_torch_the_reconstruction_mode_says_so_in_one_line(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    out = tmp_path / "f.png"
    code, _, stderr = run("snr", "--depth", "1", "--out", str(out))
    assert code == 2 and stderr.count("\n") == 1 and "needs PyTorch" in stderr
    assert not out.exists()
