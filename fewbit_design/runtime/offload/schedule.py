"""The ordering logic of offloading, as small pure functions (no torch, no threads, no devices).

Terms used by the whole package:

* **record**: one offloaded saved tensor. Records are numbered by their **position** 0, 1, 2, ... in the order
  forward packed them (only offloaded tensors get a position).
* **resident**: a record whose data is in memory again (read back, or being read back).
* **depth**: how many records may be in flight in each direction: writes behind forward, reads ahead of backward.
* **buffer**: a reusable host buffer (pinned memory on CUDA) of a **size class**; a **fence** is whatever tells
  that the last copy touching a buffer has finished (a CUDA event; in tests, any object).

Backward unpacks saved tensors roughly in reverse packing order, so when position ``p`` is unpacked the next ones
needed are ``p - 1, p - 2, ...``: those are prefetched in a first step; later steps follow the order the previous
step unpacked (:func:`upcoming_in_order`). These functions decide which, and when a buffer may be
reused; the CUDA and disk targets only carry the decisions out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "prefetch_candidates",
    "stale_positions",
    "upcoming_in_order",
    "size_class",
    "write_backlog",
    "BufferPool",
    "Lease",
]

_MIN_CLASS = 1 << 12  # 4 KiB: the smallest buffer (a page)
_STEPS_PER_OCTAVE = 4  # size classes 1, 1.25, 1.5, 1.75 x 2^k: at most 25% (typically < 12.5%) rounding waste


def prefetch_candidates(current: int, alive: Collection[int], resident: Collection[int], depth: int) -> list[int]:
    """The positions to start reading back after position ``current`` was unpacked, nearest first.

    The window is the ``depth`` alive positions just below ``current`` (those backward needs next); positions
    already resident (or in flight) are not read again.

    >>> prefetch_candidates(5, alive=range(10), resident={4}, depth=2)
    [3]
    >>> prefetch_candidates(5, alive=[0, 1, 4], resident=set(), depth=2)
    [4, 1]
    """
    if depth <= 0:
        return []
    window = sorted((p for p in alive if p < current), reverse=True)[:depth]
    return [p for p in window if p not in resident]


def stale_positions(current: int, resident: Iterable[int], depth: int) -> list[int]:
    """Resident positions that backward has gone past (above ``current`` by more than ``depth``): prefetched but
    never unpacked (their node did not run). Their memory can be dropped; the data stays in the target.

    >>> stale_positions(3, resident=[2, 4, 9], depth=2)
    [9]
    """
    return sorted(p for p in resident if p > current + max(depth, 1))


def upcoming_in_order(
    current: int, order: list[int], index: dict[int, int], alive: Collection[int], depth: int
) -> list[int] | None:
    """The ``depth`` alive positions that the previous step unpacked right after ``current`` (``order``: its
    positions in first-unpack order, ``index``: position -> place in ``order``), nearest first; None when
    ``current`` is not in that order (another structure: the caller falls back to :func:`prefetch_candidates`).

    Backward does not unpack in exact reverse packing order: a node unpacks all its saved tensors at once, in the
    order it saved them (attention's query, key, value), so the window below ``current`` misses them and they are
    read synchronously. A training step repeats the same graph, so the previous step's order predicts this one's.

    >>> upcoming_in_order(17, [21, 17, 13, 14, 15, 12], {21: 0, 17: 1, 13: 2, 14: 3, 15: 4, 12: 5}, range(30), 2)
    [13, 14]
    >>> upcoming_in_order(16, [21, 17], {21: 0, 17: 1}, range(30), 2) is None
    True
    """
    place = index.get(current)
    if place is None:
        return None
    window = []
    for position in order[place + 1 :]:
        if len(window) >= depth:
            break
        if position in alive:
            window.append(position)
    return window


def write_backlog(pending: int, depth: int) -> int:
    """How many of the oldest ``pending`` writes to wait for before queueing one more, so that at most
    ``depth`` writes are in flight (``depth`` 0: writes are synchronous, nothing queues).

    >>> write_backlog(3, 2), write_backlog(1, 2), write_backlog(0, 0)
    (2, 0, 0)
    """
    return max(0, pending + 1 - max(depth, 1)) if depth > 0 else pending


def size_class(nbytes: int) -> int:
    """The buffer size for ``nbytes``: at least a page, rounded up to one of 4 steps per power of two.

    >>> [size_class(n) for n in (1, 4096, 4097, 5000, 1 << 20, (1 << 20) + 1)]
    [4096, 4096, 5120, 5120, 1048576, 1310720]
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    octave = 1 << (nbytes - 1).bit_length() - 1  # largest power of two < nbytes
    step = octave // _STEPS_PER_OCTAVE
    return -(-nbytes // step) * step


@dataclass(eq=False)
class Lease:
    """A buffer lent by a :class:`BufferPool`: ``buffer`` holds at least ``nbytes``; ``capacity`` is its class."""

    buffer: Any
    nbytes: int
    capacity: int
    released: bool = False


@dataclass(eq=False)
class _Idle:
    buffer: Any
    capacity: int
    fence: Any


@dataclass
class BufferPool:
    """A pool of reusable buffers by size class, with a cap on the bytes it holds.

    ``allocate(capacity)`` makes a buffer (pinning memory on CUDA: slow, so buffers are reused, never made per
    tensor per step). A released buffer comes back with a ``fence``; it is handed out again only once
    ``is_done(fence)`` is true, so a copy still reading or writing it is never overtaken. When the cap would be
    passed, idle buffers of other classes whose fences are done are freed to make room; if that is not enough,
    :meth:`acquire` returns ``None`` and the caller keeps the tensor where it is.

    >>> pool = BufferPool(allocate=bytearray, capacity=3 * 4096, is_done=lambda fence: fence == "done")
    >>> a = pool.acquire(100); b = pool.acquire(5000)
    >>> pool.acquire(4096) is None          # 4096 + 5120 held, 4096 more would pass the cap
    True
    >>> pool.release(a, fence="copying"); pool.acquire(4096) is None   # a's copy is not done yet
    True
    >>> pool.release_fence_done(a); pool.acquire(4096).buffer is a.buffer
    True
    """

    allocate: Callable[[int], Any]
    capacity: int | None = None
    is_done: Callable[[Any], bool] = lambda fence: True
    held_bytes: int = 0
    in_use_bytes: int = 0
    _idle: list[_Idle] = field(default_factory=list)
    _leases: dict[int, _Idle] = field(default_factory=dict)

    def _fits(self, extra: int) -> bool:
        return self.capacity is None or self.held_bytes + extra <= self.capacity

    def _ready(self, idle: _Idle) -> bool:
        return idle.fence is None or self.is_done(idle.fence)

    def acquire(self, nbytes: int) -> Lease | None:
        """A buffer of at least ``nbytes`` bytes, or ``None`` when the cap leaves no room."""
        capacity = size_class(nbytes)
        for index, idle in enumerate(self._idle):
            if idle.capacity == capacity and self._ready(idle):
                del self._idle[index]
                return self._lend(idle.buffer, nbytes, capacity)
        if not self._fits(capacity):
            for idle in [i for i in self._idle if self._ready(i)]:
                self._idle.remove(idle)
                self.held_bytes -= idle.capacity
                if self._fits(capacity):
                    break
        if not self._fits(capacity):
            return None
        self.held_bytes += capacity
        return self._lend(self.allocate(capacity), nbytes, capacity)

    def _lend(self, buffer: Any, nbytes: int, capacity: int) -> Lease:
        lease = Lease(buffer, nbytes, capacity)
        self.in_use_bytes += capacity
        self._leases[id(lease)] = _Idle(buffer, capacity, None)
        return lease

    def release(self, lease: Lease, fence: Any = None) -> None:
        """Give ``lease`` back; its buffer is reused once ``fence`` is done. Releasing twice is a no-op."""
        if lease.released:
            return
        lease.released = True
        entry = self._leases.pop(id(lease))
        entry.fence = fence
        self.in_use_bytes -= lease.capacity
        self._idle.append(entry)

    def release_fence_done(self, lease: Lease) -> None:
        """Mark the fence of a released ``lease`` as passed (for callers without real fences)."""
        for idle in self._idle:
            if idle.buffer is lease.buffer:
                idle.fence = None

    def trim(self) -> int:
        """Free every idle buffer whose fence is done; return the bytes freed."""
        freed = [i for i in self._idle if self._ready(i)]
        self._idle = [i for i in self._idle if not self._ready(i)]
        nbytes = sum(i.capacity for i in freed)
        self.held_bytes -= nbytes
        return nbytes
