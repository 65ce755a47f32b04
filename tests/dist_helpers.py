"""Per-rank bodies for the distributed tests (module-level so spawn can import them)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import objckpt
from objckpt.testing import offline_env


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    return {
        "w": torch.randn(66, 32, generator=g),  # uneven over 4 ranks
        "emb": torch.randn(40, 16, generator=g),
        "b": torch.randn(32, generator=g),
    }


def _init(rank: int, world: int, init_file: str) -> Any:
    os.environ.update(offline_env())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def save_sharded(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    mesh = _init(rank, world, init_file)
    try:
        state = {
            "model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()},
            "step": 7,
        }
        writer = objckpt.ObjectStoreWriter(url, storage_options=options)
        dcp.save(state, storage_writer=writer)
        if rank == 0:
            assert writer.last_manifest is not None and writer.last_manifest.world_size == world
    finally:
        dist.destroy_process_group()


def load_sharded(rank: int, world: int, init_file: str, url: str, options: dict[str, Any]) -> None:
    mesh = _init(rank, world, init_file)
    try:
        expected = full_state()
        state = {
            "model": {
                k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                for k, v in expected.items()
            },
            "step": 0,
        }
        dcp.load(state, storage_reader=objckpt.ObjectStoreReader(url, storage_options=options))
        for k, v in expected.items():
            got = state["model"][k].full_tensor()
            assert torch.equal(got, v), f"rank {rank}: {k} differs after load"
        assert state["step"] == 7
    finally:
        dist.destroy_process_group()
