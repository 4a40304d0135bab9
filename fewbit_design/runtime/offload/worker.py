"""A background thread that runs I/O jobs in order and exits as soon as it has nothing to do.

Jobs hold no reference to the offload session, so a session is freed (and its file closed) as soon as autograd
drops its graph, whatever is queued. The thread starts on the first job and ends when the queue is empty: when no
transfer is in flight, no thread runs. Pure Python (no torch).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Job", "Worker", "THREAD_PREFIX"]

THREAD_PREFIX = "fewbit-offload"
_names = itertools.count()


class Job:
    """One unit of work; :meth:`wait` blocks until it ran (or was cancelled) and re-raises nothing: the caller reads
    :attr:`error`."""

    __slots__ = ("function", "result", "error", "_done")

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function: Callable[[], Any] | None = function
        self.result: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        function, self.function = self.function, None
        try:
            if function is not None:
                self.result = function()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, never swallowed
            self.error = error
        finally:
            self._done.set()

    def cancel(self, error: BaseException) -> None:
        if not self._done.is_set():
            self.function = None
            self.error = error
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()


class Worker:
    """Runs submitted jobs one after another on a thread that exists only while jobs are queued."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._queue: deque[Job] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._closed:
                job.cancel(RuntimeError(f"{self._label} is closed"))
                return job
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"{THREAD_PREFIX}-{self._label}-{next(_names)}", daemon=True
                )
                self._thread.start()
        return job

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                job = self._queue.popleft()
            job.run()

    def close(self, error: BaseException) -> None:
        """Cancel queued jobs with ``error``, wait for the running one, and refuse new ones."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            thread = self._thread
        for job in queued:
            job.cancel(error)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
