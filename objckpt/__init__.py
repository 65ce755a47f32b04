"""objckpt: PyTorch Distributed Checkpoints straight to object stores.

A checkpoint is a set of payload objects plus a ``manifest.json`` written last
with a create-only PUT; the manifest is the one commit point, so a failed save
never leaves a checkpoint that looks valid.
"""

from objckpt import errors
from objckpt._version import __version__
from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.format.manifest import Manifest
from objckpt.ops.backup import BackupStatus, BackupTarget
from objckpt.ops.config import Config, load_config
from objckpt.ops.manager import CheckpointManager
from objckpt.ops.retention import RetentionPolicy
from objckpt.ops.tiers import LocalTier, TierStatus
from objckpt.options import AsyncOptions, ReadOptions, UploadOptions
from objckpt.pipeline.checkpointer import AsyncCheckpointer, async_save
from objckpt.pipeline.handle import SaveHandle
from objckpt.pipeline.queue import AsyncCallsQueue, AsyncRequest
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

__all__ = [
    "AsyncCallsQueue",
    "AsyncCheckpointer",
    "AsyncOptions",
    "AsyncRequest",
    "BackupStatus",
    "BackupTarget",
    "CheckpointManager",
    "Config",
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
]
