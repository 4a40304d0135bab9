"""``--activation-module``: what a user's function does wrong is one line naming the module, the function and the
fault (a None or wrong-shaped result read "f(x) has shape ()", an in-place torch function failed on numpy's missing
``mul_``, and ``sys.exit`` in the module ended the command without a word)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from fewbit_design.cli import main
from fewbit_design.design import activations

USER_MODULE = """
import sys

import numpy as np

def returns_none(x):
    np.tanh(x)

def sorts_in_place(x):
    return x.sort()

def torch_in_place_no_return(x):
    x.mul_(2)

def torch_in_place(x):
    return x.mul_(2)

def adds_in_place(x):
    x += 1
    return x

def one_number(x):
    return 1.0

def wrong_length(x):
    return np.zeros(3)

def column(x):
    return x.reshape(-1, 1)

def text(x):
    return "abc"

def complex_values(x):
    return x * 1j

def exits(x):
    sys.exit(3)

def exits_quietly(x):
    sys.exit(0)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_faults_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    (tmp_path / f"{name}_exits.py").write_text("import sys\nsys.exit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    sys.modules.pop(f"{name}_exits", None)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


RETURNS_NONE = "returned None: it must return f(x), an array of real numbers of x's shape (7,) (in-place operations"


@pytest.mark.parametrize(
    ("function", "fault"),
    [
        ("returns_none", RETURNS_NONE),
        ("sorts_in_place", RETURNS_NONE),
        ("torch_in_place_no_return", RETURNS_NONE),
        ("one_number", "returned a single number for an x of shape (7,): f must act elementwise"),
        ("wrong_length", "returned shape (3,) for an x of shape (7,): f must act elementwise"),
        ("column", "returned shape (7, 1) for an x of shape (7,): f must act elementwise"),
        ("text", "returned a str, not numbers: it must return f(x), an array of real numbers"),
        ("complex_values", "returned complex numbers: it must return f(x), an array of real numbers"),
        ("exits", "called sys.exit(3) instead of returning f(x)"),
        ("exits_quietly", "called sys.exit(0) instead of returning f(x)"),
    ],
)
def test_a_faulty_function_is_one_line_naming_module_function_and_fault(capsys, tmp_path, user_module, function,
                                                                        fault):  # fmt: skip
    out = tmp_path / "table.json"
    code, stdout, err = run(capsys, "--activation-module", f"{user_module}:{function}", "--bits", "2", "--out",
                            str(out))  # fmt: skip
    assert (code, stdout) == (2, "")
    assert err.startswith(f"fewbit-design: error: activation module '{user_module}:{function}': {function}(x) {fault}")
    assert err.count("\n") == 1 and not out.exists()


def test_sys_exit_while_the_module_imports_is_one_line(capsys, user_module):
    spec = f"{user_module}_exits:f"
    code, stdout, err = run(capsys, "--activation-module", spec, "--bits", "2")
    assert (code, stdout) == (2, "")
    message = f"activation module {spec!r}: importing '{user_module}_exits' called sys.exit(4)"
    assert err == f"fewbit-design: error: {message}\n"


@pytest.mark.parametrize("function", ["torch_in_place", "adds_in_place"])
def test_an_in_place_function_that_returns_its_result_designs_with_autograd(user_module, function):
    pytest.importorskip("torch")
    bound = activations.from_module(f"{user_module}:{function}")
    x = np.linspace(-5.0, 5.0, 101)
    slope = 2.0 if function == "torch_in_place" else 1.0
    # autograd of 2x and x + 1 is exact: no tolerance
    np.testing.assert_array_equal(bound.df(x), np.full_like(x, slope))
    np.testing.assert_array_equal(bound.f(x), 2.0 * x if slope == 2.0 else x + 1.0)
