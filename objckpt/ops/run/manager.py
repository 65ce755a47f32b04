"""``CheckpointManager``: steps under a root, async saves, retention, resume.

The glue every training loop writes around DCP, done once and carefully:

* step N lives at ``<root>/step-<N, 10 digits>/`` and exists once its manifest is
  committed, so ``latest_step()`` never names a half-written step;
* saves are async (:class:`~objckpt.AsyncCheckpointer`: one staging area and one
  set of upload workers for the run) and reference unchanged bytes of the last step;
* retention runs on the coordinator after a step commits, over committed steps
  only, and never deletes the last good step before a newer one is committed.

Every rank of a process group builds its own manager with the same arguments
and calls ``save`` together; only the coordinator (rank 0) deletes and makes
backups (:mod:`objckpt.ops.run.backup`). ``load`` falls back to the first backup that
holds the step when the primary lacks it or fails verification.

With ``local=LocalTier(...)`` every save commits to node-local disk first and
every K-th is promoted to the root in the background (:mod:`objckpt.ops.tier.tiers`,
:mod:`objckpt.ops.tier.promote`); ``load`` then reads each object from this node's
copy when it holds it intact, from the root (then the backups) otherwise.

A facade holding each public method's contract over parts that own their state:
:mod:`~objckpt.ops.run.catalog`, :mod:`~objckpt.ops.run.saving` (with
:mod:`~objckpt.ops.run.local_tier`), :mod:`~objckpt.ops.run.durable`,
:mod:`~objckpt.ops.run.restore`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from objckpt._removed import MANAGER, removed_keywords
from objckpt.dcp.collective import Collectives
from objckpt.errors import ConfigurationError
from objckpt.ops.maintain.gc import DEFAULT_GRACE, GcReport, collect_garbage
from objckpt.ops.maintain.retention import RetentionPolicy
from objckpt.ops.run.backup import BackupStatus, BackupTarget
from objckpt.ops.run.catalog import StepCatalog
from objckpt.ops.run.config import load_config
from objckpt.ops.run.durable import DurableSteps
from objckpt.ops.run.restore import Restorer
from objckpt.ops.run.rollback import discard_after, judge_copy
from objckpt.ops.run.saving import SaveFlow
from objckpt.ops.tier.local_disk import sweep
from objckpt.ops.tier.peers import Peers
from objckpt.ops.tier.tiers import LocalTier, TierStatus
from objckpt.options import AsyncOptions, ReadOptions, UploadOptions
from objckpt.pipeline.handle import SaveHandle
from objckpt.pipeline.lifetime import run_bounded
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

__all__ = ["CheckpointManager"]

_READ_DEFAULTS = ReadOptions()


@removed_keywords(MANAGER)
class CheckpointManager:
    """Numbered steps of one training run under ``root_url``.

    Args:
        root_url: Where steps live (``s3://bucket/run-1``).
        storage_options: Passed untouched to fsspec.
        retention: Which committed steps to keep
            (:class:`~objckpt.RetentionPolicy`; default: keep every step). One value,
            as in the config file and on each :class:`~objckpt.ops.run.backup.BackupTarget`.
        process_group: The group that saves together (default: the default group).
        upload: Object and part sizing for the upload workers.
        async_options: Workers, saves in flight, barrier timeout, staging budget.
        backups: Backup roots (URLs or :class:`~objckpt.ops.run.backup.BackupTarget`);
            each committed step is copied there in the background by rank 0. A
            plain URL on the primary's protocol is reached with ``storage_options``.
        retry: How every store request is retried (:class:`~objckpt.RetryPolicy`).
        local: A :class:`~objckpt.LocalTier`: saves commit on this node's disk first
            and every ``promote_every``-th is promoted to ``root_url``. Each rank
            passes its own node's directory.
        reuse_unchanged: Reference unchanged items of the latest step (guides/reuse.md).

    Raises:
        ConfigurationError: Bad URL or option.
        StoreError: The root cannot be listed (at construction).
    """

    def __init__(
        self,
        root_url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        retention: RetentionPolicy | None = None,
        process_group: Any | None = None,
        upload: UploadOptions | None = None,
        async_options: AsyncOptions | None = None,
        backups: Sequence[str | BackupTarget] = (),
        retry: RetryPolicy | None = None,
        local: LocalTier | None = None,
        reuse_unchanged: bool = True,
    ) -> None:
        self.process_group = process_group
        # The manager's collectives (and their side group, if one is needed), lent
        # to its catalog, restorer, saves and rollbacks.
        self._collectives = Collectives(process_group)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world = dist.get_world_size(process_group) if distributed else 1
        # What each rank checks on its own ends in one outcome for all (fail_together):
        # a rank that raised here would leave the others in the first collective.
        failure: BaseException | None = None
        try:
            if local is not None and not isinstance(local, LocalTier):
                raise ConfigurationError(
                    f"option local={local!r} is invalid: expected objckpt.LocalTier(path, ...)"
                )
            if local is not None and upload is not None and upload.persistent_prefixes:
                # The node tier keeps each step in one directory of the node's disk
                # (its replication, promotion and restore walk it), and a promoted
                # step keeps the keys it was saved with.
                raise ConfigurationError(
                    "option persistent_prefixes=True (UploadOptions) is not supported with "
                    "a local tier (local=LocalTier(...)) yet: use prefix_entropy alone"
                )
            self.retention = retention or RetentionPolicy()
            self.retry = retry or RetryPolicy()
            self.root = Location.parse(root_url, storage_options, self.retry)
            self.backups = tuple(
                BackupTarget.beside(b, self.root, storage_options or {}) for b in backups
            )
        except Exception as exc:
            failure = exc
        self._collectives.fail_together(failure, f"opening the CheckpointManager of {root_url}")
        self.storage_options = dict(storage_options or {})
        self.local = local
        self._loaded: int | None = None  # the step the last load returned (every rank alike)
        self._catalog = StepCatalog(
            self.root,
            retention=self.retention,
            local=local.location if local is not None else None,
            backups=self.backups,
            collectives=self._collectives,
        )
        # Replicas need every rank's node and a gloo group of their own, both made
        # here, on every rank at once (collectives), never from a background thread.
        self._peers = (
            Peers.start(self._collectives, local.replication_timeout, os.fspath(local.path))
            if local is not None and local.replicas > 1 and distributed
            else None
        )
        self._restorer = Restorer(
            self._catalog,
            retry=self.retry,
            collectives=self._collectives,
            peers=self._peers,
            tier=local,
            on_loaded=lambda url, m: self._checkpointer.reuse_memory.loaded(url, m),
        )
        self._durable = DurableSteps(self._catalog, rank=self.rank)
        self.reload()
        if local is not None:
            # Every rank agrees; the steps committed on any node's tier are the run's
            # local steps (rank 0's own tier may not hold them all: it may run on
            # another node than before, or on a replacement).
            # A node that was away during a discard_after still holds the steps it
            # discarded: the rollback records (read by rank 0) say which.
            records = self._collectives.from_rank0(self._restorer.rollback_records)
            judge = functools.partial(judge_copy, records) if records else None
            on_nodes, discarded = sweep(
                local, self._catalog.durable_steps(), self._collectives, judge
            )
            self._catalog.note_local(on_nodes, discarded=discarded)
        # With a step to resume from, the job loads first: the upload workers (an
        # interpreter importing torch each) start once the load is done, not while
        # it runs on the same cores; without one they start now, well before the
        # first save.
        try:
            self._durable.start()
            self._saves = SaveFlow(
                self._catalog,
                self._durable,
                local=local,
                storage_options=self.storage_options,
                upload=upload,
                async_options=async_options,
                retry=self.retry,
                start_workers=self.latest_step() is None,
                rank=self.rank,
                world=self.world,
                collectives=self._collectives,
                distributed=distributed,
                reuse_unchanged=reuse_unchanged,
                peers=self._peers,
            )
        except Exception as exc:
            failure = exc
        try:
            self._collectives.fail_together(
                failure, f"starting the CheckpointManager of {root_url}"
            )
        except BaseException:
            if failure is None:  # another rank failed: stop what started here
                self._saves.close()
            self._durable.close()
            raise
        self._checkpointer = self._saves.checkpointer  # staging and the upload workers

    @classmethod
    def from_config(cls, path: str, **overrides: Any) -> CheckpointManager:
        """A manager built from a TOML config file (see :mod:`objckpt.ops.run.config`)."""
        config = load_config(path)
        return cls(config.root, **{**config.manager_options(), **overrides})

    # -- steps ------------------------------------------------------------------------------
    def reload(self) -> None:
        """Re-list the root (steps committed by another process show up).

        In a process group only rank 0 lists and the others receive its answer
        (one LIST per job instead of one per rank, and one picture for all), so
        every rank must call it together, as the constructor does.

        With backups configured, an unreachable primary is a warning (loading can
        still fall back to a backup); without, it raises :class:`StoreError`.
        """
        self._catalog.reload()

    def all_steps(self) -> list[int]:
        """Steps committed on the root (durable), ascending."""
        return self._catalog.durable_steps()

    def local_steps(self) -> list[int]:
        """Steps committed on the local tier, ascending: the coordinator's tier, and
        at start every node's (the agreed sweep; rank 0 may run on another node
        than before)."""
        return sorted(self._catalog.local_steps())

    def latest_step(self, *, durable: bool = False) -> int | None:
        """The newest committed step, or None when there is none.

        Args:
            durable: Only steps committed on the root. False: a step committed
                only on the local tier counts too (it loads on the nodes that
                hold it, or wherever the root holds the rest).
        """
        return self._catalog.latest(durable=durable)

    def step_url(self, step: int) -> str:
        return self._catalog.step_url(step)

    def local_step_url(self, step: int) -> str | None:
        """This rank's local copy of ``step`` (None without a local tier)."""
        return self._catalog.local_step_url(step)

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

        A step below the newest committed or saved is refused (:meth:`discard_after`).

        Raises:
            CheckpointExistsError: ``step`` is already committed.
            StepOrderError: ``step`` is below the newest step of the run.
            ConfigurationError, StateDictError, StoreError: before any upload.
        """
        # The save's phases, top to bottom, are in one function: SaveFlow.save.
        return self._saves.save(step, state_dict, user_metadata, promote, loaded=self._loaded)

    def maybe_finalize(self) -> list[int]:
        """Steps that committed since the last call (cheap; never blocks)."""
        return self._catalog.take_finished()

    def wait_staged(self) -> None:
        """Wait until every save in flight has copied the state it was given, so the
        training loop may change it (``AsyncOptions.background_staging``; call it
        before ``optimizer.step()``). Returns at once without background staging."""
        self._checkpointer.wait_staged()

    def wait_until_finished(self, backup_timeout: float | None = None) -> None:
        """Wait for saves in flight, then promotions, then backups of every committed
        step; raise the first error not yet reported. A local save the local disk
        refused (full, read-only) is logged, not raised: later saves bypass the tier.

        Args:
            backup_timeout: Seconds to wait for backups (None: until they end).

        Raises:
            BackupError: A backup target could not be brought up to date (named).
            TimeoutError: Backups still running after ``backup_timeout``.
        """
        try:
            self._saves.wait_until_finished()
        finally:
            self._durable.wait_for_backups(backup_timeout)

    def check_for_errors(self) -> None:
        """Raise the oldest unreported error of a finished save or promotion (each once)."""
        self._saves.check_for_errors()

    def tier_status(self) -> TierStatus:
        """How far the root (the durable tier) trails this rank's local tier.

        Raises:
            ConfigurationError: The manager has no local tier.
        """
        if self._saves.local is None:
            raise ConfigurationError("tier_status needs a local tier (local=LocalTier(...))")
        return self._saves.local.status()

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
        the same place. Each source is read as a plain ``dcp.load`` with
        :class:`~objckpt.ObjectStoreReader` reads it (the manifest once per job,
        replicated items fetched once and broadcast), with ``read`` as its options.

        Returns the step loaded.

        Raises:
            CheckpointNotFoundError: No committed step (or not this one) anywhere.
            IntegrityError: An object fails its check on the primary and every backup.
            ConfigurationError: ``read`` sets what the manager decides itself
                (``broadcast``, ``allow_stock``, ``local``).
        """
        decided = [
            f"{name}={getattr(read, name)!r}"
            for name in ("broadcast", "allow_stock", "local")
            if read is not None and getattr(read, name) != getattr(_READ_DEFAULTS, name)
        ]
        if decided:  # the same on every rank, before any collective
            raise ConfigurationError(
                f"CheckpointManager.load(read=ReadOptions({', '.join(decided)})): the manager "
                "decides these itself (its process group, committed steps only, its local tier)"
            )
        try:
            if self._saves.local is not None:
                # A load's transfers and replication share the peers' group: one at a time.
                self._saves.local.wait_replications()
            loaded = self._restorer.load(state_dict, step, read)
            self._loaded = loaded.step
            if loaded.refill and self._saves.local is not None:
                # Every rank alike (rank 0 decided): its nodes' files go to their replica
                # nodes again, in the background, so the next node loss is covered too.
                self._saves.local.refill(loaded.step)
            return loaded.step
        finally:
            self._checkpointer.start_workers()

    # -- backups ----------------------------------------------------------------------------
    def backup_status(self) -> list[BackupStatus]:
        """How far each backup trails the primary (steps and seconds). Coordinator only."""
        self._coordinator_only("backup_status")
        return self._durable.backup_status()

    def wait_for_backups(self, timeout: float | None = None) -> None:
        """Wait until every committed step handed to the backups is there.

        Raises:
            TimeoutError: Backups still running after ``timeout`` seconds.
            BackupError: A target could not be brought up to date.
        """
        self._durable.wait_for_backups(timeout)

    # -- deleting ---------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete one step (manifest first). Coordinator only.

        Raises:
            CheckpointNotFoundError: Nothing is stored for ``step``.
        """
        self._coordinator_only("delete")
        self._durable.delete(step)

    def discard_after(self, step: int) -> list[int]:
        """Delete every committed step above ``step`` (root, copy backups, local tiers),
        so the steps saved from now on are the newest; returns them, ascending. Every
        rank calls it together (:mod:`objckpt.ops.run.rollback`).

        Raises:
            ConfigurationError, StoreError: a bad step; a deletion failed (every rank).
        """
        return discard_after(
            step, self._catalog, self._durable, self._saves, self.local, self._collectives
        )

    def gc(self, *, grace: float = DEFAULT_GRACE, dry_run: bool = True) -> GcReport:
        """Find (and with ``dry_run=False``, remove) objects no committed manifest names
        and open uploads older than ``grace``. A dry run by default, as
        :func:`~objckpt.ops.maintain.gc.collect_garbage` and ``objckpt gc`` (without
        ``--apply``)."""
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
        stay for check_for_errors and wait_for_backups).

        Bounded when saves have a deadline (``UploadOptions``): saves in flight by
        :meth:`AsyncCheckpointer.close`, promotions and backups one more deadline and
        30 s, replications to peer nodes their own bound per step not settled. What
        still runs then is logged and abandoned, never made visible.
        """
        deadline = self._checkpointer.upload.deadline
        settles_by = self._checkpointer.settles_by()
        timeout = None
        if deadline is not None and settles_by is not None:
            timeout = settles_by - time.monotonic() + deadline + 30.0
            if self._saves.local is not None:  # and each step still to replicate
                timeout += self._saves.local.replication_seconds_left()
        run_bounded(self._close, timeout, f"closing the CheckpointManager of {self.root.url}")

    def _close(self) -> None:
        try:
            self._saves.close()
        finally:
            self._durable.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
