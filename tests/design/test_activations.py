"""The activation registry against torch (forward values and autograd), finite differences and its own contracts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fewbit_design.design import activations
from fewbit_design.errors import FewBitError

torch = pytest.importorskip("torch")

# Every registry entry, with several parameter values for each parametrised one.
CASES = [
    ("relu", {}),
    ("relu6", {}),
    ("leaky_relu", {}),
    ("leaky_relu", {"negative_slope": 0.2}),
    ("leaky_relu", {"negative_slope": -0.5}),
    ("leaky_relu", {"negative_slope": 1.0}),
    ("elu", {}),
    ("elu", {"alpha": 0.5}),
    ("elu", {"alpha": 2.5}),
    ("elu", {"alpha": -1.0}),
    ("celu", {}),
    ("celu", {"alpha": 0.5}),
    ("celu", {"alpha": 3.0}),
    ("celu", {"alpha": -2.0}),
    ("selu", {}),
    ("gelu", {}),
    ("gelu", {"approximate": "tanh"}),
    ("silu", {}),
    ("mish", {}),
    ("sigmoid", {}),
    ("tanh", {}),
    ("softplus", {}),
    ("softplus", {"beta": 2.0, "threshold": 5.0}),
    ("softplus", {"beta": 0.5, "threshold": 3.0}),
    ("softplus", {"beta": 1.0, "threshold": -2.0}),
    ("softsign", {}),
    ("hardtanh", {}),
    ("hardtanh", {"min_val": -2.0, "max_val": 3.0}),
    ("hardtanh", {"min_val": 0.5, "max_val": 1.5}),
    ("hardsigmoid", {}),
    ("hardswish", {}),
    ("logsigmoid", {}),
    ("tanhshrink", {}),
    ("softshrink", {}),
    ("softshrink", {"lambd": 0.0}),
    ("softshrink", {"lambd": 2.0}),
    ("hardshrink", {}),
    ("hardshrink", {"lambd": 0.0}),
    ("hardshrink", {"lambd": 1.5}),
    ("quick_gelu", {}),
    ("relu_squared", {}),
    ("hardshrink", {"lambd": -1.0}),
    ("threshold", {}),
    ("threshold", {"threshold": 1.0, "value": -2.0}),
    ("threshold", {"threshold": -3.0, "value": 5.0}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in params.items()) for name, params in CASES]

# torch's Hardsigmoid backward multiplies by 1/6 rounded to float32 even for float64 input (5e-9 off).
TOLERANCE = {"hardsigmoid": 1e-8}


def _points(bound: activations.BoundActivation) -> np.ndarray:
    """2001 grid points on [-12, 12], random points, each breakpoint and its float neighbours."""
    rng = np.random.default_rng(0)
    kinks = np.array(bound.breakpoints, dtype=np.float64)
    near = np.concatenate([kinks, np.nextafter(kinks, np.inf), np.nextafter(kinks, -np.inf)])
    return np.concatenate([np.linspace(-12.0, 12.0, 2001), rng.normal(0.0, 4.0, 500), near, [0.0, -0.0]])


# Registry entries without a torch.nn module: the formula of the model library's module, in torch.
NOT_TORCH_NN = {
    "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t),  # transformers QuickGELUActivation
    "relu_squared": lambda t: torch.square(torch.relu(t)),  # transformers ReLUSquaredActivation
}


def _torch_values(bound: activations.BoundActivation, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    function = NOT_TORCH_NN.get(bound.name) or bound.torch_module()
    y = function(t)
    (grad,) = torch.autograd.grad(y.sum(), t)
    return y.detach().numpy(), grad.numpy()


def test_registry_has_every_torch_pointwise_activation():
    expected = {
        "ReLU", "ReLU6", "LeakyReLU", "ELU", "CELU", "SELU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh", "Softplus",
        "Softsign", "Hardtanh", "Hardsigmoid", "Hardswish", "LogSigmoid", "Tanhshrink", "Softshrink", "Hardshrink",
        "Threshold",
    }  # fmt: skip
    assert {entry.torch_name for entry in activations.REGISTRY.values() if entry.torch_name} == expected
    assert {entry.name for entry in activations.REGISTRY.values() if not entry.torch_name} == set(NOT_TORCH_NN)
    assert activations.names() == list(activations.REGISTRY)
    assert {name for name, _ in CASES} == set(activations.names())
    for entry in activations.REGISTRY.values():
        # the canonical name is the torch.nn.functional spelling
        if entry.torch_name:
            assert callable(getattr(torch.nn.functional, entry.name)), entry.name


@pytest.mark.parametrize(
    ("name", "module"), [("quick_gelu", "QuickGELUActivation"), ("relu_squared", "ReLUSquaredActivation")]
)
def test_model_library_activations_match_transformers(name, module):
    hf = pytest.importorskip("transformers.activations")
    bound = activations.get(module).bind()
    assert bound.name == name
    x = _points(bound)
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = getattr(hf, module)()(t)
    (grad,) = torch.autograd.grad(y.sum(), t)
    np.testing.assert_allclose(bound.f(x), y.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bound.df(x), grad.numpy(), rtol=1e-12, atol=1e-12)
    with pytest.raises(FewBitError, match="not a torch.nn activation"):
        bound.torch_module()


def test_gelu_tanh_is_a_registry_variant():
    bound = activations.bind("gelu", {"approximate": "tanh"})
    assert bound.params == {"approximate": "tanh"}
    assert isinstance(bound.torch_module(), torch.nn.GELU) and bound.torch_module().approximate == "tanh"


@pytest.mark.parametrize("name", sorted(name for name, entry in activations.REGISTRY.items() if entry.torch_name))
def test_defaults_are_torchs(name):
    import inspect

    entry = activations.get(name)
    signature = inspect.signature(getattr(torch.nn, entry.torch_name))
    ignored = ("inplace", "min_value", "max_value", "args", "kwargs")  # no math in these
    torch_params = [p for p in signature.parameters.values() if p.name not in ignored]
    assert [p.name for p in torch_params] == list(entry.defaults)
    for p in torch_params:
        if p.default is not inspect.Parameter.empty:
            assert entry.defaults[p.name] == p.default
    # torch.nn.Threshold has no defaults: the registry documents threshold=0, value=0
    if name == "threshold":
        assert dict(entry.defaults) == {"threshold": 0.0, "value": 0.0}


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_f_and_derivative_match_torch(name, params):
    bound = activations.bind(name, params)
    x = _points(bound)
    expected_f, expected_df = _torch_values(bound, x)
    tolerance = TOLERANCE.get(name, 1e-12)
    np.testing.assert_allclose(bound.f(x), expected_f, rtol=1e-12, atol=1e-12)
    # breakpoints are included on purpose: the registry follows torch's backward at the kinks
    np.testing.assert_allclose(bound.df(x), expected_df, rtol=1e-12, atol=tolerance)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_derivative_matches_finite_differences_away_from_kinks(name, params):
    bound = activations.bind(name, params)
    x = np.linspace(-11.0, 11.0, 1201) + 1e-3  # off the round kink positions
    kinks = np.array(bound.breakpoints or [np.inf])
    x = x[np.min(np.abs(x[:, None] - kinks[None, :]), axis=1) > 1e-3]
    h = 1e-4
    # 4th-order central difference of our own f
    numeric = (8 * (bound.f(x + h) - bound.f(x - h)) - (bound.f(x + 2 * h) - bound.f(x - 2 * h))) / (12 * h)
    np.testing.assert_allclose(bound.df(x), numeric, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_even_flag_and_breakpoints(name, params):
    bound = activations.bind(name, params)
    x = np.linspace(0.0, 12.0, 4801)
    mirrored = np.max(np.abs(bound.df(x) - bound.df(-x)))
    if bound.even:
        assert mirrored < 1e-14  # up to round-off (sigmoid: s (1 - s))
    else:
        assert mirrored > 1e-6
    assert list(bound.breakpoints) == sorted(bound.breakpoints)
    assert all(isinstance(b, float) for b in bound.breakpoints)
    # every jump and every kink of f' on a fine grid sits at a listed breakpoint: a first (jump) or second (kink)
    # difference that stands out against its neighbours two steps away
    grid = np.linspace(-12.0, 12.0, 24001)
    suspects = []
    for order in (1, 2):
        diff = np.abs(np.diff(bound.df(grid), order))
        padded = np.pad(diff, 2)
        neighbours = np.maximum(padded[:-4], padded[4:])
        suspects.append(grid[order:][diff > 1e-6 + 20 * neighbours])
    listed = np.array(bound.breakpoints + (np.inf,))
    for point in np.concatenate(suspects):
        assert np.min(np.abs(listed - point)) < 3e-3, f"f' not smooth near {point} but breakpoints={bound.breakpoints}"


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        ("relu6", {}, (0.0, 6.0)),
        ("hardswish", {}, (-3.0, 3.0)),
        ("elu", {}, (0.0,)),
        ("gelu", {}, ()),
        ("softplus", {"beta": 2.0, "threshold": 5.0}, (2.5,)),
        ("softshrink", {"lambd": 0.0}, (0.0,)),
        ("hardtanh", {"min_val": -2.0, "max_val": 3.0}, (-2.0, 3.0)),
    ],
)
def test_known_breakpoints(name, params, expected):
    assert activations.bind(name, params).breakpoints == expected


def test_known_even_flags():
    even = {name for name in activations.names() if activations.bind(name).even}
    assert even == {"sigmoid", "tanh", "softsign", "hardtanh", "hardsigmoid", "tanhshrink", "softshrink", "hardshrink"}
    assert not activations.bind("hardtanh", {"min_val": -1.0, "max_val": 2.0}).even
    assert activations.bind("leaky_relu", {"negative_slope": 1.0}).even


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_no_overflow_warnings_for_large_inputs(name, params):
    bound = activations.bind(name, params)
    x = np.linspace(-1e3, 1e3, 2001)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        f, df = bound.f(x), bound.df(x)
    if not (name == "celu" and params.get("alpha", 1.0) < 0):  # exp(x / alpha) really is infinite there
        assert np.all(np.isfinite(f)) and np.all(np.isfinite(df))
    assert f.dtype == np.float64 and df.dtype == np.float64 and f.shape == x.shape


def test_vectorised_shapes_and_scalars():
    gelu = activations.bind("gelu")
    x = np.linspace(-3, 3, 12).reshape(3, 4)
    assert gelu.f(x).shape == (3, 4) and gelu.df(x).shape == (3, 4)
    assert float(gelu.df(0.0)) == 0.5
    assert gelu.df([1, 2]).dtype == np.float64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gelu", "gelu"),
        ("GELU", "gelu"),
        ("LeakyReLU", "leaky_relu"),
        ("leakyrelu", "leaky_relu"),
        ("leaky-relu", "leaky_relu"),
        ("LEAKY_RELU", "leaky_relu"),
        ("swish", "silu"),
        ("SiLU", "silu"),
        ("Hardswish", "hardswish"),
        ("hard_swish", "hardswish"),
        ("LogSigmoid", "logsigmoid"),
        ("ReLU6", "relu6"),
    ],
)
def test_get_accepts_names_and_variants(text, expected):
    assert activations.get(text).name == expected
    assert activations.bind(text).name == expected


def test_unknown_activation_names_close_matches():
    with pytest.raises(FewBitError) as info:
        activations.get("gelo")
    assert str(info.value) == "unknown activation 'gelo'; did you mean 'gelu'? (fewbit-design list shows all)"
    with pytest.raises(FewBitError, match=r"'relu6'"):
        activations.get("relu7")
    with pytest.raises(FewBitError) as info:
        activations.get("xyzzy")
    assert "did you mean" not in str(info.value) and "'xyzzy'" in str(info.value)


def test_bind_fills_defaults_and_is_json_serialisable():
    bound = activations.bind("softplus", {"beta": 2})
    assert bound.params == {"beta": 2.0, "threshold": 20.0}
    assert all(type(v) is float for v in bound.params.values())
    assert json.loads(json.dumps(bound.params)) == bound.params
    assert activations.get("hardtanh").bind(max_val=2).params == {"min_val": -1.0, "max_val": 2.0}
    assert activations.get("gelu").bind({"approximate": "none"}, approximate="tanh").params == {"approximate": "tanh"}
    assert activations.bind("relu").params == {}
    # bound activations with equal parameters are equal and hashable (usable as cache keys)
    assert activations.bind("elu", {"alpha": 1}) == activations.bind("elu")
    assert len({activations.bind("elu"), activations.bind("elu", {"alpha": 1.0})}) == 1
    assert len({activations.get("GELU"), activations.get("gelu")}) == 1


@pytest.mark.parametrize(
    ("name", "params", "pieces"),
    [
        ("softplus", {"beta": 0.0}, ["softplus", "beta", "0.0", "> 0"]),
        ("softplus", {"beta": -1}, ["softplus", "beta", "-1", "> 0"]),
        ("hardtanh", {"min_val": 1.0, "max_val": -1.0}, ["hardtanh", "min_val < max_val", "1.0", "-1.0"]),
        ("hardtanh", {"min_val": 1.0, "max_val": 1.0}, ["hardtanh", "min_val < max_val"]),
        ("celu", {"alpha": 0.0}, ["celu", "alpha", "0.0", "!= 0"]),
        ("softshrink", {"lambd": -0.5}, ["softshrink", "lambd", "-0.5", ">= 0"]),
        ("gelu", {"approximate": "fast"}, ["gelu", "approximate", "'none'", "'tanh'", "'fast'"]),
        ("gelu", {"approximate": 1}, ["gelu", "approximate", "'none'", "'tanh'", "got 1"]),
        ("elu", {"alpha": float("nan")}, ["elu", "alpha", "finite", "nan"]),
        ("leaky_relu", {"negative_slope": float("inf")}, ["leaky_relu", "negative_slope", "finite", "inf"]),
        ("leaky_relu", {"negative_slope": "0.2"}, ["leaky_relu", "negative_slope", "finite", "'0.2'"]),
        ("threshold", {"value": True}, ["threshold", "value", "finite", "True"]),
        ("leaky_relu", {"slope": 0.2}, ["leaky_relu", "'slope'", "negative_slope"]),
        ("softplus", {"betta": 2.0}, ["softplus", "'betta'", "did you mean 'beta'", "beta, threshold"]),
        ("relu", {"alpha": 1.0}, ["relu", "no parameters", "'alpha'"]),
    ],
)
def test_bad_parameters(name, params, pieces):
    with pytest.raises(FewBitError) as info:
        activations.bind(name, params)
    message = str(info.value)
    assert "\n" not in message
    for piece in pieces:
        assert piece in message, (piece, message)


def test_torch_module():
    module = activations.bind("leaky_relu", {"negative_slope": 0.3}).torch_module()
    assert isinstance(module, torch.nn.LeakyReLU) and module.negative_slope == 0.3
    module = activations.bind("threshold").torch_module()
    assert isinstance(module, torch.nn.Threshold) and (module.threshold, module.value) == (0.0, 0.0)
    assert isinstance(activations.bind("GELU", {"approximate": "tanh"}).torch_module(), torch.nn.GELU)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("negative_slope=0.2", ("negative_slope", 0.2)),
        ("alpha=-1e-3", ("alpha", -0.001)),
        ("alpha=.5", ("alpha", 0.5)),
        ("threshold=20", ("threshold", 20)),
        ("approximate=tanh", ("approximate", "tanh")),
        ("approximate='none'", ("approximate", "none")),
        ('name="12"', ("name", "12")),
        ("flag=true", ("flag", True)),
        ("flag=False", ("flag", False)),
        (" beta = 2.5 ", ("beta", 2.5)),
        ("x=a=b", ("x", "a=b")),
    ],
)
def test_parse_param(text, expected):
    key, value = activations.parse_param(text)
    assert (key, value) == expected
    assert type(value) is type(expected[1])


@pytest.mark.parametrize("text", ["foo", "=3", "alpha=", "1x=2", "a b=1", ""])
def test_parse_param_malformed(text):
    with pytest.raises(FewBitError) as info:
        activations.parse_param(text)
    assert str(info.value) == f"--param must look like KEY=VALUE, got {text!r}"


def test_parse_param_feeds_bind():
    params = dict(activations.parse_param(t) for t in ["beta=2", "threshold=10"])
    assert activations.bind("softplus", params).params == {"beta": 2.0, "threshold": 10.0}
    with pytest.raises(FewBitError, match="finite number"):
        activations.bind("elu", dict([activations.parse_param("alpha=nan")]))


# ----------------------------------------------------------------------------------------------------------------------
# User activations

USER_MODULE = """
    import numpy as np

    CALLS = []

    def rational(x, scale=1.0):
        # generic arithmetic: works on torch tensors and numpy arrays
        CALLS.append(type(x).__name__)
        return scale * x ** 3 / (1 + x * x)

    def numpy_only(x):
        CALLS.append(type(x).__name__)
        return np.sin(np.asarray(x)) * 2.0

    def detached(x):
        # a torch function without autograd history: torch forward, finite-difference derivative
        import torch

        CALLS.append(type(x).__name__)
        return torch.tanh(x).detach()

    def raises(x):
        raise RuntimeError("boom")

    def not_finite(x):
        return x / (x - x)

    def wrong_shape(x):
        return x.sum()

    def takes_nothing():
        return 1.0

    NOT_CALLABLE = 3
