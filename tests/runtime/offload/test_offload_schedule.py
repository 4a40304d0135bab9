"""The pure ordering logic of offloading (runs without torch devices): prefetch windows, write backlog, buffer
pool reuse and cap, size classes, and the cost model. The CUDA target only carries these decisions out."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fewbit_design.errors import FewBitError
from fewbit_design.runtime.offload import cost
from fewbit_design.runtime.offload.schedule import (
    BufferPool,
    prefetch_candidates,
    size_class,
    stale_positions,
    write_backlog,
)


def test_prefetch_window_is_the_nearest_positions_below():
    assert prefetch_candidates(10, alive=range(20), resident=set(), depth=3) == [9, 8, 7]
    assert prefetch_candidates(10, alive=range(20), resident={9, 7}, depth=3) == [8]
    assert prefetch_candidates(1, alive=range(20), resident=set(), depth=3) == [0]
    assert prefetch_candidates(0, alive=range(20), resident=set(), depth=3) == []
    assert prefetch_candidates(10, alive=range(20), resident=set(), depth=0) == []


def test_prefetch_skips_freed_records():
    # positions 8 and 9 were freed (their nodes ran): the window reaches further down
    assert prefetch_candidates(10, alive=[0, 3, 5, 7, 10], resident=set(), depth=2) == [7, 5]


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("count", [1, 2, 7, 30])
def test_reverse_backward_is_always_prefetched(depth, count):
    """Simulate backward unpacking n-1 ... 0: after the first, every record is resident when it is needed, and
    never more than ``depth`` records are resident or in flight."""
    resident: set[int] = set()
    synchronous = 0
    alive = set(range(count))
    for current in reversed(range(count)):
        if current in resident:
            resident.discard(current)
        else:
            synchronous += 1
        alive.discard(current)
        resident |= set(prefetch_candidates(current, alive, resident, depth))
        assert len(resident) <= depth
    assert synchronous == 1


def test_two_saves_out_of_order_still_prefetched():
    # a node unpacks its two saved tensors in forward order (4 then 5): both were prefetched by position 6
    resident = set(prefetch_candidates(6, alive=range(6), resident=set(), depth=2))
    assert resident == {5, 4}
    assert stale_positions(4, resident - {4}, depth=2) == []


def test_stale_positions_are_far_above():
    assert stale_positions(10, resident=[9, 11, 12, 13, 40], depth=2) == [13, 40]
    assert stale_positions(10, resident=[11], depth=0) == []


@pytest.mark.parametrize(("pending", "depth", "wait"), [(0, 2, 0), (1, 2, 0), (2, 2, 1), (5, 2, 4), (3, 0, 3)])
def test_write_backlog(pending, depth, wait):
    assert write_backlog(pending, depth) == wait
    if depth:
        assert pending - wait + 1 <= depth  # after waiting, the new write makes at most `depth` in flight


@given(st.integers(0, 1 << 40))
def test_size_class_bounds(nbytes):
    capacity = size_class(nbytes)
    assert capacity >= max(nbytes, 4096)
    assert capacity % 1024 == 0  # a quarter of a power of two >= 4096
    if nbytes > 4096:
        assert capacity <= nbytes * 1.25 + 1
    assert size_class(capacity) == capacity  # classes are fixed points: a buffer fits its own class


def test_size_class_is_monotone():
    sizes = sorted(random.Random(0).randrange(1 << 30) for _ in range(2000))
    classes = [size_class(n) for n in sizes]
    assert classes == sorted(classes)


class FakeFence:
    def __init__(self):
        self.done = False


def _pool(capacity=None):
    made = []

    def allocate(nbytes):
        made.append(nbytes)
        return bytearray(nbytes)

    return BufferPool(allocate, capacity, lambda fence: fence.done), made


def test_pool_reuses_a_buffer_only_after_its_fence():
    pool, made = _pool()
    lease = pool.acquire(10_000)
    fence = FakeFence()
    pool.release(lease, fence)
    other = pool.acquire(10_000)
    assert other.buffer is not lease.buffer  # the copy out of the first buffer may still be running
    fence.done = True
    pool.release(other, None)
    again = [pool.acquire(10_000), pool.acquire(10_000)]
    assert {id(a.buffer) for a in again} == {id(lease.buffer), id(other.buffer)}
    assert made == [size_class(10_000)] * 2  # no buffer pinned per tensor per step


def test_pool_steady_state_allocates_nothing():
    pool, made = _pool(capacity=1 << 20)
    for _step in range(5):
        leases = [pool.acquire(n) for n in (50_000, 100_000, 70_000)]
        for lease in leases:
            pool.release(lease, None)
    assert len(made) == 3


def test_pool_cap_keeps_tensors_in_place():
    pool, _ = _pool(capacity=3 * 4096)
    leases = [pool.acquire(4096) for _ in range(3)]
    assert pool.acquire(1) is None
    pool.release(leases[0], FakeFence())  # released, but its copy is not done: cannot be reused or freed
    assert pool.acquire(4096) is None
    assert pool.held_bytes == 3 * 4096


def test_pool_frees_idle_buffers_of_other_classes_to_fit():
    pool, made = _pool(capacity=20_000)
    small = pool.acquire(4096)
    pool.release(small, None)
    big = pool.acquire(16_000)  # 4096 idle + 16384 > cap: the idle small buffer is freed
    assert big is not None and pool.held_bytes == size_class(16_000)
    pool.release(big)
    pool.release(big)  # twice: no-op
    assert pool.in_use_bytes == 0
    assert pool.trim() == size_class(16_000) and pool.held_bytes == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["acquire", "release", "finish"]), st.integers(1, 60_000)), max_size=60))
def test_pool_invariants(operations):
    pool, _ = _pool(capacity=100_000)
    leases, fences = [], []
    for operation, nbytes in operations:
        if operation == "acquire":
            lease = pool.acquire(nbytes)
            if lease is not None:
                assert lease.capacity >= nbytes and len(lease.buffer) == lease.capacity
                assert all(lease.buffer is not other.buffer for other in leases)  # never lent twice
                leases.append(lease)
        elif operation == "release" and leases:
            fence = FakeFence()
            fences.append(fence)
            pool.release(leases.pop(nbytes % len(leases)), fence)
        elif operation == "finish" and fences:
            fences.pop(0).done = True
        assert pool.held_bytes <= 100_000
        assert pool.in_use_bytes == sum(lease.capacity for lease in leases)


def test_cost_model():
    saved, extra = cost(1 << 30, target="disk", tensors=10, bandwidth=2e9)
    assert saved == 1 << 30
    assert extra == pytest.approx(2 * (1 << 30) / 2e9 + 10 * 40e-6)
    hidden = cost(1 << 30, target="disk", tensors=10, bandwidth=2e9, compute_seconds=100.0)
    assert hidden.extra_seconds == pytest.approx(10 * 40e-6)
    assert cost(0, target="cuda-host", tensors=0) == (0, 0.0)
    assert cost(1 << 20, target="cuda-host").extra_seconds < cost(1 << 20, target="disk").extra_seconds


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"saved_bytes": 1, "target": "tape"}, "target must be"),
        ({"saved_bytes": -1}, "saved_bytes must be"),
        ({"saved_bytes": 1, "bandwidth": 0}, "bandwidth must be"),
    ],
)
def test_cost_model_errors(kwargs, message):
    saved = kwargs.pop("saved_bytes")
    with pytest.raises(FewBitError, match=message):
        cost(saved, **kwargs)
