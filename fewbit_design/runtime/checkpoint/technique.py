"""Checkpointing as the planner sees it: the block keeps only its input in forward and runs its forward again in
backward (exact gradients). Its cost model: the block saves its input and holds its other arguments (for the
recomputation) and not its output;
what the block's inner option keeps counts during its own backward only (the profiler measured it that way)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ...errors import FewBitError
from ..registry import Technique
from .apply import CheckpointedForward


def _check(block: torch.nn.Module, options: Any) -> None:
    if isinstance(block.__dict__.get("forward"), CheckpointedForward):
        raise FewBitError("the block is checkpointed already (checkpoint.apply?); it cannot be checkpointed twice")


def _apply(block: torch.nn.Module, options: Any) -> torch.nn.Module:
    _check(block, options)
    block.forward = CheckpointedForward(block, selective=False)  # checkpoint.apply's per-block wrapper
    return block


def _cost(cost: Any, facts: Mapping[str, int]) -> Any:
    # a checkpoint holds its input, and its other arguments (position ids, masks), for the recomputation
    return replace(cost, saves_input=True, saves_output=False, holds_arguments=True)


TECHNIQUE = Technique(
    name="checkpoint",
    summary="keep the block's input only and recompute its forward in backward",
    seam="wrapper",
    apply=_apply,
    check=_check,
    cost=_cost,
)