"""


def _rational_derivative(x, scale=1.0):
    # d/dx x^3 / (1 + x^2) = (x^4 + 3 x^2) / (1 + x^2)^2, by hand
    return scale * (x**4 + 3 * x**2) / (1 + x**2) ** 2


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    name = f"fewbit_user_act_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_user_activation_autograd_path(user_module):
    bound = activations.from_module(f"{user_module}:rational", {"scale": 2.0})
    calls = sys.modules[user_module].CALLS
    x = np.linspace(-12, 12, 1001)
    calls.clear()
    np.testing.assert_allclose(bound.f(x), 2.0 * x**3 / (1 + x**2), rtol=1e-14)
    np.testing.assert_allclose(bound.df(x), _rational_derivative(x, 2.0), rtol=1e-13, atol=1e-14)
    assert set(calls) == {"Tensor"}  # f and f' were computed by torch
    assert bound.name == f"{user_module}:rational"
    assert bound.params == {"scale": 2.0}
    assert bound.breakpoints == () and bound.even is False
    with pytest.raises(FewBitError, match="user activation"):
        bound.torch_module()


def test_user_activation_finite_difference_path(user_module, monkeypatch):
    monkeypatch.setattr(activations, "_torch_available", lambda: False)
    bound = activations.from_module(f"{user_module}:rational")
    calls = sys.modules[user_module].CALLS
    calls.clear()
    x = np.concatenate([np.linspace(-12, 12, 1001), [1e3, -1e3, 1e-9]])
    np.testing.assert_allclose(bound.df(x), _rational_derivative(x), rtol=1e-9, atol=1e-9)
    assert set(calls) == {"ndarray"}


def test_user_numpy_function_falls_back_to_finite_differences(user_module):
    bound = activations.from_module(f"{user_module}:numpy_only")
    x = np.linspace(-10, 10, 501)
    np.testing.assert_allclose(bound.f(x), 2.0 * np.sin(x), rtol=1e-14)
    np.testing.assert_allclose(bound.df(x), 2.0 * np.cos(x), rtol=1e-9, atol=1e-9)


def test_user_torch_function_without_autograd_history(user_module):
    bound = activations.from_module(f"{user_module}:detached")
    calls = sys.modules[user_module].CALLS
    calls.clear()
    x = np.linspace(-10, 10, 501)
    np.testing.assert_allclose(bound.df(x), 1.0 - np.tanh(x) ** 2, rtol=1e-8, atol=1e-10)
    assert set(calls) == {"Tensor"}


@pytest.mark.parametrize(
    ("attribute", "pieces"),
    [
        ("missing", ["has no attribute 'missing'"]),
        ("NOT_CALLABLE", ["not callable"]),
        ("raises", ["RuntimeError", "boom"]),
        ("not_finite", ["not finite"]),
        ("wrong_shape", ["shape"]),
        ("takes_nothing", ["TypeError"]),
    ],
)
def test_user_activation_errors(user_module, attribute, pieces):
    spec = f"{user_module}:{attribute}"
    with pytest.raises(FewBitError) as info:
        activations.from_module(spec)
    message = str(info.value)
    assert spec in message and "\n" not in message
    for piece in pieces:
        assert piece in message


@pytest.mark.parametrize("spec", ["no_such_module_fewbit:fn", "nocolon", "a:b:c", ":fn", "mod:"])
def test_user_activation_bad_specs(spec):
    with pytest.raises(FewBitError) as info:
        activations.from_module(spec)
    assert repr(spec) in str(info.value)


def test_import_does_not_load_torch():
    code = "import sys, fewbit_design.design.activations, fewbit_design.design.weights; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
