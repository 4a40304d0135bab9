"""The fewbit-table/1 format: validation, JSON round trip, q(x) semantics, atomic writes."""

import json
import os

import numpy as np
import pytest

from fewbit_design.errors import FewBitError
from fewbit_design.table import MAX_TABLE_BYTES, Table, format_float, load, loads

UNIFORM = {"kind": "uniform", "low": -10.0, "high": 10.0}


def make(**overrides):
    fields = dict(
        activation="gelu",
        params={"approximate": "none"},
        bits=2,
        mode="intervals",
        symmetric=False,
        weight=UNIFORM,
        boundaries=[-1.0, 0.0, 1.5],
        codes=[0, 1, 2, 3],
        levels=[0.0, 0.25, 0.75, 1.0],
        error=0.04,
        snr_db=21.5,
        design={"grid": 11},
    )
    fields.update(overrides)
    return Table(**fields)


def test_q_follows_boundaries_and_right_closed_convention():
    table = make()
    x = np.array([-5.0, -1.0 - 1e-12, -1.0, -0.5, 0.0, 1.49, 1.5, 100.0])
    # a point on a boundary belongs to the interval on its right
    assert table.interval(x).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert table.q(x).tolist() == [0.0, 0.0, 0.25, 0.25, 0.75, 0.75, 1.0, 1.0]


def test_codes_may_repeat_across_intervals():
    table = make(bits=1, boundaries=[-1.0, 1.0], codes=[1, 0, 1], levels=[0.2, 0.9])
    assert table.q([-3.0, 0.0, 3.0]).tolist() == [0.9, 0.2, 0.9]


def test_json_round_trip_is_exact_and_deterministic():
    table = make(boundaries=[-1.0 / 3.0, 0.1, 2.0 / 7.0], levels=[0.1, 1 / 3, 2 / 3, 0.9])
    text = table.to_json()
    again = loads(text)
    assert again.to_json() == text
    np.testing.assert_array_equal(again.boundaries, [format_float(b) for b in table.boundaries])
    assert again.codes.tolist() == table.codes.tolist()
    assert json.loads(text)["format"] == "fewbit-table/1"


def test_format_float_keeps_12_significant_digits():
    assert format_float(1 / 3) == 0.333333333333
    assert format_float(-2.0e-17 / 3) == -6.66666666667e-18
    assert format_float(0.0) == 0.0


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("bits", 0, "field 'bits' must be an integer from 1 to 8"),
        ("bits", 9, "field 'bits'"),
        ("mode", "foo", "must be 'levelsets' or 'intervals', got 'foo'"),
        ("boundaries", [0.0, -1.0, 2.0], "strictly increasing"),
        ("boundaries", [0.0, float("nan"), 2.0], "finite"),
        ("codes", [0, 1, 2], "len(boundaries) + 1 = 4"),
        ("codes", [0, 1, 2, 4], "must be in [0, 4)"),
        ("levels", [0.0, 1.0, float("inf"), 0.0], "finite"),
        ("levels", [0.0] * 5, "1 to 4 finite numbers"),
        ("error", -1.0, "field 'error'"),
        ("snr_db", float("inf"), "field 'snr_db'"),
    ],
)
def test_invalid_tables_name_the_field(field, value, fragment):
    with pytest.raises(FewBitError) as info:
        make(**{field: value})
    assert fragment in str(info.value)
    assert f"'{field}'" in str(info.value)


def test_load_names_file_and_field(tmp_path):
    data = make().to_dict()
    data["codes"] = [0, 1, "two", 3]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FewBitError, match=r"bad\.json.*field 'codes'"):
        load(path)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"format": "other/2"}', "field 'format' must be 'fewbit-table/1'"),
        ('{"format": "fewbit-table/1", "activation": "gelu"}', "field 'bits' is missing"),
    ],
)
def test_loads_rejects_malformed_documents(text, fragment):
    with pytest.raises(FewBitError, match=fragment.replace("(", r"\(")):
        loads(text, source="t.json")


def test_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(FewBitError, match="does not exist"):
        load(tmp_path / "nope.json")


def test_save_is_atomic_and_refuses_to_overwrite(tmp_path):
    table = make()
    path = tmp_path / "t.json"
    table.save(path)
    assert load(path).to_json() == table.to_json()
    with pytest.raises(FewBitError, match="exists; pass --force"):
        make(error=0.5).save(path)
    assert load(path).error == 0.04  # untouched
    make(error=0.5).save(path, force=True)
    assert load(path).error == 0.5
    assert sorted(os.listdir(tmp_path)) == ["t.json"]  # no temporary files left behind


def test_save_into_missing_directory_fails_without_partial_file(tmp_path):
    with pytest.raises(FewBitError, match="does not exist"):
        make().save(tmp_path / "missing" / "t.json")
    assert not (tmp_path / "missing").exists()


def test_arrays_are_read_only():
    table = make()
    with pytest.raises(ValueError):
        table.levels[0] = 5.0


def test_written_files_get_ordinary_permissions(tmp_path):
    # regression: the temporary file behind an atomic write used to leave outputs readable by the owner only
    path = tmp_path / "t.json"
    old = os.umask(0o022)
    try:
        make().save(path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


# ----------------------------------------------------------------------------------------------------------------------
# The design side reads table files with the runtime's bounds: before the loader was shared, a 10**5-deep
# file raised RecursionError and a 401-digit integer OverflowError from fewbit_design.load.


def _relu_document(**overrides):
    document = {
        "format": "fewbit-table/1", "activation": "relu", "params": {}, "bits": 1, "mode": "levelsets",
        "symmetric": False, "weight": {"kind": "uniform", "low": -10.0, "high": 10.0},
        "boundaries": [5e-324], "codes": [0, 1], "levels": [0.0, 1.0], "error": 0.0, "snr_db": None,
    }  # fmt: skip
    document.update(overrides)
    return document


def test_design_loader_bounds_nesting_before_parsing(tmp_path):
    path = tmp_path / "nested.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FewBitError, match=r"nested\.json.*nesting depth 100000 exceeds the limit of 32"):
        load(path)


def test_design_loader_bounds_file_size(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(" " * (MAX_TABLE_BYTES + 1))
    with pytest.raises(FewBitError, match=r"big\.json.*file size .* exceeds the limit"):
        load(path)


@pytest.mark.parametrize("field", ["boundaries", "levels", "error"])
def test_design_loader_names_an_integer_beyond_the_float_range(field, tmp_path):
    document = _relu_document()
    document[field] = [10**400, 1.0] if isinstance(document[field], list) else 10**400
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(document))
    with pytest.raises(FewBitError, match=f"field '{field}' holds the integer"):
        load(path)
    assert loads(json.dumps(_relu_document()), "ok").activation == "relu"  # the unbroken document loads
