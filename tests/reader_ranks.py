"""Rank bodies for tests/test_reader_broadcast.py (module-level so spawn can import them).

Two gloo ranks, one S3 (moto) root. Each rank records what it saw in
``<out>/rank<r>.json``; the parent test asserts on those records.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import objckpt
from objckpt.testing import offline_env

#: Far beyond any step here: reaching it means a rank waited for one that never came.
WAIT = datetime.timedelta(seconds=90)


def rank_main(rank: int, body: str, *args: Any) -> None:
    """Run ``body``, then leave without interpreter teardown (gloo's threads can abort it)."""
    globals()[body](rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {f"w{rank}": torch.randn(16, 8, generator=g), "shared": torch.arange(8.0)}


def everything() -> dict[str, torch.Tensor]:
    return {**state(0), **state(1)}


def _blank() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in everything().items()}


def _loaded(reader: objckpt.ObjectStoreReader, target: dict[str, torch.Tensor]) -> dict[str, Any]:
    want = everything()
    return {
        "source": reader.manifest_source,
        "metadata_bytes": reader.metadata_bytes_fetched,
        "equal": all(torch.equal(target[k], want[k]) for k in want),
    }


def loads(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any], out: str
) -> None:
    os.environ.update(offline_env())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=WAIT
    )
    store = dist.distributed_c10d._get_default_store()
    record: dict[str, Any] = {}
    url = f"{root}/ckpt"
    dcp.save(state(rank), storage_writer=objckpt.ObjectStoreWriter(url, storage_options=options))

    # 1. The default: rank 0 reads the manifest at dcp.load's first step, rank 1 receives it.
    target = _blank()
    reader = objckpt.ObjectStoreReader(url, storage_options=options)
    record["built_before_load"] = reader.manifest is not None
    dcp.load(target, storage_reader=reader)
    record["default"] = _loaded(reader, target)

    # 2. The same reader, a second load of the same URL: read (and broadcast) again.
    target = _blank()
    dcp.load(target, storage_reader=reader, checkpoint_id=url)
    record["again"] = _loaded(reader, target)

    # 3. broadcast=False: every rank reads the manifest itself.
    target = _blank()
    reader = objckpt.ObjectStoreReader(url, storage_options=options, broadcast=False)
    dcp.load(target, storage_reader=reader)
    record["each"] = _loaded(reader, target)

    # 4. Not committed (payload, no manifest): the same error on every rank.
    bare = f"{root}/bare"
    dcp.save(state(rank), storage_writer=objckpt.ObjectStoreWriter(bare, storage_options=options))
    dist.barrier()
    if rank == 0:
        fs = objckpt.ObjectStoreReader(bare, storage_options=options, broadcast=False).fs
        fs.rm(fs._strip_protocol(f"{bare}/manifest.json"))
    dist.barrier()
    try:
        dcp.load(_blank(), storage_reader=objckpt.ObjectStoreReader(bare, storage_options=options))
        record["bare"] = "loaded"
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        record["bare"] = repr(exc)

    # 5. One rank loads alone (no_dist) while the other waits on the store: with
    #    broadcast=False nothing waits for the other rank.
    if rank == 0:
        target = _blank()
        reader = objckpt.ObjectStoreReader(url, storage_options=options, broadcast=False)
        dcp.load(target, storage_reader=reader, no_dist=True)
        record["alone"] = _loaded(reader, target)
        store.set("alone-done", "1")
    else:
        store.wait(["alone-done"], WAIT)
    dist.barrier()

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
    if rank == 1:
        target = _blank()
        reader = objckpt.ObjectStoreReader(url, storage_options=options, process_group=sub)
        dcp.load(target, storage_reader=reader, process_group=sub)
        record["subgroup"] = _loaded(reader, target)
        store.set("subgroup-done", "1")
    else:
        store.wait(["subgroup-done"], WAIT)
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
