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

The format, its writer and its bounded reader are one module on purpose: the
document above is defined once, and the encoder and the decoder that must agree
on it sit side by side.

Writing. The coordinator can build every index object from every rank's write
results (:func:`encode_metadata`), but nothing in a rank's index needs the other
ranks: an item's ``chunk`` column is its position in its tensor's chunk list,
which DCP's global planner already wrote into every ``WriteItem``'s
``MetadataIndex.index`` (``create_default_global_save_plan`` rewrites the index
hints). So each rank can encode exactly those bytes from its own items
(:func:`encode_rank_index`, the same :func:`_index_doc`), and the manifest's
layout (dtype, shape and chunk columns of every tensor) is encoded once per
global plan (:func:`layout_doc`), with each chunk's writer filled in per save
(:func:`writer_columns`, :func:`with_writers`).

Reading. Both documents come from the bucket, so every count and extent in them
is checked against what the rest of the metadata allows
(:mod:`objckpt.format.bounds`) before a run is expanded or anything is fetched: a
tensor's chunk count against its element count and what the index objects can
place, chunk columns against the tensor's dimensions, index columns against the
tables they point into. A crafted manifest costs a ``ManifestError`` naming it,
not memory.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

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
from objckpt.format.bounds import (
    MAX_INT,
    check_count,
    check_dims,
    check_int,
    check_key,
    check_name,
    column_extent,
    load_json,
)
from objckpt.format.chunk_runs import ChunkRuns
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
from objckpt.format.manifest import Manifest, ObjectEntry

__all__ = [
    "INDEX_FORMAT",
    "NO_XXH3",
    "IndexShard",
    "Locator",
    "dcp_metadata",
    "decode_index",
    "decode_metadata",
    "encode_metadata",
    "encode_rank_index",
    "layout_doc",
    "with_writers",
    "writer_columns",
]

INDEX_FORMAT = "objckpt.index"
_HEX = frozenset("0123456789abcdef")
#: Bounds of a stream-transform chain in an index (DCP writes one descriptor per
#: extension; objckpt's compression two).
_MAX_TRANSFORMS = 8
_MAX_DESCRIPTOR = 200
#: An item's xxh3 in the index when it is not known.
NO_XXH3 = "-" * 32


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
    # Where each chunk stands in its tensor's list, for the index objects' columns, and
    # which rank wrote it: only for tensors saved in pieces. A tensor saved whole (most
    # of them, and all of a one-rank job's) has one chunk, found without a table: at
    # 10,000 tensors the per-tensor tables were 30,000 objects per save, each kept long
    # enough to count towards a full garbage collection (#47).
    positions: dict[str, dict[tuple[int, ...], int]] = {}
    writer: dict[str, list[int]] = {}
    placing = any(items_by_rank)  # a layout alone places nothing
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            ndim = len(md.size)
            entry: dict[str, Any] = {
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
            }
            if md.properties.requires_grad:
                entry["requires_grad"] = True
            if _whole(md):  # a tensor saved in one piece needs no chunk columns
                entry["writer"] = -1  # until a rank's item names it
            else:
                entry["chunks"] = len(md.chunks)
                # One column per dimension, transposed by zip (C loops, not a Python
                # loop per chunk and dimension).
                offsets = list(zip(*map(_OFFSETS, md.chunks), strict=True)) or [()] * ndim
                sizes = list(zip(*map(_SIZES, md.chunks), strict=True)) or [()] * ndim
                entry["offsets"] = [columns.pack(offsets[d]) for d in range(ndim)]
                entry["sizes"] = [columns.pack(sizes[d]) for d in range(ndim)]
                writer[fqn] = [-1] * len(md.chunks)
                if placing:
                    positions[fqn] = {tuple(c.offsets): n for n, c in enumerate(md.chunks)}
            state[fqn] = entry
        elif isinstance(md, BytesStorageMetadata):
            state[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"unsupported storage metadata for {fqn!r}: {type(md).__name__}")
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
        state[fqn]["writer"] = columns.pack(ranks)
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


