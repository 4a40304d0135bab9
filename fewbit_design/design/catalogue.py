"""The catalogue of activations: the closed forms f and f' of every registry activation, their constraints, and the
definitions :mod:`.activations` builds its registry from.

f and f' take ``(x, params)`` with x a float64 array and ``params`` complete and validated; f' follows torch's own
backward formula, including its value at kinks (see :mod:`.activations` for the conventions). Each definition is
the keyword arguments of an :class:`~.activations.Activation` (this module knows no registry type, so the registry
imports it and not the other way round). scipy loads only when a closed form that needs it first runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import FewBitError

__all__ = ["definitions", "SELU_ALPHA", "SELU_SCALE", "QUICK_GELU_SCALE"]

Params = Mapping[str, Any]

# torch's SELU constants (aten/src/ATen/native/Activation.cpp).
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _expit(x: np.ndarray) -> np.ndarray:
    from scipy.special import expit

    return expit(x)


# ----------------------------------------------------------------------------------------------------------------------
# Closed forms. Each takes (x, params); x is a float64 array.


def _relu(x, p):
    return np.maximum(x, 0.0)


def _step_gt(x, t):
    return (x > t).astype(np.float64)


def _relu6(x, p):
    return np.minimum(np.maximum(x, 0.0), 6.0)


def _drelu6(x, p):
    # torch: relu6 = hardtanh(x, 0, 6); hardtanh_backward passes the gradient on the open interval only.
    return ((x > 0.0) & (x < 6.0)).astype(np.float64)


def _leaky_relu(x, p):
    return np.where(x > 0.0, x, x * p["negative_slope"])


def _dleaky_relu(x, p):
    return np.where(x > 0.0, 1.0, p["negative_slope"])


def _elu_family(x, alpha, scale, input_scale):
    # torch elu: x > 0 -> scale * x, else scale * alpha * (exp(x * input_scale) - 1)
    with np.errstate(over="ignore"):
        negative = scale * alpha * np.expm1(np.minimum(x, 0.0) * input_scale)
    return np.where(x > 0.0, scale * x, negative)


def _delu_family(x, alpha, scale, input_scale):
    # torch elu_backward (is_result=False): x <= 0 -> input_scale * scale * alpha * exp(x * input_scale), else scale
    with np.errstate(over="ignore"):
        negative = input_scale * scale * alpha * np.exp(np.minimum(x, 0.0) * input_scale)
    return np.where(x <= 0.0, negative, scale)


def _gelu(x, p):
    if p["approximate"] == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
        return 0.5 * x * (1.0 + np.tanh(inner))
    from scipy.special import ndtr

    return x * ndtr(x)


def _dgelu(x, p):
    if p["approximate"] == "tanh":
        # torch GeluBackward (tanh), t = tanh(beta (x + kappa x^3)):
        # 0.5 (1 + t) + 0.5 x (1 - t^2) beta (1 + 3 kappa x^2)
        beta = math.sqrt(2.0 / math.pi)
        kappa = 0.044715
        t = np.tanh(beta * (x + kappa * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * beta * (1.0 + 3.0 * kappa * x * x)
    from scipy.special import ndtr

    # cdf + x * pdf
    return ndtr(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _silu(x, p):
    return x * _expit(x)


def _dsilu(x, p):
    s = _expit(x)
    return s * (1.0 + x * (1.0 - s))


def _mish(x, p):
    return x * np.tanh(np.logaddexp(0.0, x))


def _dmish(x, p):
    # torch mish_backward: tanh(softplus(x)) + x * sigmoid(x) * (1 - tanh(softplus(x))^2)
    t = np.tanh(np.logaddexp(0.0, x))
    return t + x * _expit(x) * (1.0 - t * t)


def _sigmoid(x, p):
    return _expit(x)


def _dsigmoid(x, p):
    s = _expit(x)
    return s * (1.0 - s)


def _tanh(x, p):
    return np.tanh(x)


def _dtanh(x, p):
    t = np.tanh(x)
    return 1.0 - t * t


def _softplus(x, p):
    beta, threshold = p["beta"], p["threshold"]
    z = x * beta
    return np.where(z > threshold, x, np.logaddexp(0.0, z) / beta)


def _dsoftplus(x, p):
    # torch softplus_backward: beta x > threshold -> 1, else sigmoid(beta x)
    z = x * p["beta"]
    return np.where(z > p["threshold"], 1.0, _expit(z))


def _softsign(x, p):
    return x / (1.0 + np.abs(x))


def _dsoftsign(x, p):
    return 1.0 / (1.0 + np.abs(x)) ** 2


def _hardtanh(x, p):
    return np.minimum(np.maximum(x, p["min_val"]), p["max_val"])


def _dhardtanh(x, p):
    # torch hardtanh_backward: gradient on the open interval (min_val, max_val)
    return ((x > p["min_val"]) & (x < p["max_val"])).astype(np.float64)


def _hardsigmoid(x, p):
    return np.minimum(np.maximum(x + 3.0, 0.0), 6.0) / 6.0


def _dhardsigmoid(x, p):
    # torch hardsigmoid_backward: 1/6 on the open interval (-3, 3)
    return np.where((x > -3.0) & (x < 3.0), 1.0 / 6.0, 0.0)


def _hardswish(x, p):
    return x * np.minimum(np.maximum(x + 3.0, 0.0), 6.0) / 6.0


def _dhardswish(x, p):
    # torch 2.13 hardswish_backward: x <= -3 -> 0; -3 < x < 3 -> x / 3 + 0.5; x >= 3 -> 1
    # (older torch releases used x < -3 and x <= 3, i.e. -0.5 and 1.5 at the kinks themselves)
    return np.where(x <= -3.0, 0.0, np.where(x < 3.0, x / 3.0 + 0.5, 1.0))


QUICK_GELU_SCALE = 1.702


def _quick_gelu(x, p):
    return x * _expit(QUICK_GELU_SCALE * x)


def _dquick_gelu(x, p):
    # d/dx x sigmoid(a x) = s + a x s (1 - s), s = sigmoid(a x) (autograd of transformers' QuickGELUActivation)
    s = _expit(QUICK_GELU_SCALE * x)
    return s + QUICK_GELU_SCALE * x * s * (1.0 - s)


def _relu_squared(x, p):
    r = np.maximum(x, 0.0)
    return r * r


def _drelu_squared(x, p):
    # autograd of relu(x) ** 2: 2 relu(x) relu'(x) = 2 x for x > 0, else 0 (0 at the kink, where f' is continuous)
    return np.where(x > 0.0, 2.0 * x, 0.0)


def _logsigmoid(x, p):
    return -np.logaddexp(0.0, -x)


def _dlogsigmoid(x, p):
    return _expit(-x)


def _tanhshrink(x, p):
    return x - np.tanh(x)


def _dtanhshrink(x, p):
    t = np.tanh(x)
    return t * t


def _softshrink(x, p):
    lambd = p["lambd"]
    return np.where(x > lambd, x - lambd, np.where(x < -lambd, x + lambd, 0.0))


def _shrink_derivative(x, p):
    # torch softshrink_backward and hardshrink_backward: 0 on the closed interval [-lambd, lambd], else 1
    lambd = p["lambd"]
    return np.where((x >= -lambd) & (x <= lambd), 0.0, 1.0)


def _hardshrink(x, p):
    lambd = p["lambd"]
    return np.where((x >= -lambd) & (x <= lambd), 0.0, x)


def _threshold(x, p):
    return np.where(x > p["threshold"], x, p["value"])


# ----------------------------------------------------------------------------------------------------------------------
# Constraints


def _check_positive(activation: str, params: Params, key: str) -> None:
    if not params[key] > 0:
        raise FewBitError(f"{activation} parameter {key} must be > 0, got {params[key]!r}")


def _check_celu(activation: str, params: Params) -> None:
    if params["alpha"] == 0:
        raise FewBitError(f"{activation} parameter alpha must be != 0, got {params['alpha']!r}")


def _check_hardtanh(activation: str, params: Params) -> None:
    if not params["min_val"] < params["max_val"]:
        raise FewBitError(
            f"{activation} parameters must satisfy min_val < max_val, "
            f"got min_val={params['min_val']!r}, max_val={params['max_val']!r}"
        )


def _check_softshrink(activation: str, params: Params) -> None:
    if not params["lambd"] >= 0:
        raise FewBitError(f"{activation} parameter lambd must be >= 0, got {params['lambd']!r}")


def _shrink_breakpoints(params: Params) -> tuple[float, ...]:
    lambd = params["lambd"]
    return (-lambd, lambd) if lambd >= 0 else ()


def _entry(
    name: str,
    torch_name: str,
    f: Callable[[np.ndarray, Params], np.ndarray],
    df: Callable[[np.ndarray, Params], np.ndarray],
    *,
    defaults: Mapping[str, object] | None = None,
    breakpoints: tuple[float, ...] | Callable[[Params], tuple[float, ...]] = (),
    even: bool | Callable[[Params], bool] = False,
    check: Callable[[str, Params], None] | None = None,
    choices: Mapping[str, tuple[str, ...]] | None = None,
    description: str = "",
) -> dict[str, Any]:
    """The keyword arguments of the :class:`~.activations.Activation` of one registry entry."""
    fixed_breakpoints = breakpoints
    fixed_even = even
    return {
        "name": name,
        "torch_name": torch_name,
        "defaults": dict(defaults or {}),
        "_f": f,
        "_df": df,
        "_breakpoints": breakpoints if callable(breakpoints) else lambda p: fixed_breakpoints,
        "_even": even if callable(even) else lambda p: fixed_even,
        "_check": check or (lambda activation, p: None),
        "_choices": dict(choices or {}),
        "description": description,
    }


def _elu_entry(name: str, torch_name: str, defaults: Mapping[str, object], constants, **options) -> dict[str, Any]:
    """ELU, CELU and SELU share torch's elu kernel: ``constants(params) -> (alpha, scale, input_scale)``."""
    return _entry(
        name,
        torch_name,
        lambda x, p: _elu_family(x, *constants(p)),
        lambda x, p: _delu_family(x, *constants(p)),
        defaults=defaults,
        breakpoints=(0.0,),
        **options,
    )


