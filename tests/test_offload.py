"""Disk offloading on CPU: bitwise round trips for every dtype and layout, bitwise gradients for an MLP, a CNN with
batch norm and a transformer block, real release of memory, and nothing lost or leaked on every failure path."""

import copy
import errno
import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch
from torch import nn

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import offload
from fewbit_design.runtime.offload import disk
from fewbit_design.runtime.offload.layout import describe, raw_bytes

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.complex32,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


# -- helpers ----------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _release_idle_files():
    """Each test starts and ends with no idle step files (they are kept per folder, and each test has its own)."""
    offload.empty_cache()
    yield
    offload.empty_cache()


def offload_threads():
    return [t for t in threading.enumerate() if t.name.startswith("fewbit-offload")]


def open_offload_files():
    """Descriptors of this process that point at offload files (unlinked files show as '... (deleted)')."""
    if not os.path.isdir("/proc/self/fd"):  # (not Linux: only the folder listing checks for files left)
        return []
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "fewbit-offload-" in target:
            found.append(target)
    return found


def assert_nothing_left(directory, collect=True):
    if collect:  # (reference counting frees a plain graph; collect where a test made cycles)
        gc.collect()
    for thread in offload_threads():
        thread.join(timeout=30)  # a liveness wait, not a timing claim: the thread ends when its queue is empty
    assert offload_threads() == []
    assert os.listdir(directory) == []
    assert len(open_offload_files()) == disk.idle_files()  # every open file is an idle one, kept for reuse
    offload.empty_cache()
    assert open_offload_files() == []


