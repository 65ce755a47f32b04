"""Per-rank bodies for the NCCL tests (module-level so spawn can import them).

Each rank owns one GPU and joins an NCCL-only process group: no CPU backend, as in
a training job that called ``init_process_group("nccl")``. Whatever objckpt issues
as a collective (the save's agreement, the commit exchange, shared replicated
reads, rank 0's listing) must run there.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import objckpt
from objckpt.testing import offline_env


def _state(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "replicated": torch.randn(64, 32, generator=g).to(device),  # same on every rank
        f"own.r{rank}": torch.full((1000,), float(rank + 1), device=device),
        "step": 3,
        "world": world,
    }


def save_and_load_on_nccl(
    rank: int, world: int, init_file: str, root: str, options: dict[str, Any]
) -> None:
    """The manager's async save and its load (shared replicated reads on by default),
    then a plain sync ``dcp.save``/``dcp.load``, on CUDA tensors in an NCCL group."""
    os.environ.update(offline_env())
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        assert "cpu" not in dist.get_backend_config(), dist.get_backend_config()
        state = _state(rank, world, device)
        with objckpt.CheckpointManager(root, storage_options=options) as mgr:
            mgr.save(3, state).result(timeout=300)
            assert mgr.all_steps() == [3]
            target = {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in state.items()}
            assert mgr.load(target) == 3
        for key, value in state.items():
            if torch.is_tensor(value):
                assert target[key].device == device, (key, target[key].device)
                assert torch.equal(target[key], value), key
            else:
                assert target[key] == value, key
        url = f"{root}/plain"
        dcp.save(state, storage_writer=objckpt.ObjectStoreWriter(url, storage_options=options))
        again = {k: torch.zeros_like(v) for k, v in state.items() if torch.is_tensor(v)}
        dcp.load(again, storage_reader=objckpt.ObjectStoreReader(url, storage_options=options))
        assert all(torch.equal(again[k], state[k]) for k in again)
    finally:
        dist.destroy_process_group()
