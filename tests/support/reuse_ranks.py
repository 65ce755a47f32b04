"""Per-rank bodies of the resharded reuse test (module-level so spawn can import them).

Step 1 is saved by a manager on 4 ranks, then a job of 2 ranks loads it and saves
step 2 from what it loaded: the plain (replicated) tensors and values are the same
items with the same bytes and are reused; the tensors sharded over the ranks are
cut differently at 2 ranks (other chunk sizes) and must be uploaded again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from dist_helpers import full_state
from ranks import init_ranks
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt

__all__ = ["load_and_save_step_2", "save_step_1"]


def _replicated() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"norm": torch.randn(256, generator=g), "bias": torch.randn(64, 4, generator=g)}


def _state(mesh: Any, fill: bool) -> dict[str, Any]:
    sharded = full_state()
    plain = _replicated()
    return {
        "sharded": {
            k: distribute_tensor(v if fill else torch.zeros_like(v), mesh, [Shard(0)])
            for k, v in sharded.items()
        },
        "plain": {k: v if fill else torch.zeros_like(v) for k, v in plain.items()},
        "step": 7 if fill else 0,
    }


def _check(state: dict[str, Any]) -> None:
    for k, v in full_state().items():
        assert torch.equal(state["sharded"][k].full_tensor(), v), k
    for k, v in _replicated().items():
        assert torch.equal(state["plain"][k], v), k
    assert state["step"] == 7


def _manager(url: str, options: dict[str, Any]) -> objckpt.CheckpointManager:
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=120)
    return objckpt.CheckpointManager(url, storage_options=options, async_options=opts)


def save_step_1(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        with _manager(url, options) as mgr:
            mgr.save(1, _state(mesh, fill=True)).result(timeout=120)
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()


def load_and_save_step_2(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        with _manager(url, options) as mgr:
            state = _state(mesh, fill=False)
            assert mgr.load(state) == 1
            _check(state)
            mgr.save(2, state).result(timeout=120)
            mgr.wait_until_finished()
            again = _state(mesh, fill=False)
            assert mgr.load(again, step=2) == 2
            _check(again)
    finally:
        dist.destroy_process_group()
