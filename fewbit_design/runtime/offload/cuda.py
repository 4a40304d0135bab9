"""The CUDA target: saved device tensors go to pinned host buffers over side streams (thin; logic in .schedule).

* Forward: the copy stream waits for the compute stream, copies the tensor's storage span into a pinned buffer
  from a shared :class:`~.schedule.BufferPool` (pinning is slow: buffers are reused across steps, never pinned per
  tensor), and records an event. The device memory is marked as used by the copy stream (``record_stream``), so
  the caching allocator hands it out again only after the copy; the session drops its reference when the event
  is done or ``depth`` newer tensors were packed (the host never waits for a copy in forward).
* ``max_host_bytes`` caps the pool; a tensor that does not fit stays on the device.
* Backward: reads are issued on a second side stream (prefetch, in reverse order, by the session); the compute
  stream waits on the read's event only when it needs the tensor (no host synchronisation), and the tensor is
  marked as used by the compute stream (``record_stream``).
* A pinned buffer goes back to the pool when its record dies, fenced by the last copy that touched it; closing the
  target (graph freed, or an exception in the region) returns every buffer it lent.

Needs a GPU; its tests are skipped without one. The decisions it carries out are tested on CPU in
``tests/runtime/offload/test_offload_schedule.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .schedule import BufferPool, Lease

__all__ = ["CudaHostTarget", "pinned_pool", "empty_cache"]

_POOLS: dict[int | None, BufferPool] = {}
_POOLS_LOCK = threading.RLock()  # guards every pool (pools are shared by the targets of all sessions)


def _allocate_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _event_done(event: Any) -> bool:
    return event.query()


def pinned_pool(max_host_bytes: int | None) -> BufferPool:
    """The process-wide pool of pinned buffers for a cap (one pool per distinct ``max_host_bytes``)."""
    with _POOLS_LOCK:
        if max_host_bytes not in _POOLS:
            _POOLS[max_host_bytes] = BufferPool(_allocate_pinned, max_host_bytes, _event_done)
        return _POOLS[max_host_bytes]


def empty_cache() -> int:
    """Free the idle pinned buffers of every pool (those whose last copy is done); return the bytes freed."""
    with _POOLS_LOCK:
        return sum(pool.trim() for pool in _POOLS.values())


class _Location:
    __slots__ = ("lease", "event")

    def __init__(self, lease: Lease, event: Any) -> None:
        self.lease = lease
        self.event = event  # the last copy that touched the pinned buffer


class _Transfer:
    """A copy in flight, with the interface of a worker job (``done``, ``wait``, ``error``, ``result``)."""

    __slots__ = ("event", "result", "error", "_device_wait")

    def __init__(self, event: Any, result: torch.Tensor | None = None, device_wait: bool = False) -> None:
        self.event, self.result, self.error, self._device_wait = event, result, None, device_wait

    @property
    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        if self._device_wait:  # a read: the compute stream waits, the host does not
            stream = torch.cuda.current_stream(self.result.device)
            stream.wait_event(self.event)
            self.result.record_stream(stream)
        else:
            self.event.synchronize()


class CudaHostTarget:
    """Pinned host memory for the saved tensors of one CUDA device."""

    device_type = "cuda"
    bounded_writes = False  # the host never blocks on a device-to-host copy; the copies queue on their stream

    def __init__(self, pool: BufferPool, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.pool = pool
        self._lock = _POOLS_LOCK
        self._lent: dict[int, _Location] = {}
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)

    def write(self, raw: torch.Tensor, *, sync: bool) -> tuple[_Location | None, _Transfer | None]:
        nbytes = raw.numel()
        with self._lock:
            lease = self.pool.acquire(nbytes)
        if lease is None:
            return None, None
        self._d2h.wait_stream(torch.cuda.current_stream(raw.device))
        with torch.cuda.stream(self._d2h):
            lease.buffer[:nbytes].copy_(raw, non_blocking=True)
            raw.record_stream(self._d2h)  # the allocator reuses the block only after this copy
            event = torch.cuda.Event()
            event.record(self._d2h)
        location = _Location(lease, event)
        with self._lock:
            self._lent[id(location)] = location
        if sync:
            event.synchronize()
        return location, _Transfer(event)

    def read(self, location: _Location, nbytes: int, *, sync: bool) -> _Transfer:
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(location.event)
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            buffer.copy_(location.lease.buffer[:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._h2d)
        location.event = event
        if sync:
            event.synchronize()
        return _Transfer(event, buffer, device_wait=True)

    def release(self, location: _Location) -> None:
        with self._lock:
            if self._lent.pop(id(location), None) is not None:
                self.pool.release(location.lease, fence=location.event)

    def describe_error(self, error: BaseException, action: str) -> str:
        return f"offload: {action} between {self.device} and pinned host memory failed ({error})"

    def close(self) -> None:
        """Return every buffer this target lent (each fenced by its last copy). Idempotent."""
        with self._lock:
            lent, self._lent = list(self._lent.values()), {}
            for location in lent:
                self.pool.release(location.lease, fence=location.event)
