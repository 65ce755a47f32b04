"""objckpt: PyTorch Distributed Checkpoints straight to object stores.

A checkpoint is a set of payload objects plus a ``manifest.json`` written last
with a create-only PUT; the manifest is the one commit point, so a failed save
never leaves a checkpoint that looks valid.

The public names below are imported on first use (PEP 562): the upload worker
processes import only the store layer, so they never pay for (or hold the memory
of) importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from objckpt import errors
from objckpt._version import __version__

if TYPE_CHECKING:
    from objckpt.dcp.load_planner import LoadPlanner
    from objckpt.dcp.storage_reader import ObjectStoreReader
    from objckpt.dcp.storage_writer import ObjectStoreWriter
    from objckpt.dcp.transforms import ByteGrouping
    from objckpt.format.manifest import Manifest
    from objckpt.ops.convert.stock import write_stock_metadata
    from objckpt.ops.maintain.retention import RetentionPolicy
    from objckpt.ops.run.backup import BackupStatus, BackupTarget
    from objckpt.ops.run.config import Config, load_config
    from objckpt.ops.run.manager import CheckpointManager
    from objckpt.ops.tier.tiers import LocalTier, TierStatus
    from objckpt.options import AsyncOptions, ReadOptions, UploadOptions
    from objckpt.pipeline.checkpointer import AsyncCheckpointer, async_save
    from objckpt.pipeline.handle import SaveHandle
    from objckpt.pipeline.queue import AsyncCallsQueue, AsyncRequest
    from objckpt.writers.location import Location
    from objckpt.writers.retry import RetryPolicy

#: Public name -> the module that defines it.
_HOMES = {
    "AsyncCallsQueue": "objckpt.pipeline.queue",
    "AsyncCheckpointer": "objckpt.pipeline.checkpointer",
    "AsyncOptions": "objckpt.options",
    "AsyncRequest": "objckpt.pipeline.queue",
    "BackupStatus": "objckpt.ops.run.backup",
    "BackupTarget": "objckpt.ops.run.backup",
    "ByteGrouping": "objckpt.dcp.transforms",
    "CheckpointManager": "objckpt.ops.run.manager",
    "Config": "objckpt.ops.run.config",
    "LoadPlanner": "objckpt.dcp.load_planner",
    "LocalTier": "objckpt.ops.tier.tiers",
    "Location": "objckpt.writers.location",
    "Manifest": "objckpt.format.manifest",
    "ObjectStoreReader": "objckpt.dcp.storage_reader",
    "ObjectStoreWriter": "objckpt.dcp.storage_writer",
    "ReadOptions": "objckpt.options",
    "RetentionPolicy": "objckpt.ops.maintain.retention",
    "RetryPolicy": "objckpt.writers.retry",
    "SaveHandle": "objckpt.pipeline.handle",
    "TierStatus": "objckpt.ops.tier.tiers",
    "UploadOptions": "objckpt.options",
    "async_save": "objckpt.pipeline.checkpointer",
    "load_config": "objckpt.ops.run.config",
    "write_stock_metadata": "objckpt.ops.convert.stock",
}

__all__ = [
    "AsyncCallsQueue",
    "AsyncCheckpointer",
    "AsyncOptions",
    "AsyncRequest",
    "BackupStatus",
    "BackupTarget",
    "ByteGrouping",
    "CheckpointManager",
    "Config",
    "LoadPlanner",
    "LocalTier",
    "Location",
    "Manifest",
    "ObjectStoreReader",
    "ObjectStoreWriter",
    "ReadOptions",
    "RetentionPolicy",
    "RetryPolicy",
    "SaveHandle",
    "TierStatus",
    "UploadOptions",
    "__version__",
    "async_save",
    "errors",
    "load_config",
    "write_stock_metadata",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'objckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