def definitions() -> list[dict[str, Any]]:
    """The registry entries in registry order, each as the keyword arguments of an ``Activation``."""
    return [
        _entry("relu", "ReLU", _relu, lambda x, p: _step_gt(x, 0.0), breakpoints=(0.0,), description="max(0, x)"),
        _entry("relu6", "ReLU6", _relu6, _drelu6, breakpoints=(0.0, 6.0), description="min(max(0, x), 6)"),
        _entry(
            "leaky_relu",
            "LeakyReLU",
            _leaky_relu,
            _dleaky_relu,
            defaults={"negative_slope": 0.01},
            breakpoints=(0.0,),
            even=lambda p: p["negative_slope"] == 1.0,
            description="x if x > 0 else negative_slope * x",
        ),
        _elu_entry(
            "elu",
            "ELU",
            {"alpha": 1.0},
            lambda p: (p["alpha"], 1.0, 1.0),
            description="x if x > 0 else alpha * (exp(x) - 1)",
        ),
        _elu_entry(
            "celu",
            "CELU",
            {"alpha": 1.0},
            lambda p: (p["alpha"], 1.0, 1.0 / p["alpha"]),
            check=_check_celu,
            description="x if x > 0 else alpha * (exp(x / alpha) - 1)",
        ),
        _elu_entry(
            "selu",
            "SELU",
            {},
            lambda p: (SELU_ALPHA, SELU_SCALE, 1.0),
            description="scale * elu(x, alpha) with scale = 1.0507..., alpha = 1.6732...",
        ),
        _entry(
            "gelu",
            "GELU",
            _gelu,
            _dgelu,
            defaults={"approximate": "none"},
            choices={"approximate": ("none", "tanh")},
            description="x * Phi(x); approximate='tanh': 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))",
        ),
        _entry("silu", "SiLU", _silu, _dsilu, description="x * sigmoid(x) (swish)"),
        _entry("mish", "Mish", _mish, _dmish, description="x * tanh(softplus(x))"),
        _entry("sigmoid", "Sigmoid", _sigmoid, _dsigmoid, even=True, description="1 / (1 + exp(-x))"),
        _entry("tanh", "Tanh", _tanh, _dtanh, even=True, description="tanh(x)"),
        _entry(
            "softplus",
            "Softplus",
            _softplus,
            _dsoftplus,
            defaults={"beta": 1.0, "threshold": 20.0},
            breakpoints=lambda p: (p["threshold"] / p["beta"],),
            check=lambda activation, p: _check_positive(activation, p, "beta"),
            description="log(1 + exp(beta x)) / beta; x where beta x > threshold",
        ),
        _entry(
            "softsign", "Softsign", _softsign, _dsoftsign, breakpoints=(0.0,), even=True, description="x / (1 + |x|)"
        ),
        _entry(
            "hardtanh",
            "Hardtanh",
            _hardtanh,
            _dhardtanh,
            defaults={"min_val": -1.0, "max_val": 1.0},
            breakpoints=lambda p: (p["min_val"], p["max_val"]),
            even=lambda p: p["min_val"] == -p["max_val"],
            check=_check_hardtanh,
            description="clamp(x, min_val, max_val)",
        ),
        _entry(
            "hardsigmoid",
            "Hardsigmoid",
            _hardsigmoid,
            _dhardsigmoid,
            breakpoints=(-3.0, 3.0),
            even=True,
            description="relu6(x + 3) / 6",
        ),
        _entry(
            "hardswish",
            "Hardswish",
            _hardswish,
            _dhardswish,
            breakpoints=(-3.0, 3.0),
            description="x * relu6(x + 3) / 6",
        ),
        _entry("logsigmoid", "LogSigmoid", _logsigmoid, _dlogsigmoid, description="log(sigmoid(x))"),
        _entry("tanhshrink", "Tanhshrink", _tanhshrink, _dtanhshrink, even=True, description="x - tanh(x)"),
        _entry(
            "softshrink",
            "Softshrink",
            _softshrink,
            _shrink_derivative,
            defaults={"lambd": 0.5},
            breakpoints=_shrink_breakpoints,
            even=True,
            check=_check_softshrink,
            description="x - lambd if x > lambd; x + lambd if x < -lambd; else 0",
        ),
        _entry(
            "hardshrink",
            "Hardshrink",
            _hardshrink,
            _shrink_derivative,
            defaults={"lambd": 0.5},
            breakpoints=_shrink_breakpoints,
            even=True,
            description="x if |x| > lambd else 0",
        ),
        _entry(
            "threshold",
            "Threshold",
            _threshold,
            lambda x, p: _step_gt(x, p["threshold"]),
            defaults={"threshold": 0.0, "value": 0.0},
            breakpoints=lambda p: (p["threshold"],),
            description="x if x > threshold else value (registry defaults 0, 0: torch has none)",
        ),
        # Closed-form activations of the model libraries that torch.nn does not have (no torch.nn module).
        _entry(
            "quick_gelu",
            "",
            _quick_gelu,
            _dquick_gelu,
            description="x * sigmoid(1.702 x) (transformers QuickGELUActivation, CLIP)",
        ),
        _entry(
            "relu_squared",
            "",
            _relu_squared,
            _drelu_squared,
            breakpoints=(0.0,),
            description="relu(x)^2 (transformers ReLUSquaredActivation, Primer); f' = 2 relu(x)",
        ),
    ]
