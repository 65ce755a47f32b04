"""Replicated bytes fetched once per job and broadcast, instead of once per replica.

Under DDP every rank loads the same full tensors; with HSDP each replica group
loads the same shards. Read naively, a W-rank job GETs every replicated byte W
times. Here the coordinator, which sees every rank's load plan, names one owner
per stored item that several ranks read (the least-loaded of them, so the owners
share the work), and during ``read_data`` each owner fetches its items and
broadcasts them over the process group; the other ranks verify the CRC32C and
copy what they need, as if they had read the store themselves.

Every rank walks the same sequence of collectives whatever happens: an owner that
fails to fetch broadcasts the failure instead of bytes, a receiver that finds a
bad checksum finishes the walk before raising, so one rank's error never leaves
the others blocked in a broadcast.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from objckpt.dcp.collective import Collectives
from objckpt.errors import ObjckptError

__all__ = ["Sent", "SharedReads", "assign_owners", "exchange_shared"]


@dataclasses.dataclass(frozen=True)
class SharedReads:
    """What the global plan tells each rank: the shared items and their owners, in order."""

    entries: tuple[tuple[MetadataIndex, int], ...]


def assign_owners(
    plans: Sequence[LoadPlan], writer_of: Callable[[MetadataIndex], int | None] | None = None
) -> list[LoadPlan]:
    """Coordinator: give every stored item read by several ranks one owner.

    ``writer_of`` names the rank that wrote an item, when known: that rank owns it
    whenever it reads it too, since with a local tier it is the one likely to
    hold the item on its own disk (the others would fetch it from the store)."""
    readers: dict[MetadataIndex, list[int]] = {}
    weight: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            idx = item.storage_index
            ranks = readers.setdefault(idx, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
            weight[idx] = max(weight.get(idx, 1), math.prod(item.lengths) if item.lengths else 1)
    load = [0] * len(plans)
    entries = []
    for idx, ranks in readers.items():
        if len(ranks) < 2:
            continue
        writer = writer_of(idx) if writer_of is not None else None
        owner = writer if writer in ranks else min(ranks, key=lambda r: (load[r], r))
        load[owner] += weight[idx]
        entries.append((idx, owner))
    if not entries:
        return list(plans)
    shared = SharedReads(tuple(entries))
    return [dataclasses.replace(p, storage_data=shared) for p in plans]


@dataclasses.dataclass(frozen=True)
class Sent:
    """One shared item as the owner describes it to the others."""

    key: str
    length: int
    crc32c: str | None
    #: Its stream transforms and length before them (a compressed item).
    transforms: tuple[str, ...] | None = None
    raw_length: int | None = None


Fetch = Callable[[list[MetadataIndex]], list[tuple[Sent, bytes | memoryview]]]
Deliver = Callable[[list[ReadItem], Sent, memoryview], None]


def exchange_shared(
    shared: SharedReads,
    mine: Sequence[ReadItem],
    fetch: Fetch,
    deliver: Deliver,
    *,
    rank: int,
    collectives: Collectives,
    batch_bytes: int,
    url: str,
) -> None:
    """Owners fetch and broadcast; every rank delivers the shared items it reads.

    Raises (after the last collective): the first error any step hit on this rank,
    or an :class:`ObjckptError` naming an owner that could not fetch.
    """
    wanted: dict[MetadataIndex, list[ReadItem]] = {}
    for req in mine:
        wanted.setdefault(req.storage_index, []).append(req)
    by_owner: dict[int, list[MetadataIndex]] = {}
    for idx, owner in shared.entries:
        by_owner.setdefault(owner, []).append(idx)
    error: BaseException | None = None
    for owner in sorted(by_owner):
        indices = by_owner[owner]
        fetched: list[tuple[Sent, bytes | memoryview]] = []
        announce: Any = None
        if owner == rank:
            try:
                fetched = fetch(indices)
                announce = [sent for sent, _ in fetched]
            except Exception as exc:
                error = error or exc
                announce = f"{type(exc).__name__}: {exc}"
        described = collectives.broadcast_object(announce, owner)
        if isinstance(described, str):
            if owner != rank:
                error = error or ObjckptError(
                    f"rank {owner} could not read the replicated items of {url} it was to "
                    f"share: {described}"
                )
            continue
        for batch in _batches(list(range(len(indices))), described, batch_bytes):
            total = sum(described[i].length for i in batch)
            if owner == rank:
                raw = bytearray(b"".join(fetched[i][1] for i in batch))
            else:
                raw = bytearray(total)
            collectives.broadcast_bytes(raw, owner)  # received in place
            view = memoryview(raw)
            pos = 0
            for i in batch:
                sent = described[i]
                reads = wanted.get(indices[i])
                if reads and error is None:
                    try:
                        deliver(reads, sent, view[pos : pos + sent.length])
                    except Exception as exc:
                        error = exc
                pos += sent.length
    if error is not None:
        raise error


def _batches(order: list[int], described: Sequence[Sent], limit: int) -> list[list[int]]:
    """Consecutive items in groups of at most ``limit`` bytes (a larger item alone)."""
    out: list[list[int]] = []
    size = 0
    for i in order:
        n = described[i].length
        if out and size + n <= limit:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size = n
    return out
