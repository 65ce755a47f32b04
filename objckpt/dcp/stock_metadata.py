"""Reading a stock DCP ``.metadata`` pickle without letting it run code.

A stock DCP checkpoint has no manifest: its only description is a pickle, and a
pickle from a bucket can name any callable (``os.system`` included) to be called
while it loads. objckpt reads it with an unpickler that resolves only the classes
DCP metadata is made of — torch's checkpoint metadata dataclasses, ``torch.Size``,
dtypes, memory formats and layouts, and a few containers — and refuses anything
else with an error naming the class, before calling it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from objckpt._torch import METADATA_PICKLE_PRIVATES
from objckpt.errors import ManifestError

__all__ = ["load_stock_metadata"]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "StorageMeta"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "BytesStorageMetadata"),
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        # StorageMeta.checkpoint_id of FileSystemWriter saves: a path, built, never opened.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        *METADATA_PICKLE_PRIVATES,  # _StorageInfo, how memory formats and layouts pickle
    }
)
_TORCH_VALUES = (torch.dtype, torch.memory_format, torch.layout)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, url: str) -> None:
        super().__init__(io.BytesIO(data))
        self.url = url

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise ManifestError(
            f"{self.url} names {module}.{name}, which is not part of DCP metadata; "
            "objckpt refuses to unpickle it (a crafted .metadata could run code)"
        )


def load_stock_metadata(data: bytes, *, url: str) -> Metadata:
    """The DCP ``Metadata`` pickled in ``data``.

    Raises:
        ManifestError: The pickle names a class outside DCP metadata, is damaged,
            or is not DCP metadata (the message names ``url``).
    """
    try:
        metadata = _MetadataUnpickler(data, url).load()
    except ManifestError:
        raise
    except Exception as exc:
        raise ManifestError(f"{url} is not a readable DCP metadata file") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ManifestError(f"{url} is not DCP metadata")
    return metadata
