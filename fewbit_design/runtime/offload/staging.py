"""Reused CPU staging buffers for packs of small saved tensors (see :mod:`.session`, "packed")."""

from __future__ import annotations

from typing import Any

import torch

from . import schedule

__all__ = ["Staging"]


class Staging:
    """Reused CPU staging buffers for packs (a pool keyed by size class, :class:`~.schedule.BufferPool`): a step
    allocates no new staging memory once the previous step's buffers are idle. One per :func:`saved_tensors` block
    or :func:`apply` (so its buffers go when the handle is removed or the model is freed); :meth:`trim` frees the
    idle ones. CUDA packs are staged in device memory, which the caching allocator reuses already."""

    def __init__(self) -> None:
        self._pool = schedule.BufferPool(_allocate_host)

    def acquire(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        """A 1-D uint8 buffer of ``nbytes`` on ``device`` and its lease (None off the CPU)."""
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        lease = self._pool.acquire(nbytes)
        assert lease is not None, "an uncapped pool always lends"
        return lease.buffer[:nbytes], lease

    def release(self, lease: Any) -> None:
        if lease is not None:
            self._pool.release(lease)

    def trim(self) -> int:
        """Free the idle buffers; return their bytes."""
        return self._pool.trim()

    @property
    def held_bytes(self) -> int:
        return self._pool.held_bytes


def _allocate_host(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)
