"""The shipped table set: completeness, validity, level sets <= intervals, builds that are
deterministic on one machine and the same table (tables.same) across machines, and `tables verify` catching a
tampered file. Recomputation is checked on a sample covering every activation."""

import json
import shutil

import pytest

from fewbit_design.design import activations
from fewbit_design.errors import FewBitError
from fewbit_design.table import load
from fewbit_design.tables import (
    TABLES_DIR,
    VARIANTS,
    TableSpec,
    build,
    build_table,
    check,
    read_index,
    same,
    sample_specs,
    table_specs,
    verify,
)


def test_index_lists_the_whole_set_and_every_file_validates():
    index = read_index()
    files = {entry["file"] for entry in index["tables"]}
    specs = table_specs()
    variants = sum(len(v) for v in VARIANTS.values())
    assert len(specs) == (len(activations.names()) + variants) * 8 * 2 * 2
    assert files == {spec.file for spec in specs}
    for entry in index["tables"]:
        table = load(TABLES_DIR / entry["file"])
        assert (table.activation, table.bits, table.mode, table.symmetric) == (
            entry["activation"],
            entry["bits"],
            entry["mode"],
            entry["symmetric"],
        )
        # torch defaults, or the variant's params (gelu approximate='tanh' in gelu_tanh/)
        assert table.params == entry["params"] == activations.bind(entry["activation"], entry["params"]).params
        assert table.weight["low"] == -10.0 and table.weight["high"] == 10.0


def test_level_sets_never_worse_than_intervals_in_the_shipped_set():
    tables = {}
    for entry in read_index()["tables"]:
        folder = entry["file"].split("/")[0]
        tables[(folder, entry["weight"], entry["bits"], entry["mode"])] = entry["error"]
    checked = 0
    for (folder, weight, bits, mode), error in tables.items():
        if mode == "levelsets":
            assert error <= tables[(folder, weight, bits, "intervals")] * (1 + 1e-6) + 1e-15, (folder, weight, bits)
            checked += 1
    assert checked == len(table_specs()) // 2  # every level-sets table has an intervals twin


def test_even_derivatives_ship_symmetric_intervals_tables():
    index = read_index()["tables"]
    for entry in index:
        if entry["mode"] == "intervals":
            assert entry["symmetric"] == activations.bind(entry["activation"], entry["params"]).even
    assert any(e["symmetric"] for e in index) and not all(e["symmetric"] for e in index if e["mode"] == "intervals")


def test_tanh_gelu_and_model_library_activations_are_shipped():
    index = read_index()["tables"]
    tanh = [e for e in index if e["activation"] == "gelu" and e["params"] == {"approximate": "tanh"}]
    assert len(tanh) == 32 and all(e["file"].startswith("gelu_tanh/") for e in tanh)
    assert {(e["bits"], e["mode"], e["weight"]) for e in tanh} == {
        (b, m, w) for b in range(1, 9) for m in ("levelsets", "intervals") for w in ("uniform", "normal")
    }
    for name in ("quick_gelu", "relu_squared"):
        assert len([e for e in index if e["activation"] == name]) == 32
    exact = [e for e in index if e["activation"] == "gelu" and e["params"] == {"approximate": "none"}]
    assert len(exact) == 32 and all(e["file"].startswith("gelu/") for e in exact)


def test_verify_recomputes_a_sample_covering_every_activation():
    # the sample CI relies on: one table per activation at least, the same table as shipped (tables.same)
    names = activations.names()
    chosen = sample_specs(table_specs(), len(names), seed=3)
    assert {spec.activation for spec in chosen} == set(names)
    assert verify(sample=len(names), seed=3) == []


def test_build_is_deterministic_on_one_machine():
    # byte for byte only on the same machine and versions: two designs of the same specs in one process
    specs = [
        TableSpec("hardswish", 3, "levelsets", False, "uniform"),
        TableSpec("gelu", 4, "intervals", False, "normal"),
    ]
    for spec in specs:
        assert build_table(spec)[1] == build_table(spec)[1], spec.file


def test_build_check_finds_the_shipped_set_the_same_table_and_writes_nothing(tmp_path):
    # the cross-machine comparison: rebuilt in memory, compared by the definition of tables.same
    before = {p: p.stat().st_mtime_ns for p in (TABLES_DIR / "hardsigmoid").iterdir()}
    assert check(activations=["hardsigmoid"], jobs=1) == []
    assert {p: p.stat().st_mtime_ns for p in (TABLES_DIR / "hardsigmoid").iterdir()} == before


def test_build_writes_tables_that_check_accepts(tmp_path):
    build(tmp_path, jobs=1, activations=["relu"])
    assert len(read_index(tmp_path)["tables"]) == 32
    for spec in table_specs(["relu"]):
        # every relu table is exact (levels 0 and 1, boundary 5e-324, flat runs laid out by arithmetic): the same
        # values on any machine, unlike tables of smooth derivatives (the design record may differ: grid_error)
        built, shipped = (json.loads((root / spec.file).read_text()) for root in (tmp_path, TABLES_DIR))
        assert {**built, "design": None} == {**shipped, "design": None}, spec.file


@pytest.fixture
def copied_tables(tmp_path):
    root = tmp_path / "tables"
    shutil.copytree(TABLES_DIR, root)
    return root


def test_verify_names_the_table_and_field_of_a_changed_level(copied_tables):
    path = copied_tables / "relu6" / "levelsets-normal-3bit.json"
    data = json.loads(path.read_text())
    shipped = data["levels"][1]
    data["levels"][1] *= 1.01
    path.write_text(json.dumps(data))
    problems = verify(copied_tables, activations=["relu6"])
    assert any(
        "relu6/levelsets-normal-3bit.json" in p and f"'levels[1]' is {shipped * 1.01!r}, recomputed {shipped!r}" in p
        for p in problems
    ), problems


def test_verify_accepts_changes_within_tolerance(copied_tables):
    # what another machine may change: the last digits of boundaries and levels (here 1e-9 relative)
    path = copied_tables / "gelu" / "levelsets-normal-3bit.json"
    data = json.loads(path.read_text())
    data["boundaries"] = [b * (1 + 1e-9) for b in data["boundaries"]]
    data["levels"] = [y * (1 - 1e-9) for y in data["levels"]]
    path.write_text(json.dumps(data))
    fresh = TableSpec("gelu", 3, "levelsets", False, "normal").design()
    assert same.differences(load(path), fresh) == []  # what verify runs for each table


def test_verify_reports_invalid_and_missing_files(copied_tables):
    path = copied_tables / "tanh" / "levelsets-uniform-2bit.json"
    data = json.loads(path.read_text())
    data["codes"][0] = 99
    path.write_text(json.dumps(data))
    (copied_tables / "elu" / "intervals-normal-8bit.json").unlink()
    problems = verify(copied_tables, activations=["relu"])
    assert any("levelsets-uniform-2bit.json" in p and "field 'codes'" in p for p in problems), problems
    assert any("intervals-normal-8bit.json" in p and "does not exist" in p for p in problems), problems


def test_missing_index_is_one_clear_error(tmp_path):
    with pytest.raises(FewBitError, match="no table index.*tables build"):
        read_index(tmp_path)
