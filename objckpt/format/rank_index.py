"""Format 2's pieces that need no other rank: a rank's own index object, and the
manifest's chunk layout, which depends only on the global plan.

The coordinator used to build every index object itself from every rank's write
results (``encode_metadata``): O(W) items decoded, encoded and PUT on one thread
of rank 0's training process. Nothing in a rank's index needs the other ranks,
though: an item's ``chunk`` column is its position in its tensor's chunk list,
which DCP's global planner already wrote into every ``WriteItem``'s
``MetadataIndex.index`` (``create_default_global_save_plan`` rewrites the index
hints), so a rank knows it from its own plan. Here a rank encodes exactly the
bytes the coordinator would have (the same :func:`objckpt.format.index._index_doc`
is used), and the manifest's layout (dtype, shape and chunk columns of every
tensor) is encoded once per global plan, with each chunk's writer filled in per
save (:func:`writer_columns`).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Mapping
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from objckpt.errors import ManifestError
from objckpt.format import columns
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import IndexShard, _index_doc, encode_metadata
from objckpt.format.layout import index_key

__all__ = ["encode_rank_index", "layout_doc", "with_writers", "writer_columns"]


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
