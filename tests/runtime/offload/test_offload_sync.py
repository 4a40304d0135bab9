"""The synchronous disk path (``prefetch=0``, the planner's setting): tensors go straight from their own
bytes to the file and come back straight into the restored tensor, with no transfer job, no uint8 view and no
restore chain, and behave exactly as through the job path: the same bytes, the same layouts, the same one-line
errors, an in-place modification never giving a wrong gradient, small tensors and parameters left in place."""

import errno

import pytest
import torch
from test_offload import (  # the disk tests' probes (tests/ is on sys.path under pytest)
    DTYPES,
    LAYOUTS,
    assert_nothing_left,
    assert_same_tensor,
    break_writes,
    random_bytes_tensor,
    round_trip,
)
from test_offload_pack import SaveMany

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import offload
from fewbit_design.runtime.offload import disk, region, session
from fewbit_design.runtime.offload.layout import describe


@pytest.fixture
def no_job_path(monkeypatch):
    """Fail on any use of the job path's pieces: a transfer job, a uint8 view of the saved tensor, a restore."""

    def refused(*args, **kwargs):
        raise AssertionError("the synchronous disk path used the job path")

    monkeypatch.setattr(disk, "Job", refused)
    monkeypatch.setattr(session, "raw_bytes", refused)
    monkeypatch.setattr(session, "restore", refused)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_layout_round_trips_bitwise_without_a_job(dtype, tmp_path, no_job_path):
    for layout, make in LAYOUTS.items():
        generator = torch.Generator().manual_seed(hash((str(dtype), layout)) % 2**31)
        tensor = make(random_bytes_tensor((6, 8), dtype, generator))
        got, stats = round_trip(tensor, tmp_path, prefetch=0)
        assert_same_tensor(got, tensor)
        nbytes = describe(tensor).nbytes
        assert stats.transfers == (1 if nbytes else 0)  # (a zero-size tensor stays in place)
        if nbytes:
            whole = tensor.untyped_storage().nbytes()
            if whole <= 2 * nbytes:  # the whole storage came back, the tensor at its own offset in it
                assert got.untyped_storage().nbytes() == whole
                assert got.storage_offset() == tensor.storage_offset()
            else:  # only the span came back, at offset 0
                assert got.untyped_storage().nbytes() == nbytes
                assert got.storage_offset() == 0
    del got  # (it maps its step's file: kept from the pool while it lives, see test_mapped_reads.py)
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_conj_and_neg_views_round_trip_without_a_job(view, tmp_path, no_job_path):
    base = torch.randn(5, 7, dtype=torch.complex64)
    tensor = base.conj() if view == "conj" else torch._neg_view(base.conj().resolve_conj())
    got, _ = round_trip(tensor, tmp_path, prefetch=0)
    assert_same_tensor(got, tensor)
    del got
    assert_nothing_left(tmp_path)


def test_gradients_of_a_model_are_bitwise_without_a_job(tmp_path, no_job_path, one_torch_thread):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64), torch.nn.Tanh())
    x = torch.randn(32, 64)
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        loss = model(x).square().sum()
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert stats.transfers > 0
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    del loss
    assert_nothing_left(tmp_path)


def test_a_tensor_saved_twice_is_written_once(tmp_path, no_job_path):
    x = torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        y = x * 1
        loss = (y * y).sum()  # (mul saves y for both operands: one record, used twice)
    loss.backward()
    assert stats.transfers == 1
    assert torch.equal(x.grad, 2 * x.detach())
    del loss
    assert_nothing_left(tmp_path)


def test_modified_in_place_after_a_synchronous_write_gives_the_saved_value(tmp_path, no_job_path):
    x = torch.randn(4096, requires_grad=True)
    y = x * 1
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
        z = torch.sin(y)
    expected = torch.cos(y.detach().clone())
    with torch.no_grad():
        y.add_(1)  # after the write: the file holds the value autograd saved
    z.sum().backward()
    assert torch.equal(x.grad, expected)
    del z
    assert_nothing_left(tmp_path)


def test_write_error_is_the_same_one_line_error(tmp_path, monkeypatch):
    break_writes(monkeypatch, errno.ENOSPC, "No space left on device")
    x = torch.randn(1024, requires_grad=True)
    with pytest.raises(FewBitError) as raised:
        with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
            torch.tanh(x * 1)
    assert str(raised.value) == (
        f"offload: writing 4096 bytes in {str(tmp_path)!r} failed (No space left on device); "
        "the step's saved tensors are lost"
    )
    assert x.grad is None
    assert_nothing_left(tmp_path)


