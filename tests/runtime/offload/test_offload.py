"""Disk offloading on CPU: bitwise round trips for every dtype and layout, bitwise gradients for an MLP, a CNN with
batch norm and a transformer block, real release of memory, and nothing lost or leaked on every failure path."""

import copy
import errno
import gc
import os
import re
import shutil
import signal
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
from fewbit_design.runtime.offload.session import close_freed

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
def offload_threads():
    return [t for t in threading.enumerate() if t.name.startswith("fewbit-offload")]


def open_offload_files(directory):
    """The offload files in ``directory`` that descriptors of this process point at, each once: unnamed files
    (Linux O_TMPFILE, shown as 'directory/#inode (deleted)') or named ones that were unlinked
    ('.../fewbit-offload-... (deleted)'). A mapped file has two descriptors (the target's, and the one Python's
    ``mmap`` keeps until the mapping is closed): one file."""
    if not os.path.isdir("/proc/self/fd"):  # (not Linux: only the folder listing checks for files left)
        return []
    folder = os.path.realpath(directory) + os.sep
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        name = target[len(folder) :]
        unnamed = re.fullmatch(r"#\d+ \(deleted\)", name)
        if target.startswith(folder) and (name.startswith("fewbit-offload-") or unnamed) and target not in found:
            found.append(target)
    return found


def assert_nothing_left(directory, collect=True, freed_outside_backward=False):
    if collect:  # (reference counting frees a plain graph; collect where a test made cycles)
        gc.collect()
    if freed_outside_backward:  # its file is given back at the next safe point (next step, empty_cache): run it
        close_freed()
    for thread in offload_threads():
        thread.join(timeout=30)  # a liveness wait, not a timing claim: the thread ends when its queue is empty
    assert offload_threads() == []
    assert os.listdir(directory) == []
    assert len(open_offload_files(directory)) == disk.idle_files()  # every open file is an idle one, kept for reuse
    offload.empty_cache()
    assert open_offload_files(directory) == []


def break_writes(monkeypatch, code, message):
    """Make every write to an offload file fail with ``OSError(code, message)``: ``pwrite`` (the job path, and the
    synchronous path where the system has no ``posix_fallocate``) and the allocation of the file's blocks before
    the synchronous path writes through the mapping (what fails there when the disk is full)."""

    def broken(*args):
        raise OSError(code, message)

    monkeypatch.setattr(disk, "_pwrite_all", broken)
    if hasattr(os, "posix_fallocate"):
        monkeypatch.setattr(disk.os, "posix_fallocate", broken)


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
    del got  # (with prefetch=0 it maps its step's file: kept from the pool while it lives, see test_mapped_reads.py)
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
    break_writes(monkeypatch, errno.EIO, "Input/output error")
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
    assert_nothing_left(tmp_path, freed_outside_backward=True)  # (when backward raised)


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
    assert_nothing_left(tmp_path, freed_outside_backward=True)


