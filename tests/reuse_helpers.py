"""The LoRA-shaped state of the reuse tests and bench, and a reader of stored items.

The state is what a fine-tuning job checkpoints: a frozen base (32 MiB of fp32
weights that never change), small low-rank adapters that train, and the
optimizer's state for the adapters only (Adam's moments and step count).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from objckpt import Location
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import decode_index, decode_metadata
from objckpt.format.manifest import read_manifest
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

#: Frozen base: 8 layers of 1024 x 1024 fp32 (4 MiB each, 32 MiB in all).
LAYERS, WIDTH, RANK = 8, 1024, 8


def lora_state(layers: int = LAYERS, width: int = WIDTH, rank: int = RANK) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, torch.Tensor] = {}
    for n in range(layers):
        model[f"layers.{n}.weight"] = torch.randn(width, width, generator=g)
        for name, shape in (
            (f"layers.{n}.lora_a", (rank, width)),
            (f"layers.{n}.lora_b", (width, rank)),
        ):
            model[name] = torch.zeros(shape)
            moments[f"{name}.exp_avg"] = torch.zeros(shape)
            moments[f"{name}.exp_avg_sq"] = torch.zeros(shape)
    return {"model": model, "optim": {"state": moments, "step": 0}}


def train_step(state: dict[str, Any], step: int) -> None:
    """One step of training: the adapters and their optimizer state change, the base not."""
    g = torch.Generator().manual_seed(step)
    for name, value in state["model"].items():
        if "lora" in name:
            value.add_(torch.randn(value.shape, generator=g) * 0.01)
    for value in state["optim"]["state"].values():
        value.add_(torch.rand(value.shape, generator=g))
    state["optim"]["step"] = step


def stored_items(url: str, target: StoreTarget) -> dict[MetadataIndex, StoredItem]:
    """Every stored item of the committed step ``url``, from all its index objects."""
    store = open_store(Location.parse(url, target.storage_options))
    manifest = read_manifest(store)
    objects = {o.key: o for o in manifest.objects}
    metadata, locator = decode_metadata(manifest.metadata, url=url, objects=objects)
    items: dict[MetadataIndex, StoredItem] = {}
    for rank, key in enumerate(locator.index_keys):
        if key is not None:
            blob = store.read(key)
            items.update(
                decode_index(blob, rank=rank, attempt=manifest.attempt, metadata=metadata, url=key)
            )
    return items
