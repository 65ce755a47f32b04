"""Rank bodies for tests/dcp/test_load_planner.py (module-level so spawn can import them)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt
from objckpt.testing import offline_env


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(66, 30, generator=g),  # uneven over 4 rows and 2 columns alike
        "emb": torch.randn(10, 6, generator=g),  # an empty shard at 4 ranks (3, 3, 3, 1)
        "b": torch.randn(9, generator=g),
    }


def init_ranks(rank: int, world: int, init_file: str) -> Any:
    os.environ.update(offline_env())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _manager(url: str, options: dict[str, Any]) -> objckpt.CheckpointManager:
    opts = objckpt.AsyncOptions(workers=1, barrier_timeout=120)
    return objckpt.CheckpointManager(url, storage_options=options, async_options=opts)


def save_rows(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        with _manager(url, options) as mgr:
            state = {
                "model": {
                    k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()
                },
                "step": 5,
            }
            mgr.save(5, state).result(timeout=120)
            mgr.wait_until_finished()
    finally:
        dist.destroy_process_group()


def load_resharded(
    rank: int, world: int, init_file: str, url: str, options: dict[str, Any]
) -> None:
    mesh = init_ranks(rank, world, init_file)
    try:
        expected = full_state()
        state: dict[str, Any] = {
            "model": {
                k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)])
                for k, v in expected.items()
            },
            "step": 0,
        }
        with _manager(url, options) as mgr:
            assert mgr.load(state) == 5
        for k, v in expected.items():
            got = state["model"][k]
            assert got.placements == (Shard(v.dim() - 1),), (rank, k, got.placements)
            assert torch.equal(got.full_tensor(), v), f"rank {rank}: {k} differs after load"
        assert state["step"] == 5
    finally:
        dist.destroy_process_group()
