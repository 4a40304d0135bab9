"""The offload worker's thread: one thread carries a burst of transfers, and it still ends when idle.

Regression (issue 26, offload's step time on CPU): the thread ended whenever its queue was empty, so a step whose
transfers come one at a time (one per saved tensor, a block's compute apart) started a thread for most of them:
75 thread starts per step of a 6-block GPT-2, about 1.8 ms of the training thread each on the loaded 2-core
machine, a third of offload's step-time cost."""

from __future__ import annotations

import threading
import time

import pytest

from fewbit_design.runtime.offload import worker as worker_module
from fewbit_design.runtime.offload.worker import Job, Worker


@pytest.fixture
def starts(monkeypatch):
    """The number of worker threads started (a list, appended to at each start)."""
    started = []
    start = worker_module.start_thread

    def counting(thread):
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(worker_module, "start_thread", counting)
    return started


def _threads(label: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{worker_module.THREAD_PREFIX}-{label}-")]


def test_one_thread_runs_jobs_that_come_one_at_a_time(starts):
    worker = Worker("burst")
    results = []
    for index in range(8):  # each job finishes before the next is submitted: the queue is empty in between
        job = worker.submit(Job(lambda index=index: index))
        job.wait()
        results.append(job.result)
        time.sleep(0.002)  # (the compute between two saved tensors)
    assert results == list(range(8))
    assert len(starts) == 1, f"{len(starts)} threads started for 8 jobs"
    worker.close(RuntimeError("closed"))
    assert _threads("burst") == []


def test_an_idle_thread_ends_by_itself_and_a_later_job_starts_another(starts, monkeypatch):
    monkeypatch.setattr(worker_module, "LINGER_SECONDS", 0.01)
    worker = Worker("idle")
    worker.submit(Job(lambda: 1)).wait()
    deadline = time.monotonic() + 30  # liveness, not a timing: the thread ends after LINGER_SECONDS idle
    while _threads("idle") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _threads("idle") == []
    later = worker.submit(Job(lambda: 2))
    later.wait()
    assert later.result == 2 and len(starts) == 2
    worker.close(RuntimeError("closed"))


def test_close_ends_a_waiting_thread_at_once(monkeypatch):
    monkeypatch.setattr(worker_module, "LINGER_SECONDS", 3600.0)  # it would wait an hour for the next job
    worker = Worker("close")
    worker.submit(Job(lambda: 1)).wait()
    assert len(_threads("close")) == 1  # waiting for work
    closing = threading.Thread(target=worker.close, args=(RuntimeError("closed"),))
    closing.start()  # (on a thread of its own: a close that waited for the hour fails here instead of hanging)
    closing.join(timeout=30)
    assert not closing.is_alive(), "close waited for the idle thread's linger"
    for thread in _threads("close"):
        thread.join(timeout=30)
    assert _threads("close") == []
    refused = worker.submit(Job(lambda: 2))
    assert refused.done and "closed" in str(refused.error)
