"""Async saves: stage, plan, hand uploads to workers, commit in the background.

``AsyncCheckpointer.save`` returns as soon as three things are done on the
calling rank: the state dict is copied into staging memory, DCP has planned the
save (its usual collectives, on the caller's thread, like any ``dcp.save``), and
the payload objects are queued for the upload workers. Everything after that —
uploads, gathering every rank's results, writing ``.metadata`` and committing
the manifest — happens in worker processes and a background thread per save,
with no call the training loop has to make. The handle reports the outcome.

The order of events for one save on one rank::

    caller:      stage -> dcp.save(staged, _DeferredWriter) -> handle returned
    workers:     serialize + upload each payload object (multipart, CRC32C)
    background:  wait for this rank's uploads -> post results (c10d store)
                 rank 0: gather all ranks (timeout) -> .metadata -> manifest
                 others: wait for rank 0's outcome (timeout)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from objckpt.commit import commit_checkpoint
from objckpt.errors import ConfigurationError, ObjckptError, UploadError
from objckpt.finalize import RankExchange, group_store
from objckpt.layout import payload_key
from objckpt.manifest import Manifest
from objckpt.options import UploadOptions
from objckpt.plan import ObjectPlan, RankPlan, assign_objects, estimate_size
from objckpt.plan_cache import (
    Agreement,
    CachedPlan,
    PlanCacheStats,
    agree,
    cache_key,
    group_ranks,
)
from objckpt.retry import RetryPolicy
from objckpt.serialize import PayloadRecord, resolve_bytes_items, written_object
from objckpt.stage import Staged, Stager, Wave
from objckpt.storage_writer import ObjectStoreWriter
from objckpt.translate import describe
from objckpt.workers import WorkerPool, upload_object

__all__ = ["AsyncCheckpointer", "AsyncOptions", "SaveHandle", "async_save"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncOptions:
    """How async saves run.

    Attributes:
        workers: Upload processes per rank (each with ``UploadOptions.max_inflight``
            requests in flight).
        max_in_flight: Saves that may be uploading at once; a further ``save``
            waits for the oldest to finish (each in-flight save holds its own staging).
        barrier_timeout: Seconds the commit waits for every rank's uploads (and
            other ranks wait for the commit) before failing with an error naming
            the missing ranks.
        staging_budget: Bytes of staging memory one save may hold (None: as much
            as the state dict). A larger state dict is staged in waves: ``save``
            copies a budget's worth, hands it to the workers, waits for those
            uploads, and goes on, returning once every tensor is copied. The stall
            then includes the upload of all but the last wave. A wave always holds
            the largest tensor, even above the budget.
    """

    workers: int = 2
    max_in_flight: int = 1
    barrier_timeout: float = 600.0
    staging_budget: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigurationError(
                f"option workers={self.workers!r} is invalid: expected an int >= 1"
            )
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ConfigurationError(
                f"option max_in_flight={self.max_in_flight!r} is invalid: expected an int >= 1"
            )
        if self.staging_budget is not None and (
            not isinstance(self.staging_budget, int)
            or isinstance(self.staging_budget, bool)
            or self.staging_budget < 1
        ):
            raise ConfigurationError(
                f"option staging_budget={self.staging_budget!r} is invalid: "
                "expected a number of bytes >= 1, or None"
            )
        if not (isinstance(self.barrier_timeout, (int, float)) and self.barrier_timeout > 0):
            raise ConfigurationError(
                f"option barrier_timeout={self.barrier_timeout!r} must be a positive number"
            )


class SaveHandle:
    """The outcome of one async save.

    ``result()`` returns the committed :class:`~objckpt.Manifest` on the
    coordinator and None on other ranks (once the coordinator has committed).
    """

    def __init__(self, url: str, future: concurrent.futures.Future[Manifest | None]) -> None:
        self.url = url
        self._future = future

    def done(self) -> bool:
        """True once the save has committed or failed (never blocks)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Manifest | None:
        """Wait for the commit; re-raises the save's error.

        Raises:
            TimeoutError: Not finished within ``timeout`` seconds.
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # the save's own error is a TimeoutError (barrier)
                raise
            raise TimeoutError(f"save of {self.url} not finished within {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))


@dataclasses.dataclass
class _Pending:
    obj: ObjectPlan
    future: concurrent.futures.Future[PayloadRecord]


class _DeferredWriter(ObjectStoreWriter):
    """A DCP writer whose ``write_data`` queues uploads and whose ``finish`` defers the commit."""

    def __init__(self, *args: Any, pool: WorkerPool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool = pool
        self._staged: Staged | None = None  # set once the state dict is staged
        self.pending: list[_Pending] = []
        self.items: list[Any] = []
        self.rank_plan: RankPlan | None = None
        self.metadata: Metadata | None = None
        self.final_plan: SavePlan | None = None
        #: The attempt id every rank agreed on before planning.
        self.agreed_attempt: str | None = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # preflight and the existence check ran before planning

    def _next_attempt(self) -> str:
        if self.agreed_attempt is None:
            raise ConfigurationError("internal: global plan before the attempt was agreed")
        return self.agreed_attempt

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, RankPlan):
            raise ConfigurationError("write_data got a plan this writer did not prepare")
        self.rank_plan = rank_plan
        self.final_plan = plan
        self._attempt = rank_plan.attempt
        items = list(plan.items)
        self.items = items
        resolved = resolve_bytes_items(items, planner)  # fails here, before any upload
        position = {id(item): n for n, item in enumerate(items)}
        staged = self._staged
        wave = staged.wave if staged is not None else None
        # In waves, no packed object may be larger than a wave.
        object_size = self.upload.object_size
        if wave is not None:
            object_size = min(object_size, wave.capacity)
        objects = assign_objects(
            items,
            object_size,
            lambda i: payload_key(rank_plan.rank, i, rank_plan.attempt, self.upload.prefix_entropy),
        )
        this_wave: list[concurrent.futures.Future[PayloadRecord]] = []
        for obj in objects:
            entries: list[tuple[int, Any]] = []
            for item in obj.items:
                pos = position[id(item)]
                if item.type == WriteItemType.BYTE_IO:
                    entries.append((pos, resolved[pos].getvalue()))
                    continue
                tensor = planner.resolve_data(item)
                ref = None
                if isinstance(tensor, torch.Tensor) and staged is not None and wave is None:
                    ref = staged.ref_of(tensor)
                entries.append((pos, ref if ref is not None else tensor))
            if wave is not None and staged is not None:
                entries = self._into_wave(wave, entries, this_wave, staged.cuda)
            future = self._pool.submit(upload_object, self.location, self.upload, obj.key, entries)
            self.pending.append(_Pending(obj, future))
            this_wave.append(future)
        # DCP gathers these now; the real locations travel through the c10d store later.
        placeholders = [
            WriteResult(index=i.index, size_in_bytes=estimate_size(i), storage_data=None)
            for i in items
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(placeholders)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.metadata = metadata  # committed later, by the background thread

    def _into_wave(
        self,
        wave: Wave,
        entries: list[tuple[int, Any]],
        this_wave: list[concurrent.futures.Future[PayloadRecord]],
        cuda: bool,
    ) -> list[tuple[int, Any]]:
        """Copy one object's tensors into the wave segment, first draining a full wave."""
        tensors = [v for _, v in entries if isinstance(v, torch.Tensor)]
        if not wave.fits_all(tensors):
            logger.debug("staging wave full (%d bytes); waiting for its uploads", wave.used)
            for f in this_wave:
                try:
                    f.result()
                except BrokenProcessPool as exc:
                    raise UploadError(
                        f"an upload worker died while saving {self.location.url} in staging "
                        "waves (killed or out of memory); nothing was committed"
                    ) from exc
            this_wave.clear()
            wave.reset()
        out = [(pos, wave.put(v) if isinstance(v, torch.Tensor) else v) for pos, v in entries]
        wave.sync(cuda)
        return out


