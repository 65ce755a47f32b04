"""Rank bodies of the ``no_dist`` save tests (module-level so spawn can import them).

A ``no_dist`` save is made by one rank while the others are elsewhere (Lightning
saves on global rank 0 while the other ranks train on). Here the other rank waits
on a c10d store key that the saving rank sets only once its save has committed:
a save that made any collective would wait for a rank that never joins it, and
the process group's timeout turns that into an error on the saving rank.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

import objckpt
from objckpt.testing import offline_env

#: How long a rank waits for the other (a collective, a store key): far beyond a
#: save of a few KiB, so reaching it means a rank waits for something that never comes.
WAIT = datetime.timedelta(seconds=90)


def state(rank: int, scale: float = 1.0) -> dict[str, Any]:
    """What rank ``rank`` holds (keys of its own: a collective save keeps every rank's)."""
    g = torch.Generator().manual_seed(rank)
    return {f"w{rank}": torch.randn(64, 32, generator=g) * scale, f"rank{rank}": rank}


def alone_then_together(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any]
) -> None:
    """Rank 0 saves alone with a long-lived checkpointer, rank 1 alone with the
    one-call ``async_save``, each while the other waits on the store; then both
    make collective saves with the same checkpointer, mixed with rank 0's
    ``no_dist`` saves: the save numbers and plan caches must still agree."""
    os.environ.update(offline_env())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=WAIT
    )
    store = dist.distributed_c10d._get_default_store()
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=60)
    try:
        with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
            # 1. Each rank alone, one after the other: rank 1 starts when rank 0 has committed.
            if rank == 0:
                manifest = ckpt.save(state(0), f"{root}/alone-0", no_dist=True).result(60)
                assert manifest is not None and manifest.world_size == 1, manifest
                store.set("rank0-committed", "1")
            else:
                store.wait(["rank0-committed"], WAIT)
                handle = objckpt.async_save(
                    state(1), f"{root}/alone-1", storage_options=options, no_dist=True
                )
                manifest = handle.result(60)
                assert manifest is not None and manifest.world_size == 1, manifest
                store.set("rank1-committed", "1")
            store.wait(["rank1-committed"], WAIT)
            # 2. Together, then rank 0 alone twice (the second reuses its plan), then
            # together again: rank 0's cached plan is its own save's, not the group's.
            for i, alone in enumerate([False, True, True, False]):
                url = f"{root}/mixed-{i}"
                if alone and rank != 0:
                    continue
                handle = ckpt.save(state(rank, scale=i + 1), url, no_dist=alone)
                manifest = handle.result(60)
                if rank == 0:
                    assert manifest is not None, url
                    assert manifest.world_size == (1 if alone else world), (url, manifest)
            hits = ckpt.plan_cache_stats.hits
            assert hits == (1 if rank == 0 else 0), (rank, ckpt.plan_cache_stats)
    finally:
        dist.destroy_process_group()


def lightning_load_alone(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any]
) -> None:
    """Lightning's calls on one rank of a group, the other waiting on the store:
    rank 0 saves, loads and removes (async), rank 1 loads a path with no
    checkpoint and gets objckpt's error itself, not torch's wrapper of it."""
    from objckpt.errors import CheckpointNotFoundError
    from objckpt.lightning import ObjckptCheckpointIO

    os.environ.update(offline_env())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=WAIT
    )
    store = dist.distributed_c10d._get_default_store()
    io = ObjckptCheckpointIO(options, async_save=True)
    try:
        if rank == 0:
            io.save_checkpoint(state(0), f"{root}/step-1.ckpt")
            assert io.load_checkpoint(f"{root}/step-1.ckpt")["rank0"] == 0
            io.remove_checkpoint(f"{root}/step-1.ckpt")
            io.teardown()
            store.set("rank0-done", "1")
        else:
            store.wait(["rank0-done"], WAIT)
            try:
                io.load_checkpoint(f"{root}/nothing.ckpt")
            except CheckpointNotFoundError as exc:
                assert "nothing.ckpt" in str(exc), str(exc)
            else:
                raise AssertionError("a load of a path with no checkpoint succeeded")
    finally:
        dist.destroy_process_group()
