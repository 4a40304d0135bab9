"""`fewbit-design plot`, `curves` and `tables` from the command line: outputs and bad input."""

import csv

import numpy as np
import pytest

from fewbit_design.cli import main
from fewbit_design.table import load
from fewbit_design.tables import TABLES_DIR


def run(capsys, *args):
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return info.value.code, out, err


def read_png(path):
    import matplotlib.image

    return matplotlib.image.imread(path)


def test_plot_writes_one_panel_per_bit_width(capsys, tmp_path):
    out = tmp_path / "gelu.png"
    code, stdout, err = run(capsys, "plot", "gelu", "--bits", "1,3", "--out", str(out))
    assert code == 0, err
    image = read_png(out)
    assert image.shape[1] > image.shape[0] > 300  # two panels side by side
    # the figure is not blank: the curves and the shaded weight give many distinct colours
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 50


def test_plot_designs_tables_that_are_not_shipped(capsys, tmp_path):
    out = tmp_path / "elu.png"
    code, _, err = run(
        capsys, "plot", "elu", "--param", "alpha=0.5", "--bits", "2", "--weight", "laplace", "--out", str(out)
    )
    assert code == 0, err
    assert out.stat().st_size > 10_000


def test_curves_prints_the_table_and_writes_png_and_csv(capsys, tmp_path):
    out, table = tmp_path / "curves.png", tmp_path / "curves.csv"
    code, stdout, err = run(
        capsys, "curves", "gelu", "sigmoid", "--bits", "1-4", "--out", str(out), "--csv", str(table)
    )
    assert code == 0, err
    assert "error, mode levelsets" in stdout and "error, mode intervals" in stdout
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 2 * 2 * 4
    # the numbers are the shipped tables' errors (uniform weight on [-10, 10])
    row = next(r for r in rows if r["activation"] == "gelu" and r["mode"] == "intervals" and r["bits"] == "3")
    assert float(row["error"]) == pytest.approx(load(TABLES_DIR / "gelu/intervals-uniform-3bit.json").error, rel=1e-11)
    sigmoid = next(r for r in rows if r["activation"] == "sigmoid" and r["mode"] == "intervals")
    assert sigmoid["symmetric"] == "true"
    assert read_png(out).shape[0] > 400


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["plot", "gelo", "--out", "{tmp}/a.png"], "unknown activation 'gelo'; did you mean 'gelu'"),
        (["plot", "gelu", "--bits", "0-9", "--out", "{tmp}/a.png"], "--bits must be from 1 to 8, got '0-9'"),
        (["plot", "gelu", "--bits", "x", "--out", "{tmp}/a.png"], "--bits must be a number, a range"),
        (["plot", "gelu", "--out", "{tmp}/missing/a.png"], "does not exist"),
        (["curves", "gelu", "--bits", "0-9", "--out", "{tmp}/c.png"], "--bits must be from 1 to 8"),
        (["curves", "nope", "--out", "{tmp}/c.png"], "unknown activation 'nope'"),
        (["curves", "gelu", "--out", "{tmp}"], "is a directory"),
        (["tables", "verify", "--dir", "{tmp}"], "no table index"),
        (["tables", "build", "--out", "{tmp}/file.txt"], "is a file"),
        (["tables", "build", "--check", "--out", "{tmp}"], "no table index"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, args, fragment):
    (tmp_path / "file.txt").write_text("x")
    code, stdout, err = run(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2
    assert fragment in err
    assert err.count("\n") == 1 and err.startswith("fewbit-design: error: ")
    assert "Traceback" not in err
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "c.png").exists()


def test_existing_output_needs_force(capsys, tmp_path):
    out = tmp_path / "g.png"
    out.write_bytes(b"keep")
    code, _, err = run(capsys, "plot", "gelu", "--bits", "1", "--out", str(out))
    assert code == 2 and "exists; pass --force" in err
    assert out.read_bytes() == b"keep"
    code, _, err = run(capsys, "plot", "gelu", "--bits", "1", "--out", str(out), "--force")
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tables_verify_command_on_shipped_set(capsys):
    code, stdout, err = run(capsys, "tables", "verify", "--activation", "relu")
    assert code == 0, err
    assert "ok: every table validates; 32 recomputed, each the same table as the one in the set" in stdout


def test_tables_build_check_writes_nothing_and_reports_a_changed_table(capsys, tmp_path):
    import json
    import shutil

    root = tmp_path / "tables"
    shutil.copytree(TABLES_DIR, root)
    path = root / "relu" / "intervals-uniform-2bit.json"
    data = json.loads(path.read_text())
    data["error"] = 0.5
    path.write_text(json.dumps(data))
    before = sorted((p, p.stat().st_mtime_ns) for p in root.rglob("*.json"))
    code, stdout, err = run(capsys, "tables", "build", "--check", "--activation", "relu", "--out", str(root))
    assert code == 2
    # problems only with the changed table (its stored error, and its index entry that no longer matches it); the
    # other 31 rebuilt in memory are the same tables
    fails = [line for line in err.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 2 and all("relu/intervals-uniform-2bit.json" in line for line in fails), err
    assert "relu/intervals-uniform-2bit.json" in err and "field 'error' is 0.5, recomputed" in err
    assert sorted((p, p.stat().st_mtime_ns) for p in root.rglob("*.json")) == before
