"""Upload worker processes: fresh interpreters, never forks of the training process.

Why not fork the training process (as NVIDIA's async checkpointing does): a
fork copies a process whose native client threads may hold locks (a deadlock in
the child), whose pinned memory is not copy-on-write (silent corruption), and
whose torch intra-op pool hangs the child's first parallel op. Why not
``multiprocessing`` (spawn or forkserver) either: its children re-import the
training script's ``__main__``, and with it torch (~190 MiB and seconds per
worker) and whatever else the script loads. A worker here is
``python -m objckpt.pipeline._worker_main``, started with ``exec`` (safe from a
threaded process), talking to the pool over a socket pair; it imports the store
layer only (:mod:`objckpt.pipeline.upload_task`) and persists across saves.

A worker that dies (``kill -9``, OOM) breaks the pool, as a
``ProcessPoolExecutor`` does: every pending task fails with
:class:`~concurrent.futures.process.BrokenProcessPool` at once, the other
workers are stopped, and the next submit starts a fresh pool. A worker that
hangs instead (stopped, stuck in native code) would hold its tasks' futures
forever: whoever waits on them with a bound calls :meth:`WorkerPool.terminate`,
which kills the workers those futures were handed to, so the same rule applies
and the next submit gets fresh workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from objckpt.errors import ConfigurationError

__all__ = ["WEDGED_AFTER", "Channel", "RemoteTraceback", "WorkerPool"]

logger = logging.getLogger(__name__)

#: Seconds past a save's deadline after which an upload that has not answered
#: counts as wedged. A healthy worker shares the deadline and fails its own
#: requests when it passes; this covers that error's trip back on a busy host.
WEDGED_AFTER = 10.0

_HEADER = struct.Struct("!Q")
#: Seconds a closing pool waits for a worker to exit before killing it.
_EXIT_WAIT = 30.0


class RemoteTraceback(Exception):
    """The worker-side traceback of a task's exception (set as its ``__cause__``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class Channel:
    """Length-prefixed pickles over a connected socket, one message at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(_HEADER.pack(len(data)))
        self.sock.sendall(data)

    def send(self, message: Any) -> None:
        self.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_bytes(self) -> bytes:
        """The next message, still pickled. Raises EOFError when the peer closed or died."""
        (size,) = _HEADER.unpack(self._exactly(_HEADER.size))
        return self._exactly(size)

    def recv(self) -> Any:
        return pickle.loads(self.recv_bytes())

    def _exactly(self, size: int) -> bytes:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise EOFError("worker channel closed")
            got += n
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Task:
    __slots__ = ("args", "fn", "future")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()


class _Generation:
    """One set of worker processes; broken for good when one of them dies."""

    def __init__(self, workers: int, name: str, slots: int) -> None:
        self.name = name
        self.tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.broken = False
        #: Why the pool stopped these workers itself (None: it did not).
        self.stopped: str | None = None
        #: Every future handed to this generation (to find the workers of a wedged one).
        self.futures: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ready: list[concurrent.futures.Future[int]] = []
        self.threads: list[threading.Thread] = []
        for n in range(workers):
            proc, channels = self._launch(slots)
            self.procs.append(proc)
            for s, channel in enumerate(channels):
                ready: concurrent.futures.Future[int] = concurrent.futures.Future()
                thread = threading.Thread(
                    target=self._serve,
                    args=(proc, channel, ready),
                    name=f"objckpt-{name}-worker-{n}-slot-{s}",
                    daemon=True,
                )
                self.ready.append(ready)
                self.threads.append(thread)
                thread.start()

    def _launch(self, slots: int) -> tuple[subprocess.Popen[bytes], list[Channel]]:
        pairs = [socket.socketpair() for _ in range(slots)]
        theirs = [pair[1].fileno() for pair in pairs]
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "objckpt.pipeline._worker_main",
                    ",".join(map(str, theirs)),
                    str(os.getpid()),
                ],
                pass_fds=theirs,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            raise
        finally:
            for _, their in pairs:
                their.close()
        channels = [Channel(ours) for ours, _ in pairs]
        # The worker imports what a pickled task names; give it this process's path.
        channels[0].send({"sys_path": list(sys.path)})
        return proc, channels

    def submit(self, task: _Task) -> bool:
        """Queue ``task``; False when this generation is broken (use a fresh one)."""
        with self.lock:
            if self.broken:
                return False
            self.futures.add(task.future)
            self.tasks.put(task)
            return True

    def _serve(
        self,
        proc: subprocess.Popen[bytes],
        channel: Channel,
        ready: concurrent.futures.Future[int],
    ) -> None:
        """One slot's thread: hands its worker one task at a time on this channel and
        settles the task's future."""
        try:
            ready.set_result(channel.recv())
        except (EOFError, OSError) as exc:
            ready.set_exception(self._died(proc, exc))
            channel.close()
            return
        while True:
            task = self.tasks.get()
            if task is None:
                with contextlib.suppress(OSError):
                    channel.send(None)
                break
            if not task.future.set_running_or_notify_cancel():
                continue
            if self.broken:
                task.future.set_exception(BrokenProcessPool(f"the {self.name} pool is broken"))
                continue
            try:
                message = pickle.dumps((task.fn, task.args), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # the caller's unpicklable argument: its error alone
                task.future.set_exception(exc)
                continue
            try:
                channel.send_bytes(message)
                reply = channel.recv_bytes()
            except (EOFError, OSError) as exc:
                task.future.set_exception(self._died(proc, exc))
                break
            try:
                ok, value, remote = pickle.loads(reply)
            except Exception as exc:  # e.g. an exception class that does not unpickle
                task.future.set_exception(exc)
                continue
            if ok:
                task.future.set_result(value)
            else:
                if remote:
                    value.__cause__ = RemoteTraceback(remote)
                task.future.set_exception(value)
        channel.close()

    def _died(self, proc: subprocess.Popen[bytes], exc: BaseException) -> BrokenProcessPool:
        """A worker is gone: break the generation, fail what waits, stop the rest."""
        try:
            code = proc.wait(timeout=_EXIT_WAIT)
        except subprocess.TimeoutExpired:
            code = None
        if self.stopped is not None:
            error = BrokenProcessPool(
                f"an objckpt {self.name} worker (pid {proc.pid}) was stopped: {self.stopped}"
            )
        else:
            error = BrokenProcessPool(
                f"an objckpt {self.name} worker (pid {proc.pid}) died"
                + (f" with exit code {code}" if code is not None else "")
                + " (killed, or out of memory?)"
            )
        error.__cause__ = exc
        if self._break(error, spare=proc):
            logger.warning("%s", error)
        return error

    def _break(self, error: BrokenProcessPool, spare: subprocess.Popen[bytes] | None) -> bool:
        """Break the generation once: kill its workers (but ``spare``), fail every
        queued task with ``error`` and let idle threads end. False if already broken."""
        with self.lock:
            first = not self.broken
            self.broken = True
        if not first:
            return False
        for other in self.procs:  # their threads fail their tasks on EOF
            if other is not spare and other.poll() is None:
                other.kill()
        while True:  # nothing is queued after ``broken`` is set (see submit)
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None and task.future.set_running_or_notify_cancel():
                task.future.set_exception(error)
        for _ in self.threads:  # idle threads: stop
            self.tasks.put(None)
        return True

    def terminate(self, reason: str) -> list[int]:
        """Kill every worker of this generation (a wedged one cannot be asked to
        stop): their tasks fail with BrokenProcessPool naming ``reason``; returns
        the pids killed."""
        with self.lock:
            if self.stopped is None:
                self.stopped = reason
        live = [p.pid for p in self.procs if p.poll() is None]
        logger.warning("stopping objckpt %s workers %s: %s", self.name, live, reason)
        self._break(
            BrokenProcessPool(f"the objckpt {self.name} workers were stopped: {reason}"), spare=None
        )
        return live

    def close(self, timeout: float | None = None) -> list[int]:
        """Let queued tasks finish, then stop the workers; returns the pids killed.

        With a ``timeout``, tasks still running after it are abandoned: their
        workers are killed (a wedged worker never answers a goodbye) and their
        futures fail, so closing never waits longer than ``timeout`` plus a kill.
        """
        for _ in self.threads:
            self.tasks.put(None)
        until = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            thread.join(None if until is None else max(0.0, until - time.monotonic()))
        killed: list[int] = []
        if any(t.is_alive() for t in self.threads):
            killed = self.terminate(f"still busy {timeout:g} s after the pool was closed")
            for thread in self.threads:
                thread.join(_EXIT_WAIT)  # their channels end with the killed workers
        for proc in self.procs:
            try:
                proc.wait(timeout=_EXIT_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return killed


class WorkerPool:
    """A persistent pool of worker processes running picklable, importable functions.

    Args:
        workers: Number of processes.
        slots: Tasks each process runs at once, each on a thread of its own (an
            upload worker: that many objects, sharing the worker's parts in flight).
        name: What the workers do, for logs and thread names.
    """

    def __init__(self, workers: int = 1, *, slots: int = 1, name: str = "upload") -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ConfigurationError(f"option workers={workers!r} is invalid: expected an int >= 1")
        if not isinstance(slots, int) or slots < 1:
            raise ConfigurationError(f"option slots={slots!r} is invalid: expected an int >= 1")
        self.workers = workers
        self.slots = slots
        self.name = name
        self._gen: _Generation | None = None
        self._lock = threading.Lock()

    def _current(self) -> _Generation:
        with self._lock:
            if self._gen is not None and self._gen.broken:
                logger.warning("starting a fresh %s worker pool", self.name)
                self._gen.close()  # its workers were stopped; reap them
                self._gen = None
            if self._gen is None:
                self._gen = _Generation(self.workers, self.name, self.slots)
            return self._gen

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` in a worker (``fn`` must be importable by name there)."""
        task = _Task(fn, args)
        while not self._current().submit(task):
            pass  # broken between lookup and put: the next lookup starts a fresh pool
        return task.future

    def start(self) -> None:
        """Start the worker processes now, in the background (never blocks).

        An interpreter's start and its imports take a moment; doing it when the
        checkpointer is built keeps that out of the first save's stall.
        """
        self._current()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the started workers are up."""
        gen = self._gen
        if gen is not None:
            concurrent.futures.wait(gen.ready, timeout=timeout)

    def pids(self) -> list[int]:
        """PIDs of the live worker processes (for tests and diagnostics)."""
        gen = self._gen
        if gen is None:
            return []
        return [p.pid for p in gen.procs if p.poll() is None]

    def terminate(
        self, futures: Iterable[concurrent.futures.Future[Any]], reason: str
    ) -> list[int]:
        """Kill the workers that hold any of ``futures`` not yet done (they hang:
        a bounded wait on them ran out); returns the pids killed.

        The whole generation goes, as when a worker dies: every task it holds
        fails with BrokenProcessPool naming ``reason`` (another save's uploads on
        those workers included), and the next submit starts fresh workers.
        """
        with self._lock:
            gen = self._gen
        if gen is None or not any(f in gen.futures for f in futures if not f.done()):
            return []
        return gen.terminate(reason)

    def close(self, timeout: float | None = None) -> list[int]:
        """Let queued tasks finish, then stop the workers; returns the pids killed.

        Args:
            timeout: Seconds to let running tasks finish; after it their workers are
                killed and their futures fail (None: wait for them).
        """
        with self._lock:
            gen, self._gen = self._gen, None
        return [] if gen is None else gen.close(timeout)
