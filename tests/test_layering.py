"""The layering of the package, checked on its import graph (read from the source with ``ast``, so every import
counts: module level and the lazy ones inside functions).

* No import circle anywhere in the package.
* The design side (everything outside ``runtime`` and ``cli``) never imports the runtime or the CLI, and never
  imports torch at module level.
* The runtime never imports the CLI, scipy or matplotlib, and imports numba only lazily: inside a function, or at
  the top of a ``_numba*`` kernel module that is itself imported only inside functions.
* The CLI imports downward only: ``cli`` -> its command modules -> ``cli._options``; nothing outside imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fewbit_design"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """Absolute module names an import statement loads (``from a import b`` loads ``a.b`` when it is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = importer if _is_package(importer) else importer.rpartition(".")[0]
    if node.level:
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    names = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        is_module = (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or _is_package(candidate)
        names.append(candidate if is_module else base)
    return names


def _graph() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(imported module, imported at module level)]"""
    graph: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(node) for node in tree.body}
        for node in tree.body:  # imports under a module-level try/if still run at import time
            if isinstance(node, ast.Try | ast.If):
                top_level |= {id(child) for child in ast.walk(node)}
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges += [(target, id(node) in top_level) for target in _resolve(name, node)]
        graph[name] = edges
    return graph


GRAPH = _graph()


def _side(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("runtime", "cli") else "design"


def _internal(target: str) -> bool:
    return target == "fewbit_design" or target.startswith("fewbit_design.")


def test_graph_covers_the_package():
    assert {"fewbit_design.cli", "fewbit_design.design.engine", "fewbit_design.runtime.fewbit.ops"} <= set(GRAPH)


def test_no_import_circle():
    internal = {
        m: sorted({t for t, _ in edges if _internal(t) and t != m and t in GRAPH}) for m, edges in GRAPH.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in internal[module]:
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in internal:
        if module not in state:
            visit(module)


def _violations(rule) -> list[str]:
    return [f"{m} imports {t}" for m, edges in GRAPH.items() for t, top in edges if rule(m, t, top)]


def test_design_side_never_imports_runtime_cli_or_torch():
    def rule(module: str, target: str, top: bool) -> bool:
        if _side(module) != "design":
            return False
        return _internal(target) and _side(target) != "design" or (top and target.split(".")[0] == "torch")

    assert _violations(rule) == []


def test_runtime_never_imports_cli_scipy_matplotlib_and_numba_only_lazily():
    def rule(module: str, target: str, top: bool) -> bool:
        if _side(module) != "runtime":
            return False
        root = target.split(".")[0]
        if _internal(target) and _side(target) == "cli" or root in ("scipy", "matplotlib", "click"):
            return True
        return root == "numba" and top and not module.rpartition(".")[2].startswith("_numba")

    assert _violations(rule) == []


def test_numba_kernel_modules_are_imported_only_inside_functions():
    kernels = {m for m in GRAPH if m.rpartition(".")[2].startswith("_numba")}
    assert kernels, "expected the numba kernel modules"
    importers = sorted(
        {f"{m} imports {t} at module level" for m, e in GRAPH.items() for t, top in e if t in kernels and top}
    )
    # the few-bit, BLPA, compressed gated-MLP and group-quantizer (linear) kernels build on the shared packing
    # kernels (one copy of the packing); all load only once a CPU kernel runs
    assert importers == [
        "fewbit_design.runtime.blpa._numba_kernels imports fewbit_design.runtime._numba_packing at module level",
        "fewbit_design.runtime.fewbit._numba_kernels imports fewbit_design.runtime._numba_packing at module level",
        "fewbit_design.runtime.gated._numba_gated imports fewbit_design.runtime._numba_packing at module level",
        "fewbit_design.runtime.linear._numba_quant imports fewbit_design.runtime._numba_packing at module level",
    ]


def test_cli_imports_downward_only():
    order = {"fewbit_design.cli": 0, "fewbit_design.cli.main": 0.5, "fewbit_design.cli._options": 2}

    def level(module: str) -> float:
        return order.get(module, 1)  # the command modules sit between the entry point (cli.main) and the options

    def rule(module: str, target: str, top: bool) -> bool:
        if not _internal(target) or _side(target) != "cli":
            return False
        if _side(module) != "cli":
            return True  # nothing outside the CLI imports it
        return level(target) <= level(module) and target != module

    assert _violations(rule) == []


def _replaces_a_module(node: ast.AST) -> bool:
    """``sys.modules[...] = ...`` or ``<anything>.__class__ = ...``: a module standing in for another, or changing
    its own type (to be callable)."""
    if not isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules":
            return True
        if isinstance(target, ast.Attribute) and target.attr == "__class__":
            return True
    return False


def test_no_module_replaces_itself_or_its_class():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if _replaces_a_module(node)
    ]
    assert found == []


@pytest.mark.parametrize("package", ["fewbit_design", "fewbit_design.design", "fewbit_design.runtime"])
def test_package_init_files_only_re_export(package):
    # The top-level, design and runtime packages: every __init__.py holds a docstring, imports, __all__ and lazy
    # tables, no function or class (the logic lives in named modules).
    root = PACKAGE.parent / package.replace(".", "/")
    inits = [root / "__init__.py"] if package != "fewbit_design.runtime" else sorted(root.rglob("__init__.py"))
    holding_logic = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
        for path in inits
        for node in ast.parse(path.read_text(), filename=str(path)).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    assert holding_logic == []