def test_graph_freed_without_backward(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as stats:
        loss = model(torch.randn(32, 64)).sum()
    assert stats.tensors >= 2 and open_offload_files(tmp_path)
    del loss
    assert_nothing_left(tmp_path, freed_outside_backward=True)


def test_graph_freed_without_backward_gives_its_file_to_the_next_step(tmp_path):
    """No Python code runs while autograd frees a graph (a Ctrl-C there would be lost): the file of a graph
    dropped without backward is given back when the next step starts, and that step reuses it."""
    x = torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path):
        loss = torch.tanh(torch.tanh(x * 1)).sum()
    del loss
    assert len(open_offload_files(tmp_path)) == 1 and disk.idle_files() == 0  # freed, not given back yet
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as stats:
        assert len(open_offload_files(tmp_path)) == 1  # the next step took the same file
        loss = torch.tanh(torch.tanh(x * 1)).sum()
    loss.backward()
    assert stats.tensors == 2
    assert disk.idle_files() == 1  # given back at the end of backward
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
    assert open_offload_files(tmp_path) == []


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

    break_writes(monkeypatch, errno.ENOSPC, "No space left on device")
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
    def broken(fd, size):  # (prefetch=0 maps the file to read: mapping it is what can fail)
        raise OSError(errno.EIO, "Input/output error")

    # (where writes go through the mapping the file is mapped in forward, and a read cannot fail but by SIGBUS:
    # the read that maps the file is that of systems without posix_fallocate, which write with pwrite)
    monkeypatch.setattr(disk, "_MAPPED_WRITES", False)
    x = torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
        loss = torch.tanh(torch.tanh(x * 1)).sum()
    monkeypatch.setattr(disk.mmap, "mmap", broken)
    with pytest.raises(FewBitError, match="Input/output error"):
        loss.backward()
    assert x.grad is None
    del loss
    assert_nothing_left(tmp_path, freed_outside_backward=True)


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
        model(torch.randn(8, 16)).sum().backward()  # the inner (module) region offloads; this one counts it too
    assert (plain.tensors, plain.bytes) == (handle.stats.tensors, handle.stats.bytes)  # and offloaded nothing itself
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
    assert len(open_offload_files(tmp_path)) == disk.idle_files() == 1
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


# -- nesting, interrupts, the idle pool, pickling ---------------------------------------------------------------------
def two_tanh(x):
    return torch.tanh(torch.tanh(x * 1)).sum()


def test_nested_regions_count_in_every_enclosing_stats(tmp_path):
    x = torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as alone:
        two_tanh(x).backward()
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as outer:
        first = two_tanh(x)
        with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as inner:
            second = two_tanh(x)
    (first + second).backward()
    assert alone.tensors == inner.tensors == 2 and alone.bytes == inner.bytes == 2 * 4096 * 4
    assert (outer.tensors, outer.bytes) == (2 * alone.tensors, 2 * alone.bytes)
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path, max_host_bytes=4096 * 4) as capped:
        with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as free:
            two_tanh(x).backward()
        two_tanh(x).backward()  # the capped region: one tensor fits, one is kept in memory
    assert (free.tensors, free.kept_tensors) == (2, 0)
    assert (capped.tensors, capped.kept_tensors) == (3, 1)
    assert_nothing_left(tmp_path)


def test_a_region_is_entered_once(tmp_path):
    region = offload.saved_tensors(target="disk", directory=tmp_path)
    with region:
        pass
    with pytest.raises(FewBitError, match="entered once"):
        with region:
            pass
    region = offload.saved_tensors(target="disk", directory=tmp_path)
    with pytest.raises(FewBitError, match="entered once"), region, region:
        pass
    assert_nothing_left(tmp_path)


def python_calls_during(action):
    """The Python functions that run during ``action()`` (called from Python or from C, e.g. by a finalizer)."""
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code) if event == "call" else None)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def test_freeing_an_offloaded_graph_runs_no_python_code(tmp_path):
    """A KeyboardInterrupt that lands while Python runs a __del__ or a weakref finalizer is printed ('Exception
    ignored') and lost, so the training loop goes on. Records and sessions are freed with autograd's graph: that
    must run no Python code at all (the work waits for the next safe point)."""
    x = torch.randn(4096, requires_grad=True)
    holder = {}
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        holder["loss"] = two_tanh(x)
    assert stats.tensors == 2
    assert python_calls_during(holder.clear) == []
    assert_nothing_left(tmp_path, freed_outside_backward=True)


def test_backward_runs_no_finalizer(tmp_path):
    x = torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
        loss = two_tanh(x)
    calls = python_calls_during(loss.backward)
    finalizers = [code for code in calls if code.co_name == "__del__" or code.co_filename.endswith("weakref.py")]
    assert finalizers == []
    assert disk.idle_files() == 1  # the end of backward was the safe point: the file is back in the pool
    assert_nothing_left(tmp_path)