def _unlisted(rank: int, index: MetadataIndex) -> ManifestError:
    offset = None if index.offset is None else list(index.offset)
    return ManifestError(
        f"rank {rank} wrote {index.fqn!r} at {offset}, a chunk DCP's metadata does not list"
    )


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
        if index.offset is None:  # a non-tensor value
            try:  # (a rank's own index passes scratch tables that take any name)
                entry = state[index.fqn]
            except KeyError:
                raise _unlisted(rank, index) from None
            if "size" in entry:
                raise _unlisted(rank, index)
            chunk = -1
            entry["writer"] = rank
        elif (chunks := positions.get(index.fqn)) is not None:
            chunk = chunks.get(tuple(index.offset), -1)
            if chunk < 0:
                raise _unlisted(rank, index)
            writer[index.fqn][chunk] = rank
        elif (
            (entry := state.get(index.fqn)) is not None
            and "size" in entry
            and len(index.offset) == len(entry["size"])
            and not any(index.offset)
        ):
            chunk = 0  # saved whole: its one chunk starts at the origin
            entry["writer"] = rank
        else:
            raise _unlisted(rank, index)
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


def encode_rank_index(
    items: Mapping[MetadataIndex, StoredItem], rank: int, attempt: str
) -> IndexShard:
    """The index object of ``rank``, from its own items alone.

    Raises:
        ManifestError: An item's index carries no chunk position (a save planner
            that does not rewrite DCP's index hints); names the item.
    """
    positions: dict[str, dict[tuple[int, ...], int]] = collections.defaultdict(dict)
    for index in items:
        if index.offset is None:
            continue
        if index.index is None:
            raise ManifestError(
                f"rank {rank}'s item {index.fqn!r} at {list(index.offset)} has no chunk "
                "position (the save planner did not rewrite DCP's index hints)"
            )
        positions[index.fqn][tuple(index.offset)] = index.index
    # What _index_doc records for the coordinator (each chunk's writer) is not this
    # rank's to decide: it goes into scratch tables here.
    scratch_writer = cast(dict[str, list[int]], collections.defaultdict(dict))
    scratch_state: dict[str, Any] = collections.defaultdict(dict)
    doc = _index_doc(items, rank, attempt, positions, scratch_writer, scratch_state)
    return IndexShard(
        rank, index_key(rank, attempt), json.dumps(doc, separators=(",", ":")).encode()
    )


def layout_doc(metadata: Metadata, attempt: str) -> dict[str, Any]:
    """The manifest's ``metadata`` for ``metadata``'s global plan with no writers yet:
    every tensor chunk's writer is -1 and no rank has an index (see :func:`with_writers`).

    Costs O(chunks) once per global plan; a save with a cached plan reuses it."""
    doc, _ = encode_metadata(metadata, [], attempt)
    return doc


def writer_columns(
    doc: Mapping[str, Any], items_by_rank: Iterable[tuple[int, Iterable[MetadataIndex]]]
) -> dict[str, Any]:
    """Each entry's ``writer`` (a rank, or a column of ranks per chunk), as
    ``encode_metadata`` writes it, from which rank stored which item.

    Raises:
        ManifestError: An item is not in the layout, or a chunk or value of the
            plan is in no rank's index (a rank's items went missing: never commit).
    """
    state = doc["state_dict"]
    chunked: dict[str, list[int]] = {
        fqn: [-1] * int(entry["chunks"]) for fqn, entry in state.items() if "chunks" in entry
    }
    single: dict[str, int] = {}
    for rank, indexes in items_by_rank:
        for index in indexes:
            if index.fqn in chunked:
                if index.index is None or not 0 <= index.index < len(chunked[index.fqn]):
                    raise ManifestError(
                        f"rank {rank} stored {index.fqn!r} chunk {index.index}, which the "
                        "global plan does not list"
                    )
                chunked[index.fqn][index.index] = rank
            elif index.fqn in state:
                single[index.fqn] = rank
            else:
                raise ManifestError(f"rank {rank} stored {index.fqn!r}, which the plan lacks")
    out: dict[str, Any] = {}
    for fqn in state:
        if fqn in chunked:
            lost = [n for n, rank in enumerate(chunked[fqn]) if rank < 0]
            if lost:  # every chunk of the plan was some rank's item
                raise ManifestError(
                    f"no rank's index places chunk {lost[0]} of {fqn!r} "
                    f"({len(lost)} of its {len(chunked[fqn])} chunks unplaced)"
                )
            out[fqn] = columns.pack(chunked[fqn])
        elif fqn in single:
            out[fqn] = single[fqn]
        else:
            raise ManifestError(f"no rank's index places {fqn!r}")
    return out


