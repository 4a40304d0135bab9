"""The activation registry: name -> f, f', parameters and the matching torch module; binding; user activations.

Every pointwise activation of ``torch.nn`` is here under its ``torch.nn.functional`` spelling, with torch's
parameter names and defaults. f and f' are closed forms in numpy (float64, vectorised, no overflow warnings for
|x| up to 1e3), defined in the catalogue (:mod:`.catalogue`); f' follows torch's own backward formula, including its
value at kinks (for example relu'(0) = 0, elu'(0) = alpha, hardswish'(3) = 1, softplus' = 1 once beta * x >
threshold).

Terms: a registry entry is an :class:`Activation`; with complete, validated parameters it becomes a
:class:`BoundActivation`, which is what the design engine works with. ``breakpoints`` are the x where f' is
discontinuous or not smooth (quadrature and grids split there); ``even`` says f'(-x) == f'(x) for every x.

Choices made where torch has none:

* ``threshold``: ``torch.nn.Threshold(threshold, value)`` has no defaults; the registry uses threshold=0.0,
  value=0.0 (which makes it ReLU).
* ``softplus``: beta must be > 0 (torch accepts any beta).
* ``inplace`` (and Hardtanh's deprecated ``min_value``/``max_value``) are left out: they do not change the math.
* ``RReLU`` (random slope) and ``PReLU`` (learned slope) are not fixed functions and are not in the registry.

A user's own activation comes from :func:`from_module` (``--activation-module pkg.mod:fn``): f by calling ``fn``
(on a float64 torch tensor when torch is importable, else on a numpy array), f' by torch autograd, or by 6th-order
central finite differences when torch is missing or ``fn`` is not differentiable by torch.

>>> from fewbit_design import activations
>>> gelu = activations.bind("gelu")
>>> gelu.params
{'approximate': 'none'}
>>> float(gelu.df(0.0))
0.5
>>> activations.bind("relu6").breakpoints
(0.0, 6.0)
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import FewBitError, close_matches
from .catalogue import definitions

__all__ = [
    "Activation",
    "BoundActivation",
    "REGISTRY",
    "names",
    "get",
    "bind",
    "parse_param",
    "from_module",
]

Params = Mapping[str, Any]


def _array(x: object) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


# ----------------------------------------------------------------------------------------------------------------------
# Registry entries


@dataclass(frozen=True)
class Activation:
    """A registry entry: an activation with its torch names and parameter defaults.

    ``defaults`` maps torch's parameter names to torch's defaults, in torch's order. Call :meth:`bind` to get a
    :class:`BoundActivation` with complete, validated parameters.

    Attributes:
        name: the registry name (torch.nn.functional spelling)
        torch_name: the torch.nn class name ('' when torch.nn has none)
        defaults: torch's parameter names and defaults, in torch's order
        description: a one-line description for ``fewbit-design list``
    """

    name: str
    torch_name: str
    defaults: Mapping[str, object]
    _f: Callable[[np.ndarray, Params], np.ndarray] = field(repr=False, compare=False)
    _df: Callable[[np.ndarray, Params], np.ndarray] = field(repr=False, compare=False)
    _breakpoints: Callable[[Params], tuple[float, ...]] = field(default=lambda p: (), repr=False, compare=False)
    _even: Callable[[Params], bool] = field(default=lambda p: False, repr=False, compare=False)
    _check: Callable[[str, Params], None] = field(default=lambda name, p: None, repr=False, compare=False)
    _choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)
    description: str = field(default="", compare=False)
    _open_params: bool = field(default=False, repr=False, compare=False)
    _check_range: Callable[[float, float, Params], None] = field(
        default=lambda low, high, p: None, repr=False, compare=False
    )

    def __hash__(self) -> int:
        return hash((self.name, self.torch_name))

    def bind(self, params: Mapping[str, object] | None = None, **kwargs: object) -> BoundActivation:
        """Fill in torch's defaults and validate; ``kwargs`` override ``params``.

        >>> get("leaky_relu").bind(negative_slope=0.2).params
        {'negative_slope': 0.2}
        """
        given = dict(params or {})
        given.update(kwargs)
        if self._open_params:
            complete = {key: _json_scalar(self.name, key, value) for key, value in given.items()}
            return BoundActivation(self, complete)
        unknown = [key for key in given if key not in self.defaults]
        if unknown:
            if not self.defaults:
                raise FewBitError(f"activation '{self.name}' takes no parameters, got {unknown[0]!r}")
            valid = ", ".join(self.defaults)
            hint = close_matches(unknown[0], self.defaults, n=1)
            hint_text = f"; did you mean {hint[0]!r}?" if hint else ""
            raise FewBitError(
                f"activation '{self.name}' has no parameter {unknown[0]!r}{hint_text} (valid parameters: {valid})"
            )
        complete: dict[str, object] = {}
        for key, default in self.defaults.items():
            value = given.get(key, default)
            if key in self._choices:
                choices = self._choices[key]
                if not (isinstance(value, str) and value in choices):
                    options = " or ".join(repr(c) for c in choices)
                    raise FewBitError(f"{self.name} parameter {key} must be {options}, got {value!r}")
                complete[key] = value
            else:
                complete[key] = _finite_param(self.name, key, value)
        self._check(self.name, complete)
        return BoundActivation(self, complete)


def _finite_param(activation: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise FewBitError(f"{activation} parameter {key} must be a finite number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise FewBitError(f"{activation} parameter {key} must be a finite number, got {value!r}")
    return number


def _json_scalar(activation: str, key: str, value: object) -> object:
    """A user activation's keyword argument: a JSON scalar (bool, int, finite float or str)."""
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating) and math.isfinite(float(value)):
        return float(value)
    raise FewBitError(f"activation '{activation}' parameter {key} must be a number, string or bool, got {value!r}")


