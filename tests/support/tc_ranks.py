"""Rank bodies for torch_checkpointing on objckpt's Storage with real gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ranks import init_ranks


def _state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return {"model": {"w": torch.randn(32, 16, generator=g)}, "rank": rank}


def save_and_load(rank: int, world: int, init_file: str, root: str, options: dict) -> None:
    """Every rank saves its own files, rank 0 commits once every rank's are uploaded; then
    every rank loads its own back, and a second save of the name fails on rank 0."""
    init_ranks(rank, world, init_file)
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    from objckpt.errors import CheckpointExistsError
    from objckpt.format.layout import MANIFEST_KEY
    from objckpt.torch_checkpointing import ObjckptStorageConfig

    config = ObjckptStorageConfig(root=root, storage_options=options)
    manager = CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)
    )
    try:
        manager.save("step_1", _state(rank))
        dist.barrier()
        storage = config.create_storage()
        assert storage.ls(Path("")) == ["step_1"]
        files = storage.ls(Path("step_1"))
        assert files == [f"{k}_{r}.pt" for k in ("model", "rank") for r in range(world)], files
        import json

        manifest = json.loads(storage._store.read(f"step_1/{MANIFEST_KEY}"))
        assert manifest["world_size"] == world
        loaded = manager.load("step_1", into={"model": {"w": torch.zeros(32, 16)}, "rank": None})
        assert torch.equal(loaded["model"]["w"], _state(rank)["model"]["w"])
        assert loaded["rank"] == rank
        refused = False
        try:
            manager.save("step_1", _state(rank))
        except CheckpointExistsError:
            refused = True
        assert refused, f"rank {rank}: a second save of step_1 was not refused"
    finally:
        manager.close()
        dist.destroy_process_group()
