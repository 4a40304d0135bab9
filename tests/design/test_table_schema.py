"""docs/table-format.schema.json describes what the toolkit writes: every shipped table, ``Table.to_json()`` output
and the example in docs/table-format.md validate against it, and broken tables do not.

``jsonschema`` is not a dependency, so this file carries a small validator for the subset of JSON Schema (draft
2020-12) the schema uses. It refuses any keyword it does not implement, so the schema cannot grow a rule that is
silently ignored here.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fewbit_design import table as table_module
from fewbit_design.design import design
from fewbit_design.design.weights import make_weight
from fewbit_design.errors import FewBitError
from fewbit_design.tables import TABLES_DIR

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = ROOT / "docs" / "table-format.schema.json"
DOC_PATH = ROOT / "docs" / "table-format.md"

ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description", "$comment", "examples"}
_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
}


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def validate(instance: Any, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    """Every violation of ``schema`` by ``instance``, as 'path: message' lines (empty when valid)."""
    root = schema if root is None else root
    errors: list[str] = []
    for keyword, value in schema.items():
        if keyword in ANNOTATIONS:
            continue
        if keyword == "$ref":
            assert value.startswith("#/"), f"only local $ref is supported, got {value!r}"
            target = root
            for part in value[2:].split("/"):
                target = target[part]
            errors += validate(instance, target, root, path)
        elif keyword == "type":
            types = [value] if isinstance(value, str) else value
            if not any(_TYPES[t](instance) for t in types):
                errors.append(f"{path}: {instance!r} is not of type {value}")
        elif keyword == "const":
            if not _equal(instance, value):
                errors.append(f"{path}: {instance!r} is not {value!r}")
        elif keyword == "enum":
            if not any(_equal(instance, choice) for choice in value):
                errors.append(f"{path}: {instance!r} is not one of {value}")
        elif keyword in ("minimum", "maximum", "exclusiveMinimum"):
            if _TYPES["number"](instance):
                ok = {"minimum": instance >= value, "maximum": instance <= value, "exclusiveMinimum": instance > value}
                if not ok[keyword]:
                    errors.append(f"{path}: {instance!r} fails {keyword} {value}")
        elif keyword in ("minItems", "maxItems"):
            if isinstance(instance, list) and not (
                len(instance) >= value if keyword == "minItems" else len(instance) <= value
            ):
                errors.append(f"{path}: {len(instance)} items fails {keyword} {value}")
        elif keyword == "minLength":
            if isinstance(instance, str) and len(instance) < value:
                errors.append(f"{path}: {instance!r} is shorter than {value}")
        elif keyword == "pattern":
            if isinstance(instance, str) and re.search(value, instance) is None:
                errors.append(f"{path}: {instance!r} does not match {value!r}")
        elif keyword == "items":
            if isinstance(instance, list):
                for index, item in enumerate(instance):
                    errors += validate(item, value, root, f"{path}[{index}]")
        elif keyword == "required":
            if isinstance(instance, dict):
                errors += [f"{path}: missing {name!r}" for name in value if name not in instance]
        elif keyword == "properties":
            if isinstance(instance, dict):
                for name, subschema in value.items():
                    if name in instance:
                        errors += validate(instance[name], subschema, root, f"{path}.{name}")
        elif keyword == "additionalProperties":
            if isinstance(instance, dict):
                extra = [name for name in instance if name not in schema.get("properties", {})]
                for name in extra:
                    if value is False:
                        errors.append(f"{path}: unexpected field {name!r}")
                    elif isinstance(value, dict):
                        errors += validate(instance[name], value, root, f"{path}.{name}")
        elif keyword == "oneOf":
            matches = [not validate(instance, option, root, path) for option in value]
            if sum(matches) != 1:
                errors.append(f"{path}: matches {sum(matches)} of the {len(value)} oneOf alternatives, not exactly 1")
        else:
            raise AssertionError(f"the test validator does not implement JSON Schema keyword {keyword!r} ({path})")
    return errors


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def shipped_files() -> list[Path]:
    return sorted(p for p in TABLES_DIR.rglob("*.json") if p.name != "index.json")


def test_every_shipped_table_validates(schema):
    files = shipped_files()
    assert len(files) >= 600  # the whole shipped set, not an empty glob
    problems = {}
    for path in files:
        errors = validate(json.loads(path.read_text(encoding="utf-8")), schema)
        if errors:
            problems[str(path.relative_to(TABLES_DIR))] = errors[:3]
    assert not problems, f"{len(problems)} shipped tables do not match the schema, e.g. {next(iter(problems.items()))}"


def _empirical_samples() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(500)


@pytest.mark.parametrize(
    ("activation", "bits", "options"),
    [
        ("relu6", 1, {}),  # exact: error 0, snr_db null
        ("gelu", 2, {"weight": "normal"}),
        ("sigmoid", 1, {"mode": "intervals", "symmetric": True}),
        ("leaky_relu", 1, {"params": {"negative_slope": 0.2}, "weight": make_weight("laplace", scale=2.0)}),
        ("silu", 1, {"mode": "intervals", "weight": make_weight("student-t", df=3.0, low=-6.0, high=6.0)}),
        ("tanh", 1, {"weight": make_weight("empirical", samples=_empirical_samples(), low=-5.0, high=5.0)}),
    ],
)
def test_to_json_output_validates(schema, activation, bits, options):
    options = dict(options)
    params = options.pop("params", None)
    if params:
        from fewbit_design.design.activations import bind

        activation = bind(activation, params)
    text = design(activation, bits, grid=257 if options.get("mode") == "intervals" else None, **options).to_json()
    assert validate(json.loads(text), schema) == []


def test_empirical_weight_from_a_file_validates(schema, tmp_path):
    path = tmp_path / "preacts.npy"
    np.save(path, _empirical_samples())
    data = json.loads(design("relu", 1, weight=make_weight("empirical", samples=str(path))).to_json())
    assert data["weight"]["file"] == "preacts.npy"
    assert validate(data, schema) == []


def test_a_hand_built_table_validates(schema):
    t = table_module.Table(activation="relu", params={}, bits=1, mode="levelsets", symmetric=False,
                           weight={"kind": "uniform", "low": -10.0, "high": 10.0},
                           boundaries=[0.0], codes=[0, 1], levels=[0.0, 1.0], error=0.0, snr_db=None)  # fmt: skip
    assert validate(json.loads(t.to_json()), schema) == []


def test_the_documented_example_is_a_valid_table(schema):
    blocks = re.findall(r"```json\n(.*?)```", DOC_PATH.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "docs/table-format.md has no json example"
    for block in blocks:
        assert validate(json.loads(block), schema) == []
        loaded = table_module.loads(block, source="docs/table-format.md")
        assert loaded.to_json() == block  # the example is exactly what the writer produces


def _base() -> dict:
    return json.loads((TABLES_DIR / "gelu" / "levelsets-normal-2bit.json").read_text(encoding="utf-8"))


def _set(data: dict, dotted: str, value: Any) -> dict:
    *parents, last = dotted.split(".")
    target = data
    for part in parents:
        target = target[part]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return data


_DELETE = object()

BROKEN = [
    ("format", "fewbit-table/2", "$.format"),
    ("bits", 9, "$.bits"),
    ("bits", 2.5, "$.bits"),
    ("bits", True, "$.bits"),
    ("mode", "Levelsets", "$.mode"),
    ("symmetric", 0, "$.symmetric"),
    ("activation", "", "$.activation"),
    ("levels", [], "$.levels"),
    ("codes", [0, 1, 2, -1], "$.codes[3]"),
    ("boundaries", [-0.5, "0", 0.5], "$.boundaries[1]"),
    ("error", -1.0, "$.error"),
    ("snr_db", "17", "$.snr_db"),
    ("params", {"approximate": ["none"]}, "$.params.approximate"),
    ("weight.kind", "cauchy", "$.weight"),
    ("weight.scale", 0.0, "$.weight"),
    ("weight.sigma", 1.0, "$.weight"),
    ("weight.loc", _DELETE, "$.weight"),
    ("design.grid", 1, "$.design.grid"),
    ("design", _DELETE, "missing 'design'"),
    ("extra", 1, "unexpected field 'extra'"),
]


@pytest.mark.parametrize(
    ("field", "value", "where"),
    BROKEN,
    ids=[f"{f}=deleted" if v is _DELETE else f"{f}={v!r}"[:40] for f, v, _ in BROKEN],
)
def test_broken_tables_are_rejected_naming_the_field(schema, field, value, where):
    assert validate(_base(), schema) == []
    errors = validate(_set(_base(), field, value), schema)
    assert errors and any(where in error for error in errors), errors


def test_what_the_schema_rejects_in_the_arrays_the_loader_rejects_too(schema):
    # The loader and the schema agree on these; the rules only the loader can check are in docs/table-format.md.
    for field, value in [("bits", 9), ("mode", "fast"), ("codes", [0, 1, 2, -1]), ("levels", [])]:
        broken = _set(_base(), field, value)
        assert validate(broken, schema)
        with pytest.raises(FewBitError, match=field):
            table_module.Table.from_dict(broken, source="broken")


def test_the_loader_checks_what_the_schema_cannot(schema):
    for field, value in [("boundaries", [0.5, -0.5, 0.0]), ("codes", [0, 1, 2]), ("codes", [0, 1, 2, 4])]:
        broken = _set(_base(), field, value)
        assert validate(broken, schema) == []  # structurally fine...
        with pytest.raises(FewBitError, match=field):  # ...but not a table
            table_module.Table.from_dict(broken, source="broken")


def test_the_validator_refuses_keywords_it_does_not_implement():
    with pytest.raises(AssertionError, match="does not implement"):
        validate(1, {"multipleOf": 2})
    assert validate({"a": 1}, {"type": "object", "properties": {"a": {"type": "string"}}}) == [
        "$.a: 1 is not of type string"
    ]
    assert validate(copy.deepcopy(True), {"const": 1}) != []
