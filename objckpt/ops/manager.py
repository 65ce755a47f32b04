"""``CheckpointManager``: steps under a root, async saves, retention, resume.

The glue every training loop writes around DCP, done once and carefully:

* step N lives at ``<root>/step-<N, 10 digits>/``; a step exists only once its
  manifest is committed, so ``latest_step()`` never names a half-written step;
* saves are async (:class:`~objckpt.AsyncCheckpointer`), one staging area and
  one set of upload workers reused for the whole run;
* retention runs on the coordinator right after a step commits, over committed
  steps only, and always keeps the newest: a step still uploading is invisible to
  it, and the last good step is never deleted before a newer one is committed.

Every rank of a process group builds its own manager with the same arguments
and calls ``save`` together; only the coordinator (rank 0) deletes and makes
backups (:mod:`objckpt.ops.backup`). ``load`` falls back to the first backup that
holds the step when the primary lacks it or fails verification.

With ``local=LocalTier(...)`` every save commits to node-local disk first and
every K-th is promoted to the root in the background (:mod:`objckpt.ops.tiers`,
:mod:`objckpt.ops.promote`); ``load`` then reads each object from this node's
copy when it holds it intact, from the root (then the backups) otherwise.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from objckpt._torch import group_store
from objckpt.dcp.collective import any_rank, broadcast_from_rank0, is_distributed
from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    IntegrityError,
    ManifestError,
    ObjckptError,
    StateDictMismatchError,
    StoreError,
)
from objckpt.format.layout import index_key, index_rank
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepInfo, parse_step, step_name
from objckpt.ops.backup import BackupStatus, BackupTarget, Replicator, committed_steps
from objckpt.ops.gc import DEFAULT_GRACE, GcReport, collect_garbage, delete_step
from objckpt.ops.promote import Promoter
from objckpt.ops.retention import RetentionPolicy
from objckpt.ops.tiers import LocalTier, TierStatus, is_disk_full, local_room, state_bytes
from objckpt.options import AsyncOptions, ReadOptions, UploadOptions
from objckpt.pipeline.checkpointer import AsyncCheckpointer
from objckpt.pipeline.handle import SaveHandle
from objckpt.pipeline.workers import WorkerPool
from objckpt.writers import open_store
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy
from objckpt.writers.translate import describe

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank errors torch's ``CheckpointException`` carries, else ``[exc]``."""
    if not isinstance(exc, CheckpointException):
        return [exc]
    # torch stores (exception, traceback frames) per rank
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def unwrap(exc: BaseException) -> BaseException:
    """The objckpt error torch's ``CheckpointException`` carries, else ``exc``."""
    return next((e for e in _failures(exc) if isinstance(e, ObjckptError)), exc)


def _size_mismatch(exc: BaseException) -> BaseException | None:
    """torch's planner error for a load target whose shape differs ("Size mismatch
    between saved ... and current ... for <key>"), which does not say which
    checkpoint it was; the manager re-raises it naming the step."""
    return next(
        (e for e in _failures(exc) if type(e) is ValueError and str(e).startswith("Size mismatch")),
        None,
    )


