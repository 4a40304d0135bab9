"""Convert a model's linear layers to compressed saved inputs, and say what was done.

Recognised by exact class: ``torch.nn.Linear`` (-> :class:`~.nn.CompressedLinear`) and Hugging Face's
``transformers.pytorch_utils.Conv1D`` (-> :class:`~.nn.CompressedConv1D`; looked at only when transformers is
already imported, never imported here). Subclasses of ``nn.Linear`` are left alone with the reason in the report:
their forward may differ (``NonDynamicallyQuantizableLinear``, the out-projection of ``nn.MultiheadAttention``, is
never even called: the attention reads its weight). Modules that are compressed already are counted, not changed,
so converting twice changes nothing.

>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
>>> model = convert(model, bits=4)
>>> print(model.linear_report)
compressed 2 linear layer(s) (4 bits, groups of 64, stochastic rounding), left 0 alone
  2 x Linear -> CompressedLinear
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...errors import FewBitError
from ..modules import slots, swap
from ..report import Report
from .nn import CompressedConv1D, CompressedLinear, compress_module
from .quant import GROUP_SIZE, check_options

__all__ = ["convert", "LinearReport", "owned_linears"]


@dataclass(kw_only=True)
class LinearReport(Report):
    """What :func:`convert` did: a :class:`~..report.Report` whose ``replaced`` are the layers replaced (qualified
    name, original class), ``skipped`` the layers left alone (name, class, reason) and ``already`` how many layers
    were compressed already.

    Attributes:
        bits: the bits of the codes
        group_size: elements per group
        rounding: ``'stochastic'`` or ``'nearest'``
    """

    bits: int
    group_size: int
    rounding: str

    ALREADY: ClassVar[str] = "layer(s) were compressed already"

    def head(self) -> str:
        return (
            f"compressed {self.count} linear layer(s) ({self.bits} bits, groups of {self.group_size}, "
            f"{self.rounding} rounding), left {len(self.skipped)} alone"
        )

    def replaced_lines(self) -> list[str]:
        targets = {"Conv1D": CompressedConv1D.__name__}
        return [
            f"  {count} x {original} -> {targets.get(original, CompressedLinear.__name__)}"
            for original, count in Counter(original for _, original in self.replaced).items()
        ]


def owned_linears(model: torch.nn.Module) -> set[int]:
    """The ids of the children of modules that compute with their children's weights themselves (class attribute
    ``owns_linears``, the gated-MLP op): a compressed class there would never run, and the op refuses children that
    are not the plain linears it was built with."""
    return {
        id(child)
        for module in model.modules()
        if getattr(type(module), "owns_linears", False)
        for child in module.children()
    }


def _conv1d_class() -> type | None:
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None) if utils is not None else None


def convert(
    model: torch.nn.Module,
    *,
    bits: int = 8,
    group_size: int = GROUP_SIZE,
    rounding: str = "stochastic",
    filter: Callable[[str, torch.nn.Module], bool] | None = None,
) -> torch.nn.Module:
    """Compress the saved inputs of every ``nn.Linear`` and ``Conv1D`` of ``model`` in place (each is replaced at
    its places by a compressed module holding the same parameters, see :func:`~.nn.compress_module`); returns the
    model (the replacement when ``model`` itself is one linear layer) with the report as ``model.linear_report``.

    Args:
        bits: code width, 2 to 8.
        group_size: values per (low, step) pair along the feature dimension (:mod:`.quant` explains 64).
        rounding: ``'stochastic'`` (unbiased weight gradients, the default) or ``'nearest'`` (half the worst-case
            error, biased).
        filter: ``filter(name, module) -> bool``; only layers it accepts are converted.
    """
    bits, group_size, rounding = check_options(bits, group_size, rounding)
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"convert takes a torch.nn.Module, got {type(model).__name__}")
    if filter is not None and not callable(filter):
        raise FewBitError(f"filter must be None or a callable(name, module) -> bool, got {filter!r}")
    report = LinearReport(bits=bits, group_size=group_size, rounding=rounding)
    targets = {torch.nn.Linear: CompressedLinear, _conv1d_class(): CompressedConv1D}
    found = slots(model)
    owned = owned_linears(model)
    replacements: dict[int, torch.nn.Module] = {}
    for slot in found:
        module, name = slot.module, slot.names[0]
        kind = type(module)
        target = targets.get(kind)
        if isinstance(module, CompressedLinear | CompressedConv1D):
            report.already += 1
        elif id(module) in owned:  # another technique's (its op computes with the weight): not this one's to list
            continue
        elif target is None and isinstance(module, torch.nn.Linear):
            report.skipped.append((name, kind.__name__, "a subclass of nn.Linear: its forward may differ"))
        elif target is not None and (filter is None or filter(name, module)):
            replacements[id(module)] = compress_module(
                module, target, bits=bits, group_size=group_size, rounding=rounding
            )
            report.replaced.append((name, kind.__name__))
    root = swap(model, found, replacements)
    root.linear_report = report
    return root