def random_bytes_tensor(shape, dtype, generator):
    """A tensor of ``dtype`` whose bytes are random (NaNs, infinities, subnormals, any bool byte...)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, 1),
    "strided_slice": lambda t: t[:, ::2],
    "offset_slice": lambda t: t[1:, 1:],
    "channels_last": lambda t: t.reshape(2, 3, 2, 4).contiguous(memory_format=torch.channels_last),
    "expanded": lambda t: t[:1, :].expand(5, 8),
    "scalar_expanded": lambda t: t[0, 0].expand(3, 4, 5),
    "zero_size": lambda t: t[:0, :],
    "zero_size_strided": lambda t: t[:, :0].transpose(0, 1),
    "zero_dim": lambda t: t[2, 3],
}


class SaveAndReturn(torch.autograd.Function):
    """Saves ``tensor`` for backward and hands what backward unpacked to ``sink``."""

    @staticmethod
    def forward(ctx, anchor, tensor, sink):
        ctx.save_for_backward(tensor)
        ctx.sink = sink
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.append(ctx.saved_tensors[0])
        return grad, None, None


def round_trip(tensor, directory, **options):
    sink = []
    anchor = torch.zeros(1, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, directory=directory, **options) as stats:
        out = SaveAndReturn.apply(anchor, tensor, sink)
    out.sum().backward()
    return sink[0], stats


def assert_same_tensor(got, expected):
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.stride() == expected.stride()
    assert got.is_conj() == expected.is_conj() and got.is_neg() == expected.is_neg()
    # bitwise: the bytes of the storage span, compared as bytes (pure copies, so exact on any machine)
    assert torch.equal(raw_bytes(got, describe(got)), raw_bytes(expected, describe(expected)))


# -- round trips -----------------------------------------------------------------------------------------------
ROUND_TRIPS = [(dtype, layout, 0) for dtype in DTYPES for layout in LAYOUTS] + [
    (dtype, layout, 2) for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.complex64) for layout in LAYOUTS
]


@pytest.mark.parametrize(("dtype", "layout", "prefetch"), ROUND_TRIPS, ids=str)
def test_round_trip_is_bitwise(dtype, layout, prefetch, tmp_path):
    generator = torch.Generator().manual_seed(hash((str(dtype), layout)) % 2**31)
    tensor = LAYOUTS[layout](random_bytes_tensor((6, 8), dtype, generator))
    got, stats = round_trip(tensor, tmp_path, prefetch=prefetch)
    assert_same_tensor(got, tensor)
    assert stats.tensors == (1 if tensor.numel() else 0)
    if tensor.numel() and prefetch == 0:  # synchronous: written at pack, read back at unpack
        assert got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert_nothing_left(tmp_path, collect=False)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_round_trip_conj_and_neg_views(prefetch, tmp_path):
    base = torch.randn(16, 9, dtype=torch.complex64)
    for tensor in (base.conj(), base.t().conj(), torch._neg_view(base.real.clone())[:, 1::3]):
        got, _ = round_trip(tensor, tmp_path, prefetch=prefetch)
        assert_same_tensor(got, tensor)
        assert torch.equal(got.resolve_conj().resolve_neg(), tensor.resolve_conj().resolve_neg())


def test_big_view_of_small_part_moves_only_its_span(tmp_path):
    base = torch.randn(1000, 1000)
    view = base[10:12, 100:300]
    got, stats = round_trip(view, tmp_path)
    assert stats.bytes == (1 * 1000 + 200) * 4  # from the first element to the last, not the whole storage
    assert_same_tensor(got, view)


# -- gradients ---------------------------------------------------------------------------------------------------
def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def transformer():
    return nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)


MODELS = {
    "mlp": (mlp, lambda g: torch.randn(16, 32, generator=g)),
    "cnn": (cnn, lambda g: torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)),
    "transformer": (transformer, lambda g: torch.randn(3, 7, 32, generator=g)),
}


def gradients(name, offloaded, directory, backwards=1, **options):
    build, data = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x = data(torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(2)  # dropout masks
    stats = None
    if offloaded:
        with offload.saved_tensors(target="disk", min_bytes=0, directory=directory, **options) as stats:
            loss = model(x).square().mean()
    else:
        loss = model(x).square().mean()
    results = []
    for index in range(backwards):
        model.zero_grad()
        x.grad = None
        loss.backward(retain_graph=index < backwards - 1)
        results.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    return results, stats


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("prefetch", [0, 2])
def test_gradients_bitwise_equal(name, prefetch, tmp_path, one_torch_thread):
    expected, _ = gradients(name, False, tmp_path)
    got, stats = gradients(name, True, tmp_path, prefetch=prefetch)
    assert stats.tensors >= 3  # the activations really went to disk
    for g, e in zip(got[0], expected[0], strict=True):
        assert torch.equal(g, e)
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_retain_graph_two_backwards(name, tmp_path, one_torch_thread):
    """unpack twice: both passes read the saved tensors again and both give the exact gradients."""
    expected, _ = gradients(name, False, tmp_path, backwards=2)
    got, stats = gradients(name, True, tmp_path, backwards=2, prefetch=1)
    assert stats.tensors >= 3
    for pass_got, pass_expected in zip(got, expected, strict=True):
        for g, e in zip(pass_got, pass_expected, strict=True):
            assert torch.equal(g, e)
    assert_nothing_left(tmp_path)


def test_cap_keeps_the_rest_in_memory(tmp_path, one_torch_thread):
    expected, _ = gradients("mlp", False, tmp_path)
    got, stats = gradients("mlp", True, tmp_path, max_host_bytes=8192)
    assert stats.tensors >= 1 and stats.kept_tensors >= 1
    assert stats.bytes <= 8192
    for g, e in zip(got[0], expected[0], strict=True):
        assert torch.equal(g, e)


def test_small_tensors_parameters_and_leaves_stay(tmp_path):
    model = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as stats:
        model(x).sum().backward()
    assert stats.tensors == 0  # x (a leaf requiring grad) and weight.t() (a view of a parameter) stay
    with offload.saved_tensors(target="disk", min_bytes=1 << 20, directory=tmp_path) as stats:
        torch.tanh(x * 2).sum().backward()
    assert stats.tensors == 0  # 2 KiB < min_bytes


def test_files_are_reused_across_steps(tmp_path, monkeypatch):
    created = []
    create = disk.DiskTarget._create
    monkeypatch.setattr(disk.DiskTarget, "_create", staticmethod(lambda folder: created.append(1) or create(folder)))
    x = torch.randn(4096, requires_grad=True)
    for _ in range(3):
        with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path):
            loss = torch.tanh(torch.tanh(x * 1)).sum()
        loss.backward()
        del loss
        assert disk.idle_files() == 1
    assert len(created) == 1  # steps 2 and 3 overwrote the file of step 1
    assert offload.empty_cache() >= 2 * 16384
    assert_nothing_left(tmp_path)


def test_a_file_that_failed_is_not_reused(tmp_path, monkeypatch):
    def broken(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk, "_pwrite_all", broken)
    x = torch.randn(4096, requires_grad=True)
    with pytest.raises(FewBitError, match="Input/output error"):
        with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
            torch.tanh(torch.tanh(x * 1)).sum()
    assert disk.idle_files() == 0
    assert_nothing_left(tmp_path)


def test_memory_is_released_after_pack(tmp_path):
    """After pack, only the file holds the saved data: the tensors' storages are freed (all but the write in
    flight), which they are not without offloading (so this test can fail)."""

    def chain(offloaded):
        x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
        h, refs = x, []
        context = offload.saved_tensors(target="disk", min_bytes=0, prefetch=1, directory=tmp_path)
        with context if offloaded else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            for _ in range(6):
                h = torch.tanh(h)  # saves its output
                refs.append(weakref.ref(h))
            loss = h.sum()
        gc.collect()
        alive = [r() is not None for r in refs]
        loss.backward()
        return alive, x.grad

    alive, grad = chain(True)
    assert alive == [False] * 5 + [True]  # the last one is still held by `h` here
    alive_plain, grad_plain = chain(False)
    assert alive_plain == [True] * 6
    assert torch.equal(grad, grad_plain)
    assert_nothing_left(tmp_path)


def test_peak_is_reduced(tmp_path):
    """memory.peak (live tensor bytes, forward and backward): a chain of 12 tanh saving 1 MiB each."""
    from fewbit_design.runtime import memory

    def run(offloaded):
        x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)).requires_grad_()
        context = offload.saved_tensors(target="disk", min_bytes=0, prefetch=1, directory=tmp_path)
        with memory.peak(x) as peak:
            with context if offloaded else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                h = x * 1
                for _ in range(12):
                    h = torch.tanh(h)
                loss = h.sum()
                del h
            loss.backward()
        return peak.peak_bytes, x.grad

    plain, grad_plain = run(False)
    offloaded, grad = run(True)
    assert plain >= 13 << 20  # every tanh output is alive at the end of forward
    assert offloaded <= 6 << 20  # working set + one write in flight + one read ahead + gradients
    assert torch.equal(grad, grad_plain)
    assert_nothing_left(tmp_path)


def test_modified_in_place_never_gives_a_wrong_gradient(tmp_path):
    """With hooks, autograd does not check versions; offloading either restores the value saved (synchronous
    write) or raises FewBitError (the write was still in flight) - never a gradient of the modified value."""
    x = torch.randn(4096, requires_grad=True)
    for prefetch in (0, 2):
        y = x * 1
        with offload.saved_tensors(target="disk", min_bytes=0, prefetch=prefetch, directory=tmp_path):
            z = torch.sin(y)  # saves y
        expected = torch.cos(y.detach().clone()) * 1
        with torch.no_grad():
            y.add_(1)
        x.grad = None
        try:
            z.sum().backward()
        except FewBitError as error:
            assert prefetch and "modified in place" in str(error)
        else:
            assert torch.equal(x.grad, expected)
        del z
    assert_nothing_left(tmp_path)


# -- nothing lost, nothing leaked -----------------------------------------------------------------------------------
class Boom(nn.Module):
    """Raises a fresh ``error`` (a fresh instance: a shared one would keep its traceback, and the graph, alive)."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def forward(self, x):
        raise self.error("boom")


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_exception_in_forward(error, tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), Boom(error))
    with pytest.raises(error):
        with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path):
            model(torch.randn(32, 64))
    assert_nothing_left(tmp_path)
    hits = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: hits.append(t) or t, lambda t: t):
        torch.tanh(torch.randn(3, requires_grad=True)).sum().backward()
    assert len(hits) == 1  # our hooks were popped: the innermost hooks are the test's


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_exception_in_backward(error, tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=2, directory=tmp_path) as stats:
        hidden = model[:3](torch.randn(32, 64))
        hidden.register_hook(lambda grad: (_ for _ in ()).throw(error("boom")))
        loss = model[3:](hidden).sum()
    assert stats.tensors >= 2
    with pytest.raises(error):
        loss.backward()
    for thread in offload_threads():
        thread.join(timeout=30)
    assert offload_threads() == []  # no thread runs even while the user still holds the graph
    del loss, hidden
    assert_nothing_left(tmp_path)


