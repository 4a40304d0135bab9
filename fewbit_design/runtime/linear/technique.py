"""Compressed linear inputs as the planner sees it: every ``nn.Linear`` / ``Conv1D`` of the block keeps its input
for the weight gradient as K-bit group codes (approximate weight gradients; forward and input gradients exact).
Config: the plan's ``linear_bits`` (default 8)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...errors import check_integer
from ..registry import Technique


def _apply(block: torch.nn.Module, bits: int) -> torch.nn.Module:
    from .convert import convert

    return convert(block, bits=bits)  # in place; the replacement when the block is one linear layer


def _config(settings: Mapping[str, Any]) -> int:
    return check_integer("linear_bits", settings.get("linear_bits", 8), low=2, high=8)


TECHNIQUE = Technique(
    name="linear",
    summary="linear layers that keep K-bit group codes of their input for the weight gradient",
    seam="module",
    exact=False,
    config=_config,
    apply=_apply,
    settings={"linear_bits": 8},
)
