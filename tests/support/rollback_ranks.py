"""Rank bodies for the rollback tests (module-level so spawn can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from dist_helpers import full_state
from ranks import init_ranks
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt
from objckpt.errors import StepOrderError


def _state(mesh: Any, step: int) -> dict[str, Any]:
    return {
        "model": {k: distribute_tensor(v + step, mesh, [Shard(0)]) for k, v in full_state().items()}
    }


def refuse_then_discard(rank: int, world: int, init_file: str, url: str, options: dict) -> None:
    """Steps 10, 15, 20; step 10 loaded; save(11) is refused on every rank (none of
    them enters the save's collectives, so none waits for another); discard_after(10)
    together; then step 11 commits and is kept."""
    mesh = init_ranks(rank, world, init_file)
    try:
        with objckpt.CheckpointManager(
            url,
            storage_options=options,
            retention=objckpt.RetentionPolicy(keep_last=2, keep_every=10),
            async_options=objckpt.AsyncOptions(workers=1, barrier_timeout=120),
        ) as mgr:
            for step in (10, 15, 20):
                mgr.save(step, _state(mesh, step)).result(timeout=120)
            mgr.wait_until_finished()
            got = {
                "model": {
                    k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                    for k, v in full_state().items()
                }
            }
            assert mgr.load(got, step=10) == 10
            try:
                mgr.save(11, _state(mesh, 11))
            except StepOrderError as exc:
                text = str(exc)
                assert "step 11 is below step 20" in text and "discard_after(10)" in text, text
            else:
                raise AssertionError(f"rank {rank}: save(11) below step 20 was not refused")
            assert mgr.discard_after(10) == [15, 20], rank
            mgr.save(11, _state(mesh, 11)).result(timeout=120)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [10, 11] and mgr.latest_step() == 11, (rank, mgr.all_steps())
    finally:
        dist.destroy_process_group()
