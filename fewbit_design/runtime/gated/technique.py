"""The gated-MLP op as the planner sees it: every gated MLP of the block (``down(act(gate(x)) * up(x))``) keeps x,
gate and up for backward and recomputes the rest (exact gradients), or, in compressed mode, K-bit codes of x, gate
and up, recomputing act(gate) and act'(gate) from gate's (approximate gradients). Config: the plan's ``gated_mode``
(``"exact"``, the default, or ``"compressed"``) and ``gated_bits`` (K, 2 to 8, default 8; read in compressed mode).

``exact`` below is the default mode's; ``exact_in`` gives the configured mode's (the compressed mode, opt-in through
``gated_mode``, is approximate), which is what the planner reads."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import check_choice, check_integer
from ..registry import Technique
from .nn import MODES


def _apply(block: torch.nn.Module, config: tuple[str, int]) -> torch.nn.Module:
    from .convert import convert

    mode, bits = config
    with warnings.catch_warnings():  # "nothing replaced": the planner then does not offer the op there
        warnings.simplefilter("ignore", UserWarning)
        return convert(block, mode=mode, bits=bits)


def _config(settings: Mapping[str, Any]) -> tuple[str, int]:
    """(mode, bits) from the plan's settings."""
    mode = check_choice("gated_mode", settings.get("gated_mode", "exact"), MODES)
    return mode, check_integer("gated_bits", settings.get("gated_bits", 8), low=2, high=8)


TECHNIQUE = Technique(
    name="gated",
    summary="gated MLPs (SwiGLU, GeGLU, fused gate_up) that keep x, gate and up and recompute the rest in backward",
    seam="module",
    exact=True,
    exact_in=lambda config: config[0] == "exact",
    config=_config,
    apply=_apply,
    settings={"gated_mode": "exact", "gated_bits": 8},
)