@dataclass(frozen=True)
class BoundActivation:
    """An activation with complete, validated parameters: f, f', breakpoints and symmetry.

    >>> act = bind("hardtanh", {"min_val": -2.0, "max_val": 2.0})
    >>> act.breakpoints, act.even
    ((-2.0, 2.0), True)
    >>> act.df([-3.0, 0.0, 3.0]).tolist()
    [0.0, 1.0, 0.0]

    Attributes:
        activation: the registry entry
        params: complete, validated parameters
    """

    activation: Activation
    params: dict[str, object]

    def __hash__(self) -> int:
        return hash((self.activation.name, tuple(self.params.items())))

    @property
    def name(self) -> str:
        """The canonical name (for a user activation, the ``pkg.mod:fn`` spec)."""
        return self.activation.name

    def f(self, x: object) -> np.ndarray:
        """The activation, vectorised, float64."""
        with np.errstate(all="ignore"):  # inf/nan in intermediates are expected (exp(-x) far out): results are checked
            return self.activation._f(_array(x), self.params)

    def df(self, x: object) -> np.ndarray:
        """The derivative f' as torch's backward computes it, vectorised, float64."""
        with np.errstate(all="ignore"):
            return self.activation._df(_array(x), self.params)

    def check_range(self, low: float, high: float) -> None:
        """Raise a :class:`FewBitError` if f' cannot be approximated on [low, high]: a user activation that jumps or
        whose derivative is unbounded there (registry activations define f' as torch's backward: nothing to check)."""
        self.activation._check_range(float(low), float(high), self.params)

    @property
    def breakpoints(self) -> tuple[float, ...]:
        """Sorted x where f' is discontinuous or not smooth (may be empty)."""
        return tuple(sorted({float(b) for b in self.activation._breakpoints(self.params)}))

    @property
    def even(self) -> bool:
        """True when f'(-x) == f'(x) for every x with these parameters."""
        return bool(self.activation._even(self.params))

    def torch_module(self) -> Any:
        """``torch.nn.<torch_name>(**params)`` (imports torch now)."""
        if not self.activation.torch_name:
            what = "a user activation" if self.activation._open_params else "not a torch.nn activation"
            raise FewBitError(f"activation '{self.name}' has no torch.nn module (it is {what})")
        import torch

        return getattr(torch.nn, self.activation.torch_name)(**self.params)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"BoundActivation({self.name}({args}))"


# ----------------------------------------------------------------------------------------------------------------------
# The registry (the activations themselves are in .catalogue)


REGISTRY: dict[str, Activation] = {entry["name"]: Activation(**entry) for entry in definitions()}

_ALIASES = {
    "swish": "silu",
    "quickgeluactivation": "quick_gelu",
    "relusquaredactivation": "relu_squared",
    "relu2": "relu_squared",
}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


_LOOKUP: dict[str, str] = {_key(alias): target for alias, target in _ALIASES.items()}
_LOOKUP.update({_key(entry.torch_name): entry.name for entry in REGISTRY.values() if entry.torch_name})
_LOOKUP.update({_key(entry.name): entry.name for entry in REGISTRY.values()})


def names() -> list[str]:
    """The canonical activation names, in registry order."""
    return list(REGISTRY)


