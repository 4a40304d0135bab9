"""Offloading as the planner sees it: what the block saves for backward leaves memory in forward and comes back in
backward (exact gradients). Plan settings: the ``offload`` object (offload's own arguments, :class:`OffloadOptions`;
``plan_memory(offload_min_bytes=..., offload_pack_bytes=..., offload_target=..., offload_prefetch=...)``). Its cost
model: an
option that offloaded nothing (every saved tensor under ``min_bytes``) is dropped; otherwise the measured bytes and
time stand (the profiler runs the block inside an offload region, so the transfer time is measured, not estimated
as :func:`.cost.cost` does), except the staging buffer of packed small tensors (``pack_bytes``): the block alone
allocates it, and it stays in the region's pool for reuse, so it is measured as bytes the block keeps; in a chain
every block's pack goes through that one buffer. So it is charged once for the step (``pool_bytes``, see
:class:`~..planner.model.OptionCost`), not as kept by each block.

With ``prefetch > 0`` (the planner's ``offload_prefetch``) transfers run on the target's thread while the block
computes, and their timing varies: a tensor whose write has not finished is still in memory, and backward reads
up to ``prefetch`` tensors ahead. The planner's offload is ``blockwise`` (:meth:`~.session.Session.end_block`): no
transfer holds memory outside its block, so a block's peaks exceed the synchronous ones by at most ``prefetch``
times its largest transfer, and that bound (``peak_allowance``) is added to the measured forward and backward peaks:
the prediction stays an upper bound whatever the timing (it is exact at ``prefetch=0``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import check_boolean, check_choice, check_integer, check_string
from ..registry import Technique


@dataclass(frozen=True)
class OffloadOptions:
    """Offload's arguments (:func:`.modules.apply`) as a plan holds them, in ``settings["offload"]``.

    Attributes:
        min_bytes: saved tensors smaller than this stay in memory.
        target: ``"auto"``, ``"disk"`` or ``"cuda-host"``.
        prefetch: transfers in flight each way (0: synchronous).
        pack_bytes: saved tensors from ``min_bytes`` up to this go out packed, one transfer per block.
        blockwise: each block's transfers finish when it returns (the planner's setting).
        max_host_bytes: a cap on what one step holds in pinned memory or in its file, or None.
        directory: the disk target's folder, or None (the temporary folder).
    """

    min_bytes: int = 1 << 20
    target: str = "auto"
    prefetch: int = 0
    pack_bytes: int = 0
    blockwise: bool = True
    max_host_bytes: int | None = None
    directory: str | None = None

    def __post_init__(self) -> None:
        from .region import TARGETS

        check_integer("settings.offload.min_bytes", self.min_bytes, low=0)
        check_choice("settings.offload.target", self.target, TARGETS)
        check_integer("settings.offload.prefetch", self.prefetch, low=0)
        check_integer("settings.offload.pack_bytes", self.pack_bytes, low=0)
        check_boolean("settings.offload.blockwise", self.blockwise)
        if self.max_host_bytes is not None:
            check_integer("settings.offload.max_host_bytes", self.max_host_bytes, low=0)
        if self.directory is not None:
            if isinstance(self.directory, os.PathLike):
                object.__setattr__(self, "directory", os.fspath(self.directory))
            check_string("settings.offload.directory", self.directory)

    def arguments(self) -> dict[str, Any]:
        """Offload's keyword arguments."""
        return dataclasses.asdict(self)


class _ProfiledRegion:
    """One block's offload region for the profiler; its value has ``bytes`` (what left memory) and ``pool_bytes``
    (the staging buffers the region's pool holds after the run: allocated by this block, kept for the next)."""

    def __init__(self, options: OffloadOptions) -> None:
        from .region import saved_tensors

        self._region = saved_tensors(**options.arguments())
        self._stats: Any = None

    def __enter__(self) -> _ProfiledRegion:
        self._stats = self._region.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._region.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return int(self._stats.bytes) if self._stats is not None else 0

    @property
    def pool_bytes(self) -> int:
        return int(self._region._options.staging.held_bytes)

    @property
    def facts(self) -> dict[str, int]:
        options = self._region._options
        largest = int(self._stats.largest_transfer) if self._stats is not None else 0
        return {"peak_allowance": options.prefetch * largest}


def _region(options: OffloadOptions) -> Any:
    return _ProfiledRegion(options)


def _apply(model: Any, blocks: list, options: OffloadOptions) -> Any:
    from .modules import apply

    return apply(model, blocks, **options.arguments())


def _cost(cost: Any, facts: Mapping[str, int]) -> Any:
    if facts.get("offloaded_bytes", 0) <= 0:
        return None  # nothing large enough to offload
    pool = facts.get("pool_bytes", 0)  # allocated at the end of the block's forward, where its bytes peak
    allowance = facts.get("peak_allowance", 0)  # transfers in flight (prefetch > 0): see the module docstring
    if pool <= 0 and allowance <= 0:
        return cost
    return dataclasses.replace(
        cost,
        forward_peak=cost.forward_peak - pool + allowance,
        backward_peak=cost.backward_peak + allowance,
        kept=cost.kept - pool,
        pool_bytes=cost.pool_bytes + pool,
    )


TECHNIQUE = Technique(
    name="offload",
    summary="move what the block saves for backward out of memory (disk or pinned host memory) and back",
    seam="region",
    options=OffloadOptions,
    apply=_apply,
    region=_region,
    cost=_cost,
    excludes=frozenset({"checkpoint"}),
    nested="offload",
    aliases={
        "offload_min_bytes": "min_bytes",
        "offload_pack_bytes": "pack_bytes",
        "offload_target": "target",
        "offload_prefetch": "prefetch",
    },
)