def test_graph_freed_without_backward(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as stats:
        loss = model(torch.randn(32, 64)).sum()
    assert stats.tensors >= 2 and open_offload_files()
    del loss
    assert_nothing_left(tmp_path)


def test_backward_after_a_failed_region_raises(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    kept = {}

    class Capture(nn.Module):
        def forward(self, x):
            kept["loss"] = x.sum()
            raise RuntimeError("late failure")

    with pytest.raises(RuntimeError, match="late failure"):
        with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path):
            nn.Sequential(model, Capture())(torch.randn(8, 64))
    with pytest.raises(FewBitError, match="exited with RuntimeError"):
        kept.pop("loss").backward()
    assert_nothing_left(tmp_path)


def test_unwritable_or_missing_directory(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(FewBitError, match="existing folder"):
        offload.saved_tensors(target="disk", directory=a_file)
    with pytest.raises(FewBitError, match="existing folder"):
        offload.saved_tensors(target="disk", directory=tmp_path / "missing")
    if sys.platform.startswith("linux"):
        with pytest.raises(FewBitError, match="not writable"):  # /proc refuses new files, even to root
            offload.saved_tensors(target="disk", directory="/proc")
    assert open_offload_files() == []


def test_full_disk_fails_at_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10 << 20})())
    with pytest.raises(FewBitError, match="MiB free"):
        offload.saved_tensors(target="disk", directory=tmp_path)
    assert_nothing_left(tmp_path)


