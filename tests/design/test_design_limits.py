"""Extreme inputs of the design: one clear error or a right answer, never an
out-of-memory, a numpy warning with a misleading message, or a wrong error labelled exact."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from scipy.integrate import quad

from fewbit_design.cli import main
from fewbit_design.design import activations, design
from fewbit_design.design.weights import make_weight
from fewbit_design.errors import FewBitError

MEMORY_LIMIT = 3 * 1024**3  # bytes of address space for the subprocesses below (the repro needed 24 GB)


def run_limited(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose address space is limited, so a regression cannot exhaust memory."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


# ----------------------------------------------------------------------------------------------------------------------
# Unbounded memory on an overflowing integrand


def test_an_overflowing_derivative_is_one_error_in_bounded_memory():
    result = run_limited(
        """
        from fewbit_design.cli import main
        main(["leaky_relu", "--param", "negative_slope=1e308", "--bits", "2"])
        """
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1
    assert "derivative of leaky_relu(negative_slope=1e+308) reaches 1e+308" in result.stderr


def test_adaptive_quadrature_stops_at_a_non_finite_or_never_converging_integrand():
    result = run_limited(
        """
        import numpy as np
        from fewbit_design.design.integrals import integrate
        from fewbit_design.errors import FewBitError

        def overflowing(x, k):
            return np.where(x > 0.5, np.inf, 1.0)[None]

        rng = np.random.default_rng(0)

        def noise(x, k):
            return rng.standard_normal(x.shape)[None]

        for func in (overflowing, noise):
            try:
                integrate(func, np.array([0.0]), np.array([1.0]))
            except FewBitError as exc:
                print("FewBitError:", exc)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert "the integrand is not finite on" in lines[0]
    assert "did not converge within 65536 panels" in lines[1]


# ----------------------------------------------------------------------------------------------------------------------
# Extreme parameters, ranges, weights and samples


def test_a_derivative_beyond_float32_is_refused_not_written_into_a_table():
    with pytest.raises(FewBitError, match=r"reaches 1e\+100 at x=-10 .* within \+-3.4e\+38 \(float32"):
        design("leaky_relu", 2, params={"negative_slope": 1e100})


@pytest.mark.parametrize(
    ("low", "high", "message"),
    [
        (-1e308, 1e308, "range must have a finite width"),
        (-1e30, 1e30, "range must lie within"),
        (0.0, 1e-300, "too narrow"),
    ],
)
def test_extreme_ranges_are_one_clear_error_without_numpy_warnings(low, high, message):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FewBitError, match=message):
            design("gelu", 2, low=low, high=high)


def test_a_weight_narrower_than_the_grid_is_named_not_called_massless():
    with pytest.raises(FewBitError, match=r"scale 1e-12 of weight 'normal' is too small .*\(scale >= 2e-05\)"):
        design("gelu", 2, weight="normal", scale=1e-12)


def test_a_student_t_weight_with_huge_df_is_the_normal_density():
    # log Gamma differences cancelled: df = 1e100 gave a density e**-115 times too small, 1e308 nan
    for df in (1e10, 1e100, 1e308):
        w = make_weight("student-t", df=df)
        assert w(np.array([0.0, 1.0])) == pytest.approx(np.exp(-0.5 * np.array([0.0, 1.0])) / math.sqrt(2 * math.pi))


@pytest.mark.parametrize("beta", [1e3, 1e4, 1e5])
def test_a_boundary_layer_beside_a_table_boundary_is_integrated_not_called_exact(beta):
    # f' = sigmoid(beta x); the 1-bit table is 0 left of 0 and 1 right of it: L = 2 (ln 2 - 1/2) / beta. The adaptive
    # quadrature started on [0, 10] never saw the layer: L came out 4.8e-8 at beta = 1e3 and 0 ("exact") at 1e5.
    table = design("softplus", 1, params={"beta": beta, "threshold": 1e30})
    assert table.error == pytest.approx(2 * (math.log(2) - 0.5) / beta, rel=1e-3)
    assert table.snr_db is not None


