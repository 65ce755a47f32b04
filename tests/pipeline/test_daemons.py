"""Daemon threads for the work a save leaves behind: reused, concurrent, never joined at exit."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from objckpt.pipeline.checkpointer import DaemonThreads


def test_calls_one_after_another_reuse_a_thread() -> None:
    """At most two threads whatever the number of calls: a call handed over while the
    previous one is returning may start a second thread, never a third."""
    pool = DaemonThreads("t-seq")
    names: list[str] = []
    for _ in range(20):
        done = threading.Event()
        pool.submit(lambda d=done: (names.append(threading.current_thread().name), d.set()))
        assert done.wait(30)
    assert pool.threads <= 2
    assert len(set(names)) == pool.threads
    assert all(name.startswith("t-seq-") for name in names)
    pool.close()


def test_calls_at_once_each_get_a_thread() -> None:
    pool = DaemonThreads("t-par")
    together = threading.Barrier(4)  # three calls and this thread: all must be running
    for _ in range(3):
        pool.submit(together.wait, 30)
    together.wait(30)
    assert pool.threads == 3
    pool.close()


class _Seen(logging.Handler):
    """Sets an event when a record is emitted (the log line comes after the call ended)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.event.set()


def test_a_failing_call_is_logged_and_the_pool_serves_the_next() -> None:
    pool = DaemonThreads("t-err")
    seen = _Seen()
    logger = logging.getLogger("objckpt.pipeline.checkpointer")
    logger.addHandler(seen)
    try:
        pool.submit(lambda: (_ for _ in ()).throw(ValueError("lost upload")))
        assert seen.event.wait(30)
    finally:
        logger.removeHandler(seen)
    record = seen.records[0]
    assert "t-err" in record.getMessage() and record.exc_info is not None
    assert "lost upload" in str(record.exc_info[1])
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(30)
    pool.close()


def test_close_ends_the_threads_after_the_calls_queued_before_it() -> None:
    pool = DaemonThreads("t-close")
    gate, ran = threading.Event(), threading.Event()
    pool.submit(gate.wait, 30)
    pool.submit(ran.set)
    pool.close()
    gate.set()
    threads = [t for t in threading.enumerate() if t.name.startswith("t-close-")]
    assert threads
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert ran.is_set()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(ran.set)


def test_close_with_a_timeout_returns_once_the_threads_have_ended() -> None:
    """What a checkpointer's close() relies on to leave no thread behind."""
    pool = DaemonThreads("t-join")
    ran = threading.Event()
    pool.submit(ran.set)
    pool.submit(ran.wait, 30)
    pool.close(timeout=30)
    assert ran.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("t-join-")]


def test_a_call_still_running_does_not_hold_the_interpreter_at_exit() -> None:
    """A script that ends without closing its checkpointer must exit (its save stays
    uncommitted), not wait for an upload: the threads are daemons."""
    code = (
        "import threading\n"
        "from objckpt.pipeline.checkpointer import DaemonThreads\n"
        "pool = DaemonThreads('t-exit')\n"
        "started = threading.Event()\n"
        "pool.submit(lambda: (started.set(), threading.Event().wait()))\n"
        "started.wait(30)\n"
        "print('leaving')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "leaving"