def test_probe_write_failure_fails_at_entry(tmp_path, monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "fsync", fsync)
    with pytest.raises(FewBitError, match="No space left"):
        offload.apply(nn.Linear(4, 4), target="disk", directory=tmp_path)
    monkeypatch.undo()
    assert_nothing_left(tmp_path)


def test_disk_filling_up_fails_in_forward(tmp_path, monkeypatch):
    free = disk.MIN_FREE_BYTES + (1 << 20)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: type("Usage", (), {"free": free})())
    x = torch.randn(1 << 18, requires_grad=True)  # 1 MiB per saved tensor
    with pytest.raises(FewBitError, match="offloading needs"):
        with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path):
            torch.tanh(torch.tanh(x * 1)).sum()
    assert x.grad is None
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_write_error_is_one_clear_error_not_a_gradient(prefetch, tmp_path, monkeypatch):
    """A failed write raises FewBitError (in forward, or in backward when the data is needed), never a gradient
    computed from missing data. With writes behind (prefetch 2), a tensor whose write has not run yet is still
    in memory, so backward may also finish from memory, with the exact gradient."""

    def broken(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "_pwrite_all", broken)
    x = torch.randn(4096, requires_grad=True)
    expected = torch.autograd.grad(torch.tanh(torch.tanh(x * 1)).sum(), x)[0]
    try:
        with offload.saved_tensors(target="disk", min_bytes=0, prefetch=prefetch, directory=tmp_path):
            loss = torch.tanh(torch.tanh(x * 1)).sum()
        loss.backward()
    except FewBitError as error:
        assert "No space left on device" in str(error)
        assert x.grad is None
    else:
        assert prefetch and torch.equal(x.grad, expected)
    loss = None
    assert_nothing_left(tmp_path)


