"""Few-bit activations as the planner sees it: every supported activation of the block keeps b-bit codes of its
derivative for backward (approximate gradients). Config: the plan's ``bits``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..registry import Technique


def _apply(block: torch.nn.Module, bits: int) -> torch.nn.Module:
    from .convert import convert

    holder = torch.nn.Sequential(block)  # converts the block itself too when it is an activation
    with warnings.catch_warnings():  # "nothing replaced": the planner then does not offer few-bit there
        warnings.simplefilter("ignore", UserWarning)
        return convert(holder, bits=bits)[0]


def _config(settings: Mapping[str, Any]) -> int:
    return int(settings.get("bits", 3))


TECHNIQUE = Technique(
    name="fewbit",
    summary="activations that keep b-bit codes of their derivative for backward",
    seam="module",
    exact=False,
    config=_config,
    apply=_apply,
)
