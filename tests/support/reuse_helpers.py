"""The LoRA-shaped state of the reuse tests and bench, and a reader of stored items.

The state is what a fine-tuning job checkpoints: a frozen base (32 MiB of fp32
weights that never change), small low-rank adapters that train, and the
optimizer's state for the adapters only (Adam's moments and step count).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from objckpt import Location
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import decode_index, decode_metadata
from objckpt.format.manifest import read_manifest
from objckpt.testing import lora as testing_lora
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

#: Frozen base: 8 layers of 1024 x 1024 fp32 (4 MiB each, 32 MiB in all).
LAYERS, WIDTH, RANK = 8, 1024, 8


def lora_state(layers: int = LAYERS, width: int = WIDTH, rank: int = RANK) -> dict[str, Any]:
    """The tests' LoRA-shaped state (a 32 MiB frozen base by default)."""
    return testing_lora.lora_state(layers, width, rank)


#: One step of training: the adapters and their optimizer state change, the base not.
train_step = testing_lora.lora_step


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
