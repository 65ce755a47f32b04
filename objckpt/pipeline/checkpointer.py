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
training loop calls; the sequence itself lives in the two phase modules. With
them, two smaller pieces of the same job:

* :func:`async_save`, ``objckpt.async_save``: one save, on a checkpointer of the
  caller's or on a one-off one that it builds for that save and closes when the
  save ends (the one-off owns a checkpointer's whole life);
* :class:`DaemonThreads`, the long-lived daemon threads each save's uploads and
  commit are waited for on. Why not a thread per call: ``Thread.start()`` returns
  only once the new thread has run, and a new thread that goes straight into
  Python work keeps the GIL for a switch interval (5 ms) before the caller gets it
  back; that was 3-4 ms of each async save's stall. Handing a call to a thread
  that already waits costs a queue put. Why not ``ThreadPoolExecutor``: its
  threads are joined at interpreter exit, so a script that ends without closing
  its checkpointer would wait for an upload (up to the barrier timeout) instead of
  leaving it uncommitted, as before.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from objckpt._removed import CHECKPOINTER, removed_keywords
from objckpt.dcp.collective import Collectives
from objckpt.dcp.serialize import Framer
from objckpt.errors import ConfigurationError, SaveDeadlineError, SaveSequenceError
from objckpt.format.manifest import Manifest
from objckpt.options import AsyncOptions, UploadOptions
from objckpt.pipeline.commit_phase import ACT_WITHIN, WEDGED_AFTER, Committer
from objckpt.pipeline.handle import SaveHandle, SaveLifecycle
from objckpt.pipeline.lifetime import register, wait_bounded, warn_and_wait
from objckpt.pipeline.plan_cache import PlanCacheStats, PlanMemory
from objckpt.pipeline.queue import AsyncRequest
from objckpt.pipeline.reuse_memory import ReuseMemory
from objckpt.pipeline.save_phases import SaveRequest, SaveResources, TargetCache, run_save
from objckpt.pipeline.stage import Stager
from objckpt.pipeline.workers import WorkerPool
from objckpt.writers.retry import RetryPolicy

__all__ = ["AsyncCheckpointer", "DaemonThreads", "async_save"]

logger = logging.getLogger(__name__)

#: Seconds ``close`` lets idle workers say goodbye once every save has ended.
_CLOSE_WAIT = 30.0


@removed_keywords(CHECKPOINTER)
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
        self.upload = upload or UploadOptions(max_parts_in_flight=4)
        self.options = async_options or AsyncOptions()
        self._stager = Stager(
            max_cached_sets=self.options.max_saves_in_flight,
            budget=self.options.staging_budget,
            copy_threads=self.options.staging_threads,
            staging_dir=self.options.staging_dir,
        )
        self._pool = WorkerPool(self.options.workers, slots=self.options.uploads_per_worker)
        self._framer = Framer()
        if start_workers:
            self.start_workers()
        self._inflight: list[SaveHandle] = []
        self._errors: list[BaseException] = []
        self._checker = concurrent.futures.ThreadPoolExecutor(1, "objckpt-check")
        self._plans = PlanMemory()
        #: The collectives of each process group this checkpointer saved with (by the
        #: group's name; None: the default group), each owning its side group.
        self._collectives: dict[str | None, Collectives] = {}
        #: What this rank wrote in its last committed save: the next save's reuse base
        #: without reading the store (each checkpointer its own).
        self.reuse_memory = ReuseMemory()
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
            memory=self.reuse_memory,
            checker=self._checker,
        )
        # Each save's uploads and commit: threads that wait for it, not one per save.
        self._finalizers = DaemonThreads("objckpt-commit")
        self._committer = Committer(
            self._stager.release,
            self.options.barrier_timeout,
            on_commit,
            self._record_error,
            workers=self._pool,
        )
        self._lock = threading.RLock()
        # Held from staging to the end of planning: one save's collectives at a time.
        self._save_lock = threading.Lock()
        self._closed = False
        self._sequence = 0
        # Saves in flight at interpreter exit are named and waited for a bounded
        # time (pipeline.lifetime); the hook holds this checkpointer weakly.
        self._exit_hook = register(self)

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
        no_dist: bool = False,
        exists: bool | None = None,
        reuse_from: str | None = None,
        lifecycle: SaveLifecycle | None = None,
    ) -> SaveHandle:
        """Stage ``state_dict`` and start saving it to ``url``; returns once staged.

        Must be called on every rank of ``process_group`` (DCP plans collectively),
        unless ``no_dist``. Safe to call from several threads: saves are staged and
        planned one at a time, then upload concurrently up to ``max_saves_in_flight``.

        Args:
            checkpoint_id: What DCP's ``StorageMeta.checkpoint_id`` records (``url``).
            no_dist: Save what this process holds as a process group of one (DCP's
                ``no_dist``, world size 1): no collective and no c10d key, so one rank
                may call it alone (Lightning saves on global rank 0 only); the other
                ranks' saves do not count it in their sequence.
            exists: Whether ``url`` holds a committed checkpoint, if the caller knows
                (a manager's step list; None on every rank or on none). None: rank 0
                asks the store beside the copy, and the uploads wait for its answer (a
                committed ``url`` fails every rank's handle, nothing uploaded). False:
                no request; the create-only manifest still refuses a conflict. True:
                refused now (on every rank, through the save's agreement).
            reuse_from: A committed step beside ``url`` whose unchanged items this
                save references instead of uploading (``ObjectStoreWriter``'s).
            lifecycle: What the handle runs when the save ends, before reporting it
                (a manager's bookkeeping), and its tier and promotion.

        Raises:
            ConfigurationError, StateDictError, CheckpointExistsError, StoreError:
                before anything is uploaded (wrapped by torch's CheckpointException
                when raised inside DCP's planning).
        """
        if no_dist and process_group is not None:
            raise ConfigurationError(
                f"save of {url}: option no_dist=True saves without a process group, "
                "but process_group was given too; pass one or the other"
            )
        request = SaveRequest(
            state_dict,
            url,
            self._collectives_of(process_group),
            overwrite,
            user_metadata,
            checkpoint_id,
            no_dist,
            exists,
            reuse_from,
        )
        with self._save_lock:
            # Every collective save() call counts, refused or not: the ranks' numbers stay
            # equal as long as every rank calls save() the same number of times.
            if not no_dist:
                self._sequence += 1
            refusal = ConfigurationError("AsyncCheckpointer is closed") if self._closed else None
            waited, refused = self._throttle(refusal, process_group)
            try:
                queued = run_save(self._resources, request, self._sequence, refused)
            except SaveSequenceError as exc:
                self._sequence = exc.highest  # every rank resumes in step from here
                raise
            future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
            target = queued.deferred.target
            copy = queued.staged.copy
            handle = SaveHandle(
                target.location.url,
                future,
                target.request_counter,
                None if copy is None else copy.finished,
                ends_by=self._committer.ends_by(queued.deferred, queued.distributed),
                lifecycle=lifecycle,
                waited_for_earlier=waited,
                attempt=target.attempt,
            )
            with self._lock:
                self._inflight.append(handle)
            self._finalizers.submit(
                self._committer.finalize,
                queued.deferred,
                queued.staged,
                handle,
                future,
                queued.world,
                queued.process_group,
                queued.distributed,
            )
            return handle

    def _collectives_of(self, process_group: Any | None) -> Collectives:
        """This checkpointer's collectives of ``process_group``, built at its first save."""
        name = None if process_group is None else str(process_group.group_name)
        with self._lock:
            return self._collectives.setdefault(name, Collectives(process_group))

    @property
    def plan_cache_stats(self) -> PlanCacheStats:
        """Saves on this rank that reused the previous plan (hits) or planned anew."""
        return self._plans.stats

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def _throttle(
        self, refusal: BaseException | None, process_group: Any
    ) -> tuple[float, BaseException | None]:
        """Wait while ``max_saves_in_flight`` saves are uploading; returns the seconds waited
        and this save's refusal (``refusal``, or: the oldest save in flight is stuck
        past its own bound, so no slot will free). A refusal goes into the save's
        agreement: every rank refuses this save, none waits for ever."""
        started = time.perf_counter()
        while refusal is None:
            with self._lock:
                self._inflight = [h for h in self._inflight if not h.done()]
                if len(self._inflight) < self.options.max_saves_in_flight:
                    break
                oldest = self._inflight[0]
            if not oldest.settled():  # its error is reported by check_for_errors
                rank = dist.get_rank(process_group) if dist.is_initialized() else 0
                refusal = SaveDeadlineError(
                    f"rank {rank}: the save of {oldest.url} is still running "
                    f"{WEDGED_AFTER + ACT_WITHIN:g} s past its deadline of "
                    f"{self.upload.deadline} s "
                    "(UploadOptions.deadline) and the commit's waits, so none of the "
                    f"AsyncOptions.max_saves_in_flight={self.options.max_saves_in_flight} slots is "
                    "free: this save was refused (is an on-commit hook stuck?)"
                )
        return time.perf_counter() - started, refusal

    def _wait_bounded(self) -> list[SaveHandle]:
        """Wait for the saves in flight, each at most until its own bound; returns
        those still running."""
        with self._lock:
            handles = list(self._inflight)
        return wait_bounded(handles)

    # -- Orbax-style hooks ----------------------------------------------------------------
    def wait_all(self) -> None:
        """Wait for every save in flight (their errors stay for ``check_for_errors``).

        Each is waited for until its own bound at most (its deadline, then the
        commit's waits); one still running then is stuck, and logged."""
        for h in self._wait_bounded():
            logger.error("the save of %s is still running past its deadline's bound", h.url)

    def settles_by(self) -> float | None:
        """The ``time.monotonic()`` by which every save now in flight has committed or
        failed, stuck workers and stores included (now, with none in flight; None
        when one has no deadline). Only a hung on-commit hook outlasts it."""
        with self._lock:
            bounds = [h.ends_by for h in self._inflight if not h.done()]
        if any(b is None for b in bounds):
            return None
        return max([time.monotonic(), *(b for b in bounds if b is not None)])

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
        """Wait for saves in flight, stop the workers and free staging memory; the
        threads, sockets and files the checkpointer opened are all closed by then.

        Returns in bounded time when saves have a deadline (``UploadOptions``):
        each save in flight is waited for until its own bound (the deadline, plus
        ``WEDGED_AFTER`` for a stuck worker and ``ACT_WITHIN`` for the commit thread
        to fail its save, plus the commit's waits); by then a stuck upload has failed
        its save. A save still running past it (a hung
        on-commit hook) is logged as abandoned and the workers are killed.
        """
        if self._closed:
            return
        stuck: list[SaveHandle] = []
        try:
            stuck = self._wait_bounded()
        finally:
            self._closed = True
            atexit.unregister(self._exit_hook)
            if stuck:
                logger.warning(
                    "closing the checkpointer abandons %d save(s) still running past "
                    "their deadline's bound: %s; their workers are stopped",
                    len(stuck),
                    ", ".join(h.url for h in stuck),
                )
            wait = 0.0 if stuck else _CLOSE_WAIT
            self._checker.shutdown(wait=not stuck)
            self._finalizers.close(timeout=wait)
            self._pool.close(timeout=wait)
            self._committer.close(timeout=wait)
            self._stager.close()
            # Last, as the commits above use them; a stuck save's requests are cancelled.
            self._resources.targets.close(timeout=_CLOSE_WAIT)

    def _at_exit(self) -> None:
        """At interpreter exit: name the saves in flight and wait for them up to
        ``AsyncOptions.exit_timeout`` (see :mod:`objckpt.pipeline.lifetime`)."""
        with self._lock:
            pending = [h for h in self._inflight if not h.done()]
        warn_and_wait(pending, self.options.exit_timeout)

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

    def async_request(
        self,
        state_dict: dict[str, Any],
        url: str,
        *,
        finalize_fns: Sequence[Callable[[], Any]] = (),
        **save_kwargs: Any,
    ) -> AsyncRequest:
        """Start a save as :meth:`save` does and return it as an
        :class:`~objckpt.AsyncRequest` for an :class:`~objckpt.AsyncCallsQueue`, the
        API Megatron users know: the queue then runs ``finalize_fns`` once this save
        has committed, in the order its requests were scheduled. The queue is an
        adapter: the save's uploads and commit are this checkpointer's, as for
        :meth:`save`.

        Args:
            finalize_fns: Called in order, once, after the save has committed.
            save_kwargs: :meth:`save`'s keywords (``process_group``, ``overwrite``, ...).
        """
        return AsyncRequest.for_save(self.save(state_dict, url, **save_kwargs), finalize_fns)