def test_read_error_is_the_same_one_line_error(tmp_path, monkeypatch):
    def broken(fd, size):  # (a synchronous read maps the file: mapping it is what can fail)
        raise OSError(errno.EIO, "Input/output error")

    # (where writes go through the mapping the file is mapped in forward, and a read cannot fail but by SIGBUS:
    # the read that maps the file is that of systems without posix_fallocate, which write with pwrite)
    monkeypatch.setattr(disk, "_MAPPED_WRITES", False)
    x = torch.randn(1024, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path):
        loss = torch.tanh(x * 1).sum()
    monkeypatch.setattr(disk.mmap, "mmap", broken)
    with pytest.raises(FewBitError) as raised:
        loss.backward()
    message = str(raised.value)
    del raised, loss  # (the traceback holds the graph)
    assert message == f"offload: reading 4096 bytes back in {str(tmp_path)!r} failed (Input/output error)"
    assert_nothing_left(tmp_path, freed_outside_backward=True)


def test_a_tensor_marked_as_parameter_stays_in_place(tmp_path):
    """``isinstance(t, Parameter)`` is also true of a plain tensor marked ``_is_param`` (torch.compile's functional
    parameters): like a parameter, it is not offloaded (the check no longer calls Parameter's ``__instancecheck__``)."""
    x = torch.randn(4096, requires_grad=True)
    marked = x * 1
    marked._is_param = True
    assert isinstance(marked, torch.nn.Parameter)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        loss = torch.sin(marked).sum() + torch.sin(marked[:10]).sum()  # (the view's base is the marked tensor)
    assert stats.tensors == 0
    loss.backward()
    del loss
    assert_nothing_left(tmp_path)


def test_hooks_are_guarded_without_a_dynamo_disable_per_region(tmp_path, monkeypatch):
    """Where dynamo is loaded, the hooks run with its frame callback cleared (so a compiled model's frame callback
    never compiles them, test_offload_compiled.py) without building ``torch._dynamo.disable`` wrappers per region
    entry (about 0.1 ms each, a dozen a step)."""
    import torch._dynamo  # noqa: F401 - loaded, as wherever something compiles

    def refused(*args, **kwargs):
        raise AssertionError("torch._dynamo.disable built per region")

    monkeypatch.setattr(torch._dynamo, "disable", refused)
    seen = []
    hook = region._never_compiled(lambda argument: seen.append(torch._C._dynamo.eval_frame.set_eval_frame(None)))
    assert hook(1) is None and seen == [None]
    x = torch.randn(1024, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        loss = torch.tanh(x * 1).sum()
    loss.backward()
    assert stats.transfers == 1
    del loss
    assert_nothing_left(tmp_path)


def test_views_of_one_storage_are_written_once_and_come_back_as_views_of_one_storage(tmp_path, no_job_path):
    """GPT-2's attention saves its query, key and value: three views of one projection's output, each spanning
    almost all of it; a linear's input is saved as (batch, sequence, width) and as (batch * sequence, width)."""
    qkv = torch.randn(2, 64, 24)
    q, k, v = (t.reshape(2, 64, 2, 4).transpose(1, 2) for t in qkv.split(8, dim=-1))
    views = [q, k, v, qkv.reshape(128, 24), qkv]
    sink = []
    anchor = torch.zeros(1, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        out = SaveMany.apply(anchor, sink, *views)
    assert stats.transfers == 1 and stats.bytes == qkv.untyped_storage().nbytes()  # one storage, written once
    out.sum().backward()
    assert len(sink) == len(views)
    assert len({t.untyped_storage().data_ptr() for t in sink}) == 1  # views of one storage read back
    for got, saved in zip(sink, views, strict=True):
        assert_same_tensor(got, saved)
        assert got.storage_offset() == saved.storage_offset()
    del sink, got, out
    assert_nothing_left(tmp_path)


def test_a_storage_modified_in_place_between_saves_is_written_again(tmp_path, no_job_path):
    x = torch.randn(4096)
    sink = []
    anchor = torch.zeros(1, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=0, prefetch=0, directory=tmp_path) as stats:
        first = SaveMany.apply(anchor, sink, x.view(64, 64))
        before = x.clone()
        x.add_(1)  # a new version: the next view of it is another record
        second = SaveMany.apply(anchor, sink, x[:])
    assert stats.transfers == 2
    (first + second).sum().backward()
    assert {tuple(t.shape) for t in sink} == {(64, 64), (4096,)}
    by_shape = {tuple(t.shape): t for t in sink}
    assert torch.equal(by_shape[(64, 64)].reshape(-1), before) and torch.equal(by_shape[(4096,)], x)
    del sink, by_shape, first, second
    assert_nothing_left(tmp_path)
