"""``convert``: fuse the ``BatchNorm -> ReLU -> Conv2d/Linear`` groups of an existing model into BLPA units.

The groups are found in ``nn.Sequential`` containers, reading through the "chain" modules that run their children
one after the other: Hugging Face's ``ResNetConvLayer`` (convolution -> normalization -> activation, looked at only
when ``transformers`` is already imported). In a Hugging Face ResNet the BLPA pattern spans two such layers: the
norm and ReLU of one ``ResNetConvLayer`` and the convolution of the next one in the same ``Sequential``; the fused
unit takes the norm's place and the ReLU and the next convolution become ``nn.Identity``, so both layers' forwards
still run in order. Runs that end a block (a ReLU after a residual sum, the stem's ReLU before max pooling) do not
match the pattern and stay.
"""

from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import dataclass, field

from torch import nn

from ...errors import FewBitError
from ..report import Report
from .nn import BNReLUConv2d, BNReLULinear, _check_unit_bits, _FusedUnit

__all__ = ["convert", "FuseReport"]

logger = logging.getLogger("fewbit_design.runtime.blpa")

_PATTERNS: tuple[tuple[type, type, type[_FusedUnit]], ...] = (
    (nn.BatchNorm2d, nn.Conv2d, BNReLUConv2d),
    (nn.BatchNorm1d, nn.Linear, BNReLULinear),
)

# (library module, class name) -> the children a chain module runs in order
_CHAINS: dict[tuple[str, str], tuple[str, ...]] = {
    ("transformers.models.resnet.modeling_resnet", "ResNetConvLayer"): ("convolution", "normalization", "activation"),
}


