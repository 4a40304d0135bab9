"""Code of a readable size: no function of the package longer than 60 lines (its docstring aside; data tables and
numba kernels exempt, each named below with why), no ``__init__.py`` holding more than a re-export list, and the
modules whose code moved keep their public import paths (the old module re-exports the same objects, it does not
copy them). Modules are split by meaning, not by length: there is no line cap on a module."""

from __future__ import annotations

import ast
import importlib
import math
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fewbit_design"
FUNCTION_LIMIT = 60
#: (module path, function): why it may be longer
EXEMPT = {
    ("fewbit_design/design/catalogue.py", "definitions"): "a data table: one entry per activation",
    ("fewbit_design/runtime/fewbit/_numba_kernels.py", "_make_unpack_scale16"): "a numba kernel factory: the "
    "unrolled loop body is one function so that numba compiles one loop",
    ("fewbit_design/runtime/fewbit/_numba_kernels.py", "unpack_scale16"): "the numba kernel it makes",
}


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of each function's body in ``path`` (its docstring aside), by qualified name within the module."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body
                docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                first = body[1] if docstring and len(body) > 1 else body[0]
                lengths[prefix + child.name] = child.end_lineno - first.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return lengths


def test_no_function_is_over_the_limit():
    found = {
        (str(path.relative_to(PACKAGE.parent)), name): lines
        for path in PACKAGE.rglob("*.py")
        for name, lines in function_lengths(path).items()
    }
    assert len(found) > 500  # the walk found the package's functions
    over = {
        key: lines
        for key, lines in found.items()
        if lines > FUNCTION_LIMIT and (key[0], key[1].split(".")[-1]) not in EXEMPT
    }
    assert over == {}


def test_the_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LIMIT + 1))
    source = tmp_path / "long.py"
    source.write_text(f'def long():\n    """Doc."""\n{body}\n\n\nclass A:\n    def short(self):\n        return 1\n')
    assert function_lengths(source) == {"long": FUNCTION_LIMIT + 1, "A.short": 1}


# (module users import, module the code lives in, names)
SPLITS = [
    ("fewbit_design.runtime.fewbit.convert", "fewbit_design.runtime.fewbit.matching", ["ECOSYSTEM", "canonical_name"]),
    (
        "fewbit_design.table",
        "fewbit_design.output_files",
        ["check_writable", "check_outputs", "write_bytes_atomic", "write_files_atomic", "write_text_atomic"],
    ),
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


INIT_CODE_LIMIT = 40  # no __init__.py over 40 lines except pure re-export lists


def _code_lines(path: Path) -> tuple[int, list[str]]:
    """Lines of ``path`` that are code other than its docstring, imports and re-export lists, and the top-level
    definitions it holds (an ``__init__.py`` should hold none)."""
    tree = ast.parse(path.read_text())
    counted, definitions = 0, []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            definitions.append(node.name)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # docstring
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets = [target.id for target in getattr(node, "targets", []) if isinstance(target, ast.Name)]
        if targets == ["__all__"]:  # the re-export list
            continue
        counted += node.end_lineno - node.lineno + 1
    return counted, definitions


def test_package_init_files_only_re_export():
    inits = sorted(PACKAGE.rglob("__init__.py"))
    assert len(inits) > 10  # the walk found the packages
    measured = {str(path.relative_to(PACKAGE.parent)): _code_lines(path) for path in inits}
    assert {path: lines for path, (lines, _) in measured.items() if lines > INIT_CODE_LIMIT} == {}
    assert {path: names for path, (_, names) in measured.items() if names} == {}


def test_the_init_check_sees_logic(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('"""doc"""\nfrom .a import b\n__all__ = ["b"]\n\n\ndef helper():\n    return 1\n')
    assert _code_lines(init) == (2, ["helper"])
