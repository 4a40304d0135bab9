"""Memory-sharing norms as the planner sees it: every LayerNorm / RMSNorm of the block proven equal on a probe keeps
only its output (shared with the next layer) and per-row statistics for backward (exact gradients, up to rounding).
Config: the plan's ``norms_threshold``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..registry import Technique
from .ops import DEFAULT_THRESHOLD


def _apply(block: torch.nn.Module, threshold: float) -> torch.nn.Module:
    from .convert import convert

    holder = torch.nn.Sequential(block)  # converts the block itself too when it is a norm
    return convert(holder, threshold=threshold)[0]


def _config(settings: Mapping[str, Any]) -> float:
    return float(settings.get("norms_threshold", DEFAULT_THRESHOLD))


TECHNIQUE = Technique(
    name="norms",
    summary="LayerNorm / RMSNorm that keep only their output and per-row statistics for backward",
    seam="module",
    exact=True,
    config=_config,
    apply=_apply,
    settings={"norms_threshold": DEFAULT_THRESHOLD},
)
