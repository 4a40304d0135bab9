"""The ``>>>`` examples in the package's docstrings run, as doctests.

One test per module that has examples; a module that needs an optional package that is not installed (triton,
transformers) is skipped with that reason. Examples marked ``# doctest: +SKIP`` need what a test cannot have (a
download, a GPU, a model of the user's) and are not run.
"""

import doctest
import importlib
import pkgutil

import pytest

import fewbit_design

OPTIONAL = {"triton", "transformers", "accelerate", "timm", "sklearn"}


def _module_names() -> list[str]:
    names = ["fewbit_design"]
    for info in pkgutil.walk_packages(fewbit_design.__path__, "fewbit_design."):
        names.append(info.name)
    return sorted(names)


def _has_examples(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    path = spec.origin if spec else None
    return bool(path and path.endswith(".py") and ">>>" in open(path, encoding="utf-8").read())


MODULES = [name for name in _module_names() if _has_examples(name)]


def test_modules_with_examples_are_found() -> None:
    assert "fewbit_design.runtime.blpa.fuse" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in OPTIONAL | {"torch"}:
            pytest.skip(f"{name} needs {error.name}, not installed")
        raise
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [test for test in finder.find(module, name) if test.examples]
    failures = []
    for test in tests:
        result = runner.run(test, out=failures.append)
        assert result.attempted >= 0
    assert runner.failures == 0, "".join(failures)
