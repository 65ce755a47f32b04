"""objckpt: PyTorch Distributed Checkpoints straight to object stores.

A checkpoint is a set of payload objects plus a ``manifest.json`` written last
with a create-only PUT; the manifest is the one commit point, so a failed save
never leaves a checkpoint that looks valid.
"""

from objckpt import errors
from objckpt._version import __version__
from objckpt.async_save import AsyncCheckpointer, AsyncOptions, SaveHandle, async_save
from objckpt.backup import BackupStatus, BackupTarget
from objckpt.config import Config, load_config
from objckpt.location import Location
from objckpt.manager import CheckpointManager
from objckpt.manifest import Manifest
from objckpt.options import ReadOptions, UploadOptions
from objckpt.queue import AsyncCallsQueue, AsyncRequest
from objckpt.retention import RetentionPolicy
from objckpt.retry import RetryPolicy
from objckpt.storage_reader import ObjectStoreReader
from objckpt.storage_writer import ObjectStoreWriter

__all__ = [
    "AsyncCallsQueue",
    "AsyncCheckpointer",
    "AsyncOptions",
    "AsyncRequest",
    "BackupStatus",
    "BackupTarget",
    "CheckpointManager",
    "Config",
    "Location",
    "Manifest",
    "ObjectStoreReader",
    "ObjectStoreWriter",
    "ReadOptions",
    "RetentionPolicy",
    "RetryPolicy",
    "SaveHandle",
    "UploadOptions",
    "__version__",
    "async_save",
    "errors",
    "load_config",
]
