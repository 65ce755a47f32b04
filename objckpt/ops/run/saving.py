"""The save path of a run: one manager save as its phases, top to bottom.

:meth:`SaveFlow.save` is the whole sequence in one function (order, where it goes,
stage -> agree -> plan or replay -> queue, commit, after the commit), each phase a
named call; the parts it calls hold state, not the sequence. A save goes to this
node's local tier when there is one and every rank has room, to the root otherwise
(:meth:`LocalTierControl.place <objckpt.ops.run.local_tier.LocalTierControl.place>`
decides, with every rank). What follows the save is handed to its handle when it is
built (a :class:`~objckpt.pipeline.handle.SaveLifecycle`), so the handle reports it
done only after that has happened: a local save is recorded, maybe promoted and
pruned (:mod:`objckpt.ops.run.local_tier`); a save to the root is recorded, backed up
and retention applied (:mod:`objckpt.ops.run.durable`).

Errors of finished saves and promotions are raised once each, from the training
loop's next check; a local save that failed because the disk filled up or the tier
refused the write is logged instead (later saves bypass the local tier), never raised.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from objckpt.dcp.collective import Collectives
from objckpt.dcp.torch_errors import unwrap
from objckpt.errors import ConfigurationError
from objckpt.format.steps import StepPlaces
from objckpt.ops.run.catalog import StepCatalog
from objckpt.ops.run.durable import DurableSteps
from objckpt.ops.run.local_tier import LocalTierControl
from objckpt.ops.tier.peers import Peers
from objckpt.ops.tier.tiers import LocalTier
from objckpt.options import AsyncOptions, UploadOptions
from objckpt.pipeline.checkpointer import AsyncCheckpointer
from objckpt.pipeline.handle import SaveHandle, SaveLifecycle
from objckpt.writers.retry import RetryPolicy

__all__ = ["SaveFlow", "Where"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Where:
    """Where one save goes, as every rank agreed.

    Attributes:
        places: The step's directories (built once, by the catalog).
        local: Whether the save goes to the local tier.
        promotion: A local save picked for promotion: ends once it is durable.
        replication: A local save other nodes copy: ends with whether they hold it.
        base: A save to the root: the committed step whose unchanged items it
            references (None: it uploads everything).
    """

    places: StepPlaces
    local: bool
    promotion: concurrent.futures.Future[None] | None = None
    replication: concurrent.futures.Future[bool] | None = None
    base: StepPlaces | None = None

    @property
    def url(self) -> str:
        """This rank's target: its local tier's step directory, or the root's."""
        local = self.places.local
        return local.url if self.local and local is not None else self.places.root.url


