"""Per-rank bodies of the reuse-check count (module-level so spawn can import them).

A job of ``world`` ranks saves step 1; a new job of the same size (a restart: no
rank remembers what step 1 holds) loads it and saves step 2, which reuses every
item. How often the restarted job asks the store about step 1's objects is what
the test counts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ranks import init_ranks
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt

__all__ = ["restart_and_save_step_2", "save_step_1"]


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {f"layer{i}": torch.randn(64, 32, generator=g) for i in range(4)}


def _state(mesh: Any, fill: bool) -> dict[str, Any]:
    return {
        "model": {
            k: distribute_tensor(v if fill else torch.zeros_like(v), mesh, [Shard(0)])
            for k, v in _full().items()
        },
        "norm": torch.ones(16) if fill else torch.zeros(16),
    }


def _manager(url: str, options: dict[str, Any]) -> objckpt.CheckpointManager:
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=180)
    return objckpt.CheckpointManager(url, storage_options=options, async_options=opts)


def save_step_1(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        with _manager(url, options) as mgr:
            mgr.save(1, _state(mesh, fill=True)).result(timeout=180)
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()


def restart_and_save_step_2(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        with _manager(url, options) as mgr:
            state = _state(mesh, fill=False)
            assert mgr.load(state) == 1
            mgr.save(2, state).result(timeout=180)
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()
