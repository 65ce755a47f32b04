"""Per-rank bodies of the tests that every rank reuses from rank 0's base (#28, real
gloo; module-level so spawn can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ranks import init_ranks
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt

__all__ = ["one_rank_cannot_read_its_base", "saves_after_rank_0_deleted_the_newest"]


def _state(mesh: Any, step: int) -> dict[str, Any]:
    """A frozen weight sharded over the ranks (each rank writes its own shard) and a
    small adapter that changes every step."""
    g = torch.Generator().manual_seed(3)
    frozen = torch.randn(64, 256, generator=g)
    return {
        "frozen": distribute_tensor(frozen, mesh, [Shard(0)]),
        "adapter": distribute_tensor(torch.full((8, 4), float(step)), mesh, [Shard(0)]),
    }


def saves_after_rank_0_deleted_the_newest(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Steps 1 and 2, then rank 0 deletes step 2 (only rank 0's catalog forgets it:
    deleting is the coordinator's), then step 3: every rank must reuse from step 1,
    rank 0's newest step, not from step 2 that rank 1's catalog still lists."""
    mesh = init_ranks(rank, world, init_file)
    try:
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=120)
        with objckpt.CheckpointManager(url, storage_options=options, async_options=opts) as mgr:
            for step in (1, 2):
                mgr.save(step, _state(mesh, step)).result(timeout=120)
                mgr.wait_until_finished()
            if rank == 0:
                mgr.delete(2)
            dist.barrier()
            assert mgr.all_steps() == ([1] if rank == 0 else [1, 2]), mgr.all_steps()
            mgr.save(3, _state(mesh, 3)).result(timeout=120)
            mgr.wait_until_finished()
            got = _state(mesh, 0)
            got["frozen"] = distribute_tensor(torch.zeros(64, 256), mesh, [Shard(0)])
            assert mgr.load(got, step=3) == 3
            want = _state(mesh, 3)
            assert torch.equal(got["frozen"].full_tensor(), want["frozen"].full_tensor())
            assert torch.equal(got["adapter"].full_tensor(), want["adapter"].full_tensor())
    finally:
        dist.destroy_process_group()


def one_rank_cannot_read_its_base(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    """Step 1, then step 2 with rank 1 unable to take up the agreed base (its memory
    of step 1 raises, as a base that cannot be opened or a thread that cannot start
    would): the failure comes after the save's agreement, so it must cost rank 1 its
    reuse only. Every rank commits step 2 and loads it bit-exact."""
    from objckpt.pipeline.reuse_memory import ReuseMemory

    mesh = init_ranks(rank, world, init_file)
    try:
        opts = objckpt.AsyncOptions(workers=1, barrier_timeout=60)
        with objckpt.CheckpointManager(url, storage_options=options, async_options=opts) as mgr:
            mgr.save(1, _state(mesh, 1)).result(timeout=120)
            mgr.wait_until_finished()
            if rank == 1:

                def broken(self: Any, url: str) -> Any:
                    raise RuntimeError("cannot read the base (injected)")

                ReuseMemory.recall = broken  # type: ignore[method-assign]
            mgr.save(2, _state(mesh, 2)).result(timeout=120)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 2], mgr.all_steps()
            got = _state(mesh, 0)
            got["frozen"] = distribute_tensor(torch.zeros(64, 256), mesh, [Shard(0)])
            assert mgr.load(got, step=2) == 2
            want = _state(mesh, 2)
            assert torch.equal(got["frozen"].full_tensor(), want["frozen"].full_tensor())
            assert torch.equal(got["adapter"].full_tensor(), want["adapter"].full_tensor())
    finally:
        dist.destroy_process_group()
