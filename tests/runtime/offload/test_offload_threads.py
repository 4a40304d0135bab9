"""The disk target's transfer thread: started once per step, not once per burst of transfers."""

import time

import torch
from test_offload import assert_nothing_left  # the disk tests' probes (tests/ is on sys.path under pytest)
from torch import nn

from fewbit_design.runtime import offload
from fewbit_design.runtime.offload import worker


class Pause(nn.Module):
    """Lets the transfer thread drain its queue between two saved tensors (as compute does in a real model)."""

    def forward(self, x):
        time.sleep(0.003)
        return x


def test_one_transfer_thread_per_step_not_one_per_burst(tmp_path, monkeypatch):
    """A thread that ended whenever its queue was empty would start once per transfer in a step whose transfers
    come apart (here 9 writes and 9 reads, each after a pause: about 18 starts); it waits for the next job
    instead, is started once per step (the step's file target), and ends when the target is closed."""
    # a stall of a loaded machine between forward and backward must not end the idle thread: this test is about
    # starts per transfer, not about the linger (raising=False: the name is new with the fix)
    monkeypatch.setattr(worker, "LINGER_SECONDS", 30.0, raising=False)
    starts = []
    real_start = worker.start_thread
    monkeypatch.setattr(worker, "start_thread", lambda thread: starts.append(thread.name) or real_start(thread))
    layers = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.Tanh(), Pause()]
    model = nn.Sequential(*layers)
    x = torch.randn(256, 64)
    for _ in range(2):
        starts.clear()
        with offload.saved_tensors(target="disk", min_bytes=0, prefetch=2, directory=tmp_path) as stats:
            loss = model(x).sum()
        assert stats.transfers == 9  # x and the eight Tanh outputs (each also the next Linear's input)
        loss.backward()
        assert len(starts) == 1, starts
    del loss
    assert_nothing_left(tmp_path)  # the thread ended with the step's target


def test_a_lingering_thread_ends_and_a_later_job_starts_another():
    jobs = worker.Worker("test", linger=0.01)
    first = jobs.submit(worker.Job(lambda: 1))
    first.wait()
    deadline = time.monotonic() + 30  # liveness: the idle thread ends after its linger
    while jobs._loops and time.monotonic() < deadline:
        time.sleep(0.002)
    assert jobs._loops == 0
    second = jobs.submit(worker.Job(lambda: 2))
    second.wait()
    assert (first.result, second.result, jobs.started) == (1, 2, 2)
    jobs.close(RuntimeError("closed"))
    assert jobs._loops == 0 and not jobs._running
