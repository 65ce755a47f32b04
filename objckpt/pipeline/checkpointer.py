"""Async saves: the checkpointer that owns what lasts across them.

``AsyncCheckpointer.save`` returns as soon as three things are done on the
calling rank: the state dict is copied into staging memory, DCP has planned the
save (its usual collectives, on the caller's thread, like any ``dcp.save``), and
the payload objects are queued for the upload workers. Everything after that —
uploads, gathering every rank's results, writing ``.metadata`` and committing
the manifest — happens in worker processes and a background thread per save,
with no call the training loop has to make. The handle reports the outcome.

The order of events for one save on one rank::

    caller:      stage -> agree -> plan or replay -> queue  (save_phases)
    workers:     serialize + upload each payload object (multipart, CRC32C)
    background:  wait for this rank's uploads -> post results (commit_phase)
                 rank 0: gather all ranks (timeout) -> .metadata -> manifest
                 others: wait for rank 0's outcome (timeout)

This module holds the resources those phases use (staging memory, upload
workers, filesystem clients, the plan cache, commit threads) and the hooks a
training loop calls; the sequence itself lives in the two phase modules.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from objckpt.dcp.serialize import Framer
from objckpt.errors import ConfigurationError, SaveSequenceError
from objckpt.format.manifest import Manifest
from objckpt.options import AsyncOptions, UploadOptions
from objckpt.pipeline.commit_phase import Committer
from objckpt.pipeline.daemons import DaemonThreads
from objckpt.pipeline.handle import SaveHandle
from objckpt.pipeline.plan_cache import PlanCacheStats, PlanMemory
from objckpt.pipeline.save_phases import SaveRequest, SaveResources, TargetCache, run_save
from objckpt.pipeline.stage import Stager
from objckpt.pipeline.workers import WorkerPool
from objckpt.writers.retry import RetryPolicy

__all__ = ["AsyncCheckpointer", "async_save"]

logger = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Runs async saves with persistent staging memory and upload workers.

    Use one per training job (every rank builds its own) and close it at the end
    (or use it as a context manager). Every public method may be called from any
    thread.

    Args:
        storage_options: Passed untouched to fsspec for every save.
        upload: Object and part sizing for the workers (default: 4 parts in flight
            per rank, shared by its workers).
        async_options: Worker count, saves in flight, barrier timeout (the same
            keyword as :class:`~objckpt.CheckpointManager`'s).
        on_commit: Called on the coordinator with (url, manifest) after each commit.
        retry: How every store request is retried (:class:`~objckpt.RetryPolicy`).
        start_workers: Start the upload workers now (False: at ``start_workers()``
            or the first save).
    """

    def __init__(
        self,
        *,
        storage_options: Mapping[str, Any] | None = None,
        upload: UploadOptions | None = None,
        async_options: AsyncOptions | None = None,
        on_commit: Callable[[str, Manifest], Any] | None = None,
        retry: RetryPolicy | None = None,
        start_workers: bool = True,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        # Measured on 2 cores against moto (1 GiB, medians of 3): 2 workers x 4 parts in
        # flight committed in 9.9 s, 2 x 8 in 10.8 s, 1 x 8 in 11.5 s, 1 x 16 in 12.1 s
        # (then a worker uploaded one object at a time; now 4 parts are shared by the
        # rank's workers and their uploads_per_worker objects at once).
        self.upload = upload or UploadOptions(max_in_flight=4)
        self.options = async_options or AsyncOptions()
        self._stager = Stager(
            max_cached_sets=self.options.max_in_flight,
            budget=self.options.staging_budget,
            copy_threads=self.options.staging_threads,
        )
        self._pool = WorkerPool(self.options.workers, slots=self.options.uploads_per_worker)
        self._framer = Framer()
        if start_workers:
            self.start_workers()
        self._inflight: list[SaveHandle] = []
        self._errors: list[BaseException] = []
        self._checker = concurrent.futures.ThreadPoolExecutor(1, "objckpt-check")
        self._plans = PlanMemory()
        self._resources = SaveResources(
            storage_options=self.storage_options,
            upload=self.upload,
            options=self.options,
            retry=self.retry,
            stager=self._stager,
            pool=self._pool,
            framer=self._framer,
            targets=TargetCache(),
            plans=self._plans,
            checker=self._checker,
        )
        # Each save's uploads and commit: threads that wait for it, not one per save.
        self._finalizers = DaemonThreads("objckpt-commit")
        self._committer = Committer(
            self._stager.release, self.options.barrier_timeout, on_commit, self._record_error
        )
        self._lock = threading.RLock()
        # Held from staging to the end of planning: one save's collectives at a time.
        self._save_lock = threading.Lock()
        self._closed = False
        self._sequence = 0

    # -- saving ---------------------------------------------------------------------------
    def save(
        self,
        state_dict: dict[str, Any],
        url: str,
        *,
        process_group: Any | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, Any] | None = None,
        checkpoint_id: str | None = None,
    ) -> SaveHandle:
        """Stage ``state_dict`` and start saving it to ``url``; returns once staged.

        ``checkpoint_id`` is what DCP's ``StorageMeta.checkpoint_id`` records (default
        ``url``; the manager records a local tier's step under its root URL, where
        the same bytes end up).

        Must be called on every rank of ``process_group`` (DCP plans collectively).
        Safe to call from several threads: saves are staged and planned one at a
        time (their collectives must not interleave), then upload concurrently up to
        ``AsyncOptions.max_in_flight``.

        Raises:
            ConfigurationError, StateDictError, CheckpointExistsError, StoreError:
                before anything is uploaded (wrapped by torch's CheckpointException
                when raised inside DCP's planning).
        """
        request = SaveRequest(
            state_dict, url, process_group, overwrite, user_metadata, checkpoint_id
        )
        with self._save_lock:
            # Every save() call counts, refused or not: the ranks' numbers stay equal as
            # long as every rank calls save() the same number of times.
            self._sequence += 1
            refusal = ConfigurationError("AsyncCheckpointer is closed") if self._closed else None
            waited = self._throttle() if refusal is None else 0.0
            try:
                queued = run_save(self._resources, request, self._sequence, refusal)
            except SaveSequenceError as exc:
                self._sequence = exc.highest  # every rank resumes in step from here
                raise
            future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
            target = queued.writer.writer
            copy = queued.staged.copy
            handle = SaveHandle(
                target.location.url,
                future,
                target.request_counter,
                None if copy is None else copy.finished,
            )
            handle.waited_for_earlier = waited
            handle.attempt = target.attempt
            with self._lock:
                self._inflight.append(handle)
            self._finalizers.submit(
                self._committer.finalize,
                queued.writer,
                queued.staged,
                handle,
                future,
                queued.world,
                queued.process_group,
                queued.distributed,
            )
            return handle

    @property
    def plan_cache_stats(self) -> PlanCacheStats:
        """Saves on this rank that reused the previous plan (hits) or planned anew."""
        return self._plans.stats

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def _throttle(self) -> float:
        """Wait while ``max_in_flight`` saves are uploading; returns the seconds waited."""
        started = time.perf_counter()
        while True:
            with self._lock:
                self._inflight = [h for h in self._inflight if not h.done()]
                if len(self._inflight) < self.options.max_in_flight:
                    return time.perf_counter() - started
                oldest = self._inflight[0]
            oldest.exception()  # wait; its error is reported by check_for_errors

    # -- Orbax-style hooks ----------------------------------------------------------------
    def wait_all(self) -> None:
        """Wait for every save in flight (their errors stay for ``check_for_errors``)."""
        with self._lock:
            handles = list(self._inflight)
        for h in handles:
            h.exception()

    def wait_staged(self) -> None:
        """Wait until every save in flight has copied its state dict to staging
        memory (``AsyncOptions.background_staging``): the tensors may change from
        then on. Returns at once without background staging."""
        with self._lock:
            handles = list(self._inflight)
        for h in handles:
            h.wait_staged()

    def wait_until_finished(self) -> None:
        """Wait for every save in flight, then raise the first error not yet reported."""
        self.wait_all()
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raise the oldest error of a finished save not reported before (each once)."""
        with self._lock:
            if not self._errors:
                return
            exc = self._errors.pop(0)
        raise exc

    def close(self) -> None:
        """Wait for saves in flight, stop the workers and free staging memory."""
        if self._closed:
            return
        try:
            with self._lock:
                handles = list(self._inflight)
            for h in handles:
                h.exception()
        finally:
            self._closed = True
            self._checker.shutdown()
            self._finalizers.close()
            self._pool.close()
            self._stager.close()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_workers(self) -> None:
        """Start the upload worker processes in the background (once; never blocks):
        starting an interpreter and its imports takes a moment, which belongs
        outside the first save's stall."""
        self._pool.start()

    def run_in_worker(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run a module-level ``fn(*args)`` in an upload worker (e.g. a promotion's
        copies: the bytes move outside the training process, like a save's)."""
        if self._closed:
            raise ConfigurationError("AsyncCheckpointer is closed")
        return self._pool.submit(fn, *args)

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the upload workers (for diagnostics and fault tests)."""
        return self._pool.pids()


def async_save(
    state_dict: dict[str, Any],
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any | None = None,
    checkpointer: AsyncCheckpointer | None = None,
    overwrite: bool = False,
    **kwargs: Any,
) -> SaveHandle:
    """Save asynchronously; returns a handle as soon as ``state_dict`` is staged.

    Pass a long-lived ``checkpointer`` to reuse staging memory and worker
    processes across saves (the fast path). Without one, a checkpointer is built
    for this save and closed when it finishes.

    Args:
        kwargs: ``upload``, ``async_options`` and ``on_commit`` for the one-off checkpointer.
    """
    if checkpointer is not None:
        return checkpointer.save(state_dict, url, process_group=process_group, overwrite=overwrite)
    ckpt = AsyncCheckpointer(storage_options=storage_options, **kwargs)
    try:
        handle = ckpt.save(state_dict, url, process_group=process_group, overwrite=overwrite)
    except BaseException:
        ckpt.close()
        raise
    handle.add_done_callback(lambda _: threading.Thread(target=ckpt.close, daemon=True).start())
    return handle
