"""Manifest format 2: compact DCP metadata plus one index object per writing rank.

Format 1 put one JSON record per stored chunk in the manifest (key, offsets,
offset, length, CRC32C, field names repeated each time), and every loading rank
read all of it: at 1,024 ranks that is 303 MB per rank and ~300 GB per job. Format 2
splits what every rank needs from what only some ranks need:

* The manifest keeps DCP's ``state_dict`` description (every rank's planner needs
  the chunk layout of every tensor) as integer columns folded into runs
  (:mod:`objckpt.format.columns`), so a regularly sharded tensor costs a few
  numbers whatever the world size, plus which rank wrote each chunk.
* Where each chunk's bytes are (object key, offset, length, CRC32C) goes into
  ``__index_<rank>.<attempt>.json``, one object per writing rank, listed in the
  manifest's ``objects`` with size and CRC32C like any payload. A loading rank
  fetches only the index objects of the ranks that wrote what it reads: its own
  when the world size is unchanged, a few when resharding.

Index document::

    {"format": "objckpt.index", "version": 1, "attempt": "<id>", "rank": R,
     "fqns": [...], "keys": [...],              # tables the columns point into
     "fqn": col, "chunk": col, "key": col, "offset": col, "length": col,
     "crc32c": "<8 hex per item>",
     "xxh3": "<32 hex per item>",              # optional (since #28)
     "transforms": [[descriptor, ...], ...],    # optional: stored transformed
     "transform": col, "raw_length": col}

``chunk`` is the item's position in its tensor's chunk list (-1 for a non-tensor
value), which is also the index hint DCP's load planner puts in ``MetadataIndex``.
``xxh3`` is the xxh3-128 of each item's stored bytes (32 dashes: unknown), written
on every save so the next save can tell an unchanged item by content; ``keys`` may
name another step's object (``../step-N/<key>``, :mod:`objckpt.format.refs`) where
an item was reused. ``transform`` points into ``transforms``, the distinct chains
of DCP stream-transform descriptors (compression, :mod:`objckpt.format.compress`;
-1: stored as is), and ``raw_length`` is each item's length before them (its
stored length when untransformed): the most its decoding may produce. Both are
absent when no item is transformed, so such an index is what it was before.

This module writes the format; reading it, bounded as untrusted input, is
:mod:`objckpt.format.index_read` (its names are importable from here too).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from objckpt.errors import ManifestError
from objckpt.format import columns
from objckpt.format.dcp_json import (
    StoredItem,
    dtype_name,
    encode_planner_data,
    encode_storage_meta,
)
from objckpt.format.index_read import (
    INDEX_FORMAT,
    NO_XXH3,
    Locator,
    dcp_metadata,
    decode_index,
    decode_metadata,
)
from objckpt.format.layout import index_key

__all__ = [
    "IndexShard",
    "Locator",
    "dcp_metadata",
    "decode_index",
    "decode_metadata",
    "encode_metadata",
]


@dataclasses.dataclass(frozen=True)
class IndexShard:
    """One index object to write before the manifest."""

    rank: int
    key: str
    data: bytes


_OFFSETS = operator.attrgetter("offsets")
_SIZES = operator.attrgetter("sizes")


def encode_metadata(
    metadata: Metadata,
    items_by_rank: Sequence[Mapping[MetadataIndex, StoredItem]],
    attempt: str,
) -> tuple[dict[str, Any], list[IndexShard]]:
    """The manifest's ``metadata`` (format 2) and the index objects it names."""
    state: dict[str, Any] = {}
    # Where each chunk stands in its tensor's list, for the index objects' columns: O(chunks),
    # so built only when there are items to place (a layout alone needs none of it).
    positions: dict[str, dict[tuple[int, ...], int]] = {}
    if any(items_by_rank):
        positions = {
            fqn: {tuple(c.offsets): n for n, c in enumerate(md.chunks)}
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            ndim = len(md.size)
            entry: dict[str, Any] = {
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
            }
            if md.properties.requires_grad:
                entry["requires_grad"] = True
            if not _whole(md):  # a tensor saved in one piece needs no chunk columns
                entry["chunks"] = len(md.chunks)
                # One column per dimension, transposed by zip (C loops, not a Python
                # loop per chunk and dimension).
                offsets = list(zip(*map(_OFFSETS, md.chunks), strict=True)) or [()] * ndim
                sizes = list(zip(*map(_SIZES, md.chunks), strict=True)) or [()] * ndim
                entry["offsets"] = [columns.pack(offsets[d]) for d in range(ndim)]
                entry["sizes"] = [columns.pack(sizes[d]) for d in range(ndim)]
            state[fqn] = entry
        elif isinstance(md, BytesStorageMetadata):
            state[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"unsupported storage metadata for {fqn!r}: {type(md).__name__}")
    writer: dict[str, list[int]] = {
        fqn: [-1] * len(md.chunks)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    shards: list[IndexShard] = []
    index_keys: list[str | None] = []
    for rank, items in enumerate(items_by_rank):
        if not items:
            index_keys.append(None)
            continue
        doc = _index_doc(items, rank, attempt, positions, writer, state)
        key = index_key(rank, attempt)
        shards.append(IndexShard(rank, key, json.dumps(doc, separators=(",", ":")).encode()))
        index_keys.append(key)
    for fqn, ranks in writer.items():
        state[fqn]["writer"] = ranks[0] if "chunks" not in state[fqn] else columns.pack(ranks)
    out: dict[str, Any] = {
        "version": metadata.version,
        "state_dict": state,
        "index": index_keys,
        "planner_data": _encode_paths(metadata.planner_data),
        "storage_meta": encode_storage_meta(metadata.storage_meta),
    }
    # Items stored transformed (compressed) are longer before their transforms than
    # the objects holding them: a reader's budget for what tensors may claim counts these.
    raw = sum(
        item.raw_length or 0
        for items in items_by_rank
        for item in items.values()
        if item.transform_descriptors
    )
    if raw:
        out["raw_bytes"] = raw
    return out, shards


def _whole(md: TensorStorageMetadata) -> bool:
    """Whether the tensor was saved as one chunk covering all of it."""
    if len(md.chunks) != 1:
        return False
    chunk = md.chunks[0]
    return chunk.sizes == md.size and not any(chunk.offsets)


def _encode_paths(planner_data: Any) -> Any:
    """DCP's flatten mapping (flat key -> path in the nested state dict), keeping only
    the paths that are not simply the key split at its dots."""
    paths = encode_planner_data(planner_data)
    if not isinstance(paths, dict):
        return paths
    return {
        "split_keys": True,
        "except": {k: v for k, v in paths.items() if v != k.split(".")},
    }


def _index_doc(
    items: Mapping[MetadataIndex, StoredItem],
    rank: int,
    attempt: str,
    positions: Mapping[str, Mapping[tuple[int, ...], int]],
    writer: dict[str, list[int]],
    state: dict[str, Any],
) -> dict[str, Any]:
    fqns: dict[str, int] = {}
    keys: dict[str, int] = {}
    fqn_col, chunk_col, key_col, off_col, len_col, crcs = [], [], [], [], [], []
    hashes: list[str] = []
    chains: dict[tuple[str, ...], int] = {}
    transform_col: list[int] = []
    raw_col: list[int] = []
    for index, item in items.items():
        if item.transform_descriptors:
            chain = tuple(item.transform_descriptors)
            transform_col.append(chains.setdefault(chain, len(chains)))
            raw_col.append(item.raw_length if item.raw_length is not None else item.length)
        else:
            transform_col.append(-1)
            raw_col.append(item.length)
        if index.offset is None:
            chunk = -1
            state[index.fqn]["writer"] = rank
        else:
            try:
                chunk = positions[index.fqn][tuple(index.offset)]
            except KeyError:
                raise ManifestError(
                    f"rank {rank} wrote {index.fqn!r} at {list(index.offset)}, "
                    "a chunk DCP's metadata does not list"
                ) from None
            writer[index.fqn][chunk] = rank
        fqn_col.append(fqns.setdefault(index.fqn, len(fqns)))
        chunk_col.append(chunk)
        key_col.append(keys.setdefault(item.relative_path, len(keys)))
        off_col.append(item.offset)
        len_col.append(item.length)
        crcs.append(item.crc32c or "--------")
        hashes.append(item.xxh3 or NO_XXH3)
    doc: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": 1,
        "attempt": attempt,
        "rank": rank,
        "fqns": list(fqns),
        "keys": list(keys),
        "fqn": columns.pack(fqn_col),
        "chunk": columns.pack(chunk_col),
        "key": columns.pack(key_col),
        "offset": columns.pack(off_col),
        "length": columns.pack(len_col),
        "crc32c": "".join(crcs),
        "xxh3": "".join(hashes),
    }
    if chains:  # only a save with stream transforms (compression) has these columns
        doc["transforms"] = [list(c) for c in chains]
        doc["transform"] = columns.pack(transform_col)
        doc["raw_length"] = columns.pack(raw_col)
    return doc
