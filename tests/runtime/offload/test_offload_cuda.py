"""The CUDA target (pinned host memory, side streams). Skipped without a GPU: its ordering logic (prefetch
windows, buffer reuse behind fences, the cap) is tested on CPU in test_offload_schedule.py."""

import gc

import pytest
import torch
from test_offload import SaveAndReturn  # the same probe as the disk round trips (tests/ is on sys.path under pytest)
from torch import nn

from fewbit_design.runtime import offload
from fewbit_design.runtime.offload import cuda
from fewbit_design.runtime.offload.layout import describe, raw_bytes
from fewbit_design.runtime.offload.session import close_freed

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU; the CUDA target's ordering logic is tested on CPU in test_offload_schedule.py",
    ),
]


def held_pinned_bytes():
    gc.collect()
    return sum(pool.in_use_bytes for pool in cuda._POOLS.values())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.complex64], ids=str
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last", "expanded", "zero_size"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_round_trip_is_bitwise(dtype, layout, prefetch):
    base = torch.randint(0, 256, (6 * 8 * 4,), dtype=torch.uint8, device="cuda").view(dtype).reshape(6, 8, -1)[..., 0]
    tensor = {
        "contiguous": lambda t: t.contiguous(),
        "transposed": lambda t: t.t(),
        "channels_last": lambda t: t.reshape(2, 3, 2, 4).contiguous(memory_format=torch.channels_last),
        "expanded": lambda t: t[:1].expand(5, 8),
        "zero_size": lambda t: t[:0],
    }[layout](base)
    sink = []
    anchor = torch.zeros(1, device="cuda", requires_grad=True)
    with offload.saved_tensors(target="cuda-host", min_bytes=0, prefetch=prefetch) as stats:
        out = SaveAndReturn.apply(anchor, tensor, sink)
    out.sum().backward()
    got = sink.pop()
    assert got.device == tensor.device and got.dtype == dtype
    assert got.shape == tensor.shape and got.stride() == tensor.stride()
    assert torch.equal(raw_bytes(got, describe(got)), raw_bytes(tensor, describe(tensor)))
    assert stats.tensors == (1 if tensor.numel() else 0)
    del out, got
    assert held_pinned_bytes() == 0


def _mlp_gradients(offloaded, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)).cuda()
    x = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    if offloaded:
        with offload.saved_tensors(target="cuda-host", min_bytes=0, **options) as stats:
            loss = model(x).square().mean()
    else:
        stats = None
        loss = model(x).square().mean()
    loss.backward()
    torch.cuda.synchronize()
    return [p.grad for p in model.parameters()], stats


@pytest.mark.parametrize("options", [{"prefetch": 0}, {"prefetch": 2}, {"max_host_bytes": 1 << 20}])
def test_gradients_equal(options):
    expected, _ = _mlp_gradients(False)
    got, stats = _mlp_gradients(True, **options)
    assert stats.tensors >= 1
    if "max_host_bytes" in options:
        assert stats.kept_tensors >= 1
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert held_pinned_bytes() == 0


def test_device_memory_is_released_and_buffers_reused():
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.Tanh())]).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    torch.cuda.synchronize()
    entry = torch.cuda.memory_allocated()
    loss = model(x).sum()
    plain = torch.cuda.memory_allocated() - entry
    del loss
    held = []
    for _ in range(2):
        with offload.saved_tensors(target="cuda-host", min_bytes=0):
            loss = model(x).sum()
        torch.cuda.synchronize()
        offloaded = torch.cuda.memory_allocated() - entry
        loss.backward()
        del loss
        held.append(cuda.pinned_pool(None).held_bytes)
    assert offloaded < plain / 2  # all but the last `prefetch` copies were let go during forward
    assert held[0] == held[1]  # the second step pinned nothing new
    assert held_pinned_bytes() == 0


def test_exception_in_forward_returns_buffers():
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()).cuda()
    with pytest.raises(RuntimeError, match="boom"):
        with offload.saved_tensors(target="cuda-host", min_bytes=0):
            model(torch.randn(512, 256, device="cuda"))
            raise RuntimeError("boom")
    assert held_pinned_bytes() == 0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_exception_in_backward_returns_buffers(error):
    # the disk target's twin is test_offload.py::test_exception_in_backward
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)).cuda()
    with offload.saved_tensors(target="cuda-host", min_bytes=0, prefetch=2) as stats:
        hidden = model[:3](torch.randn(512, 256, device="cuda"))
        hidden.register_hook(lambda grad: (_ for _ in ()).throw(error("boom")))
        loss = model[3:](hidden).sum()
    assert stats.tensors >= 2 and held_pinned_bytes() > 0
    with pytest.raises(error):
        loss.backward()
    del loss, hidden
    torch.cuda.synchronize()
    assert held_pinned_bytes() == 0


def test_graph_freed_without_backward_returns_buffers():
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()).cuda()
    with offload.saved_tensors(target="cuda-host", min_bytes=0) as stats:
        loss = model(torch.randn(512, 256, device="cuda")).sum()
    assert stats.tensors >= 2 and held_pinned_bytes() > 0
    del loss  # freed outside a backward pass: the buffers go back at the next safe point (next step, empty_cache)
    close_freed()
    assert held_pinned_bytes() == 0
    assert offload.empty_cache() >= 0


@pytest.mark.parametrize("prefetch", [0, 2])
def test_packed_small_tensors_one_transfer_per_block(prefetch):
    # the CPU twin of this path is test_offload_pack.py::test_packs_on_the_cuda_targets_twin
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)]).cuda()
    x = torch.randn(256, 64, device="cuda")
    expected = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    handle = offload.apply(model, list(model), target="cuda-host", min_bytes=0, pack_bytes=1 << 20, prefetch=prefetch)
    got = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    torch.cuda.synchronize()
    assert (handle.stats.tensors, handle.stats.transfers) == (16, 8)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    handle.remove()
    assert held_pinned_bytes() == 0