def _plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace ``Stateful`` values by their ``state_dict()``, as ``dcp.save`` does."""
    from torch.distributed.checkpoint.stateful import Stateful

    def plain(value: Any) -> Any:
        # Tensors and containers are never Stateful; skip the costly protocol check.
        if isinstance(value, (torch.Tensor, dict, list, tuple, int, float, str, bytes)):
            return value
        return value.state_dict() if isinstance(value, Stateful) else value

    return {k: plain(v) for k, v in state_dict.items()}


def _plan_and_queue(
    state: dict[str, Any], writer: _DeferredWriter, process_group: Any, distributed: bool
) -> None:
    """Run DCP's plan -> write -> finish with the deferred writer.

    DCP's internal ``_save_state_dict`` is used when present: the public
    ``dcp.save`` wraps every entry in logging that costs ~0.1 ms per tensor,
    which is most of the stall for a state dict of thousands of small tensors.
    """
    from torch.distributed.checkpoint import state_dict_saver

    no_dist = not distributed
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        inner = getattr(state_dict_saver, "_save_state_dict", None)
        if inner is None:
            dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
        else:
            inner(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)


def _replay(cached: CachedPlan, staged: Staged, writer: _DeferredWriter, rank: int) -> None:
    """Queue the uploads of a save whose structure equals the cached plan's.

    The cached final local plan names the same items; only the attempt changes.
    The planner is set up on the new staged state so items resolve to its tensors.
    """
    planner = DefaultSavePlanner()
    planner.set_up_planner(
        state_dict=staged.state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0
    )
    attempt = writer.agreed_attempt
    assert attempt is not None
    plan = dataclasses.replace(cached.plan, storage_data=RankPlan(rank=rank, attempt=attempt))
    writer.write_data(plan, planner)
    writer.metadata = cached.metadata


class AsyncCheckpointer:
    """Runs async saves with persistent staging memory and upload workers.

    Use one per training job (every rank builds its own) and close it at the end
    (or use it as a context manager). Every public method may be called from any
    thread.

    Args:
        storage_options: Passed untouched to fsspec for every save.
        upload: Object and part sizing for the workers (default: 4 parts in flight
            per worker).
        options: Worker count, saves in flight, barrier timeout.
        on_commit: Called on the coordinator with (url, manifest) after each commit.
        retry: How every store request is retried (:class:`~objckpt.RetryPolicy`).
    """

    def __init__(
        self,
        *,
        storage_options: Mapping[str, Any] | None = None,
        upload: UploadOptions | None = None,
        options: AsyncOptions | None = None,
        on_commit: Callable[[str, Manifest], Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        # Measured on 2 cores against moto (1 GiB, medians of 3): 2 workers x 4 parts in
        # flight committed in 9.9 s, 2 x 8 in 10.8 s, 1 x 8 in 11.5 s, 1 x 16 in 12.1 s.
        self.upload = upload or UploadOptions(max_inflight=4)
        self.options = options or AsyncOptions()
        self._on_commit = on_commit
        self._stager = Stager(
            max_cached_sets=self.options.max_in_flight, budget=self.options.staging_budget
        )
        self._pool = WorkerPool(self.options.workers)
        self._inflight: list[SaveHandle] = []
        self._errors: list[BaseException] = []
        # Filesystem clients by protocol, and buckets already checked: a save's
        # stall should not pay for a new HTTP session or a preflight round trip.
        self._filesystems: dict[str, Any] = {}
        self._checked: set[tuple[str, str]] = set()
        self._plan_cache: CachedPlan | None = None
        self._checker = concurrent.futures.ThreadPoolExecutor(1, "objckpt-check")
        self._cache_stats = PlanCacheStats()
        self._lock = threading.RLock()
        self._closed = False

    # -- saving ---------------------------------------------------------------------------
    def save(
        self,
        state_dict: dict[str, Any],
        url: str,
        *,
        process_group: Any | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Stage ``state_dict`` and start saving it to ``url``; returns once staged.

        Must be called on every rank of ``process_group`` (DCP plans collectively).

        Raises:
            ConfigurationError, StateDictError, CheckpointExistsError, StoreError:
                before anything is uploaded (wrapped by torch's CheckpointException
                when raised inside DCP's planning).
        """
        if self._closed:
            raise ConfigurationError("AsyncCheckpointer is closed")
        if url.startswith("memory://"):
            raise ConfigurationError(
                f"async save cannot write {url}: memory:// is private to one process and the "
                "uploads run in worker processes; use file://, s3:// or gs://"
            )
        self._throttle()
        writer = _DeferredWriter(
            url,
            storage_options=self.storage_options,
            overwrite=overwrite,
            upload=self.upload,
            user_metadata=user_metadata,
            pool=self._pool,
            retry=self.retry,
        )
        loc = writer.location
        with self._lock:
            fs = self._filesystems.get(loc.protocol)
            if fs is None:
                fs = self._filesystems[loc.protocol] = loc.open_fs(fresh=True)
            writer._fs, writer._fs_pid = fs, os.getpid()
            writer._needs_preflight = (loc.protocol, loc.bucket) not in self._checked
        # The target check is a round trip to the store: run it while the copy runs.
        # The first save to a bucket also proves it may write there (preflight) and
        # waits for that, so credentials that cannot write fail before any copy.
        check = self._checker.submit(ObjectStoreWriter.prepare_local_plan, writer, SavePlan([]))
        distributed = dist.is_available() and dist.is_initialized()
        if writer._needs_preflight and check.exception() is not None:
            self._agree_or_raise(writer, False, check.exception(), process_group, distributed)
        try:
            staged = self._stager.stage(_plain_state_dict(state_dict))
        except BaseException:
            check.exception()
            raise
        writer._staged = staged
        try:
            self._plan(staged, writer, check.exception(), process_group, distributed)
        except BaseException:
            self._settle(writer)
            self._stager.release(staged)
            raise
        with self._lock:
            self._checked.add((loc.protocol, loc.bucket))
        world = dist.get_world_size(process_group) if distributed else 1
        future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
        handle = SaveHandle(writer.location.url, future)
        with self._lock:
            self._inflight.append(handle)
        thread = threading.Thread(
            target=self._finalize,
            args=(
                writer,
                staged,
                future,
                world,
                process_group if distributed else None,
                distributed,
            ),
            name=f"objckpt-commit-{writer.rank_plan.attempt if writer.rank_plan else ''}",
            daemon=True,
        )
        thread.start()
        return handle

    def _plan(
        self,
        staged: Staged,
        writer: _DeferredWriter,
        refusal: BaseException | None,
        process_group: Any,
        distributed: bool,
    ) -> None:
        """Agree with the other ranks (on the cache and on refusals), then replay or plan.

        ``refusal`` is this rank's error from the target check (preflight and
        "already committed?"), which ran while the state dict was staged.
        """
        rank = dist.get_rank(process_group) if distributed else 0
        world = dist.get_world_size(process_group) if distributed else 1
        group = group_ranks(process_group) if distributed else (0,)
        key = cache_key(staged.structure, rank, world, group)
        cached = self._plan_cache
        hit = cached is not None and cached.key == key
        agreement = self._agree_or_raise(writer, hit, refusal, process_group, distributed)
        writer.agreed_attempt = agreement.attempt
        if agreement.hit and cached is not None:
            self._cache_stats = dataclasses.replace(
                self._cache_stats, hits=self._cache_stats.hits + 1
            )
            try:
                _replay(cached, staged, writer, rank)
            except BaseException as exc:
                if distributed:  # the others learn it from the exchange, not a collective
                    self._exchange(writer, process_group, world).post(False, describe(exc))
                raise
            return
        self._cache_stats = dataclasses.replace(
            self._cache_stats, misses=self._cache_stats.misses + 1
        )
        self._plan_cache = None
        _plan_and_queue(staged.state, writer, process_group, distributed)
        if writer.final_plan is not None:
            self._plan_cache = CachedPlan(key, writer.final_plan, writer.metadata)

    @staticmethod
    def _agree_or_raise(
        writer: _DeferredWriter,
        hit: bool,
        refusal: BaseException | None,
        process_group: Any,
        distributed: bool,
    ) -> Agreement:
        """The one collective of a save: every rank calls it exactly once, whether it
        refused before staging, after staging, or not at all. Raises on every rank
        when any rank refused."""
        rank = dist.get_rank(process_group) if distributed else 0
        writer.set_up_storage_writer(rank == 0, rank=rank)
        agreement = agree(hit, refusal is not None, rank, process_group, distributed)
        if agreement.refused_by is not None:
            if refusal is not None:
                raise refusal
            raise ObjckptError(
                f"save of {writer.location.url} was refused on rank {agreement.refused_by} "
                "(see that rank's error); nothing was uploaded"
            )
        return agreement

    @property
    def plan_cache_stats(self) -> PlanCacheStats:
        """Saves on this rank that reused the previous plan (hits) or planned anew."""
        return self._cache_stats

    def _exchange(self, writer: _DeferredWriter, process_group: Any, world: int) -> RankExchange:
        assert writer.agreed_attempt is not None
        return RankExchange(
            group_store(process_group),
            writer.agreed_attempt,
            writer._rank,
            world,
            self.options.barrier_timeout,
            writer.location.url,
        )

    def _throttle(self) -> None:
        while True:
            with self._lock:
                self._inflight = [h for h in self._inflight if not h.done()]
                if len(self._inflight) < self.options.max_in_flight:
                    return
                oldest = self._inflight[0]
            oldest.exception()  # wait; its error is reported by check_for_errors

    @staticmethod
    def _settle(writer: _DeferredWriter) -> None:
        for p in writer.pending:
            p.future.exception()

    def _finalize(
        self,
        writer: _DeferredWriter,
        staged: Staged,
        future: concurrent.futures.Future[Manifest | None],
        world: int,
        process_group: Any | None,
        distributed: bool,
    ) -> None:
        url = writer.location.url
        try:
            results, error = self._collect(writer)
            self._stager.release(staged)
            rank_plan = writer.rank_plan
            assert rank_plan is not None
            if not distributed:
                if error is not None:
                    raise error
                manifest: Manifest | None = self._commit(writer, [results], world)
            else:
                exchange = self._exchange(writer, process_group, world)
                exchange.post(error is None, results if error is None else describe(error))
                if rank_plan.rank == 0:
                    manifest = self._coordinate(writer, exchange, world)
                else:
                    if error is not None:
                        raise error
                    outcome = exchange.outcome()
                    if outcome is not None:
                        raise UploadError(outcome)
                    manifest = None
            future.set_result(manifest)
        except BaseException as exc:
            logger.error("async save of %s failed: %s", url, describe(exc))
            with self._lock:
                self._errors.append(exc)
            future.set_exception(exc)

    def _collect(self, writer: _DeferredWriter) -> tuple[list[WriteResult], BaseException | None]:
        results: list[WriteResult] = []
        error: BaseException | None = None
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        for p in writer.pending:
            try:
                record = p.future.result()
            except BrokenProcessPool as exc:
                error = error or UploadError(
                    f"an upload worker died while saving {writer.location.url} "
                    "(killed or out of memory); the save was not committed"
                )
                error.__cause__ = exc
                continue
            except BaseException as exc:
                error = error or exc
                continue
            results.extend(written_object(p.obj, writer.items, record, done).write_results())
        return results, error

    def _coordinate(self, writer: _DeferredWriter, exchange: RankExchange, world: int) -> Manifest:
        try:
            all_results = exchange.gather()
            manifest = self._commit(writer, all_results, world)
        except BaseException as exc:
            exchange.publish_outcome(describe(exc))
            raise
        exchange.publish_outcome(None)
        return manifest

    def _commit(
        self, writer: _DeferredWriter, results: list[list[WriteResult]], world: int
    ) -> Manifest:
        if writer.metadata is None or writer.rank_plan is None:
            raise ObjckptError("internal: commit without DCP metadata on the coordinator")
        manifest = commit_checkpoint(
            writer.store,
            writer.metadata,
            results,
            attempt=writer.rank_plan.attempt,
            world_size=world,
            overwrite=writer.overwrite,
            user=writer.user_metadata,
        )
        writer.close()
        if self._on_commit is not None:
            self._on_commit(writer.location.url, manifest)
        return manifest

    # -- Orbax-style hooks ----------------------------------------------------------------
    def wait_until_finished(self) -> None:
        """Wait for every save in flight, then raise the first error not yet reported."""
        with self._lock:
            handles = list(self._inflight)
        for h in handles:
            h.exception()
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
            self._pool.close()
            self._stager.close()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        kwargs: ``upload``, ``options`` and ``on_commit`` for the one-off checkpointer.
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
