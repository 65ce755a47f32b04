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
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from objckpt.dcp.collective import broadcast_from_rank0, is_distributed
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
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepInfo, parse_step, step_name
from objckpt.ops.backup import BackupStatus, BackupTarget, Replicator, committed_steps
from objckpt.ops.gc import DEFAULT_GRACE, GcReport, collect_garbage, delete_step
from objckpt.ops.retention import RetentionPolicy
from objckpt.options import AsyncOptions, ReadOptions, UploadOptions
from objckpt.pipeline.checkpointer import AsyncCheckpointer
from objckpt.pipeline.handle import SaveHandle
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

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
    ) -> None:
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
        self._lock = threading.RLock()
        self._steps: dict[int, StepInfo] = {}
        self._finished: list[int] = []
        self.backups = tuple(self._target(b) for b in backups)
        self._replicator: Replicator | None = None
        if self.backups and self.rank == 0:
            self._replicator = Replicator(
                self.root, self.backups, retention=self.retention, on_done=self._after_backup
            )
        self.reload()
        if self._replicator is not None:
            self._replicator.scan()
            self._catch_up(self._replicator)
        self._checkpointer = AsyncCheckpointer(
            storage_options=self.storage_options,
            upload=upload,
            async_options=async_options,
            on_commit=self._on_commit,
            retry=self.retry,
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
        found = self._on_rank0(self._list_primary)
        with self._lock:
            self._steps = {s.step: s for s in found}

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
        """Committed steps, ascending."""
        with self._lock:
            return sorted(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        with self._lock:
            return max(self._steps) if self._steps else None

    def step_url(self, step: int) -> str:
        return self.root.child(step_name(step)).url

    # -- saving -----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Start saving ``state_dict`` as ``step``; returns once it is staged.

        Raises:
            CheckpointExistsError: ``step`` is already committed.
            ConfigurationError, StateDictError, StoreError: before any upload.
        """
        url = self.step_url(step)
        try:
            handle = self._checkpointer.save(
                state_dict, url, process_group=self.process_group, user_metadata=user_metadata
            )
        except BaseException as exc:
            inner = unwrap(exc)
            if inner is exc:
                raise
            raise inner from exc
        handle.add_done_callback(lambda h: self._on_done(step, h))
        return handle

    def _on_done(self, step: int, handle: SaveHandle) -> None:
        if handle.exception() is not None:
            return
        with self._lock:
            self._finished.append(step)
            if self.rank != 0:  # others learn of the commit, and of retention, here
                self._steps[step] = StepInfo(step, self.step_url(step), True, 0, 0, time.time())
                for old in self.retention.to_delete(list(self._steps.values()), time.time()):
                    self._steps.pop(old, None)  # the coordinator deletes it

    def _on_commit(self, url: str, manifest: Manifest) -> None:
        """Coordinator, background thread: record the step, then apply retention."""
        step = parse_step(url)
        if step is None:
            return
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

    def wait_until_finished(self, backup_timeout: float | None = None) -> None:
        """Wait for every save in flight and then for the backups of every committed
        step; raise the first error not yet reported.

        A job that ends with this call and exits has its steps on every backup target
        (each copy is bounded by the retry policy's attempts and timeouts).

        Args:
            backup_timeout: Seconds to wait for backups (None: until they end).

        Raises:
            BackupError: A backup target could not be brought up to date (named).
            TimeoutError: Backups still running after ``backup_timeout``.
        """
        try:
            self._checkpointer.wait_until_finished()
        finally:
            if self._replicator is not None:
                self._replicator.wait(backup_timeout)

    def check_for_errors(self) -> None:
        """Raise the oldest unreported error of a finished save (each once)."""
        self._checkpointer.check_for_errors()

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
        if step is None:
            step = self._on_rank0(self._newest_step)
        roots = [self.root] + [b.location for b in self.backups]
        failures: list[BaseException] = []
        for i, root in enumerate(roots):
            url = root.child(step_name(step)).url
            try:
                self._load_from(url, root.storage_options, state_dict, read)
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

    def _newest_step(self) -> int:
        """Rank 0: the newest committed step, listed now (primary, then backups)."""
        found = self._list_primary()
        with self._lock:
            self._steps.update({s.step: s for s in found})
        step = max((s.step for s in found), default=None)
        if step is None and self.backups:
            step = self._newest_backed_up()
        if step is None:
            raise CheckpointNotFoundError(f"no committed step under {self.root.url}")
        return step

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
        logger.info("loaded %s; this rank's load cost %s", url, reader.requests.summary())

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
        self._checkpointer.close()
        if self._replicator is not None:
            self._replicator.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