class CheckpointManager:
    """Numbered steps of one training run under ``root_url``.

    Args:
        root_url: Where steps live (``s3://bucket/run-1``).
        storage_options: Passed untouched to fsspec.
        keep_last, keep_every, keep_newer_than: Retention rules (see
            :class:`~objckpt.ops.retention.RetentionPolicy`); or pass ``retention``.
        retention: A policy value instead of the three keywords.
        process_group: The group that saves together (default: the default group).
        upload: Object and part sizing for the upload workers.
        async_options: Workers, saves in flight, barrier timeout, staging budget.
        backups: Backup roots (URLs or :class:`~objckpt.ops.backup.BackupTarget`);
            each committed step is copied there in the background by rank 0. A
            plain URL on the primary's protocol is reached with ``storage_options``.
        retry: How every store request is retried (:class:`~objckpt.RetryPolicy`).
        local: A :class:`~objckpt.LocalTier`: saves commit on this node's disk first
            and every ``promote_every``-th is promoted to ``root_url``. Each rank
            passes its own node's directory.

    Raises:
        ConfigurationError: Bad URL or option.
        StoreError: The root cannot be listed (at construction).
    """

    def __init__(
        self,
        root_url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_newer_than: float | None = None,
        retention: RetentionPolicy | None = None,
        process_group: Any | None = None,
        upload: UploadOptions | None = None,
        async_options: AsyncOptions | None = None,
        backups: Sequence[str | BackupTarget] = (),
        retry: RetryPolicy | None = None,
        local: LocalTier | None = None,
    ) -> None:
        if local is not None and not isinstance(local, LocalTier):
            raise ConfigurationError(
                f"option local={local!r} is invalid: expected objckpt.LocalTier(path, ...)"
            )
        rules = (keep_last, keep_every, keep_newer_than)
        if retention is not None and any(r is not None for r in rules):
            raise ConfigurationError(
                "pass either retention=RetentionPolicy(...) or keep_* options, not both"
            )
        self.retention = retention or RetentionPolicy(
            keep_last=keep_last, keep_every=keep_every, keep_newer_than=keep_newer_than
        )
        self.retry = retry or RetryPolicy()
        self.root = Location.parse(root_url, storage_options, self.retry)
        self.storage_options = dict(storage_options or {})
        self.process_group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world = dist.get_world_size(process_group) if distributed else 1
        self._lock = threading.RLock()
        self._steps: dict[int, StepInfo] = {}
        self._finished: list[int] = []
        self.local = local
        self._local_steps: dict[int, float] = {}  # committed locally: step -> commit time
        self._local_saves = 0
        self._to_promote: set[int] = set()  # picked for promotion, not durable yet
        self._promotions: list[concurrent.futures.Future[None]] = []
        self._promotion_errors: list[BaseException] = []
        self._absorbed: list[BaseException] = []  # local disk-full failures (warned)
        self._degraded: str | None = None  # why the local tier is off for good
        self._last_bypass: str | None = None
        self._last_durable_s: float | None = None  # save to durable, newest promotion
        self._promotion_error: str | None = None  # the last promotion's failure
        self.backups = tuple(self._target(b) for b in backups)
        self._replicator: Replicator | None = None
        if self.backups and self.rank == 0:
            self._replicator = Replicator(
                self.root, self.backups, retention=self.retention, on_done=self._after_backup
            )
        self.reload()
        self._sweep_local()
        if self._replicator is not None:
            self._replicator.scan()
            self._catch_up(self._replicator)
        # With a step to resume from, the job loads first: the upload workers (an
        # interpreter importing torch each) start once the load is done, not while
        # it runs on the same cores; without one they start now, well before the
        # first save.
        self._checkpointer = AsyncCheckpointer(
            storage_options=self.storage_options,
            upload=upload,
            async_options=async_options,
            on_commit=self._on_commit,
            retry=self.retry,
            start_workers=self.latest_step() is None,
        )
        self._promoter: Promoter | None = None
        self._promotion_pool: WorkerPool | None = None
        if local is not None:
            # Promotions get worker processes of their own: sharing the save's workers
            # would queue the next local save (the fast tier) behind a slow upload.
            # Started by the first promotion, not here: a restart that loads at once
            # should not share the CPU with interpreters starting.
            self._promotion_pool = WorkerPool(
                self._checkpointer.options.workers,
                slots=self._checkpointer.options.uploads_per_worker,
                name="promotion",
            )
            self._promoter = Promoter(
                local.location,
                self.root,
                submit=self._promotion_pool.submit,
                upload=self._checkpointer.upload,
                rank=self.rank,
                world=self.world,
                process_group=process_group,
                distributed=distributed,
                timeout=self._checkpointer.options.barrier_timeout,
                on_durable=self._on_durable,
            )

    def _target(self, backup: str | BackupTarget) -> BackupTarget:
        """A URL on the primary's protocol reuses the primary's storage options."""
        if isinstance(backup, BackupTarget):
            return backup
        same = Location.parse(backup).protocol == self.root.protocol
        return BackupTarget(backup, self.storage_options if same else {})

    @classmethod
    def from_config(cls, path: str, **overrides: Any) -> CheckpointManager:
        """A manager built from a TOML config file (see :mod:`objckpt.ops.config`)."""
        from objckpt.ops.config import load_config

        return load_config(path).manager(**overrides)

    # -- steps ------------------------------------------------------------------------------
    def reload(self) -> None:
        """Re-list the root (steps committed by another process show up).

        In a process group only rank 0 lists and the others receive its answer
        (one LIST per job instead of one per rank, and one picture for all), so
        every rank must call it together, as the constructor does.

        With backups configured, an unreachable primary is a warning (loading can
        still fall back to a backup); without, it raises :class:`StoreError`.
        """
        found, local = self._on_rank0(lambda: (self._list_primary(), self._list_local()))
        with self._lock:
            self._steps = {s.step: s for s in found}
            self._local_steps = {s.step: s.modified or time.time() for s in local}

    def _list_local(self) -> list[StepInfo]:
        """Rank 0: the steps committed on its local tier (it holds their manifests)."""
        if self.local is None:
            return []
        try:
            return committed_steps(self.local.location)
        except StoreError as exc:
            logger.warning("local tier %s cannot be listed: %s", self.local.location.url, exc)
            return []

    def _sweep_local(self) -> None:
        """At start, every rank: delete step directories of its local tier that can
        never load — committed neither on the local tier (the coordinator's view) nor
        on the root: what a save killed before its local commit left. (A directory of a
        durable step stays: its objects still spare this node reading them from the
        root.)"""
        if self.local is None:
            return
        root = self.local.location.path
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return
        with self._lock:
            known = set(self._local_steps) | set(self._steps)
        for name in sorted(names):
            step = parse_step(name)
            if step is None or step in known:
                continue
            logger.info(
                "deleting %s: a local save that never committed (a crash left it)",
                os.path.join(root, name),
            )
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _list_primary(self) -> list[StepInfo]:
        try:
            return committed_steps(self.root)
        except StoreError as exc:
            if not self.backups:
                raise
            logger.warning("primary %s cannot be listed (%s); backups remain", self.root.url, exc)
            return []

    def _on_rank0(self, fn: Callable[[], T]) -> T:
        """``fn()`` decided on rank 0 and shared with every rank of the group."""
        if not is_distributed():
            return fn()
        return broadcast_from_rank0(fn, self.process_group)

    def all_steps(self) -> list[int]:
        """Steps committed on the root (durable), ascending."""
        with self._lock:
            return sorted(self._steps)

    def local_steps(self) -> list[int]:
        """Steps committed on the local tier (the coordinator's view), ascending."""
        with self._lock:
            return sorted(self._local_steps)

    def latest_step(self, *, durable: bool = False) -> int | None:
        """The newest committed step, or None when there is none.

        Args:
            durable: Only steps committed on the root. False: a step committed
                only on the local tier counts too (it loads on the nodes that
                hold it, or wherever the root holds the rest).
        """
        with self._lock:
            steps = set(self._steps) if durable else set(self._steps) | set(self._local_steps)
        return max(steps) if steps else None

    def step_url(self, step: int) -> str:
        return self.root.child(step_name(step)).url

    def local_step_url(self, step: int) -> str | None:
        """This rank's local copy of ``step`` (None without a local tier)."""
        if self.local is None:
            return None
        return self.local.location.child(step_name(step)).url

    # -- saving -----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        user_metadata: Mapping[str, Any] | None = None,
        promote: bool | None = None,
    ) -> SaveHandle:
        """Start saving ``state_dict`` as ``step``; returns once it is staged.

        With a local tier the save commits there, and is promoted to the root when
        it is every ``promote_every``-th local save (``promote=True``/``False``
        decides for this one save). When any rank's local disk lacks room the save
        goes to the root directly, with a warning, on every rank.

        Raises:
            CheckpointExistsError: ``step`` is already committed.
            ConfigurationError, StateDictError, StoreError: before any upload.
        """
        local_url = None
        if self.local is not None:
            local_url = self._local_target(step, state_dict)
        url = local_url or self.step_url(step)
        self._checkpointer.start_workers()  # no load came first
        try:
            handle = self._checkpointer.save(
                state_dict,
                url,
                process_group=self.process_group,
                user_metadata=user_metadata,
                checkpoint_id=self.step_url(step),
            )
        except BaseException as exc:
            inner = unwrap(exc)
            if inner is exc:
                raise
            raise inner from exc
        if local_url is None:
            handle._before_done(lambda exc: self._on_done(step, exc))
            return handle
        assert self.local is not None
        self._local_saves += 1
        if promote is None:
            promote = self._local_saves % self.local.promote_every == 0
        promotion: concurrent.futures.Future[None] | None = None
        if promote:
            promotion = concurrent.futures.Future()
            with self._lock:
                self._to_promote.add(step)
                self._promotions.append(promotion)
        handle._set_promotion(promotion)
        handle._before_done(lambda exc: self._on_local_done(step, handle, exc, promotion))
        return handle

    def _local_target(self, step: int, state_dict: Mapping[str, Any]) -> str | None:
        """This rank's local URL for ``step``, or None when the save must bypass the
        local tier (decided with every rank: one all-reduce)."""
        assert self.local is not None
        why = self._degraded or local_room(self.local, state_bytes(state_dict))
        if not any_rank(why is not None, self.process_group):
            self._last_bypass = None
            return self.local_step_url(step)
        why = why or "another rank's local tier has no room"
        logger.warning(
            "step %d goes to %s directly, not the local tier: %s", step, self.root.url, why
        )
        self._last_bypass = why
        return None

    def _on_local_done(
        self,
        step: int,
        handle: SaveHandle,
        exc: BaseException | None,
        promotion: concurrent.futures.Future[None] | None,
    ) -> None:
        """A local save ended: record it, start its promotion, apply local retention
        (before its handle reports it done)."""
        if exc is not None:
            if is_disk_full(exc):
                assert self.local is not None
                self._degraded = (
                    f"a save to the local tier {self.local.location.url} ran out of space "
                    f"(step {step}); later saves go to {self.root.url}"
                )
                logger.warning("%s: %s", self._degraded, exc)
                with self._lock:
                    self._absorbed.append(exc)
            if promotion is not None:
                with self._lock:
                    self._to_promote.discard(step)
                promotion.set_exception(exc)
            return
        self._keep_own_index(step, handle)
        with self._lock:
            self._local_steps[step] = time.time()
            self._finished.append(step)
        if promotion is not None:
            assert self._promoter is not None
            try:
                running = self._promoter.submit(step, handle)
            except BaseException as err:  # closed while saving
                self._promotion_ended(step, handle, promotion, err)
            else:
                running.add_done_callback(
                    lambda f: self._promotion_ended(step, handle, promotion, f.exception())
                )
        self._apply_local_retention()

    # Each rank's local copy holds its own index object too (the coordinator wrote them
    # all): a restart on the same ranks then reads nothing of its own part from the
    # store. One c10d key per rank, read once and deleted (as the commit's own keys).
    def _index_key(self, attempt: str | None, rank: int) -> str:
        return f"objckpt/{attempt}/local-index/rank{rank}"

    def _hand_out_index(self, url: str, manifest: Manifest) -> None:
        """Coordinator, before the local commit's outcome is published: post each
        rank's index object for it to keep on its own disk."""
        if not is_distributed() or self.world == 1:
            return
        local = open_store(Location.parse(url))
        blobs: dict[int, bytes] = {}
        for entry in manifest.objects:
            rank = index_rank(entry.key)
            if rank is None or rank == 0:
                continue
            try:
                blobs[rank] = local.read(entry.key)
            except OSError as exc:  # that rank reads its index from the root at load
                logger.warning("cannot hand out %s: %s", entry.key, exc)
        store = group_store(self.process_group)
        for rank in range(1, self.world):
            store.set(self._index_key(manifest.attempt, rank), blobs.get(rank, b""))

    def _keep_own_index(self, step: int, handle: SaveHandle) -> None:
        """Non-coordinator, after the local commit: write this rank's index object."""
        if self.rank == 0 or self.world == 1:
            return
        store = group_store(self.process_group)
        key = self._index_key(handle.attempt, self.rank)
        try:
            store.wait(
                [key], datetime.timedelta(seconds=self._checkpointer.options.barrier_timeout)
            )
            blob = bytes(store.get(key))
            store.delete_key(key)
        except Exception as exc:  # only a cost at load: the index is read from the root
            logger.warning("step %d: this rank's index object was not handed out: %s", step, exc)
            return
        if not blob or handle.attempt is None:
            return
        local = open_store(Location.parse(self.local_step_url(step) or ""))
        key = index_key(self.rank, handle.attempt)
        if not local.exists(key):  # else a directory shared with the coordinator
            local.put(key, blob)

    def _promotion_ended(
        self,
        step: int,
        handle: SaveHandle,
        promotion: concurrent.futures.Future[None],
        exc: BaseException | None,
    ) -> None:
        with self._lock:
            self._to_promote.discard(step)
            if exc is not None:
                self._promotion_errors.append(exc)
            elif self.rank != 0:  # the coordinator recorded it in _on_durable
                self._record_durable(step)
        if exc is not None:
            promotion.set_exception(exc)
        else:
            promotion.set_result(None)  # the handle's seconds_to_durable is set now
        with self._lock:
            if exc is not None:
                self._promotion_error = f"step {step}: {describe(exc)}"
            else:
                self._promotion_error = None
                self._last_durable_s = handle.seconds_to_durable
        self._apply_local_retention()

    def _on_durable(self, step: int, manifest: Manifest) -> None:
        """Coordinator: the root's manifest of a promoted step is committed."""
        self._on_commit(self.step_url(step), manifest)

    def _record_durable(self, step: int) -> None:
        """Non-coordinator ranks learn of a commit on the root, and of retention, here."""
        with self._lock:
            self._steps[step] = StepInfo(step, self.step_url(step), True, 0, 0, time.time())
            for old in self.retention.to_delete(list(self._steps.values()), time.time()):
                self._steps.pop(old, None)  # the coordinator deletes it

    def _apply_local_retention(self) -> None:
        """Every rank, its own local directory: keep the newest ``keep_last`` local
        steps and every step whose promotion is still running."""
        if self.local is None:
            return
        with self._lock:
            committed = sorted(self._local_steps)
            keep = set(committed[-self.local.keep_last :]) | self._to_promote
            doomed = [s for s in committed if s not in keep]
            for s in doomed:
                self._local_steps.pop(s, None)
            durable = set(self._steps)
        for s in doomed:
            if s not in durable:
                logger.info(
                    "local retention deletes step %d, which was never durable "
                    "(not promoted, or its promotion failed; keep_last=%d)",
                    s,
                    self.local.keep_last,
                )
            self._delete_local(s)

    def _delete_local(self, step: int) -> None:
        assert self.local is not None
        where = self.local.location.child(step_name(step))
        try:  # the manifest first: a half-deleted step is never taken for committed
            delete_step(where)
        except CheckpointNotFoundError:
            return
        except ObjckptError as exc:
            logger.warning("cannot delete local step %s: %s", where.url, exc)
            return
        logger.info("deleted local step %d at %s", step, where.url)

    def _on_done(self, step: int, exc: BaseException | None) -> None:
        """A save to the root ended (before its handle reports it done)."""
        if exc is not None:
            return
        with self._lock:
            self._finished.append(step)
        if self.rank != 0:
            self._record_durable(step)

    def _on_commit(self, url: str, manifest: Manifest) -> None:
        """Coordinator, background thread: record the step, then apply retention."""
        step = parse_step(url)
        if step is None:
            return
        if self.local is not None and url == self.local_step_url(step):
            logger.info("step %d committed on the local tier %s", step, url)
            self._hand_out_index(url, manifest)
            return  # recorded by _on_local_done, on every rank
        info = StepInfo(step, url, True, len(manifest.objects), manifest.total_bytes, time.time())
        if manifest.requests is not None:
            logger.info("step %d committed; the save cost %s", step, manifest.requests.summary())
        with self._lock:
            self._steps[step] = info
        if self._replicator is not None:
            self._replicator.submit(step, manifest)
        self._apply_retention()

    def _after_backup(self, step: int) -> None:
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Coordinator: delete what the policy drops, sparing steps still being backed up."""
        spared = self._replicator.pending() if self._replicator is not None else frozenset()
        with self._lock:
            doomed = self.retention.to_delete(list(self._steps.values()), time.time())
        for old in doomed:
            if old in spared:
                continue
            try:
                self.delete(old)
            except Exception as exc:  # the save committed; a failed deletion is retried later
                logger.warning("retention could not delete step %d: %s", old, exc)

    def maybe_finalize(self) -> list[int]:
        """Steps that committed since the last call (cheap; never blocks)."""
        with self._lock:
            done, self._finished = self._finished, []
        return sorted(done)

    def wait_staged(self) -> None:
        """Wait until every save in flight has copied the state it was given, so the
        training loop may change it (``AsyncOptions.background_staging``; call it
        before ``optimizer.step()``). Returns at once without background staging."""
        self._checkpointer.wait_staged()

    def wait_until_finished(self, backup_timeout: float | None = None) -> None:
        """Wait for every save in flight, then for the promotions of local steps, then
        for the backups of every committed step; raise the first error not yet
        reported.

        A job that ends with this call and exits has its promoted steps on the root
        and every step on every backup target (each copy is bounded by the retry
        policy's attempts and timeouts). A local save that failed because the local
        disk filled up is not raised (it was logged, and later saves bypass the
        local tier).

        Args:
            backup_timeout: Seconds to wait for backups (None: until they end).

        Raises:
            BackupError: A backup target could not be brought up to date (named).
            TimeoutError: Backups still running after ``backup_timeout``.
        """
        try:
            self._raise_unreported(self._checkpointer.wait_until_finished)
            with self._lock:
                promotions = list(self._promotions)
            concurrent.futures.wait(promotions)
            self._raise_promotion_error()
        finally:
            if self._replicator is not None:
                self._replicator.wait(backup_timeout)

    def check_for_errors(self) -> None:
        """Raise the oldest unreported error of a finished save or promotion (each once)."""
        self._raise_unreported(self._checkpointer.check_for_errors)
        self._raise_promotion_error()

    def _raise_unreported(self, call: Callable[[], None]) -> None:
        """``call()``, skipping the local disk-full failures already logged."""
        while True:
            try:
                call()
                return
            except BaseException as exc:
                with self._lock:
                    absorbed = any(exc is a for a in self._absorbed)
                    if absorbed:
                        self._absorbed = [a for a in self._absorbed if a is not exc]
                if not absorbed:
                    raise
                call = self._checkpointer.check_for_errors

    def _raise_promotion_error(self) -> None:
        with self._lock:
            self._promotions = [p for p in self._promotions if not p.done()]
            if not self._promotion_errors:
                return
            exc = self._promotion_errors.pop(0)
        raise exc

    def tier_status(self) -> TierStatus:
        """How far the root (the durable tier) trails this rank's local tier.

        Raises:
            ConfigurationError: The manager has no local tier.
        """
        if self.local is None or self._promoter is None:
            raise ConfigurationError("tier_status needs a local tier (local=LocalTier(...))")
        now = time.time()
        with self._lock:
            local_latest = max(self._local_steps, default=None)
            durable_latest = max(self._steps, default=None)
            behind = [
                s
                for s in self._to_promote
                if s in self._local_steps and (durable_latest is None or s > durable_latest)
            ]
            oldest = min((self._local_steps[s] for s in behind), default=now)
        return TierStatus(
            path=self.local.location.url,
            local_latest=local_latest,
            durable_latest=durable_latest,
            steps_behind=len(behind),
            seconds_behind=max(0.0, now - oldest),
            promoting=self._promoter.running(),
            last_time_to_durable=self._last_durable_s,
            degraded=self._degraded or self._last_bypass,
            error=self._promotion_error,
        )

    # -- loading ----------------------------------------------------------------------------
    def load(
        self,
        state_dict: dict[str, Any],
        step: int | None = None,
        *,
        read: ReadOptions | None = None,
    ) -> int:
        """Load ``step`` (the latest committed when None) into ``state_dict`` in place.

        The primary is read first. When the step is missing there, or an object
        fails its size/CRC32C check, or the primary cannot be reached, the first
        backup holding the step is used instead, and the log says which. With
        ``step=None`` and no step on the primary, the newest backed-up step loads.

        In a process group every rank must call it together: rank 0 lists and picks
        the step, reads each manifest once and shares it, and a failure on any rank
        moves every rank to the next source, so all ranks load the same step from
        the same place.

        Returns the step loaded.

        Raises:
            CheckpointNotFoundError: No committed step (or not this one) anywhere.
            IntegrityError: An object fails its check on the primary and every backup.
        """
        try:
            return self._load(state_dict, step, read)
        finally:
            self._checkpointer.start_workers()

    def _load(self, state_dict: dict[str, Any], step: int | None, read: ReadOptions | None) -> int:
        if step is not None:
            return self._load_step(step, state_dict, read)
        newest, durable = self._on_rank0(self._newest_steps)
        try:
            return self._load_step(newest, state_dict, read)
        except (CheckpointNotFoundError, IntegrityError, ManifestError, StoreError) as exc:
            if durable is None or durable == newest:
                raise
            logger.warning(
                "step %d (local tier) cannot be loaded everywhere (%s); loading step %d, "
                "the newest durable one",
                newest,
                exc,
                durable,
            )
            return self._load_step(durable, state_dict, read)

    def _load_step(self, step: int, state_dict: dict[str, Any], read: ReadOptions | None) -> int:
        """Load ``step`` from the root, then each backup: every object from this
        node's local copy first when there is one."""
        local = self.local_step_url(step)
        roots = [self.root] + [b.location for b in self.backups]
        failures: list[BaseException] = []
        for i, root in enumerate(roots):
            url = root.child(step_name(step)).url
            try:
                self._load_from(url, root.storage_options, state_dict, read, local)
            except (CheckpointNotFoundError, IntegrityError, ManifestError, StoreError) as exc:
                failures.append(exc)
                if i + 1 < len(roots):
                    logger.warning(
                        "cannot load step %d from %s (%s); trying its backup", step, url, exc
                    )
                continue
            if i:
                logger.warning(
                    "loaded step %d from backup %s because the primary failed: %s",
                    step,
                    url,
                    failures[0],
                )
            return step
        if len(failures) > 1:
            failures[0].add_note(
                "backups tried: " + "; ".join(f"{type(e).__name__}: {e}" for e in failures[1:])
            )
        raise failures[0]

    def _newest_steps(self) -> tuple[int, int | None]:
        """Rank 0: the newest committed step on any tier, and the newest durable one
        (primary, then backups), listed now."""
        found = self._list_primary()
        local = self._list_local()
        with self._lock:
            self._steps.update({s.step: s for s in found})
            self._local_steps.update({s.step: s.modified or time.time() for s in local})
        durable = max((s.step for s in found), default=None)
        if durable is None and self.backups:
            durable = self._newest_backed_up()
        candidates = [s.step for s in local] + ([durable] if durable is not None else [])
        newest = max(candidates, default=None)
        if newest is None:
            where = self.root.url
            if self.local is not None:
                where += f" or on the local tier {self.local.location.url}"
            raise CheckpointNotFoundError(f"no committed step under {where}")
        return newest, durable

    def _newest_backed_up(self) -> int | None:
        newest = None
        for target in self.backups:
            try:
                steps = [s.step for s in committed_steps(target.location)]
            except StoreError as exc:
                logger.warning("cannot list backup %s: %s", target.url, exc)
                continue
            if steps and (newest is None or max(steps) > newest):
                newest = max(steps)
        return newest

    def _load_from(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        state_dict: dict[str, Any],
        read: ReadOptions | None,
        local: str | None = None,
    ) -> None:
        distributed = is_distributed()
        # With a group, rank 0 reads the manifest and the others receive it: one GET
        # per job, and a missing or damaged manifest fails every rank alike, so all
        # ranks move to the same backup together.
        reader = ObjectStoreReader(
            url,
            storage_options=storage_options,
            read=read,
            retry=self.retry,
            broadcast=distributed,
            process_group=self.process_group,
            allow_stock=False,  # a step exists only once its manifest is committed
            local=local,
        )
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    state_dict,
                    storage_reader=reader,
                    process_group=self.process_group,
                    no_dist=not distributed,
                )
        except BaseException as exc:
            logger.info("load of %s failed on this rank after %s", url, reader.requests.summary())
            mismatch = _size_mismatch(exc)
            if mismatch is not None:
                raise StateDictMismatchError(
                    f"the state dict does not fit {url}: {mismatch}"
                ) from exc
            inner = unwrap(exc)
            if inner is exc:
                raise
            raise inner from exc
        logger.info(
            "loaded %s; this rank's load cost %s%s",
            url,
            reader.requests.summary(),
            f" and {reader.local_bytes_read} bytes from {local}" if local else "",
        )

    # -- backups ----------------------------------------------------------------------------
    def backup_status(self) -> list[BackupStatus]:
        """How far each backup trails the primary (steps and seconds). Coordinator only."""
        self._coordinator_only("backup_status")
        if self._replicator is None:
            return []
        with self._lock:
            steps = list(self._steps.values())
        return self._replicator.status(steps)

    def wait_for_backups(self, timeout: float | None = None) -> None:
        """Wait until every committed step handed to the backups is there.

        Raises:
            TimeoutError: Backups still running after ``timeout`` seconds.
            BackupError: A target could not be brought up to date.
        """
        if self._replicator is not None:
            self._replicator.wait(timeout)

    def _catch_up(self, replicator: Replicator) -> None:
        """At start: back up the newest primary step where a target lacks it."""
        latest = self.latest_step()
        if latest is None:
            return
        if replicator.lacking(latest):
            replicator.submit(latest)

    # -- deleting ---------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete one step (manifest first). Coordinator only.

        Raises:
            CheckpointNotFoundError: Nothing is stored for ``step``.
        """
        self._coordinator_only("delete")
        delete_step(self.root.child(step_name(step)))
        with self._lock:
            self._steps.pop(step, None)
        logger.info("deleted step %d under %s", step, self.root.url)

    def gc(self, *, grace: float = DEFAULT_GRACE, dry_run: bool = True) -> GcReport:
        """Find (and with ``dry_run=False``, remove) objects no committed manifest names
        and open uploads older than ``grace``. A dry run by default, as
        :func:`~objckpt.ops.gc.collect_garbage` and ``objckpt gc`` (without ``--apply``)."""
        self._coordinator_only("gc")
        return collect_garbage(self.root, grace=grace, dry_run=dry_run)

    def _coordinator_only(self, what: str) -> None:
        if self.rank != 0:
            raise ConfigurationError(
                f"{what} runs on the coordinator (rank 0), not rank {self.rank}"
            )

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for saves in flight and their backups, then stop the workers (errors
        stay for check_for_errors and wait_for_backups)."""
        try:
            self._checkpointer.wait_all()
            with self._lock:
                promotions = list(self._promotions)
            concurrent.futures.wait(promotions)
            if self._promoter is not None:
                self._promoter.close()
        finally:
            if self._promotion_pool is not None:
                self._promotion_pool.close()
            self._checkpointer.close()
            if self._replicator is not None:
                self._replicator.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
