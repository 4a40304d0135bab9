"""Plain modules of a readable size (issue 21): no module of the package over 700 lines, and the modules split to
get there keep their public import paths (the old module re-exports the same objects, it does not copy them)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fewbit_design"
LIMIT = 700


def test_no_module_is_over_the_limit():
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 50  # the walk found the package
    assert {path: lines for path, lines in sizes.items() if lines > LIMIT} == {}


# (module users import, module the code lives in, names)
SPLITS = [
    (
        "fewbit_design.runtime.fewbit.ops",
        "fewbit_design.runtime.fewbit.backends",
        ["table_tensors", "TableTensors", "quantize", "scale", "quantize_reference", "use_backend", "backend_for"],
    ),
    ("fewbit_design.runtime.fewbit.convert", "fewbit_design.runtime.fewbit.matching", ["ECOSYSTEM", "canonical_name"]),
]


@pytest.mark.parametrize("public, home, names", SPLITS)
def test_split_modules_re_export_the_same_objects(public, home, names):
    public_module, home_module = importlib.import_module(public), importlib.import_module(home)
    assert all(getattr(public_module, name) is getattr(home_module, name) for name in names)
    assert set(names) <= set(public_module.__all__)


def test_activation_registry_is_built_from_the_catalogue():
    from fewbit_design.design import activations, catalogue

    assert [entry["name"] for entry in catalogue.definitions()] == activations.names()
    expected = catalogue.SELU_SCALE * catalogue.SELU_ALPHA * math.exp(-1.0)  # selu'(-1), from the catalogue's constants
    assert activations.bind("selu").df([-1.0]).item() == pytest.approx(expected, rel=1e-15)
