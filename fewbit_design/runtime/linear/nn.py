"""Modules whose saved input is K-bit group codes: :class:`CompressedLinear` (an ``nn.Linear``) and
:class:`CompressedConv1D` (Hugging Face's transposed linear, GPT-2's ``Conv1D``). They hold the same ``weight`` and
``bias`` parameters under the same names as the module they replace, and no math (:mod:`.ops`)."""

from __future__ import annotations

import copy

import torch

from .._torchscript import NotScriptable
from .ops import compressed_linear
from .quant import GROUP_SIZE, check_options

__all__ = ["CompressedLinear", "CompressedConv1D", "compress_module", "share_state"]


class _Compressed(NotScriptable):
    """The options every compressed module carries (set by :func:`compress_module` or the constructor)."""

    bits: int
    group_size: int
    rounding: str

    def _set_options(self, bits: object, group_size: object, rounding: object) -> None:
        self.bits, self.group_size, self.rounding = check_options(bits, group_size, rounding)

    def _options_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}, rounding={self.rounding!r}"


class CompressedLinear(_Compressed, torch.nn.Linear):
    """``nn.Linear`` with an exact forward whose backward keeps the input as ``bits``-bit group codes.

    >>> layer = CompressedLinear(64, 8, bits=4)
    >>> layer(torch.randn(2, 64)).shape
    torch.Size([2, 8])

    Args:
        in_features: as in ``nn.Linear``
        out_features: as in ``nn.Linear``
        bias: as in ``nn.Linear``
        bits: bits per element of the saved input codes (1..8)
        group_size: elements per quantization group (each has its own low and step)
        rounding: ``'stochastic'`` (unbiased weight gradient) or ``'nearest'``
        device: as in ``nn.Linear``
        dtype: as in ``nn.Linear``
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        bits: int = 8,
        group_size: int = GROUP_SIZE,
        rounding: str = "stochastic",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._set_options(bits, group_size, rounding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compressed_linear(
            x, self.weight, self.bias, bits=self.bits, group_size=self.group_size, rounding=self.rounding
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._options_repr()}"


class CompressedConv1D(_Compressed, torch.nn.Module):
    """Hugging Face ``Conv1D`` (``y = x W + b``, weight of shape (nx, nf)) with the backward of
    :class:`CompressedLinear`. Made by :func:`compress_module` from a ``Conv1D``; attributes ``nf``, ``nx``,
    ``weight``, ``bias`` as there."""

    nf: int
    nx: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compressed_linear(
            x,
            self.weight,
            self.bias,
            bits=self.bits,
            group_size=self.group_size,
            rounding=self.rounding,
            transposed=True,
        )

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, {self._options_repr()}"


def compress_module(
    module: torch.nn.Module, target: type, *, bits: int, group_size: int, rounding: str
) -> torch.nn.Module:
    """A ``target`` module that stands for ``module`` (an ``nn.Linear`` or a ``Conv1D``): it holds the same
    ``Parameter`` objects (tied weights stay tied), buffers, hooks and attributes under the same names, so its
    state-dict keys are the original's; ``module`` itself is not changed."""
    options = check_options(bits, group_size, rounding)
    replacement = share_state(module, target)
    replacement._set_options(*options)
    return replacement


def share_state(module: torch.nn.Module, target: type) -> torch.nn.Module:
    """A new ``target`` instance (``__init__`` not run) holding ``module``'s state: a shallow copy, whose dicts
    (parameters, buffers, hooks) are new and whose entries (the ``Parameter`` objects, ...) are the same.

    Args:
        module: the module whose state is shared
        target: the class of the new module (``type(module)`` for a copy of the same class)
    """
    replacement = target.__new__(target)
    replacement.__dict__.update(
        {key: copy.copy(value) if isinstance(value, dict | set) else value for key, value in vars(module).items()}
    )
    return replacement
