"""The exact attention core as the runtime sees it: every Hugging Face SDPA attention module with a value projection
keeps that projection's input (which q_proj and k_proj keep anyway) instead of v, and rebuilds v in backward (exact
gradients; :mod:`.exact`). ``runtime.convert`` runs it by default, and the compressed core
(:mod:`.technique`) instead under ``compress=K``; both answer to ``attention=False`` and report as ``attention``."""

from __future__ import annotations

from typing import Any

import torch

from ..registry import ConvertRole, Technique


def _convert(model: torch.nn.Module, options: Any, probe: Any) -> torch.nn.Module:
    from .convert import convert

    return convert(model, mode="exact")


TECHNIQUE = Technique(
    name="exact_attention",
    summary="attention cores that keep the value projection's input instead of v and rebuild v in backward",
    seam="module",
    convert=_convert,
    excludes=frozenset({"attention"}),
    in_convert=ConvertRole(
        "attention_report", switch="attention", compress=lambda options, bits: None, report_name="attention"
    ),
)
