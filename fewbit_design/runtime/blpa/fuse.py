"""``convert``: fuse the ``BatchNorm -> ReLU -> Conv2d/Linear`` groups of an existing model into BLPA units."""

from __future__ import annotations

from torch import nn

from ...errors import FewBitError
from .nn import BNReLUConv2d, BNReLULinear, _check_unit_bits, _FusedUnit

__all__ = ["convert"]

_PATTERNS: tuple[tuple[type, type, type[_FusedUnit]], ...] = (
    (nn.BatchNorm2d, nn.Conv2d, BNReLUConv2d),
    (nn.BatchNorm1d, nn.Linear, BNReLULinear),
)


def convert(model: nn.Module, *, bits: int | None = 4, naive: bool = False, strict: bool = False) -> nn.Module:
    """Fuse every ``BatchNorm2d -> ReLU -> Conv2d`` and ``BatchNorm1d -> ReLU -> Linear`` run in ``nn.Sequential``
    containers of ``model`` (recursively) into BLPA units; returns ``model`` (changed in place).

    The fused unit takes the place of the BatchNorm and reuses the original modules (parameters, running
    statistics and hyper-parameters are shared, so an optimizer built before ``convert`` keeps working); the ReLU and
    the Conv/Linear positions become ``nn.Identity`` so other indices stay valid. Runs that match by type but cannot
    be fused (affine=False, channel mismatch, padding_mode other than 'zeros') are left alone, or raise with
    ``strict=True``.

    >>> seq = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 4, 3))
    >>> [type(m).__name__ for m in convert(seq, bits=8)]
    ['BNReLUConv2d', 'Identity', 'Identity']
    """
    if not isinstance(model, nn.Module):
        raise FewBitError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    bits = _check_unit_bits("convert", bits, naive)
    for module in list(model.modules()):
        if isinstance(module, nn.Sequential):
            _fuse_sequential(module, bits, naive, strict)
    return model


def _fuse_sequential(seq: nn.Sequential, bits: int | None, naive: bool, strict: bool) -> None:
    keys = list(seq._modules)
    index = 0
    while index + 2 < len(keys):
        first, second, third = (seq._modules[key] for key in keys[index : index + 3])
        unit = None
        for bn_type, op_type, unit_type in _PATTERNS:
            if isinstance(first, bn_type) and isinstance(second, nn.ReLU) and isinstance(third, op_type):
                try:
                    unit = unit_type.from_modules(first, second, third, bits=bits, naive=naive)
                except FewBitError:
                    if strict:
                        raise
                break
        if unit is None:
            index += 1
            continue
        seq._modules[keys[index]] = unit
        seq._modules[keys[index + 1]] = nn.Identity()
        seq._modules[keys[index + 2]] = nn.Identity()
        index += 3
