"""Rank bodies for tests/distributed/test_reader_broadcast.py (module-level: spawn imports them).

Two gloo ranks, one S3 (moto) root. Each rank records what it saw in
``<out>/rank<r>.json``; the parent test asserts on those records.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import init_ranks

import objckpt

#: Far beyond any step here: reaching it means a rank waited for one that never came.
WAIT = datetime.timedelta(seconds=90)


def state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {f"w{rank}": torch.randn(16, 8, generator=g), "shared": torch.arange(8.0)}


def everything() -> dict[str, torch.Tensor]:
    return {**state(0), **state(1)}


def _blank() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in everything().items()}


def _load(reader: objckpt.ObjectStoreReader, **load: Any) -> dict[str, Any]:
    """``dcp.load`` of everything through ``reader``: where its manifest came from on
    this rank, the metadata bytes it fetched, and whether the bytes are right."""
    target = _blank()
    dcp.load(target, storage_reader=reader, **load)
    want = everything()
    return {
        "source": reader.manifest_source,
        "metadata_bytes": reader.metadata_bytes_fetched,
        "equal": all(torch.equal(target[k], want[k]) for k in want),
    }


def _while_the_other_waits(
    rank: int, who: int, key: str, store: Any, body: Callable[[], None]
) -> None:
    """``body`` on rank ``who`` alone while the other rank waits on the c10d store for
    ``key`` (no collective: a ``body`` that made one would wait for a rank that never
    joins, and the group's timeout would fail it); then both meet at a barrier."""
    if rank == who:
        body()
        store.set(key, "1")
    else:
        store.wait([key], WAIT)
    dist.barrier()


def loads(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    init_ranks(rank, world, init_file)
    store = dist.distributed_c10d._get_default_store()
    record: dict[str, Any] = {}
    url = f"{root}/ckpt"
    dcp.save(state(rank), storage_writer=objckpt.ObjectStoreWriter(url, storage_options=options))

    # 1. The default: rank 0 reads the manifest at dcp.load's first step, rank 1 receives it.
    reader = objckpt.ObjectStoreReader(url, storage_options=options)
    record["built_before_load"] = reader.manifest is not None
    record["default"] = _load(reader)

    # 2. The same reader, a second load of the same URL: read (and broadcast) again.
    record["again"] = _load(reader, checkpoint_id=url)

    # 3. broadcast=False: every rank reads the manifest itself.
    record["each"] = _load(
        objckpt.ObjectStoreReader(
            url, storage_options=options, read=objckpt.ReadOptions(broadcast=False)
        )
    )

    # 4. Not committed (payload, no manifest): the same error on every rank.
    bare = f"{root}/bare"
    dcp.save(state(rank), storage_writer=objckpt.ObjectStoreWriter(bare, storage_options=options))
    dist.barrier()
    if rank == 0:
        objckpt.ObjectStoreReader(
            bare, storage_options=options, read=objckpt.ReadOptions(broadcast=False)
        ).store.delete("manifest.json")
    dist.barrier()
    try:
        dcp.load(_blank(), storage_reader=objckpt.ObjectStoreReader(bare, storage_options=options))
        record["bare"] = "loaded"
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        record["bare"] = repr(exc)

    # 5. One rank loads alone (no_dist) while the other waits on the store: with
    #    broadcast=False nothing waits for the other rank.
    def alone() -> None:
        reader = objckpt.ObjectStoreReader(
            url, storage_options=options, read=objckpt.ReadOptions(broadcast=False)
        )
        record["alone"] = _load(reader, no_dist=True)

    _while_the_other_waits(rank, 0, "alone-done", store, alone)

    # 6. Each rank loads a checkpoint of its own (no_dist) with the default reader at the
    #    same time: the broadcast pairs the ranks, and a rank whose URL is not rank 0's
    #    reads its own manifest instead of taking rank 0's.
    own = f"{root}/own-{rank}"
    mine = {f"w{rank}": state(rank)[f"w{rank}"] * (rank + 2)}
    dcp.save(
        mine, storage_writer=objckpt.ObjectStoreWriter(own, storage_options=options), no_dist=True
    )
    dist.barrier()
    target = {k: torch.zeros_like(v) for k, v in mine.items()}
    reader = objckpt.ObjectStoreReader(own, storage_options=options)
    dcp.load(target, storage_reader=reader, no_dist=True)
    record["own"] = {
        "source": reader.manifest_source,
        "equal": all(torch.equal(target[k], v) for k, v in mine.items()),
    }
    dist.barrier()

    # 7. A load on a subgroup (rank 1 alone in it) with the reader on that subgroup: the
    #    broadcast runs on the ranks that load, and rank 1, the subgroup's rank 0, reads.
    sub = dist.new_group([1])  # every rank creates it, as torch requires

    def on_subgroup() -> None:
        reader = objckpt.ObjectStoreReader(url, storage_options=options, process_group=sub)
        record["subgroup"] = _load(reader, process_group=sub)

    _while_the_other_waits(rank, 1, "subgroup-done", store, on_subgroup)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
