"""Small saved tensors packed into one transfer per block (``pack_bytes``): bitwise round trips and gradients, one
transfer per block, a peak with no size floor, the staging buffers reused, and the unbounded (CUDA-style) path on
a CPU twin of the CUDA target."""

import pytest
import torch
from test_offload import (  # the disk tests' probes (tests/ is on sys.path under pytest)
    DTYPES,
    LAYOUTS,
    assert_nothing_left,
    assert_same_tensor,
    gradients,
    random_bytes_tensor,
)
from torch import nn

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory, offload
from fewbit_design.runtime.offload import schedule
from fewbit_design.runtime.offload.region import _Region
from fewbit_design.runtime.offload.session import Session, Staging

PACK = {"min_bytes": 0, "pack_bytes": 1 << 20}


class SaveMany(torch.autograd.Function):
    """Saves every tensor given for backward and hands what backward unpacked to ``sink``."""

    @staticmethod
    def forward(ctx, anchor, sink, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.sink = sink
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.extend(ctx.saved_tensors)
        return (grad, None) + (None,) * len(ctx.saved_tensors)


def some_tensors():
    """One tensor of every dtype and layout (odd sizes: members land at unaligned byte counts)."""
    generator = torch.Generator().manual_seed(0)
    tensors = [LAYOUTS[layout](random_bytes_tensor((6, 8), dtype, generator)) for dtype in DTYPES for layout in LAYOUTS]
    return [t for t in tensors if t.numel()]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_packed_round_trip_is_bitwise_in_one_transfer(prefetch, tmp_path):
    tensors = some_tensors()
    sink = []
    anchor = torch.zeros(1, requires_grad=True)
    with offload.saved_tensors(target="disk", directory=tmp_path, prefetch=prefetch, **PACK) as stats:
        out = SaveMany.apply(anchor, sink, *tensors)
    assert (stats.tensors, stats.transfers) == (len(tensors), 1)
    out.sum().backward()
    assert len(sink) == len(tensors)
    for got, expected in zip(sink, tensors, strict=True):
        assert_same_tensor(got, expected)
        assert got.untyped_storage().data_ptr() != expected.untyped_storage().data_ptr()  # really read back
    del sink, out
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_packed_gradients_bitwise_equal(name, prefetch, tmp_path, one_torch_thread):
    expected, _ = gradients(name, False, tmp_path, backwards=2)
    got, stats = gradients(name, True, tmp_path, backwards=2, prefetch=prefetch, pack_bytes=1 << 20)
    assert stats.tensors >= 3 and stats.transfers == 1  # every small tensor of the block in one transfer
    for pass_got, pass_expected in zip(got, expected, strict=True):  # (retain_graph: the pack is read twice)
        for g, e in zip(pass_got, pass_expected, strict=True):
            assert torch.equal(g, e)
    assert_nothing_left(tmp_path)


def test_a_pack_is_flushed_when_it_reaches_pack_bytes(tmp_path):
    x = torch.randn(1024, requires_grad=True)  # each tanh saves 4 KiB; a pack holds 3 of them
    h = x * 1
    with offload.saved_tensors(target="disk", directory=tmp_path, min_bytes=0, pack_bytes=3 * 4096) as stats:
        for _ in range(7):
            h = torch.tanh(h)
    assert (stats.tensors, stats.transfers) == (7, 3)  # 3 + 3 + the last one at the end of the block
    expected = torch.autograd.grad(_tanh7(x).sum(), x)[0]
    assert torch.equal(torch.autograd.grad(h.sum(), x)[0], expected)
    del h
    assert_nothing_left(tmp_path)


def _tanh7(x):
    h = x * 1
    for _ in range(7):
        h = torch.tanh(h)
    return h


def mlp_blocks(blocks, width):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)])


def test_small_tensors_are_no_floor_one_transfer_per_block(tmp_path, one_torch_thread):
    """A 32-block MLP whose saved tensors are all under ``min_bytes`` (each block saves its input and the GELU's
    input: 2 x 128 KiB). Unpacked, offload leaves everything in place (size is the floor: the unconverted peak);
    packed, each block goes out in one transfer and the peak is the gradients plus a few blocks in flight."""
    blocks, width, batch = 32, 64, 512  # activations dominate the parameters, as in training
    block_saved = 2 * batch * width * 4
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))

    def step(**options):
        model = mlp_blocks(blocks, width)
        handle = offload.apply(model, list(model), target="disk", directory=tmp_path, **options)
        with memory.peak(model, x) as peak:
            model(x).square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        handle.remove()
        return peak.peak_bytes, grads, handle.stats

    plain, expected, floor_stats = step(min_bytes=block_saved)  # today: every tensor is under min_bytes
    packed, got, stats = step(min_bytes=0, pack_bytes=block_saved)
    assert floor_stats.tensors == 0
    assert (stats.tensors, stats.transfers) == (2 * blocks, blocks)  # one transfer per block
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    # Unpacked the peak holds every block's saved tensors; packed it holds the gradients (as the plain step
    # does), plus at most: the block being run and its pack, its staging copy, `prefetch` (2) writes behind and
    # 2 reads ahead, and the block being differentiated: 7 blocks, and 2 more for the working set.
    gradient_bytes = sum(p.numel() * 4 for p in mlp_blocks(blocks, width).parameters())
    assert plain >= blocks * block_saved
    bound = (gradient_bytes + 9 * block_saved) / (blocks * block_saved)  # 0.35
    assert packed / plain <= bound
    assert_nothing_left(tmp_path)