def test_ctrl_c_inside_thread_start_is_held_back_until_the_thread_runs(tmp_path, monkeypatch):
    """Ctrl-C inside Thread.start() (Python code) can leave the new thread blocked forever on a lock it needs, or
    never started with the job queued for it: the start is shielded, and the interrupt is raised once it returned."""
    from fewbit_design.runtime.offload.worker import Job, Worker

    start = threading.Thread.start

    def interrupted_start(thread):
        signal.raise_signal(signal.SIGINT)  # the handler runs at the next check: inside start, unshielded
        start(thread)

    worker = Worker("test")
    job = Job(lambda: 1)
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        worker.submit(job)
    monkeypatch.undo()
    worker.close(RuntimeError("closed"))  # waits for the job the thread runs
    assert job.done and job.result == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert_nothing_left(tmp_path)


def test_a_thread_that_cannot_start_leaves_nothing_queued(tmp_path, monkeypatch):
    from fewbit_design.runtime.offload.worker import Job, Worker

    def cannot_start(thread):
        raise RuntimeError("can't start new thread")

    worker = Worker("test")
    job = Job(lambda: 1)
    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.raises(RuntimeError, match="can't start"):
        worker.submit(job)
    monkeypatch.undo()
    assert job.done  # cancelled: never left waiting for a thread that will not come
    assert job.result is None and "did not start" in str(job.error)
    later = worker.submit(Job(lambda: 2))  # the next job starts a thread
    later.wait()
    assert later.result == 2
    worker.close(RuntimeError("closed"))
    assert_nothing_left(tmp_path)


def test_interrupt_while_creating_the_file_leaves_no_file(tmp_path, monkeypatch):
    def fsync(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(disk.os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        offload.saved_tensors(target="disk", directory=tmp_path)
    monkeypatch.undo()
    assert_nothing_left(tmp_path)


def open_descriptors():
    """Open files of this process, each once (a mapped offload file has two descriptors: the target's and the one
    Python's ``mmap`` keeps while the mapping is open)."""
    files = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            files.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
    return len(files)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_idle_files_of_removed_folders_are_closed(tmp_path):
    """A new folder per step, removed after the step: the pool keeps no file of a removed folder (it kept one
    descriptor, and the disk space of one step, per folder ever used)."""
    x = torch.randn(1 << 16, requires_grad=True)
    before = open_descriptors()
    for step in range(40):
        folder = tmp_path / f"step{step}"
        folder.mkdir()
        with offload.saved_tensors(target="disk", min_bytes=0, directory=folder):
            loss = two_tanh(x)
        loss.backward()
        shutil.rmtree(folder)
        assert open_descriptors() <= before + 1  # the file of the step just done (its folder was just removed)
    assert disk.idle_files() == 0 and open_descriptors() == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_removing_an_offload_closes_the_idle_file_of_its_folder(tmp_path):
    """The file kept for the next step in the folder is closed when the offload is removed (no next step comes),
    so removing the folder afterwards frees its disk space at once; another folder's idle file stays."""
    other = tmp_path / "other"
    other.mkdir()
    with offload.saved_tensors(target="disk", min_bytes=0, directory=other):
        loss = two_tanh(torch.randn(1 << 16, requires_grad=True))
    loss.backward()
    before = open_descriptors()
    folder = tmp_path / "steps"
    folder.mkdir()
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    handle = offload.apply(model, target="disk", min_bytes=0, prefetch=0, directory=folder)
    model(torch.randn(64, 256)).sum().backward()
    assert disk.idle_files() == 2 and open_descriptors() == before + 1
    handle.remove()
    shutil.rmtree(folder)
    assert open_descriptors() == before  # (counted first: idle_files() closes the files of removed folders)
    assert disk.idle_files() == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_idle_files_are_capped_in_all(tmp_path):
    x = torch.randn(1 << 16, requires_grad=True)
    before = open_descriptors()
    for step in range(12):
        folder = tmp_path / f"step{step}"
        folder.mkdir()
        with offload.saved_tensors(target="disk", min_bytes=0, directory=folder):
            loss = two_tanh(x)
        loss.backward()
    assert disk.idle_files() == disk.MAX_IDLE_TOTAL
    assert open_descriptors() == before + disk.MAX_IDLE_TOTAL
    assert offload.empty_cache() == disk.MAX_IDLE_TOTAL * 2 * (1 << 18)
    assert open_descriptors() == before


def test_apply_stats_are_zeros_before_the_first_step(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    handle = offload.apply(model, target="disk", min_bytes=0, directory=tmp_path)
    assert handle.stats == offload.Stats(tensors=0, bytes=0, kept_tensors=0, kept_bytes=0)
    model(torch.randn(8, 16)).sum().backward()
    assert handle.stats.tensors == 2  # the input of the Linear and the output of the Tanh
    handle.remove()


def test_a_cap_below_the_reserve_needs_only_the_cap_free(tmp_path, monkeypatch):
    """The free-space check is based on what can be written: with max_host_bytes = 1 MiB a folder with 10 MiB
    free is enough (it was refused for having less than 64 MiB); the reserve kept free is the cap."""
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10 << 20})())
    x = torch.randn(1 << 17, requires_grad=True)  # 512 KiB per saved tensor
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path, max_host_bytes=1 << 20) as stats:
        loss = torch.tanh(torch.tanh(torch.tanh(x * 1))).sum()
    loss.backward()
    assert (stats.tensors, stats.kept_tensors) == (2, 1)  # two fit in the cap, the third stays in memory
    with pytest.raises(FewBitError, match=r"has 10 MiB free, needs at least 16 MiB \(the smaller of 64 MiB"):
        offload.saved_tensors(target="disk", directory=tmp_path, max_host_bytes=16 << 20)
    with pytest.raises(FewBitError, match="has 10 MiB free, needs at least 64 MiB; free some space"):
        offload.saved_tensors(target="disk", directory=tmp_path)
    offload.empty_cache()  # (the idle file's bytes would count as the folder's own)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 5 << 20})())
    with pytest.raises(FewBitError, match=r"needs 1.5 MiB .* had 5 MiB free at entry \(keeping 4 MiB free\)"):
        with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path, max_host_bytes=4 << 20):
            torch.tanh(torch.tanh(torch.tanh(x * 1))).sum()
    assert_nothing_left(tmp_path)


