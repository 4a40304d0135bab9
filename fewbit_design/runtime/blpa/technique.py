"""BLPA as the runtime sees it: fuse ``BatchNorm -> ReLU -> Conv2d/Linear`` runs into units that keep K-bit
activations for backward (approximate gradients). Plan setting: ``blpa_bits`` (``plan_memory(blpa_bits=...)``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import check_integer
from ..registry import Technique


@dataclass(frozen=True)
class BlpaOptions:
    """Options of BLPA.

    Attributes:
        bits: bits per saved activation, 2 to 8.
    """

    bits: int = field(default=4, metadata={"setting": "blpa_bits"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_integer("BLPA bits", self.bits, low=2, high=8))


def _convert(model: torch.nn.Module, options: BlpaOptions, probe: Any) -> torch.nn.Module:
    from .fuse import convert

    return convert(model, bits=options.bits)


TECHNIQUE = Technique(
    name="blpa",
    summary="BatchNorm -> ReLU -> Conv/Linear units that keep K-bit activations for backward",
    seam="module",
    options=BlpaOptions,
    approximate=lambda options: f"gradients of BatchNorm -> ReLU -> op units ({options.bits}-bit activations)",
    convert=_convert,
    aliases={"blpa_bits": "bits"},
)