def test_modified_in_place_before_its_pack_is_written_raises(tmp_path):
    x = torch.randn(64, requires_grad=True)
    with offload.saved_tensors(target="disk", directory=tmp_path, **PACK):
        h = torch.tanh(x * 1)  # saves its output (a member of the block's pack)
        loss = (h * 2).sum()
        h.add_(1)  # after it was saved, before the block ends
    with pytest.raises(FewBitError, match="modified in place while it was offloaded"):
        loss.backward()
    del loss, h
    assert_nothing_left(tmp_path, freed_outside_backward=True)


def test_backward_inside_the_block_uses_the_members_in_memory(tmp_path):
    x = torch.randn(256, requires_grad=True)
    with offload.saved_tensors(target="disk", directory=tmp_path, **PACK) as stats:
        torch.tanh(torch.tanh(x * 1)).sum().backward()  # before the block ends: nothing is written
    assert torch.equal(x.grad, torch.autograd.grad(torch.tanh(torch.tanh(x * 1)).sum(), x)[0])
    assert stats.transfers == 0
    assert_nothing_left(tmp_path)


def test_the_cap_keeps_a_pack_in_memory(tmp_path, one_torch_thread):
    expected, _ = gradients("mlp", False, tmp_path)
    got, stats = gradients("mlp", True, tmp_path, max_host_bytes=4096, pack_bytes=1 << 20)
    assert stats.transfers == 0 and stats.kept_tensors >= 3
    for g, e in zip(got[0], expected[0], strict=True):
        assert torch.equal(g, e)
    assert_nothing_left(tmp_path)


def _staging_held(tmp_path, prefetch: int) -> list[int]:
    """The staging pool's bytes after each of 3 steps, and after ``handle.remove()`` (last)."""
    model = mlp_blocks(4, 64)
    handle = offload.apply(model, list(model), target="disk", directory=tmp_path, prefetch=prefetch, **PACK)
    staging = handle._offloader.options.staging
    x = torch.randn(32, 64)
    held = []
    for _ in range(3):
        model(x).sum().backward()
        held.append(staging.held_bytes)
    handle.remove()
    held.append(staging.held_bytes)
    assert_nothing_left(tmp_path)
    return held


def test_staging_buffers_are_reused_across_steps_and_freed_on_remove(tmp_path):
    """Synchronous writes (prefetch=0): one staging buffer serves every block of every step. (With writes in
    flight, as below, how many buffers are busy at once depends on the writer thread's timing: this assertion with
    the default prefetch failed in about half of the runs.)"""
    held = _staging_held(tmp_path, prefetch=0)
    assert held[0] > 0 and held[0] == held[1] == held[2]  # later steps allocate no new staging buffer
    assert held[3] == 0


def test_staging_pool_with_writes_in_flight_stays_within_its_bound(tmp_path):
    """With prefetch=2 at most 2 writes are behind the one being filled: the pool never holds more than 3 of the
    synchronous run's buffer, whatever the timing, and is freed on remove."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    one = _staging_held(tmp_path / "sync", prefetch=0)[0]
    held = _staging_held(tmp_path / "async", prefetch=2)
    assert 0 < max(held[:3]) <= 3 * one
    assert held[3] == 0


def test_bad_pack_bytes():
    with pytest.raises(FewBitError, match="pack_bytes must be an integer >= 0, got -1"):
        offload.saved_tensors(pack_bytes=-1)


# -- the unbounded path (the CUDA target's), on a CPU twin ------------------------------------------------------------
class _Done:
    done, error = True, None

    def __init__(self, result=None):
        self.result = result

    def wait(self):
        pass


class HostTwin:
    """The CUDA target's contract on CPU: writes never block the host (``bounded_writes`` False: the session lets
    go of a write ``depth`` tensors later without waiting), buffers from a :class:`~.schedule.BufferPool` that
    are given back when their record dies, reads into a fresh tensor. Counts its transfers."""

    device_type = "cpu"
    bounded_writes = False

    def __init__(self):
        self.pool = schedule.BufferPool(lambda n: torch.empty(n, dtype=torch.uint8))
        self.writes = self.reads = 0

    def write(self, raw, *, sync):
        lease = self.pool.acquire(raw.numel())
        lease.buffer[: raw.numel()].copy_(raw)
        self.writes += 1
        return lease, _Done()

    def read(self, lease, nbytes, *, sync):
        self.reads += 1
        return _Done(lease.buffer[:nbytes].clone())

    def release(self, lease):
        self.pool.release(lease)

    def describe_error(self, error, action):
        return f"twin: {action} failed ({error})"

    def close(self):
        pass


@pytest.mark.parametrize("prefetch", [0, 2])
def test_packs_on_the_cuda_targets_twin(prefetch, one_torch_thread):
    twin = HostTwin()
    model = mlp_blocks(6, 64)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    session = Session(lambda device: twin, depth=prefetch, staging=Staging(), **PACK)
    for block in model:  # one region per block, one session for the step (as offload.apply does)
        with _Region(session):
            x = block(x)
    loss = x.square().mean()
    assert (session.stats.tensors, session.stats.transfers, twin.writes) == (12, 6, 6)
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert twin.reads == 6  # one read per pack, prefetched or not
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    del loss, x
    session._release_freed_records()
    assert twin.pool.in_use_bytes == 0  # every pack's buffer went back when its members died
