"""The compressed attention core as the planner sees it: every Hugging Face SDPA attention module of the block keeps
q, k and v as K-bit group codes for backward and recomputes the attention there (exact forward, approximate
gradients). Config: the plan's ``attention_bits`` (default 8)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...errors import check_integer
from ..registry import Technique


def _apply(block: torch.nn.Module, bits: int) -> torch.nn.Module:
    from .convert import convert

    holder = torch.nn.Sequential(block)  # converts the block itself too when it is an attention module
    return convert(holder, bits=bits)[0]


def _config(settings: Mapping[str, Any]) -> int:
    return check_integer("attention_bits", settings.get("attention_bits", 8), low=2, high=8)


TECHNIQUE = Technique(
    name="attention",
    summary="attention cores that keep K-bit group codes of q, k and v and recompute the attention in backward",
    seam="module",
    exact=False,
    config=_config,
    apply=_apply,
    settings={"attention_bits": 8},
)
