"""One name per concept: "tables" named five modules; the runtime's lookup is ``runtime/fewbit/lookup.py``
and the first docstring line of each table module says which concept it is."""

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "fewbit_design"

CONCEPTS = {
    "table.py": "table file format",
    "tables/__init__.py": "shipped set",
    "runtime/tables.py": "runtime lookup",
    "runtime/fewbit/lookup.py": "runtime lookup",
    "cli/tables.py": "CLI command",
}


@pytest.mark.parametrize("path", sorted(CONCEPTS))
def test_first_docstring_line_names_the_concept(path):
    docstring = ast.get_docstring(ast.parse((PACKAGE / path).read_text()))
    assert docstring is not None and CONCEPTS[path] in docstring.splitlines()[0]


def test_the_runtime_lookup_is_lookup_not_a_second_tables_module():
    from fewbit_design import runtime
    from fewbit_design.runtime import tables
    from fewbit_design.runtime.fewbit import lookup

    assert importlib.util.find_spec("fewbit_design.runtime.fewbit.tables") is None
    assert tables.load_table is lookup.load_table is runtime.load_table
    assert sorted(tables.__all__) == sorted(lookup.__all__)
