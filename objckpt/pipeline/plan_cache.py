"""Reuse of the previous save's plan when the state dict's structure is unchanged.

Most of an async save's stall beyond the copy is DCP planning: building a write
item per tensor, gathering every rank's plan on the coordinator, deduplicating
and computing the global metadata, then two more collectives. In a training loop
every save has the same structure as the one before, so all of that produces the
same answer each time.

A checkpointer keeps, after each fully planned save, the final local plan of its
rank and (on the coordinator) the global plan, keyed by the structure: every
path, type, shape, dtype and device, plus DTensor global shapes, placements and
meshes, and the rank, world size and group. The next save on every rank computes
its key and the ranks agree in one small all-reduce whether *all* of them hit;
a single rank whose structure changed sends every rank back to full planning, so
ranks never disagree on the collectives they make. The same all-reduce carries
the coordinator's fresh attempt id and any rank's local refusal (an existing
checkpoint, an unreachable bucket), so a save refused on one rank fails on all.

DCP's own ``enable_plan_caching`` is not used: it keeps its caches in class
attributes shared by every planner in the process and replays the previous
plan's storage data, which here names the previous attempt.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan

from objckpt.dcp.collective import Collectives
from objckpt.errors import SaveSequenceError
from objckpt.format.commit import GlobalPlan
from objckpt.format.layout import new_attempt_id

__all__ = ["Agreement", "CachedPlan", "PlanCacheStats", "PlanMemory", "agree", "cache_key"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    """What one rank keeps from a fully planned save."""

    key: tuple[Hashable, ...]
    plan: SavePlan  # this rank's final local plan (storage_data is replaced per save)
    #: The global plan, coordinator only: its layout once a commit built it, not DCP's
    #: ``Metadata`` (2 GiB at 8,192 ranks; :class:`~objckpt.format.commit.GlobalPlan`).
    global_plan: GlobalPlan | None
    #: Every tensor item resolved into staging memory: a save of this structure may
    #: queue its uploads on the commit thread, after ``save()`` returned.
    queue_later: bool = False
    #: The plan has non-tensor items, serialized before ``save()`` returns (known
    #: here so a replay does not look through every item again).
    has_bytes: bool = True


@dataclasses.dataclass(frozen=True)
class PlanCacheStats:
    """How often saves reused the previous plan (per checkpointer, this rank)."""

    hits: int = 0
    misses: int = 0


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The outcome of the per-save agreement, the same on every rank."""

    hit: bool
    attempt: str
    refused_by: int | None  # the lowest rank that refused the save locally, if any
    #: Rank 0's base step for reuse (None: no reuse), the same on every rank (#28).
    base: int | None = None


def cache_key(
    structure: tuple[Hashable, ...], rank: int, world: int, group: tuple[int, ...]
) -> tuple[Hashable, ...]:
    """The key a plan is cached under: structure plus the rank's place in its group."""
    return (structure, rank, world, group)


def group_ranks(process_group: Any | None) -> tuple[int, ...]:
    """Global ranks of ``process_group`` (the default group when None)."""
    if process_group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(process_group))


def _attempt_to_ints(attempt: str) -> tuple[int, int]:
    return int(attempt[:8], 16), int(attempt[8:], 16)


def _ints_to_attempt(hi: int, lo: int) -> str:
    return f"{hi:08x}{lo:08x}"


def agree(
    local_hit: bool,
    refused: bool,
    rank: int,
    collectives: Collectives,
    distributed: bool,
    sequence: int = 0,
    base: int | None = None,
) -> Agreement:
    """One all-reduce (MAX) settles hit or miss, the attempt id and refusals on every rank.

    Without a process group it is a local decision. Must be called by every rank
    of the group for every save, hit or miss. ``sequence`` numbers this
    checkpointer's saves: ranks that arrive with different numbers (one rank in
    save N+1 while another is still in save N) get :class:`SaveSequenceError` on
    every rank instead of pairing two different saves. ``base`` is this rank's
    base step for reuse: rank 0's travels in the same all-reduce (every other rank
    proposes none), so every rank references the one base rank 0 holds.
    """
    proposal = new_attempt_id() if rank == 0 else "0" * 16
    if not distributed:
        return Agreement(local_hit, proposal, 0 if refused else None, base)
    hi, lo = _attempt_to_ints(proposal)
    world = dist.get_world_size(collectives.group)
    # MAX over: miss flag, (world - refusing rank) so the lowest refusing rank wins,
    # rank 0's attempt id (every other rank proposes zero), and the save number with
    # its negation (the maximum and the minimum: equal unless ranks are out of step),
    # and rank 0's base step plus one (0: none; every other rank proposes 0).
    chosen = base + 1 if rank == 0 and base is not None else 0
    miss, refusal, hi, lo, highest, neg_lowest, agreed_base = collectives.all_reduce_max(
        [
            0 if local_hit else 1,
            world - rank if refused else 0,
            hi,
            lo,
            sequence,
            -sequence,
            chosen,
        ]
    )
    if highest != -neg_lowest:
        raise SaveSequenceError(
            f"ranks are in different saves: this rank (rank {rank}) is in save {sequence}, "
            f"others between save {-neg_lowest} and save {highest}; a rank skipped or "
            "repeated a save() call, so their collectives would pair different saves",
            highest=highest,
        )
    return Agreement(
        hit=miss == 0,
        attempt=_ints_to_attempt(hi, lo),
        refused_by=world - refusal if refusal else None,
        base=agreed_base - 1 if agreed_base else None,
    )


class PlanMemory:
    """One checkpointer's cached plan and its hit/miss counts (this rank).

    Only the save sequence touches it, under the checkpointer's save lock (one
    save plans at a time), so it needs no lock of its own.
    """

    def __init__(self) -> None:
        self.cached: CachedPlan | None = None
        self.stats = PlanCacheStats()

    def lookup(self, key: tuple[Hashable, ...]) -> CachedPlan | None:
        """The cached plan when its key is ``key`` (this rank's view of a hit)."""
        cached = self.cached
        return cached if cached is not None and cached.key == key else None

    def count_hit(self) -> None:
        self.stats = dataclasses.replace(self.stats, hits=self.stats.hits + 1)

    def count_miss(self) -> None:
        """A full plan follows: forget the old one until it is replaced."""
        self.stats = dataclasses.replace(self.stats, misses=self.stats.misses + 1)
        self.cached = None
