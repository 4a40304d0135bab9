"""The compressed attention core as the runtime sees it: every Hugging Face SDPA attention module keeps q, k and v
as K-bit group codes for backward and recomputes the attention there (exact forward, approximate gradients). Plan
setting: ``attention_bits`` (default 8). ``runtime.convert`` runs it under ``compress=K`` in place of the exact core
(:mod:`.exact_technique`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import check_integer
from ..linear.quant import GROUP_SIZE
from ..registry import ConvertRole, Technique


@dataclass(frozen=True)
class AttentionOptions:
    """Options of the compressed attention core.

    Attributes:
        bits: bits of the q, k, v codes, 2 to 8.
        group_size: values per (low, step) group along the head dimension (not a plan setting).
    """

    bits: int = 8
    group_size: int = field(default=GROUP_SIZE, metadata={"setting": None})

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_integer("attention_bits", self.bits, low=2, high=8))
        object.__setattr__(self, "group_size", check_integer("attention group_size", self.group_size, low=1))


def _convert(model: torch.nn.Module, options: AttentionOptions, probe: Any) -> torch.nn.Module:
    from .convert import convert

    return convert(model, bits=options.bits, group_size=options.group_size)


TECHNIQUE = Technique(
    name="attention",
    summary="attention cores that keep K-bit group codes of q, k and v and recompute the attention in backward",
    seam="module",
    options=AttentionOptions,
    approximate=lambda options: f"gradients through compressed attention cores ({options.bits}-bit q, k, v)",
    convert=_convert,
    in_convert=ConvertRole(
        "attention_report",
        switch="attention",
        default=False,
        compress=lambda options, bits: AttentionOptions(bits, options.group_size),
    ),
)