def with_writers(
    doc: Mapping[str, Any],
    writers: Mapping[str, Any],
    index_keys: list[str | None],
    raw_bytes: int = 0,
) -> dict[str, Any]:
    """``doc`` (a :func:`layout_doc`) completed for one save: its writers, index keys and
    the length of its transformed items before their transforms (``raw_bytes``, 0:
    none), in the key order ``encode_metadata`` gives them (the same document)."""
    state = {fqn: {**entry, "writer": writers[fqn]} for fqn, entry in doc["state_dict"].items()}
    out = {**doc, "state_dict": state, "index": list(index_keys)}
    if raw_bytes:
        out["raw_bytes"] = raw_bytes
    return out


def _decode_paths(raw: Any, keys: Sequence[str]) -> Any:
    if isinstance(raw, dict) and raw.get("split_keys") is True:
        found = raw.get("except") or {}
        if not isinstance(found, dict):
            raise ValueError("planner_data exceptions must be an object")
        out = {k: tuple(k.split(".")) for k in keys}
        out.update({k: tuple(v) for k, v in found.items()})
        return out
    return decode_planner_data(raw)


class Locator:
    """Which index object holds each stored item of a format-2 checkpoint."""

    def __init__(
        self,
        index_keys: Sequence[str | None],
        writers: Mapping[str, Sequence[int] | int],
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


def decode_metadata(
    doc: Mapping[str, Any], *, url: str, objects: Mapping[str, ObjectEntry] | None = None
) -> tuple[Metadata, Locator]:
    """DCP metadata (without item locations) and the locator of a format-2 manifest.

    Args:
        doc: The manifest's ``metadata``.
        url: The checkpoint's URL, for messages.
        objects: The manifest's objects by key: with them, no tensor may need more
            bytes than the payload holds, and no more chunks may be claimed than the
            index objects can place (each item takes 8 bytes of CRC32C in one).

    Raises:
        ManifestError: Malformed, or a count or extent the rest does not allow.
    """
    try:
        return _decode_metadata(doc, _Budget.of(doc, objects))
    except ManifestError as exc:
        raise ManifestError(f"manifest {url}: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ManifestError(
            f"manifest {url}: malformed DCP metadata ({type(exc).__name__}: {exc})"
        ) from exc


@dataclasses.dataclass
class _Budget:
    """What the rest of a manifest allows its tensors: payload bytes, and chunks."""

    payload_bytes: int
    chunks: int

    @classmethod
    def of(cls, doc: Mapping[str, Any], objects: Mapping[str, ObjectEntry] | None) -> _Budget:
        if objects is None:
            return cls(MAX_INT, MAX_INT)
        index = doc.get("index")
        keys = []
        for n, key in enumerate(index if isinstance(index, list) else []):
            if key is None:
                continue
            keys.append(check_name(key, f"index[{n}]"))
            if key not in objects:
                raise ManifestError(f"names index object {key!r}, which its object list does not")
        placed = sum(objects[k].size // 8 for k in keys)
        # Compressed items: what they decode to, which each item's decoding is
        # bounded by (its index's raw_length, checked against its chunk's shape).
        raw = check_int(doc.get("raw_bytes", 0), "raw_bytes")
        return cls(sum(o.size for o in objects.values()) + raw, placed)

    def take_chunks(self, n: int, fqn: str) -> None:
        if n > self.chunks:
            raise ManifestError(
                f"{fqn!r} claims {n} chunks, more than the {self.chunks} items the "
                "index objects' recorded sizes can place (8 bytes of CRC32C each)"
            )
        self.chunks -= n


def _decode_metadata(doc: Mapping[str, Any], budget: _Budget) -> tuple[Metadata, Locator]:
    index_keys = doc["index"]
    if not isinstance(index_keys, list):
        raise ValueError("'index' must be a list")
    keys = [None if k is None else check_name(k, f"index[{n}]") for n, k in enumerate(index_keys)]
    world = len(keys)
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    writers: dict[str, Sequence[int] | int] = {}
    for fqn, raw in doc["state_dict"].items():
        kind = raw.get("type", "tensor")
        if kind == "bytes":
            sd_md[fqn] = BytesStorageMetadata()
            writer = raw["writer"]
            if type(writer) is not int or not 0 <= writer < world:
                raise ValueError(f"{fqn!r}: writer {writer!r} is not a rank of the index")
            writers[fqn] = writer
            continue
        if kind != "tensor":
            raise ValueError(f"unknown entry type {kind!r} for {fqn!r}")
        dtype = dtype_from_name(raw["dtype"])
        if not isinstance(raw["size"], list):
            raise ValueError(f"{fqn!r}: size must be a list")
        size = raw["size"]
        numel = check_dims(
            tuple(size), fqn, dtype, where="state_dict", payload_bytes=budget.payload_bytes
        )
        ndim = len(size)
        chunks: Sequence[ChunkStorageMetadata]
        writer_col: Sequence[int]
        if "chunks" not in raw:  # saved whole: one chunk at the origin
            budget.take_chunks(1, fqn)
            chunks = [ChunkStorageMetadata(torch.Size([0] * ndim), torch.Size(size))]
            writer = raw["writer"]
            if type(writer) is not int or not -1 <= writer < world:
                raise ValueError(f"{fqn!r}: writer {writer!r} is not a rank of the index")
            writer_col = [writer]
        else:
            # Bounded before any run is expanded: a chunk per element, plus an
            # empty one per rank (a shard of nothing), and no more than the index
            # objects can place.
            n = check_count(
                raw["chunks"],
                f"chunk count of {fqn!r}",
                at_most=numel + world,
                because=f"its {numel} elements plus an empty chunk for each of {world} ranks",
            )
            budget.take_chunks(n, fqn)
            if len(raw["offsets"]) != ndim or len(raw["sizes"]) != ndim:
                raise ValueError(f"{fqn!r}: chunk columns do not match its {ndim} dimensions")
            for d in range(ndim):
                for name in ("offsets", "sizes"):
                    low, high = column_extent(raw[name][d], n, f"{fqn!r} {name}[{d}]")
                    if low < 0 or high > size[d]:
                        raise ManifestError(
                            f"{fqn!r} {name}[{d}] reach {low}..{high}, outside its "
                            f"dimension of {size[d]}"
                        )
            low, high = column_extent(raw["writer"], n, f"{fqn!r} writer")
            if low < -1 or high >= world:
                raise ManifestError(f"{fqn!r}: a chunk's writer is not a rank of the index")
            # Kept as runs: a rank reads a handful of a tensor's W chunks, and
            # objckpt.LoadPlanner finds them from the runs (chunk_runs.py).
            chunks = ChunkRuns(
                [columns.column(raw["offsets"][d], n, f"{fqn!r} offsets") for d in range(ndim)],
                [columns.column(raw["sizes"][d], n, f"{fqn!r} sizes") for d in range(ndim)],
                n,
            )
            writer_col = columns.column(raw["writer"], n, f"{fqn!r} writer")
        sd_md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=dtype,
                requires_grad=bool(raw.get("requires_grad", False)),
            ),
            size=torch.Size(size),
            # DCP types it a list; ChunkRuns is the read-only sequence standing for one.
            chunks=cast(list[ChunkStorageMetadata], chunks),
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
        objects = {o.key: o for o in manifest.objects}
        return decode_metadata(manifest.metadata, url=url, objects=objects)[0]
    return metadata_from_json(manifest.metadata, url=url)[0]


def decode_index(
    blob: bytes, *, rank: int, attempt: str, metadata: Metadata, url: str
) -> dict[MetadataIndex, StoredItem]:
    """The item locations in one index object; ManifestError naming ``url`` on bad input.

    ``blob`` was checked whole against the manifest's entry (size, CRC32C) and that
    size against ``ReadOptions.max_metadata_bytes`` before it was fetched; here every
    column is bounded by the tables it points into before it is expanded.
    """
    doc = load_json(blob, what="index", url=url, max_bytes=MAX_INT)
    try:
        return _decode_index(doc, rank, attempt, metadata)
    except ManifestError as exc:
        raise ManifestError(f"index {url}: {exc}") from exc
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ManifestError(f"index {url} is malformed ({type(exc).__name__}: {exc})") from exc


_new_index = object.__new__
_INDEX_HAS_DICT = hasattr(MetadataIndex(""), "__dict__")  # a torch with slots: the constructor


def _chunk_index(fqn: str, offsets: Any, chunk: int) -> MetadataIndex:
    """``MetadataIndex(fqn, offsets, chunk)`` holding the chunk's own ``torch.Size``
    (DCP's constructor copies it: one more object per item, where a reader or rank 0's
    commit helper holds millions of items)."""
    if type(offsets) is not torch.Size or not _INDEX_HAS_DICT:
        return MetadataIndex(fqn, offsets, chunk)
    index = _new_index(MetadataIndex)
    # Frozen: its fields are set past __setattr__, as DCP's own __init__ sets them.
    index.__dict__.update(fqn=fqn, offset=offsets, index=chunk)
    return index


def _decode_index(
    doc: Any, rank: int, attempt: str, metadata: Metadata
) -> dict[MetadataIndex, StoredItem]:
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or doc.get("version") != 1:
        raise ValueError("not an objckpt index (format/version)")
    if doc.get("rank") != rank or doc.get("attempt") != attempt:
        raise ValueError(f"belongs to rank {doc.get('rank')} of attempt {doc.get('attempt')}")
    fqns, keys, crcs = doc["fqns"], doc["keys"], doc["crc32c"]
    if not isinstance(fqns, list) or not all(isinstance(f, str) for f in fqns):
        raise ValueError("fqns must be a list of strings")
    if not isinstance(keys, list):
        raise ValueError("keys must be a list")
    if not isinstance(crcs, str) or len(crcs) % 8 or not set(crcs) <= _HEX | {"-"}:
        raise ValueError("crc32c must be 8 hex digits per item")
    n = len(crcs) // 8
    hashes = doc.get("xxh3")  # absent: written before #28 (never reused from)
    if hashes is not None and (
        not isinstance(hashes, str) or len(hashes) != 32 * n or not set(hashes) <= _HEX | {"-"}
    ):
        raise ValueError(f"xxh3 must be 32 hex digits for each of the {n} items")
    # Every column fits the tables it points into before it is expanded (a negative
    # position would silently count from the end).
    for name, low_bound, high_bound in (
        ("fqn", 0, len(fqns)),
        ("key", 0, len(keys)),
        ("chunk", -1, MAX_INT),
        ("offset", 0, MAX_INT),
        ("length", 0, MAX_INT),
    ):
        low, high = column_extent(doc[name], n, name)
        if n and (low < low_bound or high >= high_bound):
            raise ManifestError(
                f"column {name!r} reaches {low}..{high}, outside [{low_bound}, {high_bound})"
            )
    chains, transform_col, raw_col = _transform_columns(doc, n)
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
        md = sd_md.get(fqn)
        if chunk < 0:
            if not isinstance(md, BytesStorageMetadata):
                raise ValueError(f"{fqn!r} is not a non-tensor value in the manifest")
            index = MetadataIndex(fqn)
        else:
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{fqn!r} is not a tensor in the manifest")
            if chunk >= len(md.chunks):
                raise ValueError(f"{fqn!r} has {len(md.chunks)} chunks, not a chunk {chunk}")
            index = _chunk_index(fqn, md.chunks[chunk].offsets, chunk)
        crc = crcs[8 * i : 8 * i + 8]
        digest = None if hashes is None else hashes[32 * i : 32 * i + 32]
        items[index] = StoredItem(
            relative_path=checked_keys[key_col[i]],
            offset=off_col[i],
            length=len_col[i],
            crc32c=None if crc == "--------" else crc,
            xxh3=None if digest is None or digest == NO_XXH3 else digest,
            transform_descriptors=chains[transform_col[i]] if transform_col[i] >= 0 else None,
            raw_length=raw_col[i] if transform_col[i] >= 0 else None,
        )
    return items


def _transform_columns(
    doc: Mapping[str, Any], n: int
) -> tuple[list[tuple[str, ...]], Sequence[int], Sequence[int]]:
    """The optional stream-transform table and columns (absent: nothing transformed),
    bounded before they are expanded: at most one chain per item, each of a few
    short descriptors, positions inside the table."""
    if "transforms" not in doc:
        return [], [-1] * n, [0] * n
    table = doc["transforms"]
    if not isinstance(table, list) or len(table) > max(n, 1):
        raise ValueError(f"transforms must be a list of at most {max(n, 1)} chains")
    chains: list[tuple[str, ...]] = []
    for chain in table:
        if (
            not isinstance(chain, list)
            or not 1 <= len(chain) <= _MAX_TRANSFORMS
            or not all(isinstance(d, str) and 0 < len(d) <= _MAX_DESCRIPTOR for d in chain)
        ):
            raise ValueError(
                f"a transform chain must be 1-{_MAX_TRANSFORMS} descriptors of at most "
                f"{_MAX_DESCRIPTOR} characters"
            )
        chains.append(tuple(chain))
    for name, low_bound, high_bound in (("transform", -1, len(chains)), ("raw_length", 0, MAX_INT)):
        low, high = column_extent(doc[name], n, name)
        if n and (low < low_bound or high >= high_bound):
            raise ManifestError(
                f"column {name!r} reaches {low}..{high}, outside [{low_bound}, {high_bound})"
            )
    return (
        chains,
        columns.unpack(doc["transform"], n, "transform"),
        columns.unpack(doc["raw_length"], n, "raw_length"),
    )
