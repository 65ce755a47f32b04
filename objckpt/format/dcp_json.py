"""DCP ``Metadata`` in JSON, so objckpt's reader never unpickles; format-1 decoding.

DCP keeps its metadata as a pickle (``.metadata``); loading a pickle from a
bucket runs whatever code it names. objckpt writes that pickle for stock DCP
readers, and the same information as plain JSON for its own reader, plus a
CRC32C per stored item so partial (resharded) reads can be verified without
fetching whole objects.

This module holds what both manifest formats share (``StoredItem``, dtype and
planner-data encodings) and the decoder of format 1, where every stored item was
a record in the manifest. Format 2, written since, is :mod:`objckpt.format.index`.
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
from objckpt.format.bounds import MAX_DIMS, check_int, check_key

__all__ = [
    "StoredItem",
    "decode_planner_data",
    "decode_storage_meta",
    "dtype_from_name",
    "dtype_name",
    "encode_planner_data",
    "encode_storage_meta",
    "metadata_from_json",
]

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
        xxh3: xxh3-128 of the item's stored bytes (32 hex digits), what reuse
            compares (with the length) to decide an item is unchanged; None when
            unknown (stock DCP checkpoints, indexes written before #28).
        raw_length: With ``transform_descriptors`` (stream transforms such as
            compression, :mod:`objckpt.format.compress`, the first undone first):
            the item's length before them, the most decoding may produce.
    """

    relative_path: str
    offset: int
    length: int
    crc32c: str | None = None
    object_size: int = 0
    object_crc32c: str = ""
    transform_descriptors: tuple[str, ...] | None = None
    xxh3: str | None = None
    raw_length: int | None = None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a manifest names; ManifestError for anything that is not one."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r} in manifest metadata")
    return value


def _encode_path(value: Any) -> Any:
    """planner_data values are tuples of str/int (DCP's flatten mapping)."""
    if isinstance(value, (tuple, list)) and all(isinstance(v, (str, int)) for v in value):
        return list(value)
    raise TypeError(type(value).__name__)


def encode_planner_data(planner_data: Any) -> Any:
    """DCP's flatten mapping as JSON (None when it is not representable)."""
    if isinstance(planner_data, dict):
        try:
            return {k: _encode_path(v) for k, v in planner_data.items()}
        except TypeError:
            logger.info("planner_data is not JSON-representable; only .metadata keeps it")
    return None


def decode_planner_data(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: tuple(v) for k, v in raw.items()}
    return raw


def encode_storage_meta(meta: StorageMeta | None) -> Any:
    if meta is None:
        return None
    return {
        "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
        "save_id": meta.save_id,
        "modules": list(meta.modules),
    }


def decode_storage_meta(raw: Any) -> StorageMeta:
    if not isinstance(raw, dict):
        return StorageMeta()
    return StorageMeta(
        checkpoint_id=raw.get("checkpoint_id"),
        save_id=raw.get("save_id"),
        modules=list(raw.get("modules") or []),
    )


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


def _ints(values: Any, what: str) -> list[int]:
    """A list of at most MAX_DIMS integers in the 64-bit range (sizes, offsets)."""
    if not isinstance(values, list) or len(values) > MAX_DIMS:
        raise ValueError(f"{what} must be a list of at most {MAX_DIMS} integers")
    return [check_int(v, what) for v in values]


def _decode(doc: Mapping[str, Any]) -> tuple[Metadata, dict[MetadataIndex, StoredItem]]:
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, raw in doc["state_dict"].items():
        if raw["type"] == "bytes":
            sd_md[fqn] = BytesStorageMetadata()
        elif raw["type"] == "tensor":
            sd_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=dtype_from_name(raw["dtype"]), requires_grad=bool(raw["requires_grad"])
                ),
                size=torch.Size(_ints(raw["size"], f"size of {fqn!r}")),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(_ints(c["offsets"], f"a chunk offset of {fqn!r}")),
                        sizes=torch.Size(_ints(c["sizes"], f"a chunk size of {fqn!r}")),
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
            raw["fqn"],
            None if offset is None else _ints(offset, f"chunk offset of {raw['fqn']!r}"),
            raw["index"],
        )
        crc = raw["crc32c"]
        if crc is not None and (not isinstance(crc, str) or len(crc) != 8):
            raise ValueError(f"crc32c of {raw['fqn']!r} must be 8 hex digits")
        transforms = raw.get("transforms")
        items[index] = StoredItem(
            relative_path=check_key(raw["key"], f"item {raw['fqn']!r}"),
            offset=check_int(raw["offset"], f"offset of {raw['fqn']!r}"),
            length=check_int(raw["length"], f"length of {raw['fqn']!r}"),
            crc32c=crc,
            transform_descriptors=tuple(transforms) if transforms else None,
        )
    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=decode_planner_data(doc.get("planner_data")),
        storage_data=dict(items),
        storage_meta=decode_storage_meta(doc.get("storage_meta")),
        version=doc.get("version"),
    )
    return metadata, items
