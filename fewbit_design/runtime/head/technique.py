"""The chunked LM head as the runtime sees it: a Hugging Face causal LM called with ``labels`` computes its loss a
chunk of rows at a time, and its logits never exist whole (exact gradients). It applies to a whole model (the head
is not inside any block: a ``"model"``-scope technique, which the planner profiles the step with and without);
other modules are left as they are. Plan setting: ``head_chunk_rows`` (None: the automatic
chunk of :func:`.ops.default_chunk_rows`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import check_integer
from ..registry import Technique


@dataclass(frozen=True)
class HeadOptions:
    """Options of the chunked LM head.

    Attributes:
        chunk_rows: rows per chunk, or None for the automatic chunk.
    """

    chunk_rows: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_rows is not None:
            object.__setattr__(self, "chunk_rows", check_integer("head_chunk_rows", self.chunk_rows, low=1))


def _convert(model: torch.nn.Module, options: HeadOptions, probe: Any) -> torch.nn.Module:
    from .convert import apply

    return apply(model, options.chunk_rows)


def _remove(model: torch.nn.Module) -> None:
    from .convert import remove

    remove(model)


def _changes(block: torch.nn.Module, options: HeadOptions) -> bool:
    from .convert import _causal_lms

    return any(not hasattr(found, "head_report") for found in _causal_lms(block))


TECHNIQUE = Technique(
    name="head",
    summary="the LM head's loss a chunk of rows at a time: the logits (batch x seq x vocab) never exist whole",
    seam="module",
    options=HeadOptions,
    convert=_convert,
    apply=lambda block, options: _convert(block, options, None),
    changes=_changes,
    scope="model",
    remove=_remove,
)
