"""The chunked LM head as the planner sees it: a Hugging Face causal LM called with ``labels`` computes its loss a
chunk of rows at a time, and its logits never exist whole (exact gradients). It applies to a whole model (the head
is not inside any block); other modules are left as they are. Config: the plan's ``head_chunk_rows`` (None: the
automatic chunk of :func:`.ops.default_chunk_rows`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...errors import check_integer
from ..registry import Technique


def _apply(block: torch.nn.Module, chunk_rows: int | None) -> torch.nn.Module:
    from .convert import apply

    return apply(block, chunk_rows)


def _changes(block: torch.nn.Module, chunk_rows: int | None) -> bool:
    from .convert import _causal_lms

    return any(not hasattr(found, "head_report") for found in _causal_lms(block))


def _config(settings: Mapping[str, Any]) -> int | None:
    chunk_rows = settings.get("head_chunk_rows")
    return None if chunk_rows is None else check_integer("head_chunk_rows", chunk_rows, low=1)


TECHNIQUE = Technique(
    name="head",
    summary="the LM head's loss a chunk of rows at a time: the logits (batch x seq x vocab) never exist whole",
    seam="module",
    exact=True,
    config=_config,
    apply=_apply,
    changes=_changes,
    settings={"head_chunk_rows": None},
)
