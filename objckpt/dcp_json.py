"""DCP ``Metadata`` to and from JSON, so objckpt's reader never unpickles.

DCP keeps its metadata as a pickle (``.metadata``); loading a pickle from a
bucket runs whatever code it names. objckpt writes that pickle for stock DCP
readers, and the same information as plain JSON inside the manifest for its own
reader, plus a CRC32C per stored item so partial (resharded) reads can be
verified without fetching whole objects.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from objckpt.errors import ManifestError
from objckpt.manifest import check_key

__all__ = ["StoredItem", "metadata_from_json", "metadata_to_json"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one write item's bytes are: DCP's ``_StorageInfo`` plus checksums.

    Ranks return these as ``WriteResult.storage_data``; the coordinator turns them
    into DCP's own ``_StorageInfo`` for ``.metadata`` and into manifest entries.

    Attributes:
        relative_path: Payload object key, relative to the checkpoint URL.
        offset: Byte offset of the item inside the object.
        length: Byte length of the item.
        crc32c: CRC32C of the item's bytes (8 hex digits), or None when unknown
            (stock DCP checkpoints).
        object_size: Size of the whole payload object.
        object_crc32c: CRC32C of the whole payload object.
    """

    relative_path: str
    offset: int
    length: int
    crc32c: str | None = None
    object_size: int = 0
    object_crc32c: str = ""
    transform_descriptors: tuple[str, ...] | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r} in manifest metadata")
    return value


def _encode_path(value: Any) -> Any:
    """planner_data values are tuples of str/int (DCP's flatten mapping)."""
    if isinstance(value, (tuple, list)) and all(isinstance(v, (str, int)) for v in value):
        return list(value)
    raise TypeError(type(value).__name__)


def metadata_to_json(
    metadata: Metadata, items: Mapping[MetadataIndex, StoredItem]
) -> dict[str, Any]:
    """Encode DCP metadata and the stored items as JSON-ready data."""
    tensors: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = {
                "type": "tensor",
                "dtype": _dtype_name(md.properties.dtype),
                "requires_grad": bool(md.properties.requires_grad),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            tensors[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"unsupported storage metadata for {fqn!r}: {type(md).__name__}")
    storage = []
    for index, item in items.items():
        storage.append(
            {
                "fqn": index.fqn,
                "chunk_offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "key": item.relative_path,
                "offset": item.offset,
                "length": item.length,
                "crc32c": item.crc32c,
                "transforms": list(item.transform_descriptors)
                if item.transform_descriptors
                else None,
            }
        )
    planner_data: Any = None
    if isinstance(metadata.planner_data, dict):
        try:
            planner_data = {k: _encode_path(v) for k, v in metadata.planner_data.items()}
        except TypeError:
            logger.info("planner_data is not JSON-representable; only .metadata keeps it")
    meta = metadata.storage_meta
    return {
        "version": metadata.version,
        "state_dict": tensors,
        "storage": storage,
        "planner_data": planner_data,
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id,
            "modules": list(meta.modules),
        },
    }


def metadata_from_json(
    doc: Mapping[str, Any], *, url: str
) -> tuple[Metadata, dict[MetadataIndex, StoredItem]]:
    """Rebuild DCP metadata and stored-item locations; ManifestError on bad input."""
    try:
        return _decode(doc)
    except ManifestError as exc:
        raise ManifestError(f"manifest {url}: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(
            f"manifest {url}: malformed DCP metadata ({type(exc).__name__}: {exc})"
        ) from exc


def _decode(doc: Mapping[str, Any]) -> tuple[Metadata, dict[MetadataIndex, StoredItem]]:
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, raw in doc["state_dict"].items():
        if raw["type"] == "bytes":
            sd_md[fqn] = BytesStorageMetadata()
        elif raw["type"] == "tensor":
            sd_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=_dtype(raw["dtype"]), requires_grad=bool(raw["requires_grad"])
                ),
                size=torch.Size([int(s) for s in raw["size"]]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size([int(o) for o in c["offsets"]]),
                        sizes=torch.Size([int(s) for s in c["sizes"]]),
                    )
                    for c in raw["chunks"]
                ],
            )
        else:
            raise ValueError(f"unknown entry type {raw['type']!r} for {fqn!r}")
    items: dict[MetadataIndex, StoredItem] = {}
    for raw in doc["storage"]:
        offset = raw["chunk_offset"]
        index = MetadataIndex(
            raw["fqn"], None if offset is None else [int(o) for o in offset], raw["index"]
        )
        length, start = int(raw["length"]), int(raw["offset"])
        if length < 0 or start < 0:
            raise ValueError(f"negative offset or length for {raw['fqn']!r}")
        transforms = raw.get("transforms")
        items[index] = StoredItem(
            relative_path=check_key(raw["key"], f"item {raw['fqn']!r}"),
            offset=start,
            length=length,
            crc32c=raw["crc32c"],
            transform_descriptors=tuple(transforms) if transforms else None,
        )
    planner_data = doc.get("planner_data")
    if isinstance(planner_data, dict):
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    meta_raw = doc.get("storage_meta")
    storage_meta = (
        StorageMeta(
            checkpoint_id=meta_raw.get("checkpoint_id"),
            save_id=meta_raw.get("save_id"),
            modules=list(meta_raw.get("modules") or []),
        )
        if isinstance(meta_raw, dict)
        else StorageMeta()
    )
    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=planner_data,
        storage_data=dict(items),
        storage_meta=storage_meta,
        version=doc.get("version"),
    )
    return metadata, items
