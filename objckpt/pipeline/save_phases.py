"""One async save on the caller's thread, phase by phase: stage, agree, plan or replay, queue.

:class:`~objckpt.pipeline.checkpointer.AsyncCheckpointer` owns what lasts across
saves (staging memory, worker processes, filesystem clients, the plan cache);
this module is the sequence one save walks through them, so it reads top to
bottom in :func:`run_save`::

    open the target    -> an ObjectStoreWriter on a reused filesystem client
    check the target   -> the preflight, before the first copy to a bucket only;
                          a bare save's "already committed?" starts on rank 0's
                          checker thread (target_check)
    stage              -> copy the state dict into staging memory
    agree              -> one all-reduce: cache hit, attempt id, any rank's refusal
    plan or replay     -> DCP's planning collectives, or the cached plan; its uploads
                          are held until rank 0 answers "already committed?"
    queue              -> hand the commit to a background thread (commit_phase)

The agreement is the one collective every rank makes for every save, whatever
failed before it: a rank's refusal travels inside it, so a save refused on one
rank is refused on all. A ``no_dist`` save makes none (rank 0 of a group of one).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from objckpt._torch import group_store, save_state_dict_fn
from objckpt.dcp.collective import Collectives
from objckpt.dcp.planner import ReplicaSlicingPlanner
from objckpt.dcp.serialize import Framer
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.errors import CheckpointExistsError, ConfigurationError, PeerRankError
from objckpt.options import AsyncOptions, UploadOptions
from objckpt.pipeline.commit_phase import exchange_for
from objckpt.pipeline.deferred import DeferredWriter
from objckpt.pipeline.plan_cache import (
    Agreement,
    CachedPlan,
    PlanMemory,
    agree,
    cache_key,
    group_ranks,
)
from objckpt.pipeline.reuse_memory import ReuseMemory
from objckpt.pipeline.reuse_phase import adopt_base, proposed_base
from objckpt.pipeline.stage import Staged, Stager
from objckpt.pipeline.target_check import CheckGate, TargetCache
from objckpt.pipeline.workers import WorkerPool
from objckpt.writers.retry import RetryPolicy
from objckpt.writers.translate import describe

__all__ = ["SaveRequest", "SaveResources", "TargetCache", "run_save"]


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """What the caller asked of one save."""

    state_dict: dict[str, Any]
    url: str
    #: The collectives of the group that saves together (its caller's, who owns them).
    collectives: Collectives = dataclasses.field(default_factory=Collectives)
    overwrite: bool = False
    user_metadata: Mapping[str, Any] | None = None
    #: What DCP's ``StorageMeta.checkpoint_id`` records (default ``url``).
    checkpoint_id: str | None = None
    no_dist: bool = False  # this process alone: a group of one, no collective (DCP's)
    #: Whether ``url`` holds a committed checkpoint, when the caller knows (a manager's
    #: step catalog): True refuses the save, False asks the store nothing (the
    #: create-only manifest still refuses a conflict at commit); None: rank 0 asks
    #: beside the copy, and the save's uploads wait for its answer (so None on every
    #: rank or on none; any rank's True refuses the save on all).
    exists: bool | None = None
    #: A committed sibling step whose unchanged items are referenced, not uploaded.
    reuse_from: str | None = None

    @property
    def process_group(self) -> Any | None:
        """The group that saves together (None: the default group)."""
        return self.collectives.group

    @property
    def asks(self) -> bool:
        """Whether rank 0 asks the store "already committed?" (in the background)."""
        return self.exists is None and not self.overwrite


@dataclasses.dataclass(frozen=True)
class SaveResources:
    """What a checkpointer lends each save (owned and closed by the checkpointer)."""

    storage_options: Mapping[str, Any]
    upload: UploadOptions
    options: AsyncOptions
    retry: RetryPolicy
    stager: Stager
    pool: WorkerPool
    framer: Framer
    targets: TargetCache
    plans: PlanMemory
    #: What this checkpointer's rank wrote in its last committed save (reuse's base).
    memory: ReuseMemory
    #: One thread that asks "already committed?" while the save goes on.
    checker: concurrent.futures.ThreadPoolExecutor


@dataclasses.dataclass(frozen=True)
class Queued:
    """A save that passed every foreground phase: the commit thread takes it from here."""

    deferred: DeferredWriter
    staged: Staged
    world: int
    process_group: Any | None
    distributed: bool


def run_save(
    res: SaveResources, request: SaveRequest, sequence: int, refusal: BaseException | None = None
) -> Queued:
    """Stage, agree, plan or replay, and queue one save (caller's thread, every rank).

    Every rank reaches the agreement whatever failed before it on that rank (the
    target could not be opened or checked, the state dict could not be staged):
    that failure becomes the rank's refusal, and every rank raises.

    Args:
        sequence: This checkpointer's save number (the same on every rank).
        refusal: A reason to refuse known before the save starts (a closed checkpointer).

    Raises:
        ConfigurationError, StateDictError, CheckpointExistsError, StoreError: this
            rank's own refusal, before anything is uploaded (wrapped by torch's
            CheckpointException when raised inside DCP's planning).
        PeerRankError: another rank refused (its rank and error in the message).
        SaveSequenceError: the ranks are not in the same save.
    """
    distributed = not request.no_dist and dist.is_available() and dist.is_initialized()
    process_group = request.process_group
    rank = dist.get_rank(process_group) if distributed else 0
    target: ObjectStoreWriter | None = None
    staged: Staged | None = None
    check: concurrent.futures.Future[None] | None = None
    if refusal is None:
        try:
            target, check = _open_and_check(res, request, rank)
            staged = res.stager.stage(
                _plain_state_dict(request.state_dict),
                defer_copy=res.options.background_staging,
            )
        except Exception as exc:
            refusal = exc
    writer = None
    if target is not None and staged is not None:
        writer = DeferredWriter(target, res.pool, staged, res.framer)
        if request.asks:  # on every rank alike: the uploads wait for rank 0's answer
            world = dist.get_world_size(process_group) if distributed else 1
            store = group_store(process_group) if world > 1 else None
            gate = CheckGate(check, store, target, world, res.options.barrier_timeout)
            writer.hold_uploads(gate)
    try:
        _plan(res, request, staged, writer, refusal, distributed, sequence)
    except BaseException:
        if writer is not None:
            writer.settle()
        if staged is not None:
            res.stager.release(staged)
        raise
    assert target is not None and staged is not None and writer is not None  # agreed: no refusal
    res.targets.proven(target)
    res.memory.wrote(request.url, writer)  # the next save's base, once committed
    world = dist.get_world_size(process_group) if distributed else 1
    return Queued(writer, staged, world, process_group if distributed else None, distributed)


def _open_and_check(
    res: SaveResources, request: SaveRequest, rank: int
) -> tuple[ObjectStoreWriter, concurrent.futures.Future[None] | None]:
    """The target writer, proven writable, and rank 0's "already committed?" started.

    The preflight is the one round trip ``save()`` may wait for, on every rank,
    once per bucket and process: credentials that cannot write fail before any copy.
    "Already committed?" is known to a manager (``request.exists``); a bare save's
    runs on rank 0's checker thread (:mod:`objckpt.pipeline.target_check`).
    """
    if request.url.startswith("memory://"):
        raise ConfigurationError(
            f"async save cannot write {request.url}: memory:// is private to one process and "
            "the uploads run in worker processes; use file://, s3:// or gs://"
        )
    if request.exists and not request.overwrite:
        raise CheckpointExistsError(
            f"{request.url} already holds a committed checkpoint; pass overwrite=True to replace it"
        )
    target = _open_target(res, request)
    target.set_up_storage_writer(rank == 0, rank=rank)
    target.prepare_local_plan(SavePlan([]))  # the preflight, for a bucket new to us
    check = None
    if rank == 0 and request.asks:
        check = res.checker.submit(contextvars.copy_context().run, target.refuse_existing)
    return target, check  # its base, if any, is rank 0's: read after the agreement


def _open_target(res: SaveResources, request: SaveRequest) -> ObjectStoreWriter:
    target = ObjectStoreWriter(
        request.url,
        storage_options=res.storage_options,
        overwrite=request.overwrite,
        upload=res.upload,
        user_metadata=request.user_metadata,
        retry=res.retry,
        reuse_from=request.reuse_from,
    )
    if request.checkpoint_id is not None:
        target.checkpoint_id = request.checkpoint_id
    res.targets.attach(target)
    return target


def _plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace ``Stateful`` values by their ``state_dict()``, as ``dcp.save`` does."""
    from torch.distributed.checkpoint.stateful import Stateful

    # Tensors and containers are never Stateful: skip the costly protocol check, and
    # the call, for them (a state dict may hold thousands of tensors at its top level).
    return {
        k: v if isinstance(v, _NEVER_STATEFUL) or not isinstance(v, Stateful) else v.state_dict()
        for k, v in state_dict.items()
    }


_NEVER_STATEFUL = (torch.Tensor, dict, list, tuple, int, float, str, bytes)


def _plan(
    res: SaveResources,
    request: SaveRequest,
    staged: Staged | None,
    writer: DeferredWriter | None,
    refusal: BaseException | None,
    distributed: bool,
    sequence: int,
) -> None:
    """Agree with the other ranks (on the cache and on refusals), then replay or plan.

    ``refusal`` is this rank's error from opening or checking the target or from
    staging (``staged`` and ``writer`` are then None).
    """
    process_group = request.process_group
    rank = dist.get_rank(process_group) if distributed else 0
    world = dist.get_world_size(process_group) if distributed else 1
    cached = None
    key: tuple[Any, ...] = ()
    if staged is not None:
        group = group_ranks(process_group) if distributed else (0,)
        key = cache_key(staged.structure, rank, world, group)
        cached = res.plans.lookup(key)
        if refusal is None and cached is None and staged.copy is not None:
            try:  # a miss copies before planning anyway: a copy error is a refusal
                staged.copy.run()
            except Exception as exc:
                refusal = exc
    base = proposed_base(writer.target if writer is not None else None)
    agreement = agree_or_raise(
        request.url, cached is not None, refusal, request.collectives, distributed, sequence, base
    )
    assert staged is not None and writer is not None  # no rank refused
    writer.target.attach(attempt=agreement.attempt)
    adopt_base(writer.target, agreement.base, rank, res.memory)  # rank 0's base, on every rank
    if writer.gate is not None and rank == 0:
        res.checker.submit(writer.gate.publish)  # once its check has the answer
    planner = _planner(res, world)
    if agreement.hit and cached is not None:
        res.plans.count_hit()
        announce = _announcer(
            writer, process_group, world, res.options.barrier_timeout, distributed
        )
        if staged.copy is not None and not cached.queue_later:
            try:
                staged.copy.run()  # uploads are queued now: their bytes must be there
            except BaseException as exc:
                announce(exc)
                raise
        _replay(cached, staged, writer, planner, rank, on_error=announce)
        return
    res.plans.count_miss()
    if staged.copy is not None:
        # Copied before the agreement unless this rank hit and another missed.
        staged.copy.run()  # a first plan queues its uploads as it goes
    _plan_and_queue(staged.state, writer, planner, process_group, distributed)
    if writer.final_plan is not None:
        queue_later = writer.all_staged and staged.wave is None
        res.plans.cached = CachedPlan(
            key, writer.final_plan, writer.global_plan, queue_later, writer.has_bytes
        )


def _planner(res: SaveResources, world: int) -> SavePlanner:
    """DCP's planner, splitting large replicated tensors across the replicas."""
    if world > 1 and res.options.share_replicated:
        return ReplicaSlicingPlanner(replicas=world, slice_bytes=res.upload.part_size)
    return DefaultSavePlanner()


def agree_or_raise(
    url: str,
    hit: bool,
    refusal: BaseException | None,
    collectives: Collectives,
    distributed: bool,
    sequence: int = 0,
    base: int | None = None,
) -> Agreement:
    """The one collective of a save: every rank calls it exactly once, whether it
    refused before staging, after staging, or not at all. Raises on every rank
    when any rank refused: the refusing rank its own error, the others a
    :class:`PeerRankError` naming that rank and its error (one more broadcast, on
    the failure path only). Rank 0's ``base`` step (reuse) comes back to all."""
    rank = dist.get_rank(collectives.group) if distributed else 0
    agreement = agree(hit, refusal is not None, rank, collectives, distributed, sequence, base)
    refused_by = agreement.refused_by
    if refused_by is None:
        return agreement
    cause = describe(refusal) if refusal is not None else None
    if distributed:
        cause = collectives.broadcast_object(cause, refused_by)
    if refusal is not None:
        raise refusal
    raise PeerRankError(
        f"save of {url} was refused on rank {refused_by}: {cause}; nothing was uploaded",
        rank=refused_by,
    )


def _announcer(
    writer: DeferredWriter, process_group: Any, world: int, timeout: float, distributed: bool
) -> Callable[[BaseException], None]:
    """How a replay error reaches the other ranks: through the commit exchange (the
    replay makes no collective they could learn it from)."""

    def announce(exc: BaseException) -> None:
        if not distributed:
            return
        exchange = exchange_for(writer, process_group, world, timeout)
        exchange.post(False, describe(exc))
        if exchange.rank == 0:  # no coordinator will gather: tell the others now
            exchange.publish_outcome(f"rank 0: {describe(exc)}")

    return announce


def _plan_and_queue(
    state: dict[str, Any],
    writer: DeferredWriter,
    planner: SavePlanner,
    process_group: Any,
    distributed: bool,
) -> None:
    """Run DCP's plan -> write -> finish with the deferred writer.

    DCP's internal ``_save_state_dict`` is used when present: the public
    ``dcp.save`` wraps every entry in logging that costs ~0.1 ms per tensor,
    which is most of the stall for a state dict of thousands of small tensors.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save_state_dict_fn()(
            state,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=not distributed,
        )


def _replay(
    cached: CachedPlan,
    staged: Staged,
    writer: DeferredWriter,
    planner: SavePlanner,
    rank: int,
    on_error: Callable[[BaseException], None],
) -> None:
    """Queue the uploads of a save whose structure equals the cached plan's.

    The cached final local plan names the same items; only the attempt changes.
    The planner is set up on the new staged state so items resolve to its tensors.
    """

    def set_up() -> None:
        planner.set_up_planner(
            state_dict=staged.state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0
        )

    try:
        writer.replay(
            cached.plan,
            planner,
            cached.global_plan,
            set_up=set_up,
            later=cached.queue_later,
            has_bytes=cached.has_bytes,
        )
    except BaseException as exc:
        on_error(exc)
        raise