def get(name: str) -> Activation:
    """Look up an activation by its canonical name, torch class name, an alias or a case/underscore variant.

    >>> get("LeakyReLU").name, get("swish").name, get("HardSwish").name
    ('leaky_relu', 'silu', 'hardswish')
    """
    if isinstance(name, Activation):
        return name
    if not isinstance(name, str):
        raise FewBitError(f"activation must be a name (a string), got {name!r}")
    canonical = _LOOKUP.get(_key(name))
    if canonical is not None:
        return REGISTRY[canonical]
    torch_names = [e.torch_name for e in REGISTRY.values() if e.torch_name]
    matches = close_matches(name, list(REGISTRY) + torch_names + list(_ALIASES))
    suggestions: list[str] = []
    for match in matches:
        target = _LOOKUP[_key(match)]
        if target not in suggestions:
            suggestions.append(target)
    hint = ""
    if suggestions:
        quoted = [repr(s) for s in suggestions]
        listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        hint = f"; did you mean {listed}?"
    raise FewBitError(f"unknown activation {name!r}{hint} (fewbit-design list shows all)")


def bind(name_or_activation: str | Activation, params: Mapping[str, object] | None = None) -> BoundActivation:
    """``get(name).bind(params)``: the activation with complete, validated parameters.

    >>> bind("softplus", {"beta": 2}).params
    {'beta': 2.0, 'threshold': 20.0}

    Args:
        name_or_activation: a registry name (any spelling :func:`get` accepts) or an :class:`Activation`
        params: parameters; torch's defaults fill in the rest
    """
    activation = name_or_activation if isinstance(name_or_activation, Activation) else get(name_or_activation)
    return activation.bind(params)


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)
_INTEGER = re.compile(r"[+-]?\d+")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_param(text: str) -> tuple[str, object]:
    """Parse a CLI ``--param KEY=VALUE``: VALUE becomes an int, float, bool (true/false) or str.

    >>> parse_param("negative_slope=0.2"), parse_param("approximate=tanh"), parse_param("n=3")
    (('negative_slope', 0.2), ('approximate', 'tanh'), ('n', 3))

    Args:
        text: ``KEY=VALUE``
    """
    if not isinstance(text, str) or "=" not in text:
        raise FewBitError(f"--param must look like KEY=VALUE, got {text!r}")
    key, value = (part.strip() for part in text.split("=", 1))
    if not _KEY.fullmatch(key) or value == "":
        raise FewBitError(f"--param must look like KEY=VALUE, got {text!r}")
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return key, value[1:-1]
    if _INTEGER.fullmatch(value):
        return key, int(value)
    if _NUMBER.fullmatch(value):
        return key, float(value)
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, value


# ----------------------------------------------------------------------------------------------------------------------
# User activations


