"""Drop-in few-bit ``torch.nn`` activation modules (thin: the math is in :mod:`.ops`).

Every class takes the torch.nn class's constructor arguments (same names, defaults and positional order) and keeps
them as attributes, plus keyword-only ``bits=3``, ``weight='uniform'``, ``mode='levelsets'`` and ``table=None``:

* ``table=None`` loads the shipped table for (activation, params, bits, weight, mode)
  (:func:`fewbit_design.runtime.load_table`);
* ``table`` = a :class:`~fewbit_design.table.Table`, a ``fewbit-table/1`` dict or a path: it must be for the same
  activation and params; its bits, weight and mode win over the arguments.

The forward output is bitwise the torch module's; backward stores ``bits`` bits per element. ``inplace`` is accepted
for drop-in compatibility and ignored: the few-bit op computes out of place. :class:`FewBit` wraps any activation
function with a table designed for it. The table follows the hyper-parameters: assigning one after construction
(``act.negative_slope = 0.2``) loads the table for the new value at once, or raises and keeps the old value.

>>> import torch
>>> from fewbit_design.runtime import nn as fnn
>>> act = fnn.GELU(bits=3)                          # doctest: +SKIP
>>> act = fnn.GELU(table="gelu-3bit.json")          # doctest: +SKIP
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ...design import activations
from ...errors import FewBitError
from ...table import Table
from .._torchscript import NotScriptable
from .backends import decode_table, encode_table, fused_relu
from .functional import quick_gelu_native, relu_squared_native
from .lookup import TableLike, as_table, document_arguments, resolve_table
from .ops import fewbit_activation

__all__ = [
    "FewBitModule",
    "FewBit",
    "ReLU",
    "ReLU6",
    "LeakyReLU",
    "ELU",
    "CELU",
    "SELU",
    "GELU",
    "SiLU",
    "Mish",
    "Sigmoid",
    "Tanh",
    "Softplus",
    "Softsign",
    "Hardtanh",
    "Hardsigmoid",
    "Hardswish",
    "LogSigmoid",
    "Tanhshrink",
    "Softshrink",
    "Hardshrink",
    "Threshold",
    "QuickGELU",
    "ReLUSquared",
]

_BUFFERS = ("boundaries32", "boundaries64", "interval_codes", "levels32", "levels64")
_BUFFER_NAMES = tuple(f"_fewbit_{name}" for name in _BUFFERS)
# module -> (device, its table buffers, their TableTensors views, the buffers' ids), see FewBitModule._table_tensors
_DECODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class FewBitModule(NotScriptable, torch.nn.Module):
    """Base class: holds a table (``self.table``) and its tensors as non-persistent integer buffers.

    Assigning ``module.table = other`` (a Table, a dict or a path) checks the table and replaces the buffers too.
    """

    table: Table

    def _set_table(self, table: Table) -> None:
        # normal tensors even under torch.inference_mode (the module may be trained later), on the device of the
        # buffers they replace
        with torch.inference_mode(False):
            for name, tensor in encode_table(table).items():
                previous = self._buffers.get(f"_fewbit_{name}")
                if previous is not None:
                    tensor = tensor.to(previous.device)
                self.register_buffer(f"_fewbit_{name}", tensor, persistent=False)
        self.__dict__["table"] = table

    def _check_table(self, table: TableLike) -> Table:
        """The table ``module.table = table`` installs (checked for this module)."""
        return as_table(table)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "table" and "table" in self.__dict__:
            self._set_table(self._check_table(value))
            return
        super().__setattr__(name, value)

    @property
    def bits(self) -> int:
        """Bits stored per element for backward (the table's)."""
        return int(self.table.bits)

    def _table_tensors(self, device: torch.device):
        # cached per device while the buffers are the same tensors (module.to() and a new table replace them): the
        # five lookups, moves and views cost ~10 us a call, more than a native GELU of 2^12 elements
        # (kept outside the module, so that copies and pickles of the module do not carry it; not while torch.compile
        # traces, which needs no cache and should see no side effect)
        if torch.compiler.is_compiling():
            encoded = {name: getattr(self, f"_fewbit_{name}").to(device) for name in _BUFFERS}
            return decode_table(self.bits, encoded)
        buffers = tuple(map(self._buffers.get, _BUFFER_NAMES))
        cached = _DECODED.get(self)
        # the same buffer objects (by id: the entry holds the buffers, so their ids are not reused while it lives)
        if cached is not None and cached[3] == tuple(map(id, buffers)) and cached[0] == device:
            return cached[2]
        if any(buffer is None for buffer in buffers):  # a subclass that replaced the buffers: look them up
            buffers = tuple(getattr(self, f"_fewbit_{name}") for name in _BUFFERS)
        tensors = decode_table(self.bits, {name: b.to(device) for name, b in zip(_BUFFERS, buffers, strict=True)})
        if all(buffer.device == device for buffer in buffers):  # views of the buffers (copies would go stale)
            _DECODED[self] = (device, buffers, tensors, tuple(map(id, buffers)))
        return tensors

    def _native(self, input: torch.Tensor) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fewbit_activation(input, self._native, self._table_tensors(input.device))


class _Activation(FewBitModule):
    """A registry activation: its torch.nn hyper-parameters are attributes named as in torch.

    The table follows the hyper-parameters: assigning one after construction (``act.negative_slope = 0.2``,
    ``act.approximate = 'tanh'``) changes the forward, so the table is resolved again at once for the new value: the
    shipped table of the same bits, weight and mode, or, for a module given ``table=``, that table, which must be
    for the new value. When there is none, the assignment raises :class:`FewBitError` (with the ``fewbit-design``
    command that designs the table) and the module keeps its old value: the gradient is never for another function
    than the forward's.
    """

    activation: ClassVar[str]
    #: attributes of the torch class that this module fixes (assigning another value raises)
    _fixed: ClassVar[dict[str, Any]] = {}

    def _setup(self, bits: int, weight: str, mode: str, table: TableLike | None) -> None:
        self._weight = weight if table is None else None
        self._explicit_table = table is not None
        try:
            resolved = self._resolve(table, bits=bits, weight=weight, mode=mode)
        except FewBitError as exc:
            raise FewBitError(f"fewbit_design.runtime.nn.{type(self).__name__}: {exc}") from None
        self._set_table(resolved)

    def _resolve(self, table: TableLike | None, *, bits: int, weight: str, mode: str) -> Table:
        entry = activations.get(self.activation)
        params = {name: getattr(self, name) for name in entry.defaults}
        return resolve_table(table, activation=entry.name, params=params, bits=bits, weight=weight, mode=mode)

    def _check_table(self, table: TableLike) -> Table:
        try:
            resolved = self._resolve(table, bits=self.bits, weight="uniform", mode=self.table.mode)
        except FewBitError as exc:
            raise FewBitError(f"fewbit_design.runtime.nn.{type(self).__name__}.table: {exc}") from None
        self._weight, self._explicit_table = None, True
        return resolved

    def __setattr__(self, name: str, value: Any) -> None:
        if "table" not in self.__dict__:  # still in __init__
            super().__setattr__(name, value)
            return
        if name in self._fixed and value != self._fixed[name]:
            raise FewBitError(
                f"fewbit_design.runtime.nn.{type(self).__name__}: {name} is fixed at {self._fixed[name]!r}, got "
                f"{value!r}; use Hardtanh(min_val, max_val) for other limits"
            )
        if name not in activations.get(self.activation).defaults:
            super().__setattr__(name, value)
            return
        previous = getattr(self, name)
        super().__setattr__(name, value)
        try:
            table = self.table if self._explicit_table else None
            resolved = self._resolve(table, bits=self.bits, weight=self._weight or "uniform", mode=self.table.mode)
        except FewBitError as exc:
            super().__setattr__(name, previous)
            raise FewBitError(
                f"cannot set {type(self).__name__}.{name} = {value!r} (it stays {previous!r}): the backward's table "
                f"must follow it, and {exc} (to change both, build a new module: "
                f"{type(self).__name__}({name}={value!r}, table=...))"
            ) from None
        self._set_table(resolved)

    def extra_repr(self) -> str:
        entry = activations.get(self.activation)
        parts = [f"{name}={getattr(self, name)!r}" for name in entry.defaults]
        parts.append(f"bits={self.bits}")
        if self._weight not in (None, "uniform"):
            parts.append(f"weight={self._weight!r}")
        if self.table.mode != "levelsets":
            parts.append(f"mode={self.table.mode!r}")
        if self._explicit_table:
            parts.append(f"table={self.table.source or '<dict>'!r}")
        return ", ".join(parts)


class _NoArguments(_Activation):
    """An activation whose torch.nn class takes no arguments."""

    def __init__(self, *, bits=3, weight="uniform", mode="levelsets", table=None):
        super().__init__()
        self._setup(bits, weight, mode, table)


class _InplaceOnly(_Activation):
    """An activation whose torch.nn class takes only ``inplace``."""

    def __init__(self, inplace: bool = False, *, bits=3, weight="uniform", mode="levelsets", table=None):
        super().__init__()
        self.inplace = inplace
        self._setup(bits, weight, mode, table)


class _AlphaInplace(_Activation):
    """An activation whose torch.nn class takes ``alpha`` and ``inplace`` (ELU, CELU)."""

    def __init__(
        self, alpha: float = 1.0, inplace: bool = False, *, bits=3, weight="uniform", mode="levelsets", table=None
    ):
        super().__init__()
        self.alpha = alpha
        self.inplace = inplace
        self._setup(bits, weight, mode, table)


class _Lambd(_Activation):
    """A shrink activation whose torch.nn class takes only ``lambd``."""

    def __init__(self, lambd: float = 0.5, *, bits=3, weight="uniform", mode="levelsets", table=None):
        super().__init__()
        self.lambd = lambd
        self._setup(bits, weight, mode, table)


class ReLU(_InplaceOnly):
    """Few-bit :class:`torch.nn.ReLU`."""

    activation = "relu"

    @fused_relu  # the CPU forward may compute relu in the codes kernel's pass
    def _native(self, input):
        return F.relu(input)


class ReLU6(_Activation):
    """Few-bit :class:`torch.nn.ReLU6`."""

    activation = "relu6"
    _fixed = {"min_val": 0.0, "max_val": 6.0}

    def __init__(self, inplace: bool = False, *, bits=3, weight="uniform", mode="levelsets", table=None):
        super().__init__()
        self.inplace = inplace
        self.min_val, self.max_val = 0.0, 6.0
        self._setup(bits, weight, mode, table)

    def _native(self, input):
        return F.hardtanh(input, 0.0, 6.0)


class LeakyReLU(_Activation):
    """Few-bit :class:`torch.nn.LeakyReLU`."""

    activation = "leaky_relu"

    def __init__(
        self,
        negative_slope: float = 1e-2,
        inplace: bool = False,
        *,
        bits=3,
        weight="uniform",
        mode="levelsets",
        table=None,
    ):
        super().__init__()
        self.negative_slope = negative_slope
        self.inplace = inplace
        self._setup(bits, weight, mode, table)

    def _native(self, input):
        return F.leaky_relu(input, self.negative_slope)


class ELU(_AlphaInplace):
    """Few-bit :class:`torch.nn.ELU`."""

    activation = "elu"

    def _native(self, input):
        return F.elu(input, self.alpha)


class CELU(_AlphaInplace):
    """Few-bit :class:`torch.nn.CELU`."""

    activation = "celu"

    def _native(self, input):
        return F.celu(input, self.alpha)


class SELU(_InplaceOnly):
    """Few-bit :class:`torch.nn.SELU`."""

    activation = "selu"

    def _native(self, input):
        return F.selu(input)


class GELU(_Activation):
    """Few-bit :class:`torch.nn.GELU`."""

    activation = "gelu"

    def __init__(self, approximate: str = "none", *, bits=3, weight="uniform", mode="levelsets", table=None):
        super().__init__()
        self.approximate = approximate
        self._setup(bits, weight, mode, table)

    def _native(self, input):
        return F.gelu(input, approximate=self.approximate)


class SiLU(_InplaceOnly):
    """Few-bit :class:`torch.nn.SiLU`."""

    activation = "silu"

    def _native(self, input):
        return F.silu(input)


class Mish(_InplaceOnly):
    """Few-bit :class:`torch.nn.Mish`."""

    activation = "mish"

    def _native(self, input):
        return F.mish(input)


class Sigmoid(_NoArguments):
    """Few-bit :class:`torch.nn.Sigmoid`."""

    activation = "sigmoid"

    def _native(self, input):
        return torch.sigmoid(input)


class Tanh(_NoArguments):
    """Few-bit :class:`torch.nn.Tanh`."""

    activation = "tanh"

    def _native(self, input):
        return torch.tanh(input)


class Softplus(_Activation):
    """Few-bit :class:`torch.nn.Softplus`."""

    activation = "softplus"

    def __init__(
        self, beta: float = 1.0, threshold: float = 20.0, *, bits=3, weight="uniform", mode="levelsets", table=None
    ):
        super().__init__()
        self.beta = beta
        self.threshold = threshold
        self._setup(bits, weight, mode, table)

    def _native(self, input):
        return F.softplus(input, self.beta, self.threshold)


class Softsign(_NoArguments):
    """Few-bit :class:`torch.nn.Softsign`."""

    activation = "softsign"

    def _native(self, input):
        return F.softsign(input)


class Hardtanh(_Activation):
    """Few-bit :class:`torch.nn.Hardtanh` (``min_value`` / ``max_value`` are torch's deprecated aliases)."""

    activation = "hardtanh"

    def __init__(
        self,
        min_val: float = -1.0,
        max_val: float = 1.0,
        inplace: bool = False,
        min_value: float | None = None,
        max_value: float | None = None,
        *,
        bits=3,
        weight="uniform",
        mode="levelsets",
        table=None,
    ):
        super().__init__()
        if min_value is not None:
            warnings.warn("keyword argument min_value is deprecated, use min_val", FutureWarning, stacklevel=2)
            min_val = min_value
        if max_value is not None:
            warnings.warn("keyword argument max_value is deprecated, use max_val", FutureWarning, stacklevel=2)
            max_val = max_value
        self.min_val = min_val
        self.max_val = max_val
        self.inplace = inplace
        self._setup(bits, weight, mode, table)

    def _native(self, input):
        return F.hardtanh(input, self.min_val, self.max_val)


class Hardsigmoid(_InplaceOnly):
    """Few-bit :class:`torch.nn.Hardsigmoid`."""

    activation = "hardsigmoid"

    def _native(self, input):
        return F.hardsigmoid(input)


class Hardswish(_InplaceOnly):
    """Few-bit :class:`torch.nn.Hardswish`."""

    activation = "hardswish"

    def _native(self, input):
        return F.hardswish(input)


class LogSigmoid(_NoArguments):
    """Few-bit :class:`torch.nn.LogSigmoid`."""

    activation = "logsigmoid"

    def _native(self, input):
        return F.logsigmoid(input)


class Tanhshrink(_NoArguments):
    """Few-bit :class:`torch.nn.Tanhshrink`."""

    activation = "tanhshrink"

    def _native(self, input):
        return F.tanhshrink(input)


class Softshrink(_Lambd):
    """Few-bit :class:`torch.nn.Softshrink`."""

    activation = "softshrink"

    def _native(self, input):
        return F.softshrink(input, self.lambd)


class Hardshrink(_Lambd):
    """Few-bit :class:`torch.nn.Hardshrink`."""

    activation = "hardshrink"

    def _native(self, input):
        return F.hardshrink(input, self.lambd)


class Threshold(_Activation):
    """Few-bit :class:`torch.nn.Threshold` (like torch, ``threshold`` and ``value`` are required)."""

    activation = "threshold"

    def __init__(
        self,
        threshold: float,
        value: float,
        inplace: bool = False,
        *,
        bits=3,
        weight="uniform",
        mode="levelsets",
        table=None,
    ):
        super().__init__()
        self.threshold = threshold
        self.value = value
        self.inplace = inplace
        self._setup(bits, weight, mode, table)

    def _native(self, input):
        return F.threshold(input, self.threshold, self.value)


class QuickGELU(_NoArguments):
    """Few-bit x * sigmoid(1.702 x): Hugging Face's ``QuickGELUActivation``, timm's ``QuickGELU`` (not in torch.nn)."""

    activation = "quick_gelu"

    def _native(self, input):
        return quick_gelu_native(input)


class ReLUSquared(_NoArguments):
    """Few-bit relu(x) ** 2: Hugging Face's ``ReLUSquaredActivation`` (no torch.nn class)."""

    activation = "relu_squared"

    def _native(self, input):
        return relu_squared_native(input)


class FewBit(FewBitModule):
    """Any activation ``fn(x)`` with a few-bit backward from ``table`` (a Table, a dict or a path).

    The forward is exactly ``fn(x)`` (run without recording autograd, so ``fn`` must be pointwise and must not
    have trainable parameters; an ``fn`` whose output is not a tensor of x's shape raises :class:`FewBitError`); the
    backward is ``grad * q(x)`` from the table, which should be designed for ``fn`` (e.g. ``fewbit-design
    --activation-module pkg.mod:fn ...``). An ``nn.Module`` ``fn`` is registered as a submodule; its own attributes
    are not watched (a change that alters what ``fn`` computes needs a new table: ``module.table = ...``).

    >>> act = FewBit(my_activation, "my_activation-3bit.json")      # doctest: +SKIP
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], table: TableLike):
        super().__init__()
        if not callable(fn):
            raise FewBitError(f"FewBit needs a callable activation fn(x), got {type(fn).__name__}")
        if isinstance(fn, torch.nn.Module):
            trainable = [name for name, p in fn.named_parameters() if p.requires_grad]
            if trainable:
                raise FewBitError(
                    f"FewBit cannot wrap {type(fn).__name__}: its parameter {trainable[0]!r} is trainable and would "
                    "get no gradient (the forward runs without autograd); freeze it or keep the native module"
                )
        self.fn = fn
        if table is None:
            raise FewBitError("FewBit needs a table designed for fn (a Table, a fewbit-table/1 dict or a path)")
        self._set_table(as_table(table))

    def _native(self, input):
        output = self.fn(input)
        if not isinstance(output, torch.Tensor) or output.shape != input.shape:
            got = f"shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else f"a {type(output).__name__}"
            raise FewBitError(
                f"FewBit({self._fn_name()}): fn(x) must return a tensor of x's shape {tuple(input.shape)} (an "
                f"elementwise activation: the backward scales each element's gradient by its level), got {got}"
            )
        return output

    def _fn_name(self) -> str:
        return getattr(self.fn, "__qualname__", None) or type(self.fn).__name__

    def extra_repr(self) -> str:
        name = self._fn_name()
        parts = [] if isinstance(self.fn, torch.nn.Module) else [f"fn={name}"]
        parts += [f"activation={self.table.activation!r}", f"bits={self.bits}"]
        if self.table.source:
            parts.append(f"table={self.table.source!r}")
        return ", ".join(parts)


CLASSES: dict[str, type[_Activation]] = {
    cls.activation: cls
    for cls in (
        ReLU,
        ReLU6,
        LeakyReLU,
        ELU,
        CELU,
        SELU,
        GELU,
        SiLU,
        Mish,
        Sigmoid,
        Tanh,
        Softplus,
        Softsign,
        Hardtanh,
        Hardsigmoid,
        Hardswish,
        LogSigmoid,
        Tanhshrink,
        Softshrink,
        Hardshrink,
        Threshold,
        QuickGELU,
        ReLUSquared,
    )
}


for _cls in CLASSES.values():
    document_arguments(_cls, f"torch.nn.{_cls.__name__}")
del _cls


def from_torch(module: torch.nn.Module, **kwargs: Any) -> _Activation:
    """The few-bit module for a torch.nn activation module (its exact class), with the same hyper-parameters."""
    entry = _entry_for(type(module))
    if entry is None:
        raise FewBitError(f"{type(module).__name__} is not a torch.nn activation with a few-bit version")
    cls = CLASSES[entry.name]
    params = {name: getattr(module, name) for name in entry.defaults if entry.name != "relu6"}
    if entry.name == "threshold":
        return cls(params.pop("threshold"), params.pop("value"), **kwargs)
    return cls(**params, **kwargs)


def _entry_for(cls: type) -> activations.Activation | None:
    for entry in activations.REGISTRY.values():
        if entry.torch_name and getattr(torch.nn, entry.torch_name, None) is cls:
            return entry
    return None
