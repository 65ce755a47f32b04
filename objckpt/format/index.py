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
     "crc32c": "<8 hex per item>"}

``chunk`` is the item's position in its tensor's chunk list (-1 for a non-tensor
value), which is also the index hint DCP's load planner puts in ``MetadataIndex``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from objckpt.errors import ManifestError
from objckpt.format import columns
from objckpt.format.dcp_json import (
    StoredItem,
    decode_planner_data,
    decode_storage_meta,
    dtype_from_name,
    dtype_name,
    encode_planner_data,
    encode_storage_meta,
    metadata_from_json,
)
from objckpt.format.layout import index_key
from objckpt.format.manifest import Manifest, check_key

__all__ = [
    "IndexShard",
    "Locator",
    "dcp_metadata",
    "decode_index",
    "decode_metadata",
    "encode_metadata",
]

INDEX_FORMAT = "objckpt.index"
_HEX = frozenset("0123456789abcdef")


@dataclasses.dataclass(frozen=True)
class IndexShard:
    """One index object to write before the manifest."""

    rank: int
    key: str
    data: bytes


def encode_metadata(
    metadata: Metadata,
    items_by_rank: Sequence[Mapping[MetadataIndex, StoredItem]],
    attempt: str,
) -> tuple[dict[str, Any], list[IndexShard]]:
    """The manifest's ``metadata`` (format 2) and the index objects it names."""
    state: dict[str, Any] = {}
    positions: dict[str, dict[tuple[int, ...], int]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            ndim = len(md.size)
            positions[fqn] = {tuple(c.offsets): n for n, c in enumerate(md.chunks)}
            entry: dict[str, Any] = {
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
            }
            if md.properties.requires_grad:
                entry["requires_grad"] = True
            if not _whole(md):  # a tensor saved in one piece needs no chunk columns
                entry["chunks"] = len(md.chunks)
                entry["offsets"] = [
                    columns.pack([c.offsets[d] for c in md.chunks]) for d in range(ndim)
                ]
                entry["sizes"] = [
                    columns.pack([c.sizes[d] for c in md.chunks]) for d in range(ndim)
                ]
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
    return {
        "version": metadata.version,
        "state_dict": state,
        "index": index_keys,
        "planner_data": _encode_paths(metadata.planner_data),
        "storage_meta": encode_storage_meta(metadata.storage_meta),
    }, shards


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


def _decode_paths(raw: Any, keys: Sequence[str]) -> Any:
    if isinstance(raw, dict) and raw.get("split_keys") is True:
        found = raw.get("except") or {}
        if not isinstance(found, dict):
            raise ValueError("planner_data exceptions must be an object")
        out = {k: tuple(k.split(".")) for k in keys}
        out.update({k: tuple(v) for k, v in found.items()})
        return out
    return decode_planner_data(raw)


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
    for index, item in items.items():
        if item.transform_descriptors:
            raise ManifestError(f"stream transforms are not supported ({index.fqn!r})")
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
    return {
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
    }


class Locator:
    """Which index object holds each stored item of a format-2 checkpoint."""

    def __init__(
        self,
        index_keys: Sequence[str | None],
        writers: Mapping[str, list[int] | int],
    ) -> None:
        self.index_keys = tuple(index_keys)
        self._writers = writers

    def shard_of(self, index: MetadataIndex, metadata: Metadata) -> int | None:
        """The rank whose index object locates ``index`` (None: no such item)."""
        writer = self._writers.get(index.fqn)
        if writer is None:
            return None
        if isinstance(writer, int):
            return writer
        pos = index.index
        md = metadata.state_dict_metadata[index.fqn]
        if not isinstance(md, TensorStorageMetadata):
            return None
        if pos is None or pos >= len(md.chunks) or md.chunks[pos].offsets != index.offset:
            pos = next(
                (n for n, c in enumerate(md.chunks) if c.offsets == index.offset),
                None,
            )
        if pos is None or writer[pos] < 0:
            return None
        return writer[pos]


def decode_metadata(doc: Mapping[str, Any], *, url: str) -> tuple[Metadata, Locator]:
    """DCP metadata (without item locations) and the locator of a format-2 manifest."""
    try:
        return _decode_metadata(doc, url)
    except ManifestError as exc:
        raise ManifestError(f"manifest {url}: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ManifestError(
            f"manifest {url}: malformed DCP metadata ({type(exc).__name__}: {exc})"
        ) from exc


def _decode_metadata(doc: Mapping[str, Any], url: str) -> tuple[Metadata, Locator]:
    index_keys = doc["index"]
    if not isinstance(index_keys, list):
        raise ValueError("'index' must be a list")
    keys = [None if k is None else check_key(k, f"index[{n}]") for n, k in enumerate(index_keys)]
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    writers: dict[str, list[int] | int] = {}
    sizes_cache: dict[tuple[int, ...], torch.Size] = {}
    for fqn, raw in doc["state_dict"].items():
        kind = raw.get("type", "tensor")
        if kind == "bytes":
            sd_md[fqn] = BytesStorageMetadata()
            writer = raw["writer"]
            if type(writer) is not int or not 0 <= writer < len(keys):
                raise ValueError(f"{fqn!r}: writer {writer!r} is not a rank of the index")
            writers[fqn] = writer
            continue
        if kind != "tensor":
            raise ValueError(f"unknown entry type {kind!r} for {fqn!r}")
        size = [int(s) for s in raw["size"]]
        ndim = len(size)
        if "chunks" not in raw:  # saved whole: one chunk at the origin
            n, offs, lens = 1, [[0] for _ in size], [[s] for s in size]
            writer_col = [raw["writer"]]
            if type(writer_col[0]) is not int:
                raise ValueError(f"{fqn!r}: writer {writer_col[0]!r} is not a rank")
        else:
            n = raw["chunks"]
            if type(n) is not int or n < 0 or len(raw["offsets"]) != ndim:
                raise ValueError(f"{fqn!r}: chunk columns do not match its {ndim} dimensions")
            offs = [columns.unpack(raw["offsets"][d], n, f"{fqn!r} offsets") for d in range(ndim)]
            lens = [columns.unpack(raw["sizes"][d], n, f"{fqn!r} sizes") for d in range(ndim)]
            writer_col = columns.unpack(raw["writer"], n, f"{fqn!r} writer")
        if any(not -1 <= w < len(keys) for w in writer_col):
            raise ValueError(f"{fqn!r}: a chunk's writer is not a rank of the index")
        # The hot loop of a load at scale (a chunk per tensor and rank): tuples
        # straight from the columns, and one torch.Size per distinct chunk shape.
        if ndim:
            shapes = []
            for shape in zip(*lens, strict=True):
                cached = sizes_cache.get(shape)
                if cached is None:
                    cached = sizes_cache[shape] = torch.Size(shape)
                shapes.append(cached)
            chunks = [
                ChunkStorageMetadata(torch.Size(offset), shape)
                for offset, shape in zip(zip(*offs, strict=True), shapes, strict=True)
            ]
        else:  # a 0-d tensor: one chunk of no dimensions
            chunks = [ChunkStorageMetadata(torch.Size(()), torch.Size(())) for _ in range(n)]
        sd_md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=dtype_from_name(raw["dtype"]),
                requires_grad=bool(raw.get("requires_grad", False)),
            ),
            size=torch.Size(size),
            chunks=chunks,
        )
        writers[fqn] = writer_col
    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=_decode_paths(doc.get("planner_data"), list(sd_md)),
        storage_data=None,
        storage_meta=decode_storage_meta(doc.get("storage_meta")),
        version=doc.get("version"),
    )
    return metadata, Locator(keys, writers)


