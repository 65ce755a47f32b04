"""Upload worker processes, forked from a clean forkserver.

Why not fork the training process (as NVIDIA's async checkpointing does): a
fork copies a process whose native client threads may hold locks (a deadlock in
the child), whose pinned memory is not copy-on-write (silent corruption), and
whose torch intra-op pool hangs the child's first parallel op. The forkserver
is a fresh interpreter started on first use, so its forks are clean whatever the
training process has done since; workers preload torch once and then persist
across saves.

Workers receive staged tensors through torch's shared-memory reductions (no
copy: they map the staging buffers), build their own filesystem clients from the
picklable :class:`~objckpt.writers.location.Location`, and upload with parts in flight.
A worker that dies (``kill -9``, OOM) breaks the pool: every pending upload fails
with ``BrokenProcessPool`` at once, and the next save starts a fresh pool.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from objckpt.dcp.serialize import PayloadRecord, close_payload, write_payload
from objckpt.errors import ConfigurationError
from objckpt.options import UploadOptions
from objckpt.pipeline import lifeline
from objckpt.pipeline.stage import SegmentRef, attach_tensor
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.accounting import RequestCounter, counting
from objckpt.writers.checksum import BytesLike
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import Location

__all__ = ["WorkerPool", "upload_object", "worker_store"]

logger = logging.getLogger(__name__)

# Per worker process: store objects by what they were built from, so a persistent
# worker reuses its HTTP connections across objects and saves. Lives only in
# worker processes (never in the training process).
_WORKER_STORES: dict[tuple[str, str, str, str, int], ObjectStore] = {}
_WORKER_SEGMENTS: dict[str, Any] = {}

Entry = tuple[int, "SegmentRef | torch.Tensor | bytes"]


def _worker_init(parent_pid: int) -> None:
    # A forked child that runs parallel torch ops can hang on the intra-op pool.
    torch.set_num_threads(1)
    lifeline.watch_parent(parent_pid, _unlink_attached_segments)


def _forget_freed_segments() -> None:
    """Unmap staging segments the training process has freed (their file is gone):
    a mapping kept here would hold the memory after the trainer let it go. Between
    uploads none is in use (a worker runs one upload at a time)."""
    for path in [p for p in _WORKER_SEGMENTS if not os.path.exists(p)]:
        mapped = _WORKER_SEGMENTS.pop(path)
        with contextlib.suppress(BufferError, ValueError):
            mapped.close()


def _ready() -> None:
    """A no-op task: submitting it makes the pool start a worker."""


def _unlink_attached_segments() -> None:
    """The training process died: its staging segments would outlive it in /dev/shm."""
    for path in list(_WORKER_SEGMENTS):
        with contextlib.suppress(OSError):
            os.unlink(path)


def worker_store(location: Location, options: UploadOptions) -> ObjectStore:
    """Worker side: the store for ``location``, kept for the worker's life so its
    HTTP connections serve every later object and save."""
    # Everything the store was built from: a later save with other upload options
    # or another retry policy must not reuse a store made for the first.
    cache_key = (
        location.protocol,
        repr(sorted(location.storage_options.items())),
        repr(location.retry),
        repr(options),
        os.getpid(),
    )
    store = _WORKER_STORES.get(cache_key)
    if store is None:
        store = open_store(location, options)
        _WORKER_STORES[cache_key] = store
    store.location = location
    return store


def upload_object(
    location: Location,
    options: UploadOptions,
    key: str,
    entries: list[Entry],
    deadline: Deadline | None = None,
) -> PayloadRecord:
    """Worker side: serialize ``entries`` into the object ``key`` and upload it.

    Entries are (item id, data): a :class:`SegmentRef` into a staging segment, a
    tensor, or already-serialized bytes. Every request is bounded by the save's
    ``deadline``.
    """
    _forget_freed_segments()
    resolved: list[tuple[int, torch.Tensor | BytesLike]] = [
        (i, attach_tensor(d, _WORKER_SEGMENTS) if isinstance(d, SegmentRef) else d)
        for i, d in entries
    ]
    store = worker_store(location, options)
    size_hint = sum(
        t.numel() * t.element_size() if isinstance(t, torch.Tensor) else len(t) for _, t in resolved
    )
    with counting(RequestCounter()) as counter, bounded_by(deadline):
        upload = store.begin(key, size_hint)
        try:
            record, done = close_payload(upload, write_payload(upload, resolved))
            done.result()
        except BaseException:
            upload.abort()
            raise
    return dataclasses.replace(record, requests=counter.snapshot())


class WorkerPool:
    """A persistent pool of upload processes from the forkserver.

    Args:
        workers: Number of processes. Each runs one object upload at a time with
            ``UploadOptions.max_in_flight`` parts in flight.
    """

    def __init__(self, workers: int = 2) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ConfigurationError(f"option workers={workers!r} is invalid: expected an int >= 1")
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._warming: list[concurrent.futures.Future[None]] = []
        self._lock = threading.Lock()

    def _ensure(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is not None and getattr(self._pool, "_broken", False):
                logger.warning("an upload worker died; starting a fresh worker pool")
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            if self._pool is None:
                ctx = multiprocessing.get_context("forkserver")
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=ctx,
                    initializer=_worker_init,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        try:
            return self._ensure().submit(fn, *args)
        except BrokenProcessPool:
            with self._lock:
                self._pool = None
            return self._ensure().submit(fn, *args)

    def start(self) -> None:
        """Start the worker processes now, in the background (never blocks).

        Starting an interpreter and importing torch takes seconds; doing it when the
        checkpointer is built keeps that out of the first save's stall.
        """
        if self._warming:
            return
        pool = self._ensure()
        self._warming = [pool.submit(_ready) for _ in range(self.workers)]

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the workers ``start`` began have run their first task."""
        concurrent.futures.wait(self._warming, timeout=timeout)

    def pids(self) -> list[int]:
        """PIDs of the live worker processes (for tests and diagnostics)."""
        pool = self._pool
        if pool is None:
            return []
        return [p.pid for p in getattr(pool, "_processes", {}).values() if p.pid is not None]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
