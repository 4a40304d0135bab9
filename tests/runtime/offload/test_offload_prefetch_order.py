"""Prefetch in the order backward unpacks (offload's step time on CPU).

Regression: prefetch read the positions just below the one unpacked, but a node unpacks all its saved tensors at
once in the order it saved them (attention's query, key, value, output): those were read synchronously while
backward waited, and a prefetched one dropped as stale and read again (GPT-2 blocks: 28 reads for 22 records, 5
of them synchronous). A step now prefetches in the order the previous step's backward unpacked."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbit_design.runtime import offload
from fewbit_design.runtime.offload import disk


class _SavesFour(torch.autograd.Function):
    """y = a * b * c * d of four linear maps of x, saving the four (unpacked together, in the order saved)."""

    @staticmethod
    def forward(ctx, a, b, c, d):
        ctx.save_for_backward(a, b, c, d)
        return a * b * c * d

    @staticmethod
    def backward(ctx, grad):
        a, b, c, d = ctx.saved_tensors
        return grad * b * c * d, grad * a * c * d, grad * a * b * d, grad * a * b * c


class Block(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.maps = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        return x + _SavesFour.apply(*(torch.tanh(m(x)) for m in self.maps))


@pytest.fixture
def reads(monkeypatch):
    """(position-free) counts of the disk reads: {"sync": n, "prefetch": n}."""
    counts = {"sync": 0, "prefetch": 0}
    read = disk.DiskTarget.read

    def counting(self, offset, nbytes, *, sync):
        counts["sync" if sync else "prefetch"] += 1
        return read(self, offset, nbytes, sync=sync)

    monkeypatch.setattr(disk.DiskTarget, "read", counting)
    return counts


def test_each_record_is_read_once_and_ahead_of_backward_from_the_second_step(tmp_path, reads):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*(Block() for _ in range(3)))
    model = copy.deepcopy(plain)
    handle = offload.apply(model, list(model), min_bytes=0, prefetch=2, target="disk", directory=tmp_path)
    x = torch.randn(256, 64)
    plain(x).square().sum().backward()
    for step in range(3):
        model.zero_grad(set_to_none=True)
        reads.update(sync=0, prefetch=0)
        loss = model(x).square().sum()
        records = handle.stats.transfers
        loss.backward()
        for got, want in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(got.grad, want.grad)
        if step == 0:
            continue  # the first step has no order to learn from
        assert reads["sync"] + reads["prefetch"] <= records, (step, reads, records)  # none read twice
        assert reads["sync"] <= 1, (step, reads)  # at most the first one backward needs (no record before it)
    handle.remove()