@dataclass(kw_only=True)
class FuseReport(Report):
    """What :func:`convert` did: a :class:`~..report.Report` whose ``replaced`` are the fused runs (names of the norm,
    ReLU and op; also :attr:`fused`) and ``skipped`` the runs left alone (norm name, reason)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def fused(self) -> list[tuple[str, str, str]]:
        """The fused runs: (norm, ReLU, op) names."""
        return self.replaced

    def head(self) -> str:
        return f"fused {self.count} BatchNorm -> ReLU -> op run(s) into BLPA units"

    def left_lines(self) -> list[str]:
        return [f"  left alone at {name!r}: {reason}" for name, reason in self.skipped]


def _chain_children(module: nn.Module) -> tuple[str, ...] | None:
    cls = type(module)
    for (library, name), children in _CHAINS.items():
        imported = sys.modules.get(library)
        if imported is not None and getattr(imported, name, None) is cls:
            return children
    return None


def convert(
    model: nn.Module, *, bits: int | None = 4, naive: bool = False, strict: bool = False, report: bool = False
) -> nn.Module:
    """Fuse every ``BatchNorm2d -> ReLU -> Conv2d`` and ``BatchNorm1d -> ReLU -> Linear`` run in ``nn.Sequential``
    containers of ``model`` (recursively, through Hugging Face ``ResNetConvLayer`` chains) into BLPA units; returns
    ``model`` (changed in place), always.

    What was done is the :class:`FuseReport` in ``model.blpa_report``, set by every call (the next call overwrites
    it). ``report`` must stay False: ``report=True`` (an older form that returned ``(model, report)``) raises.

    The fused unit takes the place of the BatchNorm and reuses the original modules (parameters, running
    statistics and hyper-parameters are shared, so an optimizer built before ``convert`` keeps working); the ReLU and
    the Conv/Linear positions become ``nn.Identity`` so other indices stay valid. Runs that match by type but cannot
    be fused (affine=False, channel mismatch, padding_mode other than 'zeros') are left alone, or raise with
    ``strict=True``; ``strict=True`` also raises when nothing at all was fused, and without it a model where nothing
    was fused gives a warning. The summary is logged (logger ``fewbit_design.runtime.blpa``, INFO).

    Examples:
        >>> seq = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 4, 3))
        >>> [type(m).__name__ for m in convert(seq, bits=8)]
        ['BNReLUConv2d', 'Identity', 'Identity']

    Args:
        model: the model, changed in place
        bits: bits per element (None: exact fused units)
        naive: the paper's naive baseline
        strict: raise instead of leaving unfusable runs alone
        report: must stay False (see above)
    """
    if not isinstance(model, nn.Module):
        raise FewBitError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if report is not False:
        raise FewBitError(
            f"blpa.convert(report={report!r}): blpa.convert always returns the model; the report of the fusion is "
            "the attribute model.blpa_report of the returned model (drop report=)"
        )
    bits = _check_unit_bits("convert", bits, naive)
    result = FuseReport()
    already = any(isinstance(module, _FusedUnit) for module in model.modules())
    # all or nothing: every unit is built (and strict checked) before the first module is swapped
    fusions: list[_Fusion] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Sequential):
            fusions += _plan_sequential(module, name, bits, naive, strict, result)
    for slots, unit in fusions:
        (bn_owner, bn_attribute, _), (relu_owner, relu_attribute, _), (op_owner, op_attribute, _) = slots
        bn_owner._modules[bn_attribute] = unit
        relu_owner._modules[relu_attribute] = nn.Identity()
        op_owner._modules[op_attribute] = nn.Identity()
        result.replaced.append(tuple(name for _, _, name in slots))
    logger.info("blpa.convert %s: %s", type(model).__name__, result)
    if not result.fused and not already:
        reasons = "; ".join(f"{name!r}: {reason}" for name, reason in result.skipped) or (
            "no BatchNorm -> ReLU -> Conv2d/Linear run inside an nn.Sequential (BLPA fuses only that pattern)"
        )
        if strict:
            raise FewBitError(f"blpa.convert(strict=True): nothing fused in {type(model).__name__}: {reasons}")
        warnings.warn(f"blpa.convert: nothing fused in {type(model).__name__}: {reasons}", stacklevel=2)
    model.blpa_report = result
    return model


def _slots(seq: nn.Sequential, prefix: str) -> list[tuple[nn.Module, str, str]]:
    """(owner, attribute, qualified name) of every module the Sequential runs, in order, through chain modules."""
    slots = []
    for key, module in seq._modules.items():
        name = f"{prefix}.{key}" if prefix else key
        children = _chain_children(module)
        if children is None:
            slots.append((seq, key, name))
        else:
            slots += [(module, child, f"{name}.{child}") for child in children]
    return slots


_Slot = tuple[nn.Module, str, str]
_Fusion = tuple[tuple[_Slot, _Slot, _Slot], _FusedUnit]


def _plan_sequential(seq: nn.Sequential, prefix: str, bits, naive: bool, strict: bool, result: FuseReport):
    """The runs of ``seq`` to fuse, with their units (nothing is changed here); runs that cannot be fused go to the
    report, or raise with ``strict``."""
    slots = _slots(seq, prefix)
    fusions: list[_Fusion] = []
    index = 0
    while index + 2 < len(slots):
        parts = [getattr(owner, attribute) for owner, attribute, _ in slots[index : index + 3]]
        unit = None
        for bn_type, op_type, unit_type in _PATTERNS:
            if isinstance(parts[0], bn_type) and isinstance(parts[1], nn.ReLU) and isinstance(parts[2], op_type):
                try:
                    unit = unit_type.from_modules(*parts, bits=bits, naive=naive)
                except FewBitError as exc:
                    if strict:
                        raise FewBitError(f"blpa.convert(strict=True): run at {slots[index][2]!r}: {exc}") from None
                    result.skipped.append((slots[index][2], str(exc)))
                break
        if unit is None:
            index += 1
            continue
        unit.train(parts[0].training)  # a new module starts in training mode; the model may be in eval mode
        fusions.append(((slots[index], slots[index + 1], slots[index + 2]), unit))
        index += 3
    return fusions