def dcp_metadata(manifest: Manifest, *, url: str) -> Metadata:
    """The DCP metadata of a manifest of any format (format 2: without item locations)."""
    if manifest.version >= 2:
        return decode_metadata(manifest.metadata, url=url)[0]
    return metadata_from_json(manifest.metadata, url=url)[0]


def decode_index(
    blob: bytes, *, rank: int, attempt: str, metadata: Metadata, url: str
) -> dict[MetadataIndex, StoredItem]:
    """The item locations in one index object; ManifestError naming ``url`` on bad input."""
    try:
        doc = json.loads(blob)
        return _decode_index(doc, rank, attempt, metadata)
    except ManifestError as exc:
        raise ManifestError(f"index {url}: {exc}") from exc
    except (UnicodeDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise ManifestError(f"index {url} is malformed ({type(exc).__name__}: {exc})") from exc


def _decode_index(
    doc: Any, rank: int, attempt: str, metadata: Metadata
) -> dict[MetadataIndex, StoredItem]:
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or doc.get("version") != 1:
        raise ValueError("not an objckpt index (format/version)")
    if doc.get("rank") != rank or doc.get("attempt") != attempt:
        raise ValueError(f"belongs to rank {doc.get('rank')} of attempt {doc.get('attempt')}")
    fqns, keys, crcs = doc["fqns"], doc["keys"], doc["crc32c"]
    if not isinstance(crcs, str) or len(crcs) % 8 or not set(crcs) <= _HEX | {"-"}:
        raise ValueError("crc32c must be 8 hex digits per item")
    n = len(crcs) // 8
    fqn_col = columns.unpack(doc["fqn"], n, "fqn")
    chunk_col = columns.unpack(doc["chunk"], n, "chunk")
    key_col = columns.unpack(doc["key"], n, "key")
    off_col = columns.unpack(doc["offset"], n, "offset")
    len_col = columns.unpack(doc["length"], n, "length")
    checked_keys = [check_key(k, "index keys") for k in keys]
    items: dict[MetadataIndex, StoredItem] = {}
    sd_md = metadata.state_dict_metadata
    for i in range(n):
        fqn = fqns[fqn_col[i]]
        chunk = chunk_col[i]
        if off_col[i] < 0 or len_col[i] < 0:
            raise ValueError(f"negative offset or length for {fqn!r}")
        md = sd_md.get(fqn)
        if chunk < 0:
            if not isinstance(md, BytesStorageMetadata):
                raise ValueError(f"{fqn!r} is not a non-tensor value in the manifest")
            index = MetadataIndex(fqn)
        else:
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{fqn!r} is not a tensor in the manifest")
            index = MetadataIndex(fqn, md.chunks[chunk].offsets, chunk)
        crc = crcs[8 * i : 8 * i + 8]
        items[index] = StoredItem(
            relative_path=checked_keys[key_col[i]],
            offset=off_col[i],
            length=len_col[i],
            crc32c=None if crc == "--------" else crc,
        )
    return items
