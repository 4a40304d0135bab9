"""Every public function and class has a docstring that names its arguments.

Public: the names in ``__all__`` of each public module (``PUBLIC_MODULES``). A class's constructor arguments may be
named in the class docstring or in ``__init__``'s. ``EXEMPT`` lists the few callables whose arguments are
documented elsewhere, each with the reason.
"""

import importlib
import inspect

import pytest

PUBLIC_MODULES = [
    "fewbit_design",
    "fewbit_design.errors",
    "fewbit_design.table",
    "fewbit_design.design",
    "fewbit_design.design.activations",
    "fewbit_design.design.weights",
    "fewbit_design.design.snr",
    "fewbit_design.tables",
    "fewbit_design.cli",
    "fewbit_design.runtime",
    "fewbit_design.runtime.nn",
    "fewbit_design.runtime.functional",
    "fewbit_design.runtime.tables",
    "fewbit_design.runtime.memory",
    "fewbit_design.runtime.registry",
    "fewbit_design.runtime.hf",
    "fewbit_design.runtime.norms",
    "fewbit_design.runtime.gated",
    "fewbit_design.runtime.attention",
    "fewbit_design.runtime.linear",
    "fewbit_design.runtime.head",
    "fewbit_design.runtime.blpa",
    "fewbit_design.runtime.reversible",
    "fewbit_design.runtime.checkpoint",
    "fewbit_design.runtime.offload",
    "fewbit_design.runtime.planner",
]

# qualified name -> why its arguments need not be named in its docstring
EXEMPT: dict[str, str] = {}

SKIPPED_PARAMETERS = {"self", "cls"}


def _callables():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__.startswith("fewbit_design"):
                yield f"{module_name}.{name}", value


def _missing(value) -> list[str]:
    """The parameters of ``value`` (its constructor's, for a class) its docstrings do not name."""
    if inspect.isclass(value):
        text = (inspect.getdoc(value) or "") + (inspect.getdoc(value.__init__) or "")
        function = value.__init__ if "__init__" in vars(value) else None
        if function is None:
            return []
    else:
        text, function = inspect.getdoc(value) or "", value
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    names = [
        p.name
        for p in parameters
        if p.name not in SKIPPED_PARAMETERS
        and not p.name.startswith("_")  # private by convention (internal dataclass fields): not part of the API
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return [name for name in names if name not in text]


def test_every_public_callable_has_a_docstring_naming_its_arguments() -> None:
    pytest.importorskip("torch")
    problems = []
    for qualified, value in _callables():
        if not (inspect.getdoc(value) or "").strip():
            problems.append(f"{qualified}: no docstring")
        elif qualified not in EXEMPT and (missing := _missing(value)):
            problems.append(f"{qualified}: docstring does not name {', '.join(missing)}")
    assert problems == [], "\n".join(problems)


def test_the_check_sees_an_unnamed_argument() -> None:
    def documented(alpha, *, beta=1):
        """Uses alpha and beta."""

    def undocumented(alpha, gamma):
        """Uses alpha."""

    assert _missing(documented) == []
    assert _missing(undocumented) == ["gamma"]


def test_exemptions_are_public_names() -> None:
    names = {qualified for qualified, _ in _callables()}
    assert set(EXEMPT) <= names
