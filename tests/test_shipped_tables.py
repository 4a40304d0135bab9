"""The shipped table set (issue 3): completeness, validity, level sets <= intervals, reproducible builds, and
`tables verify` catching a tampered file. Recomputation is checked on a sample covering every activation."""

import json
import shutil

import pytest

from fewbit_design.design import activations
from fewbit_design.errors import FewBitError
from fewbit_design.table import load
from fewbit_design.tables import TABLES_DIR, build, read_index, sample_specs, table_specs, verify


def test_index_lists_the_whole_set_and_every_file_validates():
    index = read_index()
    files = {entry["file"] for entry in index["tables"]}
    specs = table_specs()
    assert len(specs) == len(activations.names()) * 8 * 2 * 2
    assert files == {spec.file for spec in specs}
    for entry in index["tables"]:
        table = load(TABLES_DIR / entry["file"])
        assert (table.activation, table.bits, table.mode, table.symmetric) == (
            entry["activation"],
            entry["bits"],
            entry["mode"],
            entry["symmetric"],
        )
        assert table.params == activations.bind(entry["activation"]).params  # torch defaults
        assert table.weight["low"] == -10.0 and table.weight["high"] == 10.0


def test_level_sets_never_worse_than_intervals_in_the_shipped_set():
    tables = {}
    for entry in read_index()["tables"]:
        tables[(entry["activation"], entry["weight"], entry["bits"], entry["mode"])] = entry["error"]
    checked = 0
    for (name, weight, bits, mode), error in tables.items():
        if mode == "levelsets":
            assert error <= tables[(name, weight, bits, "intervals")] * (1 + 1e-9) + 1e-15, (name, weight, bits)
            checked += 1
    assert checked == len(activations.names()) * 2 * 8


def test_even_derivatives_ship_symmetric_intervals_tables():
    index = read_index()["tables"]
    for entry in index:
        if entry["mode"] == "intervals":
            assert entry["symmetric"] == activations.bind(entry["activation"]).even
    assert any(e["symmetric"] for e in index) and not all(e["symmetric"] for e in index if e["mode"] == "intervals")


def test_verify_recomputes_a_sample_covering_every_activation():
    # the sample CI relies on: one table per activation at least, recomputed within 1e-9 relative
    names = activations.names()
    chosen = sample_specs(table_specs(), len(names), seed=3)
    assert {spec.activation for spec in chosen} == set(names)
    assert verify(sample=len(names), seed=3) == []


def test_build_reproduces_shipped_files_byte_for_byte(tmp_path):
    build(tmp_path, jobs=1, activations=["hardswish"])
    for spec in table_specs(["hardswish"]):
        assert (tmp_path / spec.file).read_bytes() == (TABLES_DIR / spec.file).read_bytes(), spec.file


@pytest.fixture
def copied_tables(tmp_path):
    root = tmp_path / "tables"
    shutil.copytree(TABLES_DIR, root)
    return root


def test_verify_names_the_table_and_field_of_a_changed_level(copied_tables):
    path = copied_tables / "relu6" / "levelsets-normal-3bit.json"
    data = json.loads(path.read_text())
    data["levels"][1] *= 1 + 1e-7  # beyond the 1e-9 relative tolerance
    path.write_text(json.dumps(data))
    problems = verify(copied_tables, activations=["relu6"])
    assert any("relu6/levelsets-normal-3bit.json" in p and "'levels[1]'" in p for p in problems), problems


def test_verify_accepts_changes_within_tolerance(copied_tables):
    path = copied_tables / "relu6" / "levelsets-normal-3bit.json"
    data = json.loads(path.read_text())
    data["boundaries"][0] *= 1 + 1e-12
    path.write_text(json.dumps(data))
    assert verify(copied_tables, activations=["relu6"]) == []


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
