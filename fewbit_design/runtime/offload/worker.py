"""A background thread that runs I/O jobs in order, started once per target and waiting between jobs.

Jobs hold no reference to the offload session, so a session is freed (and its file closed) as soon as autograd
drops its graph, whatever is queued. The thread starts on the first job and then waits for the next one on a C
lock; it ends when the worker is closed (the step's target is closed) or after ``LINGER_SECONDS`` without a job, so
no thread outlives a step for long, and none runs while nothing is queued for that long. Pure Python (no torch).

Why one thread that waits, and not a thread per burst: the queue empties between saved tensors, so a thread that
ended as soon as its queue was empty would start about once per transfer (216 times a step on the 12-layer LLaMA
benchmark model with ``prefetch=2``: ``Thread.start`` costs tens of microseconds of the training thread's time each
and, on a loaded machine, a wait for the scheduler). A waiting thread is woken by releasing a lock. (A thread that
waited 0.25 s measured slower on the loaded 2-core machine: the woken thread queued behind the training thread.
Offloading under the planner writes synchronously, ``prefetch=0``, and runs no thread at all; ``prefetch > 0`` is
for machines with a core to spare.)

Interrupts. A ``KeyboardInterrupt`` is raised in the main thread after any call returns, also inside the Python
code of ``threading`` (``Thread.start``, ``Event.wait``, ``Condition.wait``), where it can leave a lock held
forever: a new thread then blocks for good on its ``started`` event, or a worker on a job's ``done`` event, and the
next close hangs. So the main thread waits here only on plain C locks (``_thread.allocate_lock``), a new thread is
started with Ctrl-C held back until ``Thread.start`` returns (:func:`start_thread`), a loop counts itself in when
it runs, a waiting loop is woken by releasing a plain lock (never waited on by the main thread), and
:meth:`Worker.close` polls the count of jobs being run (taken from the queue under the lock) rather
than joining a thread. After :meth:`Worker.close` returns, no job of this worker runs or will run.
"""

from __future__ import annotations

import _thread
import itertools
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Job", "Worker", "THREAD_PREFIX", "LINGER_SECONDS", "start_thread"]

THREAD_PREFIX = "fewbit-offload"
_names = itertools.count()
LINGER_SECONDS = 0.1  # a thread with nothing to do for this long ends (a step's transfers come far closer)
_POLL_SECONDS = 0.0005  # Worker.close waits for a running job (a transfer of at most 1 GiB) in steps of this


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``, with SIGINT held back (its handler swapped for one that notes it) until it returns; a
    Ctrl-C that came meanwhile is handed to the previous handler afterwards (``KeyboardInterrupt`` by default)."""
    if threading.current_thread() is not threading.main_thread():  # (only the main thread sees SIGINT)
        thread.start()
        return
    noted: list[Any] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(frame))
    except (ValueError, OSError):  # (not the main interpreter: SIGINT is not ours to handle)
        thread.start()
        return
    try:
        thread.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    if noted:
        if callable(previous):
            previous(signal.SIGINT, noted[0])
        elif previous != signal.SIG_IGN:  # the default action: end the process as the signal would have
            signal.raise_signal(signal.SIGINT)


class Job:
    """One unit of work; :meth:`wait` blocks until it ran (or was cancelled) and re-raises nothing: the caller reads
    :attr:`error`. Exactly one of :meth:`run` and :meth:`cancel` finishes a job (the worker's queue decides)."""

    __slots__ = ("function", "result", "error", "_finished", "_wake")

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function: Callable[[], Any] | None = function
        self.result: Any = None
        self.error: BaseException | None = None
        self._finished = False
        self._wake = _thread.allocate_lock()
        self._wake.acquire()  # released once, when the job is finished

    def _finish(self) -> None:
        self._finished = True
        self._wake.release()

    def run(self) -> None:
        """Run the job here. An interrupt of a job run on the calling thread (a synchronous transfer) propagates
        after the job is marked finished with it as its error."""
        function, self.function = self.function, None
        try:
            if function is not None:
                self.result = function()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            self.error = error
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: never turned into an I/O error
                raise
        finally:
            self._finish()

    def cancel(self, error: BaseException) -> None:
        if not self._finished:
            self.function = None
            self.error = error
            self._finish()

    @property
    def done(self) -> bool:
        return self._finished

    def wait(self) -> None:
        if not self._finished:
            self._wake.acquire()  # (a C lock: an interrupt here leaves nothing half done)
            self._wake.release()


class Worker:
    """Runs submitted jobs one after another on one thread, started by the first job; it waits for the next job
    and ends when the worker is closed or after ``linger`` seconds without one (default ``LINGER_SECONDS``; a later
    job starts it again)."""

    def __init__(self, label: str, linger: float | None = None) -> None:
        self._label = label
        self._linger = LINGER_SECONDS if linger is None else linger
        self._queue: deque[Job] = deque()
        self._lock = threading.Lock()
        self._loops = 0  # loops running (each counts itself in, so a start that never happened is never counted)
        self._starting = False  # a thread was started and has not counted itself in yet
        self._running = 0  # jobs taken from the queue and not finished
        self._closed = False
        self._waiting = False  # the loop waits on ``_wake`` (held while nobody released it)
        self._wake = _thread.allocate_lock()
        self._wake.acquire()
        self.started = 0  # threads started by this worker (one per step unless it lingered out in between)

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._closed:
                job.cancel(RuntimeError(f"{self._label} is closed"))
                return job
            self._queue.append(job)
            start = self._loops == 0 and not self._starting
            if start:
                self._starting = True
            else:
                self._wake_loop()
        if start:
            self._start()
        return job

    def _wake_loop(self) -> None:
        """Wake the waiting loop (under ``_lock``)."""
        if self._waiting:
            self._waiting = False
            self._wake.release()

    def _start(self) -> None:
        thread = threading.Thread(target=self._loop, name=f"{THREAD_PREFIX}-{self._label}-{next(_names)}", daemon=True)
        self.started += 1
        try:
            start_thread(thread)
        except BaseException:  # (an interrupt after the start, or a thread the system could not start)
            if thread.ident is None:  # not started: nobody will run what is queued
                with self._lock:
                    self._starting = False
                    queued, self._queue = list(self._queue), deque()
                for job in queued:
                    job.cancel(RuntimeError(f"{self._label}: the transfer thread did not start"))
            raise

    def _loop(self) -> None:
        with self._lock:
            self._starting = False
            self._loops += 1
        while True:
            with self._lock:
                if self._queue:
                    job = self._queue.popleft()
                    self._running += 1
                elif self._closed:
                    self._loops -= 1
                    return
                else:
                    job = None
                    self._waiting = True
            if job is None:
                woken = self._wake.acquire(timeout=self._linger)
                with self._lock:
                    if not woken:
                        if self._waiting:  # nobody came: end (a later submit starts a new thread)
                            self._waiting = False
                            if not self._queue:
                                self._loops -= 1
                                return
                        else:  # released after the timeout: take the release back (returns at once)
                            self._wake.acquire()
                continue
            try:
                job.run()
            finally:
                with self._lock:
                    self._running -= 1

    def close(self, error: BaseException) -> None:
        """Cancel queued jobs with ``error``, wait for the running one (and for the thread's loop to end), and
        refuse new ones. Idempotent. Waiting can be interrupted (the interrupt propagates; the worker stays closed)."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._wake_loop()
        for job in queued:
            job.cancel(error)
        while True:
            with self._lock:
                if not (self._running or self._loops or self._starting):
                    return
            time.sleep(_POLL_SECONDS)
