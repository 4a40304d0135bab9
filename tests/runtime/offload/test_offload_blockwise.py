"""``blockwise`` offload (the planner's): a block's writes are finished when its region ends, and backward prefetches
only the block's own tensors, so no transfer holds memory outside its block (so the planner can run offload
with ``prefetch > 0`` and still bound the peak it predicts)."""

import weakref

import pytest
import torch
from test_offload import assert_nothing_left  # the disk tests' probes (tests/ is on sys.path under pytest)
from torch import nn

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import offload
from fewbit_design.runtime.offload import session as session_module


def _model(blocks=4, width=64):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])


def _sessions(monkeypatch):
    made = []
    real = session_module.Session.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(weakref.ref(self))  # (weak: a session kept alive would keep its file open)

    monkeypatch.setattr(session_module.Session, "__init__", init)
    return made


def test_blockwise_writes_are_finished_when_each_block_returns(tmp_path, monkeypatch):
    made = _sessions(monkeypatch)
    model = _model()
    in_flight_after_block = []
    offload.apply(model, list(model), min_bytes=0, prefetch=2, blockwise=True, directory=tmp_path)
    for block in model:
        block.register_forward_hook(lambda *_: in_flight_after_block.append(len(made[-1]()._inflight)))
    loss = model(torch.randn(256, 64)).sum()
    assert in_flight_after_block == [0, 0, 0, 0]
    loss.backward()
    del loss
    assert_nothing_left(tmp_path)


def test_blockwise_prefetch_never_reads_another_blocks_tensor(tmp_path, monkeypatch):
    """Each read ahead is of a record of the block being unpacked (without ``blockwise`` reads cross blocks)."""
    made = _sessions(monkeypatch)
    crossed = {}
    for blockwise in (False, True):
        model = _model()
        handle = offload.apply(model, list(model), min_bytes=0, prefetch=2, blockwise=blockwise, directory=tmp_path)
        for _ in range(2):  # the second step prefetches in the first one's unpack order
            loss = model(torch.randn(256, 64)).sum()
            session = made[-1]()
            real_prefetch = session._prefetch
            reads = []

            def prefetch(current, session=session, real_prefetch=real_prefetch, reads=reads):
                records = session._alive_records()
                before = {p for p, r in records.items() if r.fetch is not None}
                real_prefetch(current)
                after = {p for p, r in session._alive_records().items() if r.fetch is not None}
                reads.extend((records[current].block, records[p].block) for p in after - before)

            session._prefetch = prefetch
            loss.backward()
            del loss, session, prefetch, real_prefetch  # (each holds the session: its file stays open)
        crossed[blockwise] = sum(mine != theirs for mine, theirs in reads)
        assert reads  # something was read ahead
        handle.remove()
    assert crossed[False] > 0 and crossed[True] == 0
    assert_nothing_left(tmp_path, freed_outside_backward=True)  # (the wrapped _prefetch made cycles: gc frees them)


def test_blockwise_gradients_equal_the_unconverted_models(tmp_path):
    x = torch.randn(128, 64)
    reference = _model()
    reference(x).sum().backward()
    model = _model()
    offload.apply(model, list(model), min_bytes=0, prefetch=1, blockwise=True, directory=tmp_path)
    for _ in range(2):
        model.zero_grad()
        model(x).sum().backward()
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)
    assert_nothing_left(tmp_path)


def test_bad_blockwise():
    with pytest.raises(FewBitError, match="offload blockwise must be true or false, got 'yes'"):
        offload.saved_tensors(blockwise="yes")
