"""Fuzzing the two file formats of the design side: the table format (``fewbit-table/1``)
and the index format (``fewbit-index/1``). Valid files are mutated (values replaced by JSON of any type, keys removed
or added, containers wrapped, deep nesting, integer literals beyond 4300 digits, numbers beyond float64, NaN and
Infinity tokens, truncation, random and non-UTF-8 bytes): every input either loads or raises ``FewBitError``,
nothing else; a table that loads writes back and loads again unchanged.

Example counts are small by default (a few seconds); ``HYPOTHESIS_PROFILE=nightly`` gives 20x more.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fewbit_design.errors import FewBitError
from fewbit_design.table import Table, load, loads
from fewbit_design.tables import TABLES_DIR, read_index

settings.register_profile("fewbit-fuzz", max_examples=150, deadline=None)
settings.register_profile("fewbit-fuzz-nightly", max_examples=3000, deadline=None)
PROFILE = settings.get_profile(
    "fewbit-fuzz-nightly" if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else "fewbit-fuzz"
)
FUZZ = settings(PROFILE, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

VALID_TABLES = [
    "relu/levelsets-uniform-1bit.json",
    "gelu/intervals-normal-2bit.json",
    "gelu_tanh/levelsets-uniform-3bit.json",
    "sigmoid/intervals-symmetric-uniform-2bit.json",
]

SPECIAL = [None, True, False, 0, -1, 1, 8, 9, 2**31, 2**63, 2**64, 10**300, -(10**300), 0.5, -0.0, 5e-324, 1e308,
           -1e308, 3.5e38, "", "relu", "levelsets", "intervals", "uniform", "fewbit-table/1", "fewbit-index/1",
           "../../etc/passwd", "/abs/path.json", "\u00e9\u4e2d", "\ud800"]  # fmt: skip
LEAVES = st.one_of(
    st.sampled_from(SPECIAL),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    LEAVES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def paths(document, prefix=()):
    """Every path (a tuple of keys and indices) in ``document``, the root included."""
    yield prefix
    if isinstance(document, dict):
        for key, value in document.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield from paths(value, (*prefix, index))


def replace(document, path, value):
    if not path:
        return value
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return document


def delete(document, path):
    if not path:
        return document
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    del parent[path[-1]]
    return document


TEXT_MUTATIONS = ["none", "big-integer", "big-float", "nan", "infinity", "truncate", "bytes", "non-utf8", "nest"]


@st.composite
def mutated(draw, document):
    """The bytes of ``document`` after 1 to 3 structural mutations and at most one mutation of the text."""
    document = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(paths(document))))
        kind = draw(st.sampled_from(["replace", "delete", "add-key", "wrap", "append"]))
        if kind == "replace":
            document = replace(document, path, draw(JSON_VALUES))
        elif kind == "delete":
            document = delete(document, path)
        elif kind == "wrap":
            target = document
            for step in path:
                target = target[step]
            document = replace(document, path, draw(st.sampled_from([[target], {"value": target}])))
        else:
            target = document
            for step in path:
                target = target[step]
            if isinstance(target, dict):
                target[draw(st.text(max_size=8))] = draw(JSON_VALUES)
            elif isinstance(target, list):
                target.append(draw(JSON_VALUES))
    text = json.dumps(document, allow_nan=True, ensure_ascii=draw(st.booleans()))
    mutation = draw(st.sampled_from(TEXT_MUTATIONS))
    numbers = [i for i, c in enumerate(text) if c.isdigit() and (i == 0 or not text[i - 1].isalnum())]
    position = draw(st.integers(0, len(text)))
    if mutation == "big-integer" and numbers:
        at = draw(st.sampled_from(numbers))
        text = text[:at] + "9" * draw(st.sampled_from([4301, 5000, 20000])) + text[at:]
    elif mutation == "big-float" and numbers:
        at = draw(st.sampled_from(numbers))
        text = text[:at] + "1" + "0" * 400 + ".5" + text[at:]
    elif mutation in ("nan", "infinity") and numbers:
        at = draw(st.sampled_from(numbers))
        end = at
        while end < len(text) and (text[end].isdigit() or text[end] in ".eE+-"):
            end += 1
        text = text[:at] + ("NaN" if mutation == "nan" else "-Infinity") + text[end:]
    elif mutation == "truncate":
        text = text[:position]
    elif mutation == "nest":
        depth = draw(st.sampled_from([40, 1000, 100_000]))
        text = text[:position] + "[" * depth + "]" * depth + text[position:]
    data = text.encode("utf-8", "surrogatepass")
    if mutation == "bytes":
        data = data[:position] + draw(st.binary(min_size=1, max_size=8)) + data[position:]
    elif mutation == "non-utf8":
        data = data[:position] + b"\xff\xfe" + data[position:]
    return data


def check_table_or_error(read):
    """``read()`` gives a table, which writes back and reads again unchanged, or raises FewBitError; nothing else."""
    try:
        table = read()
    except FewBitError as error:
        assert "\n" not in str(error)
        return
    assert isinstance(table, Table)
    again = loads(table.to_json())
    assert again.to_json() == table.to_json()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(data=st.data())
def test_mutated_table_files_load_or_raise_fewbit_error(scratch, data):
    name = data.draw(st.sampled_from(VALID_TABLES))
    document = json.loads((TABLES_DIR / name).read_text())
    raw = data.draw(mutated(document))
    path = scratch / "table.json"
    path.write_bytes(raw)
    check_table_or_error(lambda: load(path))
    text = raw.decode("utf-8", "replace")
    check_table_or_error(lambda: loads(text, "table.json"))


@FUZZ
@given(raw=st.binary(max_size=300))
def test_random_bytes_are_not_a_table(scratch, raw):
    path = scratch / "bytes.json"
    path.write_bytes(raw)
    check_table_or_error(lambda: load(path))


@pytest.fixture(scope="module")
def index_root(tmp_path_factory):
    """A tables folder: the relu and gelu tables of the shipped set (files only) and their index."""
    root = tmp_path_factory.mktemp("index")
    document = read_index(TABLES_DIR)
    entries = [entry for entry in document["tables"] if entry["activation"] in ("relu", "gelu")]
    for entry in entries:
        (root / entry["file"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TABLES_DIR / entry["file"], root / entry["file"])
    return root, {**document, "tables": entries}


def load_through_index(root):
    """Every path by which the index is read: the design side's reader and the runtime's lookup."""
    from fewbit_design.runtime.fewbit import lookup

    read_index(root)
    for name, bits, mode, weight in (("relu", 1, "levelsets", "uniform"), ("gelu", 3, "intervals", "normal")):
        lookup.load_table(name, bits=bits, mode=mode, weight=weight, root=root)


@FUZZ
@given(data=st.data())
def test_mutated_index_files_load_or_raise_fewbit_error(index_root, data):
    root, document = index_root
    small = {**document, "tables": data.draw(st.lists(st.sampled_from(document["tables"]), min_size=1, max_size=6))}
    small["tables"] += [e for e in document["tables"] if e["file"] in ("relu/levelsets-uniform-1bit.json",)]
    raw = data.draw(mutated(small))
    (root / "index.json").write_bytes(raw)
    try:
        load_through_index(root)
    except FewBitError as error:
        assert "\n" not in str(error)


# ----------------------------------------------------------------------------------------------------------------------
# Regression tests of what the fuzzing found (each failed before the fix with another exception or a bad round trip)


def relu_document(**overrides):
    document = json.loads((TABLES_DIR / "relu/levelsets-uniform-1bit.json").read_text())
    document.update(overrides)
    return document


def test_an_integer_literal_beyond_4300_digits_is_a_fewbit_error():
    text = json.dumps(relu_document()).replace('"bits": 1', '"bits": 1' + "0" * 5000)
    with pytest.raises(FewBitError, match=r"table 'big.json': not valid JSON \(Exceeds the limit \(4300 digits\)"):
        loads(text, "big.json")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_nan_infinity_and_overflowing_numbers_are_not_table_json(token):
    text = json.dumps(relu_document()).replace('"high": 10.0', f'"high": {token}')
    with pytest.raises(FewBitError, match="not valid"):
        loads(text, "t.json")  # before: loaded, and the table could not be written back (ValueError)


def test_a_table_without_error_writes_back_as_null():
    document = relu_document()
    del document["error"]
    table = Table.from_dict(document)
    assert json.loads(table.to_json())["error"] is None  # before: ValueError (NaN is not JSON) on to_json
    assert loads(table.to_json()).to_json() == table.to_json()


@pytest.mark.parametrize("params", [{"negative_slope": [0.2]}, {"x": {"y": 1}}])
def test_table_params_must_be_scalars(params):
    with pytest.raises(FewBitError, match="field 'params' must map names to numbers, strings or booleans"):
        Table.from_dict(relu_document(params=params))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"params": [{}]}, "entry 0 field 'params' has the wrong type"),  # before: ValueError from dict([{}])
        ({"file": ["relu"]}, "entry 0 field 'file' has the wrong type"),
        ({"bits": True}, "entry 0 field 'bits' has the wrong type"),
    ],
)
def test_index_entries_of_the_wrong_type_are_one_error(index_root, entry, message):
    from fewbit_design.runtime.fewbit import lookup

    root, document = index_root
    first = next(e for e in document["tables"] if e["file"] == "relu/levelsets-uniform-1bit.json")
    (root / "index.json").write_text(json.dumps({**document, "tables": [{**first, **entry}]}))
    with pytest.raises(FewBitError, match=message):
        read_index(root)
    with pytest.raises(FewBitError, match=message):
        lookup.load_table("relu", bits=1, root=root)


def test_an_index_with_a_huge_integer_is_one_error(index_root):
    from fewbit_design.runtime.fewbit import lookup

    root, document = index_root
    (root / "index.json").write_text(json.dumps(document).replace('"bits": 1', '"bits": ' + "7" * 5000, 1))
    for read in (lambda: read_index(root), lambda: lookup.load_table("relu", bits=1, root=root)):
        with pytest.raises(FewBitError, match="4300 digits"):
            read()