def _torch_available() -> bool:
    """Whether torch can be imported (tests monkeypatch this to exercise the finite-difference path)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _finite_difference(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """6th-order central difference; the step is scaled to |x| and made exactly representable."""
    h = np.finfo(np.float64).eps ** (1.0 / 7.0) * np.maximum(1.0, np.abs(x))
    h = (x + h) - x
    coefficients = ((1, 45.0), (2, -9.0), (3, 1.0))
    total = np.zeros_like(x)
    for k, c in coefficients:
        total += c * (f(x + k * h) - f(x - k * h))
    return total / (60.0 * h)


#: Cells of the scan of a user activation's f over the design range, and bisections of its steepest cells.
RANGE_SCAN = 1 << 14
BISECTIONS = 20


class _UserFunction:
    """Calls a user's ``fn`` and checks what comes back; every failure is one FewBitError naming the spec.

    With torch importable, a probe call on a float64 tensor decides the path: a tensor result of the right shape
    means f is computed by torch, and if that result carries autograd history, f' is computed by autograd.
    Otherwise ``fn`` gets numpy arrays. Without autograd, f' is a 6th-order central finite difference of f.
    """

    def __init__(self, spec: str, fn: Callable[..., Any], kwargs: Mapping[str, object], use_torch: bool):
        self.spec = spec
        self.name = spec.partition(":")[2].strip()  # the function, as the user named it
        self.fn = fn
        self.kwargs = dict(kwargs)
        self.torch_forward = False
        self.use_autograd = False
        if use_torch:
            self._probe_torch()

    def _fail(self, what: str) -> FewBitError:
        return FewBitError(f"activation module {self.spec!r}: {what}")

    def _call(self, argument: Any) -> Any:
        try:
            return self.fn(argument, **self.kwargs)
        except FewBitError:
            raise
        except SystemExit as exc:
            raise self._exited(exc) from None
        except Exception as exc:  # the user's code may raise anything
            raise self._fail(f"calling it failed: {type(exc).__name__}: {exc}") from None

    def _exited(self, exc: SystemExit) -> FewBitError:
        """The user's code ending the process would end the command without a word."""
        return self._fail(f"{self.name}(x) called sys.exit({exc.code!r}) instead of returning f(x)")

    def _probe_torch(self) -> None:
        import torch

        leaf = torch.linspace(-3.0, 3.0, 7, dtype=torch.float64, requires_grad=True)
        try:  # on a copy: an in-place operation on x (x.mul_(2), x += 1) is then fine for autograd too
            y = self.fn(leaf.clone(), **self.kwargs)
        except SystemExit as exc:
            raise self._exited(exc) from None
        except Exception:  # e.g. a numpy function that cannot take a tensor requiring grad
            return
        if y is None:  # the same with numpy arrays, or an error about torch methods on them
            self._check(y, leaf.detach().numpy(), f"{self.name}(x)")
        if isinstance(y, torch.Tensor) and y.shape == leaf.shape and not y.is_complex():
            self.torch_forward = True
            self.use_autograd = y.requires_grad

    def _check(self, y: Any, x: np.ndarray, what: str) -> np.ndarray:
        y = self._real_array(y, x, what)
        if y.shape != x.shape:
            count = "a single number" if y.ndim == 0 else f"shape {y.shape}"
            raise self._fail(
                f"{what} returned {count} for an x of shape {x.shape}: f must act elementwise, one value per element "
                "of x"
            )
        if not np.all(np.isfinite(y)):
            bad = x[~np.isfinite(y)].ravel()[0] if x.ndim else x
            raise self._fail(f"{what} is not finite at x={float(bad):g}")
        return y

    def _real_array(self, y: Any, x: np.ndarray, what: str) -> np.ndarray:
        """``y`` as a float64 array; None, complex values or what is not numbers at all is one clear error."""
        expected = f"it must return f(x), an array of real numbers of x's shape {x.shape}"
        if y is None:
            raise self._fail(
                f"{what} returned None: {expected} (in-place operations such as x.mul_(2) or x.sort() return None)"
            )
        if hasattr(y, "detach"):
            y = y.detach().cpu().numpy()
        if np.iscomplexobj(y):
            raise self._fail(f"{what} returned complex numbers: {expected}")
        try:
            return np.asarray(y, dtype=np.float64)
        except (TypeError, ValueError, RuntimeError):
            kind = f"an array of dtype {y.dtype}" if isinstance(y, np.ndarray) else f"a {type(y).__name__}"
            raise self._fail(f"{what} returned {kind}, not numbers: {expected}") from None

    def check_range(self, low: float, high: float, params: Params) -> None:
        """Refuse an f that is discontinuous or has an unbounded derivative on [low, high].

        Neither has a derivative a table can approximate: finite differences turn a jump into a spike of height
        ~ jump / step, autograd of a step (``torch.round``, ``x > 0``) gives 0, and either way the design returned
        garbage levels labelled exact. The test: on a scan of :data:`RANGE_SCAN` cells, the steepest cells are
        bisected :data:`BISECTIONS` times towards their steeper half. For an f with a bounded f', the secant slope
        over the shrinking interval stays below max |f'| (about the largest secant slope of the scan); at a jump it
        grows like 1 / width, at an unbounded f' (sqrt|x|) like a power of it.
        """
        x = np.linspace(low, high, RANGE_SCAN + 1)
        y = self.f(x, params)
        slopes = np.abs(np.diff(y)) / np.diff(x)
        steepest = float(slopes.max())
        cells = np.argsort(slopes, kind="stable")[-8:]
        a, b = x[cells], x[cells + 1]
        fa, fb = y[cells], y[cells + 1]
        start = np.abs(fb - fa)
        for _ in range(BISECTIONS):
            middle = 0.5 * (a + b)
            fm = self.f(middle, params)
            left = np.abs(fm - fa) >= np.abs(fb - fm)
            # stop where the interval nears the float resolution of x
            left &= b - a > 1024 * np.spacing(np.maximum(np.abs(a), np.abs(b)))
            right = ~left & (b - a > 1024 * np.spacing(np.maximum(np.abs(a), np.abs(b))))
            b, fb = np.where(left, middle, b), np.where(left, fm, fb)
            a, fa = np.where(right, middle, a), np.where(right, fm, fa)
        width = b - a
        change = np.abs(fb - fa)
        # rounding of f itself makes change / width up to 64 eps |f| / width
        noise = 64.0 * np.finfo(np.float64).eps * float(np.max(np.abs(y))) / width
        steep = change / width > 16.0 * steepest + noise
        if not steep.any():
            return
        k = int(np.flatnonzero(steep)[np.argmax((change / width)[steep])])
        where = f"near x={0.5 * (a[k] + b[k]):.6g}"
        if change[k] >= 0.5 * start[k]:
            raise self._fail(
                f"f is discontinuous {where} (it jumps by {change[k]:.3g} within a width of {width[k]:.2g}): its "
                "derivative there is not a function a few-bit table can approximate; make f continuous"
            )
        raise self._fail(
            f"the derivative of f is unbounded {where} (f changes by {change[k]:.3g} within a width of "
            f"{width[k]:.2g}): a few-bit table approximates a bounded f' only; exclude that point with --range"
        )

    def f(self, x: np.ndarray, params: Params) -> np.ndarray:
        if self.torch_forward:
            import torch

            with torch.no_grad():
                y = self._call(torch.from_numpy(np.array(x, dtype=np.float64)))
        else:
            y = self._call(np.array(x, dtype=np.float64))
        return self._check(y, x, f"{self.name}(x)")

    def df(self, x: np.ndarray, params: Params) -> np.ndarray:
        if not self.use_autograd:
            return self._check(_finite_difference(lambda z: self.f(z, params), x), x, "f'(x) (finite differences)")
        import torch

        t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        with torch.enable_grad():
            y = self._call(t.clone())  # a copy, which an in-place operation may change (see _probe_torch)
            if not isinstance(y, torch.Tensor) or y.shape != t.shape or y.is_complex():
                self._check(y, x, f"{self.name}(x)")
            if not y.requires_grad:  # constant for these inputs
                return np.zeros_like(x)
            try:
                (grad,) = torch.autograd.grad(y.sum(), t, allow_unused=True)
            except Exception as exc:
                raise self._fail(f"autograd failed: {type(exc).__name__}: {exc}") from None
        if grad is None:
            return np.zeros_like(x)
        return self._check(grad, x, "f'(x) (autograd)")