class SaveFlow:
    """Starts a run's saves and follows each to its end.

    Args:
        catalog: The run's steps (step URLs; commits are recorded there).
        durable: What follows a commit on the root.
        local: This rank's local tier, or None.
        storage_options, upload, async_options, retry: The checkpointer's.
        start_workers: Start the upload workers now (False: at the first save or
            ``start_workers()``).
        rank, world, distributed: Who saves together.
        collectives: The collectives of the group that saves together (the manager's).
        reuse_unchanged: Each save to the root references the items whose bytes
            equal the latest committed step's (its base, rank 0's choice on every
            rank), which retention and ``delete`` spare until the save ends
            (``DurableSteps.hold_base``).
    """

    def __init__(
        self,
        catalog: StepCatalog,
        durable: DurableSteps,
        *,
        local: LocalTier | None,
        storage_options: Mapping[str, Any],
        upload: UploadOptions | None,
        async_options: AsyncOptions | None,
        retry: RetryPolicy,
        start_workers: bool,
        rank: int,
        world: int,
        collectives: Collectives,
        distributed: bool,
        reuse_unchanged: bool = True,
        peers: Peers | None = None,
    ) -> None:
        if not isinstance(reuse_unchanged, bool):
            raise ConfigurationError(
                f"option reuse_unchanged={reuse_unchanged!r} is invalid: expected True or False"
            )
        self._catalog = catalog
        self._reuse = reuse_unchanged
        self._durable = durable
        self._group = collectives.group
        self._rank = rank
        self.checkpointer = AsyncCheckpointer(
            storage_options=storage_options,
            upload=upload,
            async_options=async_options,
            retry=retry,
            start_workers=start_workers,
        )
        self.local: LocalTierControl | None = None
        if local is not None:
            self.local = LocalTierControl(
                local,
                catalog,
                upload=self.checkpointer.upload,
                options=self.checkpointer.options,
                rank=rank,
                world=world,
                collectives=collectives,
                distributed=distributed,
                on_durable=durable.committed,
                peers=peers,
            )

    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        user_metadata: Mapping[str, Any] | None,
        promote: bool | None,
        *,
        loaded: int | None,
    ) -> SaveHandle:
        """Save ``step`` (see :meth:`objckpt.CheckpointManager.save`), phase by phase.

        One manager save, top to bottom, each phase a named call:

        1. order and places: a step below the run's newest is refused (every rank
           alike), else the step's directories are derived, once
           (:meth:`StepCatalog.begin`): every later phase receives that
           :class:`~objckpt.format.steps.StepPlaces` and derives none;
        2. where it goes: the local tier or the root (:meth:`_where`);
        3. stage -> agree -> plan or replay -> queue: ``AsyncCheckpointer.save``
           (:func:`objckpt.pipeline.save_phases.run_save`), on the caller's thread;
        4. commit: in the background (:mod:`objckpt.pipeline.commit_phase`); the
           coordinator then runs the save's commit hook (:meth:`_after_save` names
           it): a step on the root is recorded, backed up and retention applied
           (:meth:`DurableSteps.committed`); a local one hands out the ranks'
           index objects (:meth:`LocalTierControl.hand_out_index`);
        5. after the commit, on every rank, before the handle reports it
           (:meth:`_after_save` names it): a save to the root releases its base and
           is recorded (:meth:`_after_root_save`); a local save is recorded, promoted
           and local retention applied (:meth:`LocalTierControl.after_save`).

        ``loaded`` is the step the manager's last load returned (named by a refusal).
        """
        places = self._catalog.begin(step, loaded=loaded)  # every rank alike
        where = self._where(places, state_dict, promote)
        release = None if where.base is None else self._durable.hold_base(where.base.step)
        try:
            self.checkpointer.start_workers()  # no load came first
            return self.checkpointer.save(
                state_dict,
                where.url,
                process_group=self._group,
                user_metadata=user_metadata,
                checkpoint_id=places.root.url,  # what DCP records, wherever it goes
                exists=self._committed(where),
                reuse_from=None if where.base is None else where.base.root.url,
                lifecycle=self._after_save(where, release),
            )
        except BaseException as exc:  # nothing was queued: undo what _where started
            if release is not None:
                release()
            if where.local and self.local is not None:
                self.local.abandon(step, where.promotion, where.replication)
            inner = unwrap(exc)
            if inner is exc:
                raise
            raise inner from exc

    def _where(
        self, places: StepPlaces, state_dict: Mapping[str, Any], promote: bool | None
    ) -> Where:
        """Where the save of ``places.step`` goes (every rank alike: one all-reduce with
        a local tier), whether a local save is promoted, and a root save's base."""
        if self.local is not None:
            local = self.local.place(places, state_dict, promote)
            if local is not None:
                promotion, replication = local
                return Where(places, local=True, promotion=promotion, replication=replication)
        return Where(places, local=False, base=self._base(places.step))

    def _after_save(self, where: Where, release: Callable[[], None] | None) -> SaveLifecycle:
        """What runs when the save commits (the coordinator) and when it ends (every
        rank), in order, before its handle reports it."""
        local = self.local
        if where.local and local is not None:
            return SaveLifecycle(
                tier="local",
                promotion=where.promotion,
                replication=where.replication,
                on_commit=lambda manifest: local.hand_out_index(where.places, manifest),
                on_end=(
                    lambda h, exc: local.after_save(
                        where.places, h, exc, where.promotion, where.replication
                    ),
                ),
            )
        return SaveLifecycle(
            on_commit=lambda manifest: self._durable.committed(where.places, manifest),
            on_end=(lambda h, exc: self._after_root_save(where, release, h, exc),),
        )

    def _after_root_save(
        self,
        where: Where,
        release: Callable[[], None] | None,
        handle: SaveHandle,
        exc: BaseException | None,
    ) -> None:
        """A save to the root ended, on every rank: its base is released (retention
        may drop it now), what it wrote is the next save's base once committed, and
        the step is recorded (the coordinator backed it up and applied retention at
        its commit, the save's ``on_commit``: :meth:`DurableSteps.committed`). Each
        runs even when one before it failed."""
        try:
            if release is not None:
                release()
        finally:
            try:
                if self._reuse:
                    if exc is None:
                        self.checkpointer.reuse_memory.committed(where.url)
                    else:
                        self.checkpointer.reuse_memory.forget(where.url)
            finally:
                if exc is None:
                    self._catalog.finished(where.places.step)
                    if self._rank != 0:  # the coordinator recorded it at its commit
                        self._catalog.add_durable(where.places)

    def _base(self, step: int) -> StepPlaces | None:
        """The step a save of ``step`` to the root reuses from: the newest step
        committed on the root below it (None: reuse is off, or there is none).
        Saves to the local tier upload everything (their base would be on another
        node's disk for some ranks).

        Rank 0 decides, as for :meth:`_committed`: its choice travels in the save's
        agreement and every rank references that step, the one rank 0's retention
        spares (the other ranks' catalogs learn of commits later, and of deletions
        never)."""
        if not self._reuse or self._rank != 0:
            return None
        latest = self._catalog.latest(durable=True)
        return self._catalog.places(latest) if latest is not None and latest < step else None

    def _committed(self, where: Where) -> bool:
        """Whether the step is committed where this save goes (``where``), from the step catalog
        (listed at start, kept up to date): no request in ``save()``. Rank 0 decides,
        as it decides every multi-rank question (its True refuses the save on every
        rank); a writer the catalog does not know about loses at the commit instead,
        to the create-only manifest."""
        if self._rank != 0:
            return False
        steps = self._catalog.local_steps() if where.local else self._catalog.durable_steps()
        return where.places.step in steps

    # -- errors -----------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for every save in flight, then for the promotions started (their errors
        stay for :meth:`check_for_errors`)."""
        self.checkpointer.wait_all()
        if self.local is not None:
            self.local.wait_promotions()

    def wait_until_finished(self) -> None:
        """Wait for every save in flight, then for the promotions; raise the first
        error not yet reported."""
        self._raise_unreported(self.checkpointer.wait_until_finished)
        if self.local is not None:
            self.local.wait_promotions()
            self.local.raise_promotion_error()

    def check_for_errors(self) -> None:
        """Raise the oldest unreported error of a finished save or promotion."""
        self._raise_unreported(self.checkpointer.check_for_errors)
        if self.local is not None:
            self.local.raise_promotion_error()

    def _raise_unreported(self, call: Callable[[], None]) -> None:
        """``call()``, skipping the local failures already logged (full, refused)."""
        while True:
            try:
                call()
                return
            except BaseException as exc:
                if self.local is None or not self.local.absorbed(exc):
                    raise
                call = self.checkpointer.check_for_errors

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for saves and promotions in flight, then stop every worker."""
        try:
            self.checkpointer.wait_all()
            if self.local is not None:
                self.local.drain()
        finally:
            if self.local is not None:
                self.local.close()
            self.checkpointer.close()
