"""Offloading as the planner sees it: what the block saves for backward leaves memory in forward and comes back in
backward (exact gradients). Config: the plan's ``offload`` settings (offload's own arguments). Its cost model: an
option that offloaded nothing (every saved tensor under ``min_bytes``) is dropped; otherwise the measured bytes and
time stand (the profiler runs the block inside a synchronous offload region, so the transfer time is measured,
not estimated as :func:`.cost.cost` does)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..registry import Technique


def _region(options: Mapping[str, Any]) -> Any:
    from .region import saved_tensors

    return saved_tensors(**options)


def _apply(model: Any, blocks: list, options: Mapping[str, Any]) -> Any:
    from .modules import apply

    return apply(model, blocks, **options)


def _cost(cost: Any, facts: Mapping[str, int]) -> Any:
    return cost if facts.get("offloaded_bytes", 0) > 0 else None  # nothing large enough to offload


TECHNIQUE = Technique(
    name="offload",
    summary="move what the block saves for backward out of memory (disk or pinned host memory) and back",
    seam="region",
    exact=True,
    config=lambda settings: dict(settings["offload"]),
    apply=_apply,
    region=_region,
    cost=_cost,
    excludes=frozenset({"checkpoint"}),
)
