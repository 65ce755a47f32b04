"""Running the local tier for one manager: where each save goes, and what happens after.

:mod:`objckpt.ops.tier.tiers` holds the values (:class:`~objckpt.LocalTier`,
:class:`~objckpt.TierStatus`) and the room checks; :mod:`objckpt.ops.tier.promote` copies
one step to the root. This module holds the bookkeeping between them, per rank:

* before a save: the local tier, or the root directly when any rank's tier is not
  writable, lacks room, holds a link at the step's name, or a local save once ran
  out of space or was refused (decided with every rank, so all ranks write to the
  same place; a training step never fails for the local tier);
* after a local commit: each rank keeps its own index object on its disk (handed
  out by the coordinator through the c10d store), every ``promote_every``-th step
  is promoted, and local retention keeps what ``LocalTier.retention`` keeps plus every
  step whose promotion is still running;
* at start: step directories no commit names (a save killed before its local
  commit) are swept away (:func:`objckpt.ops.tier.local_disk.sweep`, agreed by every
  rank; deleting only objckpt's own files, never through a link).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from objckpt._torch import group_store
from objckpt.dcp.collective import Collectives, is_distributed
from objckpt.format.layout import index_key, index_rank
from objckpt.format.manifest import Manifest
from objckpt.format.steps import StepPlaces, step_name
from objckpt.ops.run.catalog import StepCatalog
from objckpt.ops.tier.local_disk import (
    delete_local_step,
    list_tier,
    local_references,
    step_dir_refusal,
)
from objckpt.ops.tier.peers import Peers, replica_dir
from objckpt.ops.tier.promote import Promoter
from objckpt.ops.tier.replication import start_replication
from objckpt.ops.tier.tiers import (
    LocalTier,
    TierStatus,
    is_disk_full,
    is_not_writable,
    local_room,
    state_bytes,
)
from objckpt.options import AsyncOptions, UploadOptions
from objckpt.pipeline.handle import SaveHandle
from objckpt.pipeline.workers import WorkerPool
from objckpt.writers import open_store
from objckpt.writers.node_store import tier_store
from objckpt.writers.translate import describe

__all__ = ["LocalTierControl"]

logger = logging.getLogger(__name__)


class LocalTierControl:
    """One rank's local saves, their promotions and local retention.

    Promotions get worker processes of their own: sharing the save's workers would
    queue the next local save (the fast tier) behind a slow upload. They start with
    the first promotion, not here: a restart that loads at once should not share the
    CPU with interpreters starting.

    Args:
        tier: This rank's local tier.
        catalog: The run's steps (local commits are recorded there).
        upload: Part sizing for the promotions' copies.
        options: Worker counts and the barrier timeout of the saves.
        rank, world, distributed: Who saves together.
        collectives: The collectives of the group that saves together (the manager's).
        on_durable: Coordinator: called with (places, manifest) once a promoted
            step's manifest is committed on the root.
        peers: The job's peers (``LocalTier(replicas=)`` >= 2 in a process group):
            each local step is replicated to other nodes (:mod:`objckpt.ops.tier.replication`).
    """

    def __init__(
        self,
        tier: LocalTier,
        catalog: StepCatalog,
        *,
        upload: UploadOptions,
        options: AsyncOptions,
        rank: int,
        world: int,
        collectives: Collectives,
        distributed: bool,
        on_durable: Callable[[StepPlaces, Manifest], None],
        peers: Peers | None = None,
    ) -> None:
        self.tier = tier
        self._catalog = catalog
        self._rank = rank
        self._world = world
        self._collectives = collectives
        self._group = collectives.group
        self._timeout = options.barrier_timeout
        self._max_waiting = options.max_saves_in_flight
        self._lock = threading.Lock()
        self._saves = 0
        self._to_promote: set[int] = set()  # picked for promotion, not durable yet
        self._promotions: list[concurrent.futures.Future[None]] = []
        self._errors: list[BaseException] = []
        self._absorbed: list[BaseException] = []  # local disk-full/refused failures (warned)
        self._degraded: str | None = None  # why the local tier is off for good
        self._last_bypass: str | None = None
        self._last_durable_s: float | None = None  # save to durable, newest promotion
        self._last_error: str | None = None  # the last promotion's failure
        self._pool = WorkerPool(options.workers, slots=options.uploads_per_worker, name="promotion")
        self._promoter = Promoter(
            submit=self._pool.submit,
            upload=upload,
            rank=rank,
            world=world,
            process_group=collectives.group,
            distributed=distributed,
            timeout=options.barrier_timeout,
            on_durable=on_durable,
        )
        self._replicator = (
            None
            if peers is None
            else start_replication(
                tier,
                peers.group,
                peers.nodes,
                peers.group.rank,
                max_waiting=options.max_saves_in_flight,
                save_timeout=options.barrier_timeout,
                on_settled=lambda _step: self._apply_retention(),
            )
        )

    # -- a save -----------------------------------------------------------------------------
    def place(
        self, places: StepPlaces, state_dict: Mapping[str, Any], promote: bool | None
    ) -> (
        tuple[concurrent.futures.Future[None] | None, concurrent.futures.Future[bool] | None] | None
    ):
        """Whether a save of ``places.step`` goes to this tier (``places.local``): the
        future that ends once it is durable when it is picked for promotion, and the
        one that ends with whether other nodes hold it when the tier has replicas;
        None when the save must bypass the tier (decided with every rank: one
        all-reduce).

        A promotion picked here is running from now on (spared by local retention):
        the save's end settles it (:meth:`after_save`), or :meth:`abandon` when the
        save never started."""
        step = places.step
        bypass, backlog = self._target(places, state_dict)
        if bypass:
            return None
        replication: concurrent.futures.Future[bool] | None = None
        if self._replicator is not None:
            replication = concurrent.futures.Future()
            if backlog:  # every rank alike: decided with the placement's all-reduce
                self._replicator.refuse(
                    step,
                    f"{self._max_waiting} step(s) already wait to replicate on some rank "
                    f"(AsyncOptions.max_saves_in_flight={self._max_waiting})",
                )
                replication.set_result(False)
            else:  # every rank, in save order: the order the steps are exchanged in
                self._replicator.reserve(step, replication)
        if not self._pick(promote):  # every rank counts, whatever follows
            return None, replication
        promotion: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._to_promote.add(step)
            self._promotions.append(promotion)
        return promotion, replication

    def abandon(
        self,
        step: int,
        promotion: concurrent.futures.Future[None] | None,
        replication: concurrent.futures.Future[bool] | None = None,
    ) -> None:
        """The save of ``step`` :meth:`place` sent here failed to start: forget its
        promotion and replication (its error is the save's, raised to the caller).
        Its replication still walks its exchanges (sending that it has nothing), so
        the other ranks' order stays the same."""
        if replication is not None and self._replicator is not None:
            self._replicator.cancel(step, f"its save of step {step} did not start")
        if promotion is None:
            return
        with self._lock:
            self._to_promote.discard(step)
            self._promotions = [p for p in self._promotions if p is not promotion]
        promotion.cancel()

    def _target(self, places: StepPlaces, state_dict: Mapping[str, Any]) -> tuple[bool, bool]:
        """Whether the save of ``places.step`` must bypass the local tier, and whether
        ``max_saves_in_flight`` steps already wait to replicate on some rank (both
        decided with every rank: one all-reduce)."""
        assert places.local is not None  # the catalog of a run with a local tier
        why = (
            self._degraded
            or step_dir_refusal(places.local.path)
            or local_room(self.tier, state_bytes(state_dict))
        )
        full = self._replicator is not None and self._replicator.backlog_full()
        if is_distributed():
            bypass, backlog = self._collectives.all_reduce_max([int(why is not None), int(full)])
        else:
            bypass, backlog = int(why is not None), int(full)
        if not bypass:
            self._last_bypass = None
            return False, bool(backlog)
        why = why or "another rank's local tier cannot take this save"
        # Warned when the reason changes, not at every save while it lasts.
        log = logger.info if why == self._last_bypass else logger.warning
        log(
            "step %d goes to %s directly, not the local tier: %s",
            places.step,
            self._catalog.root.url,
            why,
        )
        self._last_bypass = why
        return True, False

    def _pick(self, promote: bool | None) -> bool:
        """Count a save to the local tier and say whether it is promoted (every
        ``promote_every``-th, unless ``promote`` decides). Called for every save the
        ranks agreed to send here, before it starts, whether or not it then fails on
        this rank: a count that differed between ranks would pick different steps
        for promotion on each, and no promotion would agree again."""
        self._saves += 1
        return promote if promote is not None else self._saves % self.tier.promote_every == 0

    def after_save(
        self,
        places: StepPlaces,
        handle: SaveHandle,
        exc: BaseException | None,
        promotion: concurrent.futures.Future[None] | None,
        replication: concurrent.futures.Future[bool] | None = None,
    ) -> None:
        """A local save ended (before its handle reports it done): record it, keep
        this rank's index object, start its replication and promotion, apply local
        retention."""
        step = places.step
        if exc is not None:
            if replication is not None and self._replicator is not None:
                self._replicator.cancel(step, f"its save of step {step} failed: {describe(exc)}")
            full, refused = is_disk_full(exc), is_not_writable(exc)
            if full or refused:
                self._degraded = (
                    f"a save to the local tier {self.tier.location.url} "
                    + ("ran out of space" if full else "was refused (not writable)")
                    + f" (step {step}); later saves go to {self._catalog.root.url}"
                )
                logger.warning("%s: %s", self._degraded, exc)
                with self._lock:
                    self._absorbed.append(exc)
            if promotion is not None:
                with self._lock:
                    self._to_promote.discard(step)
                promotion.set_exception(exc)
            return
        index_error = self._keep_own_index(places, handle)
        self._catalog.add_local(step)
        if replication is not None and self._replicator is not None:
            # Settled on every rank, whatever failed here: the step walks its exchanges
            # (in save order) and its agreement on every rank.
            if index_error is None:
                self._replicator.submit(step, handle)
            else:
                self._replicator.cancel(step, index_error)
        if promotion is not None:
            try:
                running = self._promoter.submit(places, handle)
            except BaseException as err:  # closed while saving
                self._promotion_ended(places, handle, promotion, err)
            else:
                running.add_done_callback(
                    lambda f: self._promotion_ended(places, handle, promotion, f.exception())
                )
        self._apply_retention()

    def wait_replications(self) -> None:
        """Wait for the replications started so far (their outcome is reported, never
        raised)."""
        if self._replicator is not None:
            self._replicator.wait()

    def refill(self, step: int) -> None:
        """Every rank, after a load that took ``step``'s files of a replaced node from
        its peers: send this rank's part to its replica nodes again (background)."""
        if self._replicator is not None:
            self._replicator.refill(step)

    # -- index objects ----------------------------------------------------------------------
    # Each rank's local copy holds its own index object too (the coordinator wrote them
    # all): a restart on the same ranks then reads nothing of its own part from the
    # store. One c10d key per rank, read once and deleted (as the commit's own keys).
    def _index_key(self, attempt: str | None, rank: int) -> str:
        return f"objckpt/{attempt}/local-index/rank{rank}"

    def hand_out_index(self, places: StepPlaces, manifest: Manifest) -> None:
        """Coordinator, before the local commit's outcome is published: post each
        rank's index object for it to keep on its own disk."""
        assert places.local is not None  # the save went to the local tier
        logger.info("step %d committed on the local tier %s", places.step, places.local.url)
        if not is_distributed() or self._world == 1:
            return
        local = open_store(places.local)
        blobs: dict[int, bytes] = {}
        for entry in manifest.objects:
            rank = index_rank(entry.key)
            if rank is None or rank == 0:
                continue
            try:
                blobs[rank] = local.read(entry.key)
            except OSError as exc:  # that rank reads its index from the root at load
                logger.warning("cannot hand out %s: %s", entry.key, exc)
        store = group_store(self._group)
        for rank in range(1, self._world):
            store.set(self._index_key(manifest.attempt, rank), blobs.get(rank, b""))

    def _keep_own_index(self, places: StepPlaces, handle: SaveHandle) -> str | None:
        """Non-coordinator, after the local commit: write this rank's index object.

        Returns why it is not on this node's disk (None: it is, or this rank needs
        none): the step then cannot be restored from this node after the
        coordinator's is lost, so it is not reported replicated."""
        if self._rank == 0 or self._world == 1:
            return None
        step = places.step
        store = group_store(self._group)
        key = self._index_key(handle.attempt, self._rank)
        try:
            store.wait([key], datetime.timedelta(seconds=self._timeout))
            blob = bytes(store.get(key))
            store.delete_key(key)
        except Exception as exc:  # only a cost at load: the index is read from the root
            logger.warning("step %d: this rank's index object was not handed out: %s", step, exc)
            return f"its index object of step {step} was not handed out: {describe(exc)}"
        if not blob or handle.attempt is None:
            return None
        assert places.local is not None  # the save went to the local tier
        local = open_store(places.local)
        key = index_key(self._rank, handle.attempt)
        try:
            if not local.exists(key):  # else a directory shared with the coordinator
                local.put(key, blob)
        except Exception as exc:  # a load reads it from the coordinator's node or the root
            logger.warning("step %d: cannot keep this rank's index object: %s", step, exc)
            return f"cannot write its index object of step {step}: {describe(exc)}"
        return None

    # -- promotion and retention ------------------------------------------------------------
    def _promotion_ended(
        self,
        places: StepPlaces,
        handle: SaveHandle,
        promotion: concurrent.futures.Future[None],
        exc: BaseException | None,
    ) -> None:
        step = places.step
        with self._lock:
            self._to_promote.discard(step)
            if exc is not None:
                self._errors.append(exc)
        if exc is None and self._rank != 0:  # the coordinator recorded it on commit
            self._catalog.add_durable(places)
        if exc is not None:
            promotion.set_exception(exc)
        else:
            promotion.set_result(None)  # the handle's seconds_to_durable is set now
        with self._lock:
            if exc is not None:
                self._last_error = f"step {step}: {describe(exc)}"
            else:
                self._last_error = None
                self._last_durable_s = handle.seconds_to_durable
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Every rank, its own local directory: keep the local steps the tier's
        retention keeps and every step whose promotion or replication is running."""
        with self._lock:
            spare = set(self._to_promote)
        if self._replicator is not None:
            spare |= self._replicator.running()  # its files are being sent and received
        doomed = self._catalog.prune_local(self.tier.retention, spare)
        if not doomed:
            return
        gone = {s for s, _ in doomed}
        listing = list_tier(self.tier.location.path)
        # What the kept steps (and saves in flight) of this node reference stays.
        referenced = local_references(
            self.tier.location.path, [s for s in listing.present if s not in gone]
        )
        for s, durable in doomed:
            if not durable:
                logger.info(
                    "local retention deletes step %d, which was never durable "
                    "(not promoted, or its promotion failed; %s)",
                    s,
                    self.tier.retention,
                )
            self._delete(s, referenced)

    def _delete(self, step: int, referenced: frozenset[str]) -> None:
        """Delete this rank's directory of ``step``: objckpt's own files, the manifest
        first (a half-deleted step is never taken for committed), never through a link;
        the files ``referenced`` (root-relative keys) by kept steps stay."""
        where = self._catalog.places(step).local
        assert where is not None  # the catalog of a run with a local tier
        prefix = step_name(step) + "/"
        keep = {k[len(prefix) :] for k in referenced if k.startswith(prefix)}
        if delete_local_step(where.path, keep):
            logger.info("deleted local step %d at %s", step, where.url)
        replicas = replica_dir(self.tier.location.path, step)
        store, rel = tier_store(replicas)
        if store.exists(rel) and delete_local_step(replicas):
            logger.info("deleted the replicas of local step %d at %s", step, replicas)

    # -- errors, status, lifetime -----------------------------------------------------------
    def absorbed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a local failure already logged (a full disk, or a tier
        that refused the write; reported once: it is forgotten here)."""
        with self._lock:
            found = any(exc is a for a in self._absorbed)
            if found:
                self._absorbed = [a for a in self._absorbed if a is not exc]
        return found

    def wait_promotions(self) -> None:
        """Wait for the replications and promotions started so far."""
        if self._replicator is not None:
            self._replicator.wait()
        with self._lock:
            promotions = list(self._promotions)
        concurrent.futures.wait(promotions)

    def raise_promotion_error(self) -> None:
        """Raise the oldest promotion error not yet raised."""
        with self._lock:
            self._promotions = [p for p in self._promotions if not p.done()]
            if not self._errors:
                return
            exc = self._errors.pop(0)
        raise exc

    def status(self) -> TierStatus:
        """How far the root trails this rank's local tier."""
        now = time.time()
        local = self._catalog.local_steps()
        durable_latest = self._catalog.latest(durable=True)
        with self._lock:
            behind = [
                s
                for s in self._to_promote
                if s in local and (durable_latest is None or s > durable_latest)
            ]
        oldest = min((local[s] for s in behind), default=now)
        rep = self._replicator
        kept = set(local)
        return TierStatus(
            path=self.tier.location.url,
            local_latest=max(local, default=None),
            durable_latest=durable_latest,
            steps_behind=len(behind),
            seconds_behind=max(0.0, now - oldest),
            promoting=self._promoter.running(),
            last_time_to_durable=self._last_durable_s,
            degraded=self._degraded or self._last_bypass,
            error=self._last_error,
            replicas=1 if rep is None else rep.replicas,
            replicated_latest=None if rep is None else rep.replicated_latest(kept),
            not_replicated=() if rep is None else rep.not_replicated(kept),
            last_time_to_replicated=None if rep is None else rep.last_seconds,
            replication_error=None if rep is None else rep.last_error,
        )

    def replication_seconds_left(self) -> float:
        """The most the replications not settled yet may still take (0: none)."""
        return 0.0 if self._replicator is None else self._replicator.seconds_left()

    def drain(self) -> None:
        """Wait for the replications and promotions started so far, then stop both;
        local retention then keeps only what the tier's retention keeps."""
        self.wait_promotions()
        if self._replicator is not None:
            self._replicator.close()
        self._promoter.close()
        self._apply_retention()

    def close(self) -> None:
        """Stop the promotion workers."""
        self._pool.close()
