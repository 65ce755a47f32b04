"""Long-lived daemon threads that run submitted calls, for work a save leaves behind.

Why not a thread per call: ``Thread.start()`` returns only once the new thread
has run, and a new thread that goes straight into Python work keeps the GIL for
a switch interval (5 ms) before the caller gets it back; that was 3-4 ms of each
async save's stall. Handing a call to a thread that already waits costs a queue
put. Why not ``ThreadPoolExecutor``: its threads are joined at interpreter exit,
so a script that ends without closing its checkpointer would wait for an upload
(up to the barrier timeout) instead of leaving it uncommitted, as before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DaemonThreads"]

logger = logging.getLogger(__name__)

_Job = tuple[Callable[..., Any], tuple[Any, ...]]


class DaemonThreads:
    """Runs each submitted call on an idle thread, starting one when none is idle.

    Calls must handle their own errors (a save reports them through its handle);
    one that escapes is logged. A thread is started only when none waits, so there
    are never more threads than calls running (or just returning) at once; they
    stay until :meth:`close`.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Threads waiting for a call minus calls queued for them: never below 0.
        self._idle = 0
        self._threads = 0
        self._started: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a thread of this pool; returns without waiting for it."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} threads are closed")
            if self._idle:
                self._idle -= 1
            else:
                self._threads += 1
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{self._threads}", daemon=True
                )
                thread.start()
                self._started.append(thread)
        self._jobs.put((fn, args))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except BaseException:
                logger.exception("%s: a background call failed", self._name)
            with self._lock:
                self._idle += 1

    @property
    def threads(self) -> int:
        """Threads started so far (for tests and diagnostics)."""
        with self._lock:
            return self._threads

    def close(self, timeout: float = 0.0) -> None:
        """Let every thread end once the calls before it are done, and wait up to
        ``timeout`` seconds in all for them to end (0: do not wait)."""
        with self._lock:
            closing, self._closed = not self._closed, True
            threads = list(self._started)
        if closing:
            for _ in threads:
                self._jobs.put(None)
        until = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():  # closed from a call it runs
                thread.join(max(0.0, until - time.monotonic()))