def from_module(spec: str, params: Mapping[str, object] | None = None) -> BoundActivation:
    """A user activation ``"pkg.mod:fn"``: ``fn(x, **params)`` is f, f' comes from torch autograd or finite differences.

    ``fn`` receives a float64 torch tensor when torch is importable and ``fn`` works on tensors with autograd;
    otherwise a float64 numpy array, and f' is a 6th-order central finite difference (step eps**(1/7) * max(1, |x|)).
    ``params`` (JSON scalars) are passed to ``fn`` as keyword arguments and recorded in the table.
    The result's name is ``spec``; it has no breakpoints, is not marked even and has no torch module.

    f must be continuous with a bounded derivative on the design range: a jump (a step, ``sign``, ``round``) or an
    unbounded f' (``sqrt(|x|)`` at 0) is refused when the design starts (:meth:`_UserFunction.check_range`). A kink
    is fine, but finite differences smear it over about 3 steps (6e-3 max(1, |x|)) on either side; with torch,
    autograd gives the exact piecewise-constant derivative (``abs`` designs exactly with 1 bit).
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise FewBitError(f"--activation-module must look like 'package.module:function', got {spec!r}")
    module_name, attribute = (part.strip() for part in spec.split(":"))
    if not module_name or not attribute:
        raise FewBitError(f"--activation-module must look like 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FewBitError(f"activation module {spec!r}: cannot import {module_name!r} ({exc})") from None
    except SystemExit as exc:  # the user's module ending the process would end the command without a word
        raise FewBitError(
            f"activation module {spec!r}: importing {module_name!r} called sys.exit({exc.code!r})"
        ) from None
    except Exception as exc:  # the user's module may raise anything on import
        raise FewBitError(f"activation module {spec!r}: importing {module_name!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None  # fmt: skip
    fn = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise FewBitError(f"activation module {spec!r}: module {module_name!r} has no attribute {attribute!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise FewBitError(f"activation module {spec!r}: {attribute!r} is not callable (got {type(fn).__name__})")
    kwargs = {key: _json_scalar(spec, key, value) for key, value in dict(params or {}).items()}
    user = _UserFunction(spec, fn, kwargs, use_torch=_torch_available())
    activation = Activation(
        name=spec,
        torch_name="",
        defaults={},
        _f=user.f,
        _df=user.df,
        description=f"user activation {spec}",
        _open_params=True,
        _check_range=user.check_range,
    )
    bound = activation.bind(kwargs)
    bound.f(np.linspace(-3.0, 3.0, 7))  # fail now, not in the middle of a design
    return bound