@removed_keywords(CHECKPOINTER)
def async_save(
    state_dict: dict[str, Any],
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any | None = None,
    checkpointer: AsyncCheckpointer | None = None,
    overwrite: bool = False,
    no_dist: bool = False,
    **kwargs: Any,
) -> SaveHandle:
    """Save asynchronously; returns a handle as soon as ``state_dict`` is staged.

    Pass a long-lived ``checkpointer`` to reuse staging memory and worker
    processes across saves (the fast path). Without one, a checkpointer is built
    for this save and closed when it finishes.

    Args:
        no_dist: This process alone, without a collective (see
            :meth:`AsyncCheckpointer.save`).
        kwargs: ``upload``, ``async_options`` and ``on_commit`` for the one-off checkpointer.
    """
    if checkpointer is not None:
        return checkpointer.save(
            state_dict, url, process_group=process_group, overwrite=overwrite, no_dist=no_dist
        )
    ckpt = AsyncCheckpointer(storage_options=storage_options, **kwargs)
    try:
        handle = ckpt.save(
            state_dict, url, process_group=process_group, overwrite=overwrite, no_dist=no_dist
        )
    except BaseException:
        ckpt.close()
        raise
    handle.add_done_callback(lambda _: threading.Thread(target=ckpt.close, daemon=True).start())
    return handle


# -- the threads each save's commit runs on ------------------------------------------------
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
