"""BLPA as the planner sees it: fuse the block's ``BatchNorm -> ReLU -> Conv2d/Linear`` runs into units that keep
K-bit activations for backward (approximate gradients). Config: the plan's ``blpa_bits``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..registry import Technique


def _apply(block: torch.nn.Module, bits: int) -> torch.nn.Module:
    from .fuse import convert

    with warnings.catch_warnings():  # "nothing fused": the planner then does not offer BLPA there
        warnings.simplefilter("ignore", UserWarning)
        return convert(block, bits=bits)


def _config(settings: Mapping[str, Any]) -> int:
    return int(settings.get("blpa_bits", 4))


TECHNIQUE = Technique(
    name="blpa",
    summary="BatchNorm -> ReLU -> Conv/Linear units that keep K-bit activations for backward",
    seam="module",
    exact=False,
    config=_config,
    apply=_apply,
)
