"""Mapped reads of the synchronous disk path (``prefetch=0``): a tensor read back is a view of the mapped
offload file, not a copy. What must hold: no read copies (no ``preadv``), the bytes are the saved ones, ``memory.peak``
counts the mapped tensors exactly as it counted the copies they replace, and a file that a live tensor still maps is
never handed to the next step (which would overwrite the bytes under it)."""

import os

import pytest
import torch
from test_offload import assert_nothing_left, assert_same_tensor, open_offload_files, round_trip

from fewbit_design.runtime import memory, offload
from fewbit_design.runtime.offload import disk
from fewbit_design.runtime.offload.layout import address_bytes, describe, empty, with_flags


@pytest.fixture
def no_read_copy(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the synchronous path copied a tensor back with preadv")

    monkeypatch.setattr(disk, "_pread_all", refused)


def test_a_tensor_read_back_maps_the_file_and_holds_the_saved_bytes(tmp_path, no_read_copy):
    tensor = torch.randn(300, 70)[:, 3:50]  # (a strided view: its span comes back, at offset 0)
    got, stats = round_trip(tensor, tmp_path, prefetch=0)
    assert stats.transfers == 1
    assert_same_tensor(got, tensor)
    # the file's pages: inside a shared mapping of an offload file of this folder
    address = got.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    mapped = [r for r in regions if len(r) >= 6 and os.path.dirname(r[5]) == os.path.realpath(tmp_path)]
    assert any(int(r[0].split("-")[0], 16) <= address < int(r[0].split("-")[1], 16) for r in mapped)
    del got
    assert_nothing_left(tmp_path)


def reference_read_now(self, offset, layout):
    """The read this path replaced: a new tensor of the layout, allocated through the dispatcher, filled by preadv."""
    tensor = empty(layout)
    if layout.nbytes:
        os.preadv(self._fd, [address_bytes(tensor.data_ptr(), layout.nbytes)], offset)
    return with_flags(tensor, layout), None


def offloaded_step_peak(directory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.Tanh())
    x = torch.randn(128, 64)
    with memory.peak(model, x) as measured:
        with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=directory):
            loss = model(x).square().sum()
        loss.backward()
    return measured.peak_bytes, [p.grad.clone() for p in model.parameters()]


def test_peak_counts_mapped_tensors_as_it_counted_the_copies(tmp_path, monkeypatch):
    mapped_peak, mapped_grads = offloaded_step_peak(tmp_path)
    monkeypatch.setattr(disk.DiskTarget, "read_now", reference_read_now)
    copied_peak, copied_grads = offloaded_step_peak(tmp_path)
    assert mapped_peak == copied_peak  # exact: the same storages, counted over the same operators
    for a, b in zip(mapped_grads, copied_grads, strict=True):
        assert torch.equal(a, b)
    # and the mapped tensors are counted at all: the step's peak is above what the forward pass leaves alive
    assert mapped_peak > 128 * 64 * 4


def test_count_storage_counts_once_and_uncounts_when_freed():
    import mmap

    mapping = mmap.mmap(-1, 1 << 16)
    with memory.peak() as measured:
        tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=4096, offset=8192)
        memory.count_storage(tensor)
        memory.count_storage(tensor[10:])  # (a view of it: the same storage, not counted again)
        assert measured.live_bytes == 4096
        del tensor
        assert measured.live_bytes == 0
    assert measured.peak_bytes == 4096


def test_a_file_still_mapped_by_a_tensor_is_not_reused(tmp_path):
    first = torch.randn(64, 64)
    kept, _ = round_trip(first, tmp_path, prefetch=0)  # a tensor of step 1, alive after step 1
    second = torch.randn(64, 64)
    got, _ = round_trip(second, tmp_path, prefetch=0)  # step 2 in the same folder: must not write over `kept`
    assert torch.equal(kept, first) and torch.equal(got, second)
    assert disk.idle_files() == 0  # (step 1's file was closed, not pooled; step 2's is mapped by `got`)
    del kept, got
    assert_nothing_left(tmp_path)


def test_a_file_is_reused_once_nothing_maps_it(tmp_path):
    """Training as usual (no tensor read back outlives its backward): every step reuses the one file, mapped."""
    x = torch.randn(4096, requires_grad=True)
    files = set()
    for step in range(3):
        with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
            loss = torch.tanh(torch.tanh(x * (step + 1))).sum()
        loss.backward()
        del loss
        files.update(open_offload_files(tmp_path))
        assert disk.idle_files() == 1
    assert len(files) == 1
    assert_nothing_left(tmp_path)


def test_double_backward_keeps_its_mapped_tensors_intact(tmp_path):
    x = torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
        y = torch.tanh(x * 1)
        loss = (y * y).sum()
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)  # its graph keeps tensors read back from the file
    del loss, y  # (grad's graph still reaches the step's nodes: the step and its file stay alive)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
        other = torch.tanh(torch.randn(4096, requires_grad=True) * 3).square().sum()  # another step's writes
    other.backward()
    (second,) = torch.autograd.grad(grad.sum(), x)
    x0 = x.detach()
    y0 = torch.tanh(x0)
    expected = (2 * (1 - y0**2) ** 2 - 4 * y0**2 * (1 - y0**2)).double()  # d/dx of 2 y (1 - y^2)
    torch.testing.assert_close(second.double(), expected, rtol=1e-5, atol=1e-5)
    del grad, second
    assert_nothing_left(tmp_path, freed_outside_backward=True)


def test_a_longer_file_is_mapped_again_while_tensors_hold_the_shorter_mapping(tmp_path):
    target = disk.DiskTarget(tmp_path)
    a = torch.arange(1024, dtype=torch.float32)
    offset_a, error = target.write_now(a.data_ptr(), a.numel() * 4)
    assert error is None
    got_a, error = target.read_now(offset_a, describe(a))  # maps the file as it is now
    assert error is None
    b = torch.arange(4096, dtype=torch.float64)
    offset_b, _ = target.write_now(b.data_ptr(), b.numel() * 8)
    got_b, error = target.read_now(offset_b, describe(b))  # past the mapping: the file is mapped again
    assert error is None
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    target.close()  # `got_a` holds the first mapping: the file must not go to the pool
    assert disk.idle_files() == 0
    assert torch.equal(got_a, a)  # (still mapped: reading it does not fault)
    del got_a, got_b
    later = disk.DiskTarget(tmp_path)  # nothing maps a file now: a closed target's file is pooled again
    later.close()
    assert disk.idle_files() == 1


@pytest.mark.skipif(not disk._MAPPED_WRITES, reason="writes through the mapping need posix_fallocate")
def test_writes_go_through_the_mapping_and_the_file_is_mapped_a_few_times(tmp_path, no_read_copy, monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the synchronous path wrote with pwrite")

    monkeypatch.setattr(disk, "_pwrite_all", refused)
    maps = []
    real_map = disk.DiskTarget._map
    monkeypatch.setattr(disk.DiskTarget, "_map", lambda self, fd, end: maps.append(end) or real_map(self, fd, end))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(16)])
    x = torch.randn(256, 64)
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        loss = model(x).square().sum()
    got = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert stats.transfers >= 16
    assert len(maps) <= 1 + stats.transfers.bit_length()  # grown geometrically: a few mappings, not one a tensor
    del loss
    assert_nothing_left(tmp_path)
