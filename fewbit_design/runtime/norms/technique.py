"""Memory-sharing norms as the runtime sees it: every LayerNorm / RMSNorm proven equal on a probe keeps only its
output (shared with the next layer) and per-row statistics for backward (exact gradients, up to rounding); with
``bits``, K-bit group codes of its output instead (approximate gradients). Plan settings: ``norms_threshold``,
``norms_bits``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import check_integer, check_positive
from ..registry import ConvertRole, Technique
from .ops import DEFAULT_THRESHOLD


@dataclass(frozen=True)
class NormsOptions:
    """Options of the memory-sharing norms.

    Attributes:
        threshold: channels with ``|w| < threshold * (|b| + tiny / eps)`` keep their normalised input (:mod:`.ops`).
        bits: None (exact), or 2..8: the output kept as group codes (the compressed mode).
    """

    threshold: float = DEFAULT_THRESHOLD
    bits: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", check_positive("norms threshold", self.threshold))
        if self.bits is not None:
            object.__setattr__(self, "bits", check_integer("norms bits", self.bits, low=2, high=8))


def _convert(model: torch.nn.Module, options: NormsOptions, probe: Any) -> torch.nn.Module:
    from .convert import convert

    return convert(model, threshold=options.threshold, bits=options.bits)


def _approximate(options: NormsOptions) -> str | None:
    return None if options.bits is None else f"gradients of norms (compressed mode, {options.bits}-bit output codes)"


TECHNIQUE = Technique(
    name="norms",
    summary="LayerNorm / RMSNorm that keep only their output and per-row statistics for backward",
    seam="module",
    options=NormsOptions,
    approximate=_approximate,
    convert=_convert,
    in_convert=ConvertRole(
        "norms_report", switch="norms", compress=lambda options, bits: NormsOptions(options.threshold, bits)
    ),
)
