"""Swap the activation modules of an existing model for few-bit ones.

>>> import torch
>>> from fewbit_design import runtime
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
>>> model = runtime.convert(model, bits=3)                         # doctest: +SKIP
>>> model = runtime.convert(model, filter={MyAct: "myact.json"})   # doctest: +SKIP
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import FewBitError
from .nn import FewBit, FewBitModule, _entry_for, from_torch
from .tables import TableLike

__all__ = ["convert", "Filter"]

Filter = Mapping[type, TableLike | None] | Callable[[str, torch.nn.Module], Any] | None


def _decision(filter: Filter, name: str, module: torch.nn.Module) -> Any:
    """True (default table), a table, or None (leave the module alone)."""
    if filter is None:
        return True
    if isinstance(filter, Mapping):
        for cls, table in filter.items():
            if isinstance(module, cls):
                return table
        return True
    if callable(filter):
        return filter(name, module)
    raise FewBitError(
        f"filter must be None, a dict {{module class: table}} or a callable(name, module), got {filter!r}"
    )


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        return tensor.device
    return None


def convert(
    model: torch.nn.Module,
    *,
    bits: int = 3,
    weight: str = "uniform",
    mode: str = "levelsets",
    filter: Filter = None,
) -> torch.nn.Module:
    """Replace the activation modules of ``model`` (in place) by few-bit modules and return the model.

    Every module whose exact class is a torch.nn activation of the registry (ReLU, GELU, SiLU, LeakyReLU, ...)
    becomes the matching :mod:`fewbit_design.runtime.nn` module with the same hyper-parameters and the shipped table
    for (``bits``, ``weight``, ``mode``). ``filter`` chooses per module:

    * a dict ``{module class: table}``: modules that are instances of a key use that table (a Table, a dict or a
      path); a torch.nn activation class becomes its few-bit module with the table, any other class (your own
      activation) is wrapped as ``FewBit(module, table)``; a ``None`` value leaves those modules alone. Modules that
      match no key get the default treatment.
    * a callable ``filter(name, module)`` returning a table (use it), ``True`` (default treatment) or
      ``None`` / ``False`` (leave the module alone).

    Few-bit modules already in the model are left as they are, so converting twice changes nothing the second
    time. Raises :class:`FewBitError` naming the module when its table cannot be found.
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"convert takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, FewBitModule):
        return model
    _convert_children(model, "", bits=bits, weight=weight, mode=mode, filter=filter)
    return model


def _convert_children(parent: torch.nn.Module, prefix: str, **options: Any) -> None:
    for child_name, child in list(parent.named_children()):
        name = f"{prefix}.{child_name}" if prefix else child_name
        if isinstance(child, FewBitModule):
            continue
        replacement = _replacement(name, child, **options)
        if replacement is None:
            _convert_children(child, name, **options)
            continue
        replacement.train(child.training)
        device = _device_of(child) or _device_of(parent)
        if device is not None:
            replacement.to(device)
        setattr(parent, child_name, replacement)


def _replacement(name: str, module: torch.nn.Module, *, bits: int, weight: str, mode: str, filter: Filter):
    decision = _decision(filter, name, module)
    if decision is None or decision is False:
        return None
    is_activation = _entry_for(type(module)) is not None
    try:
        if decision is True:
            if not is_activation:
                return None
            return from_torch(module, bits=bits, weight=weight, mode=mode)
        if is_activation:
            return from_torch(module, table=decision)
        return FewBit(module, decision)
    except FewBitError as exc:
        raise FewBitError(f"cannot convert module {name!r} ({module!r}): {exc}") from None


class _CallableModule(types.ModuleType):
    # ``fewbit_design.runtime.convert`` is both this module and the function: importing the submodule makes the
    # package attribute the module, so the module forwards calls to :func:`convert`.
    def __call__(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        return convert(model, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
