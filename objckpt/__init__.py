"""objckpt: PyTorch Distributed Checkpoints straight to object stores.

A checkpoint is a set of payload objects plus a ``manifest.json`` written last
with a create-only PUT; the manifest is the one commit point, so a failed save
never leaves a checkpoint that looks valid.
"""

from objckpt import errors
from objckpt._version import __version__
from objckpt.location import Location
from objckpt.manifest import Manifest
from objckpt.options import ReadOptions, UploadOptions
from objckpt.storage_reader import ObjectStoreReader
from objckpt.storage_writer import ObjectStoreWriter

__all__ = [
    "Location",
    "Manifest",
    "ObjectStoreReader",
    "ObjectStoreWriter",
    "ReadOptions",
    "UploadOptions",
    "__version__",
    "errors",
]