def test_read_error_is_one_clear_error(tmp_path, monkeypatch):
    def broken(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    x = torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
        loss = torch.tanh(torch.tanh(x * 1)).sum()
    monkeypatch.setattr(disk, "_pread_all", broken)
    with pytest.raises(FewBitError, match="Input/output error"):
        loss.backward()
    assert x.grad is None
    del loss
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": "tape"}, "target must be 'auto', 'disk' or 'cuda-host', got 'tape'"),
        ({"min_bytes": -1}, "min_bytes must be an integer >= 0"),
        ({"prefetch": 1.5}, "prefetch must be an integer >= 0"),
        ({"max_host_bytes": -5}, "max_host_bytes must be an integer >= 0 or None"),
        ({"directory": 3}, "directory must be a path"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(FewBitError, match=message):
        offload.saved_tensors(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without CUDA")
def test_cuda_target_without_cuda():
    with pytest.raises(FewBitError, match="needs CUDA"):
        offload.saved_tensors(target="cuda-host")


# -- module form ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("modules", [None, [nn.Tanh], ["1", "3"], "encoder"])
def test_apply_gradients_bitwise_and_remove(modules, tmp_path, one_torch_thread):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        return nn.ModuleDict({"encoder": model}) if modules == "encoder" else model

    def run(model):
        body = model["encoder"] if isinstance(model, nn.ModuleDict) else model
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # two steps: each gets its own file
            body.zero_grad()
            body(x).square().mean().backward()
        return [p.grad.clone() for p in body.parameters()]

    expected = run(build())
    model = build()
    handle = offload.apply(model, modules, target="disk", min_bytes=0, directory=tmp_path)
    got = run(model)
    assert handle.stats.tensors >= 1
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    clone = copy.deepcopy(model)
    assert torch.equal(run(clone)[0], expected[0])
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert_nothing_left(tmp_path)


def test_apply_keeps_parameters_and_buffers(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh())
    handle = offload.apply(model, target="disk", min_bytes=0, directory=tmp_path)
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as plain:
        model(torch.randn(8, 16)).sum().backward()  # the inner (module) region wins: this one sees nothing
    assert plain.tensors == 0
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    assert handle.stats.tensors >= 2 and buffers
    handle.remove()


def test_apply_exception_in_forward(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), Boom(KeyboardInterrupt))
    handle = offload.apply(model, target="disk", min_bytes=0, directory=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(8, 16))
    assert_nothing_left(tmp_path)
    hits = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: hits.append(t) or t, lambda t: t):
        torch.tanh(torch.randn(3, requires_grad=True)).sum().backward()
    assert len(hits) == 1
    handle.remove()


def test_apply_evaluation_opens_no_file(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    handle = offload.apply(model, target="disk", min_bytes=0, directory=tmp_path)  # probes: one idle file
    assert len(open_offload_files()) == disk.idle_files() == 1
    with torch.no_grad():
        model(torch.randn(4, 16))
        assert disk.idle_files() == 1  # not taken: no step began
    handle.remove()


def test_apply_bad_modules():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(FewBitError, match="no submodule 'O'"):
        offload.apply(model, ["O"])
    with pytest.raises(FewBitError, match="no GELU submodule"):
        offload.apply(model, nn.GELU)
    with pytest.raises(FewBitError, match="not part of the model"):
        offload.apply(model, nn.ReLU())
    handle = offload.apply(model, ["0"], min_bytes=0)
    with pytest.raises(FewBitError, match="already offloaded"):
        offload.apply(model, nn.Linear)
    handle.remove()


def test_lean_import():
    code = (
        "import sys; import fewbit_design.runtime.offload as o; "
        "bad = [m for m in ('scipy', 'matplotlib', 'numba', 'fewbit_design.cli') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
