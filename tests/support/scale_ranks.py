"""Rank bodies for tests/distributed/test_scale_ranks.py (module-level so spawn can import them).

One spawn runs every path the test measures, one after the other, on the same W
gloo processes: an async save through ``CheckpointManager``, a sync ``dcp.save``
with ``ObjectStoreWriter``, a load through ``CheckpointManager.load`` and a plain
``dcp.load`` with ``ObjectStoreReader`` (default and ``broadcast=True``). Each rank
reaches the store through a recording proxy of its own per path
(``options["ranks"][rank][path]``), so the parent attributes every request to one
rank and one path without reading keys.

The c10d side is read from the job's ``FileStore`` (the group is initialised with
``file://``): every ``set``/``add``/``delete_key`` any rank makes appends one record
to that file, so the records appended between two barriers are exactly the store
writes of the path that ran between them. Rank 0 reads them and reports them.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import init_ranks
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt

#: The paths in the order they run; each saves to or loads from its own URL.
PATHS = ("manager_save", "dcp_save", "manager_load", "dcp_load", "dcp_load_broadcast")

#: Rows of each rank's shard of ``w`` (and elements of its shard of ``b``).
ROWS = 4
COLS = 64


def full_state(world: int) -> dict[str, torch.Tensor]:
    """Tensors whose shards are the same size on every rank at any W (per-rank cost
    is then comparable across world sizes)."""
    g = torch.Generator().manual_seed(17)
    return {
        "w": torch.randn(world * ROWS, COLS, generator=g),
        "b": torch.randn(world * COLS, generator=g),
    }


def _state(mesh: Any, world: int, blank: bool) -> dict[str, Any]:
    full = full_state(world)
    model = {
        k: distribute_tensor(torch.zeros_like(v) if blank else v, mesh, [Shard(0)])
        for k, v in full.items()
    }
    return {"model": model, "step": 0 if blank else 7}


def _check(state: dict[str, Any], world: int, rank: int, path: str) -> None:
    for k, v in full_state(world).items():
        if not torch.equal(state["model"][k].full_tensor(), v):
            raise AssertionError(f"rank {rank}, {path}: {k} differs after the load")
    if state["step"] != 7:
        raise AssertionError(f"rank {rank}, {path}: step {state['step']} after the load")


def store_records(path: str, start: int) -> tuple[int, list[tuple[str, int]]]:
    """The records a ``FileStore`` appended to ``path`` after byte ``start``.

    Each record is a length-prefixed key (``/…`` for a write, ``-/…`` for a
    deletion) then a length-prefixed value (lengths are native 32-bit unsigned, as
    torch's ``FileStore.cpp`` writes them).

    Returns:
        The file's end, and (key, value length) per record.
    """
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    out, pos = [], 0
    while pos + 4 <= len(data):
        (klen,) = struct.unpack_from("=I", data, pos)
        key = data[pos + 4 : pos + 4 + klen].decode("utf-8", "replace")
        pos += 4 + klen
        (vlen,) = struct.unpack_from("=I", data, pos)
        pos += 4 + vlen
        out.append((key, vlen))
    return start + pos, out


def measure(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    """Run every path once; rank 0 reports the c10d store writes of each."""
    mesh = init_ranks(rank, world, init_file)
    store = dist.distributed_c10d._get_default_store()
    report: dict[str, Any] = {}
    mine = options["ranks"][rank]
    upload = objckpt.AsyncOptions(workers=1, barrier_timeout=120)
    try:
        dist.barrier()
        mark, _ = store_records(init_file, 0) if rank == 0 else (0, [])
        keys_before = store.num_keys()
        for path in PATHS:
            opts = mine[path]
            if path == "manager_save":
                with objckpt.CheckpointManager(
                    f"{url}/manager", storage_options=opts, async_options=upload
                ) as mgr:
                    mgr.save(1, _state(mesh, world, blank=False)).result(timeout=240)
                    mgr.wait_until_finished()
            elif path == "dcp_save":
                writer = objckpt.ObjectStoreWriter(f"{url}/dcp", storage_options=opts)
                dcp.save(_state(mesh, world, blank=False), storage_writer=writer)
            elif path == "manager_load":
                state = _state(mesh, world, blank=True)
                with objckpt.CheckpointManager(f"{url}/manager", storage_options=opts) as mgr:
                    if mgr.load(state) != 1:
                        raise AssertionError(f"rank {rank}: the manager loaded another step")
                _check(state, world, rank, path)
            else:
                state = _state(mesh, world, blank=True)
                reader = objckpt.ObjectStoreReader(
                    f"{url}/dcp",
                    storage_options=opts,
                    read=objckpt.ReadOptions(
                        broadcast=True if path.endswith("broadcast") else None
                    ),
                )
                dcp.load(state, storage_reader=reader)
                _check(state, world, rank, path)
            dist.barrier()  # every rank is done with this path: the store is quiet
            if rank == 0:
                mark, records = store_records(init_file, mark)
                keys = store.num_keys()
                report[path] = {
                    "records": records,
                    "keys_left": keys - keys_before,
                }
                keys_before = keys
            dist.barrier()
        if rank == 0:
            with open(options["report"], "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()
