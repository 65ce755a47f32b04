"""Rank bodies of tests/pipeline/test_rank_commit.py (module-level so spawn can import them)."""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

import torch.distributed as dist
from dist_helpers import full_state
from helpers import SHORT_WINDOW
from ranks import init_ranks
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt


def save_each(
    rank: int,
    world: int,
    init_file: str,
    urls: list[str],
    options: dict[str, Any],
    out: str,
    no_helper_for: int = -1,
    stock_metadata_max_ranks: int | None = 2048,
) -> None:
    """An async save to each of ``urls`` in turn; each rank records in
    ``<out>.rank<r>.json`` each outcome (``"committed"`` or the error), the c10d
    store's key count once every rank is done with that save, how many commit
    helper processes it runs, its plan-cache hits, and how many DCP ``Metadata``
    objects it holds then (rank 0's plan cache keeps the layout instead, #46). Rank 0
    cannot start a process during save number ``no_helper_for`` (its
    ``sys.executable`` is a missing file then); saves of more ranks than
    ``stock_metadata_max_ranks`` write no ``.metadata``."""
    mesh = init_ranks(rank, world, init_file)
    store = dist.distributed_c10d._get_default_store()
    record: dict[str, list[Any]] = {
        "outcomes": [],
        "keys": [],
        "helpers": [],
        "hits": [],
        "metadata": [],
    }
    try:
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()},
            "step": 3,
        }
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=30)
        upload = objckpt.UploadOptions(
            deadline=20.0, stock_metadata_max_ranks=stock_metadata_max_ranks
        )
        with objckpt.AsyncCheckpointer(
            storage_options=options, upload=upload, retry=SHORT_WINDOW, async_options=opts
        ) as ckpt:
            ckpt.start_workers()
            ckpt._pool.wait_ready(120)  # the upload workers up before any start fails
            executable = sys.executable
            for n, url in enumerate(urls):
                if rank == 0 and n == no_helper_for:
                    sys.executable = os.path.join(os.path.dirname(out), "no-such-python")
                try:
                    ckpt.save(state, url).result(timeout=180)
                    record["outcomes"].append("committed")
                except objckpt.errors.ObjckptError as exc:
                    record["outcomes"].append(f"{type(exc).__name__}: {exc}")
                finally:
                    sys.executable = executable
                dist.barrier()  # every rank is done with this save's keys
                record["keys"].append(store.num_keys())
                record["helpers"].append(len(ckpt._committer._helper.pids()))
                record["hits"].append(ckpt.plan_cache_stats.hits)
                gc.collect()
                record["metadata"].append(sum(isinstance(o, Metadata) for o in gc.get_objects()))
                dist.barrier()  # counted before any rank starts the next save
    finally:
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(record, f)
        dist.destroy_process_group()


def save_while_metadata_held(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any], out: str
) -> None:
    """One async save to ``url``; each rank writes ``<out>.rank<r>.json`` once its save
    returned: its outcome, and whether ``manifest.json`` and ``.metadata`` were on
    the store then (the test holds rank 0's ``.metadata`` PUT meanwhile)."""
    import fsspec

    mesh = init_ranks(rank, world, init_file)
    record: dict[str, Any] = {}
    try:
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()},
            "step": 3,
        }
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=60)
        with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
            try:
                ckpt.save(state, url).result(timeout=300)
                record["outcome"] = "committed"
            except objckpt.errors.ObjckptError as exc:
                record["outcome"] = f"{type(exc).__name__}: {exc}"
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
            path = url.split("://", 1)[1]
            record["manifest"] = fs.exists(f"{path}/manifest.json")
            record["metadata"] = fs.exists(f"{path}/.metadata")
            with open(f"{out}.rank{rank}.json", "w") as f:
                json.dump(record, f)
            dist.barrier()  # rank 0 returns only once the test released its PUT
    finally:
        dist.destroy_process_group()
