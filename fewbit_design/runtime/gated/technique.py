"""The gated-MLP op as the planner sees it: every gated MLP of the block (``down(act(gate(x)) * up(x))``) keeps x,
gate and up for backward and recomputes the rest (exact gradients). Config: the plan's ``gated_mode`` (only
``"exact"`` for now)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import check_choice
from ..registry import Technique

#: the modes of the op (a compressed mode, few-bit codes of act'(gate), is not built yet)
MODES = ("exact",)


def _apply(block: torch.nn.Module, mode: str) -> torch.nn.Module:
    from .convert import convert

    with warnings.catch_warnings():  # "nothing replaced": the planner then does not offer the op there
        warnings.simplefilter("ignore", UserWarning)
        return convert(block)


def _config(settings: Mapping[str, Any]) -> str:
    return check_choice("gated_mode", settings.get("gated_mode", "exact"), MODES)


TECHNIQUE = Technique(
    name="gated",
    summary="gated MLPs (SwiGLU, GeGLU, fused gate_up) that keep x, gate and up and recompute the rest in backward",
    seam="module",
    exact=True,
    config=_config,
    apply=_apply,
    settings={"gated_mode": "exact"},
)