def test_torch_save_of_an_offloaded_model(tmp_path, one_torch_thread):
    """Pickling keeps the offloading (options and model), not the hooks' state."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(16, 32)
    offload.apply(model, [nn.Tanh], target="disk", min_bytes=0, directory=tmp_path)
    model(x).sum().backward()  # a step first: a session and stats exist
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded[1].__dict__["forward"], offload.modules._OffloadedForward)
    assert loaded[1].__dict__["forward"].offloader.stats.tensors == 0  # a fresh start
    model.zero_grad()
    model(x).sum().backward()
    loaded(x).sum().backward()
    assert loaded[1].__dict__["forward"].offloader.stats.tensors == 1
    for got, expected in zip(loaded.parameters(), model.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad)
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("form", ["region", "apply"])
def test_ctrl_c_right_after_the_hooks_are_pushed_leaves_no_hooks(form, tmp_path, monkeypatch):
    """An interrupt can come right after torch pushed the hooks, before the block is set up to pop them: the
    hooks of a dead step would then stay on the stack and catch every later saved tensor of the thread."""
    push = torch.autograd.graph.saved_tensors_hooks.__enter__

    def interrupted(self):
        push(self)
        raise KeyboardInterrupt

    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    handle = offload.apply(model, target="disk", min_bytes=0, directory=tmp_path) if form == "apply" else None
    monkeypatch.setattr(torch.autograd.graph.saved_tensors_hooks, "__enter__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if form == "apply":
            model(torch.randn(8, 16))
        else:
            with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path):
                pass
    monkeypatch.undo()
    from fewbit_design.runtime.offload import session

    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None  # nothing left on the stack
    assert getattr(session._ACTIVE, "stats", []) == []  # and no stats left counting
    if handle is not None:
        handle.remove()
    assert_nothing_left(tmp_path, freed_outside_backward=True)