def test_the_error_over_a_wide_range_is_the_error_of_the_table():
    # gelu on [-3000, 3000]: the stored error was 5 times smaller than the table's
    table = design("gelu", 2, low=-3000.0, high=3000.0)
    bound = activations.bind("gelu")
    edges = np.concatenate([[-3000.0], table.boundaries, [3000.0]])
    total = 0.0
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        level = table.q(np.array([(a + b) / 2]))[0]
        inner = sorted({a, b, *[p for p in (-50.0, -10.0, -3.0, 0.0, 3.0, 10.0, 50.0) if a < p < b]})
        for lo, hi in zip(inner[:-1], inner[1:], strict=True):
            total += quad(lambda x, y=level: (bound.df(np.array([x]))[0] - y) ** 2, lo, hi, epsabs=1e-14, epsrel=1e-10)[
                0
            ]
    assert table.error == pytest.approx(total, rel=1e-6)


def test_a_tiny_error_gives_a_finite_snr_not_a_misleading_table_error():
    # error 4e-323: signal / error overflowed to an infinite SNR, rejected as "table: field 'snr_db' must be finite"
    table = design("softplus", 2, params={"beta": 1e308})
    assert table.error > 0 and math.isfinite(table.snr_db) and table.snr_db > 1000


@pytest.mark.parametrize(
    "samples",
    [
        np.array([-1e308, 1e308, 0.0, 1.0, 2.0]),  # squares overflowed (numpy warnings)
        np.array([0.0, 5e-324, 1e-323]),  # a zero bandwidth: ZeroDivisionError
        np.concatenate([np.linspace(-3, 3, 999), [1.7e308]]),
    ],
)
def test_empirical_samples_near_the_float_limits(samples):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = design("gelu", 2, weight="empirical", samples=samples)
    assert math.isfinite(table.error) and table.weight["kind"] == "empirical"


# ----------------------------------------------------------------------------------------------------------------------
# --activation-module with a step function, a jump, an unbounded derivative

USER_ACTIVATIONS = """
import numpy as np

def np_step(x):
    return np.where(np.asarray(x) > 0, 1.0, 0.0)

def np_sign(x):
    return np.sign(x)

def np_floor(x):
    return np.floor(x)

def np_sqrt_abs(x):
    return np.sqrt(np.abs(x))

def np_square(x):
    return x * x

def np_abs(x):
    return np.abs(x)

def t_step(x):
    return (x > 0).to(x.dtype)

def t_round(x):
    import torch
    return torch.round(x)

def t_const(x):
    return x * 0 + 1.0

def t_abs(x):
    return x.abs()

def t_tanh(x):
    return x.tanh()
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_acts_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_ACTIVATIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("np_step", "f is discontinuous near x=5.8"),
        ("np_sign", "f is discontinuous near x=-5.8"),
        ("np_floor", "f is discontinuous near x="),
        ("t_step", "f is discontinuous near x=5.8"),
        ("t_round", "f is discontinuous near x="),
        ("np_sqrt_abs", "the derivative of f is unbounded near x=-5.8"),
    ],
)
def test_a_jump_or_an_unbounded_derivative_is_one_error_not_an_exact_table(capsys, user_module, function, message):
    # before: garbage levels (spikes of height ~ jump / step, or zeros from autograd) printed as "SNR = inf (exact)",
    # and np.floor ran out of memory
    code, out, err = run(capsys, "--activation-module", f"{user_module}:{function}", "--bits", "2")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and f"activation module '{user_module}:{function}'" in err


@pytest.mark.parametrize(
    ("function", "bits", "exact"),
    [("np_square", 2, False), ("np_abs", 2, False), ("t_abs", 1, True), ("t_tanh", 3, False)],
)
def test_continuous_user_activations_with_a_bounded_derivative_still_design(user_module, function, bits, exact):
    table = design(activations.from_module(f"{user_module}:{function}"), bits)
    assert (table.error == 0) is exact and (table.snr_db is None) is exact


def test_exact_and_undefined_snr_are_told_apart(capsys, user_module):
    code, out, _ = run(capsys, "relu6", "--bits", "1")
    assert code == 0 and "SNR = inf (exact: q = f' wherever w > 0)" in out
    code, out, _ = run(capsys, "--activation-module", f"{user_module}:t_const", "--bits", "1")
    assert code == 0 and "SNR = undefined (f' = 0 wherever w > 0; the table of zeros is exact)" in out
