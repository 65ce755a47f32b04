"""Writing one safetensors export: shards streamed from a checkpoint, then the commit.

Why a streaming writer and not ``safetensors.torch.save_file``: that needs every
tensor of a shard in memory and a local file. The checkpoint's metadata gives every
tensor's dtype and shape up front, so each shard's header is written first and the
tensors are streamed after it into one multipart upload, a few tensors at a time
(read with ranged GETs and consolidated from however many ranks' shards by DCP's
own load). Memory stays at ``max_batch_bytes`` plus the parts in flight; no local
temp copy.

The commit is the checkpoints' protocol applied to an export: every shard is named
with the export's attempt id, and the index is written last with a create-only PUT.
Whatever does not end in this attempt's committed index is deleted by this attempt:
the shards it wrote when a shard fails, and all of them when another export
committed first. A create-only PUT that meets an existing index, or whose answer is
lost, is settled by reading the index back: this attempt's id means the export
committed (a retried PUT met its own write), and its shards stay.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.errors import CheckpointExistsError
from objckpt.ops.safetensors_format import INDEX_NAME, Entry, encode_header, index_attempt
from objckpt.writers import ObjectStore
from objckpt.writers.checksum import Crc32c

__all__ = ["commit_index", "write_shards"]

logger = logging.getLogger(__name__)


def _batches(entries: list[Entry], limit: int) -> Iterator[list[Entry]]:
    batch: list[Entry] = []
    size = 0
    for e in entries:
        if batch and size + e.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch


def _load(reader: ObjectStoreReader, batch: list[Entry]) -> dict[str, torch.Tensor]:
    """The batch's tensors, whole, in their stored dtype (DCP consolidates the shards)."""
    state = {e.key: torch.empty(e.shape, dtype=e.source_dtype) for e in batch}
    dcp.load(
        state,
        storage_reader=reader,
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    return state


def _write_shard(
    store: ObjectStore,
    reader: ObjectStoreReader,
    name: str,
    shard: list[Entry],
    max_batch_bytes: int,
    progress: Callable[[int], None] | None,
) -> tuple[int, str]:
    header = encode_header(shard)
    size = len(header) + sum(e.nbytes for e in shard)
    upload = store.begin(name, size)
    crc = Crc32c()
    try:
        crc.feed(header, upload.write(header))
        for batch in _batches(shard, max_batch_bytes):
            tensors = _load(reader, batch)
            for e in batch:
                t = tensors.pop(e.key).to(e.dtype).contiguous().reshape(-1)
                data = t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
                crc.feed(data, upload.write(data))
                if progress is not None:
                    progress(e.nbytes)
        upload.close().result()
    except BaseException:
        upload.abort()
        raise
    return size, crc.hexdigest()


def write_shards(
    store: ObjectStore,
    reader: ObjectStoreReader,
    shards: Sequence[tuple[str, list[Entry]]],
    max_batch_bytes: int,
    progress: Callable[[int], None] | None,
) -> list[tuple[str, int, str]]:
    """Write each ``(name, entries)`` shard; returns (name, size, CRC32C) per shard.

    A failure deletes the shards already written (they are this attempt's alone, and
    no index will name them) before it is raised.
    """
    files: list[tuple[str, int, str]] = []
    try:
        for name, entries in shards:
            size, crc = _write_shard(store, reader, name, entries, max_batch_bytes, progress)
            files.append((name, size, crc))
    except BaseException:
        _discard(store, [f for f, _, _ in files])
        raise
    return files


def commit_index(
    store: ObjectStore, index: dict[str, Any], attempt: str, shards: Sequence[str]
) -> None:
    """Write the index create-only: the export's commit.

    Raises:
        CheckpointExistsError: Another export committed the destination first (this
            attempt's ``shards`` are deleted before it is raised).
        StoreError: The index could not be written, and reading it back does not
            show it committed (the shards are deleted when no index is there).
    """
    url = store.location.url_of(INDEX_NAME)
    try:
        store.create(INDEX_NAME, json.dumps(index, indent=2).encode())
        return
    except FileExistsError as exc:
        winner = _committed_attempt(store)
        if winner == attempt:
            logger.info("%s was already written by this export (a retried PUT)", url)
            return
        _discard(store, shards)
        who = (
            f"another export (attempt {winner})"
            if winner is not None
            else "another writer (an index without an objckpt attempt)"
        )
        raise CheckpointExistsError(
            f"{url} was committed by {who} while this export (attempt {attempt}) ran; "
            f"this export's {len(shards)} shard(s) were deleted and the committed index "
            "is intact"
        ) from exc
    except Exception:
        try:  # the PUT may have landed with its answer lost
            winner = _committed_attempt(store)
        except Exception:
            logger.warning("%s: cannot tell whether the index landed; shards kept", url)
            raise
        if winner == attempt:
            logger.info("%s is committed by this export (the PUT's answer was lost)", url)
            return
        _discard(store, shards)
        raise


def _committed_attempt(store: ObjectStore) -> str | None:
    """The attempt whose index is at the destination (None: no index)."""
    try:
        return index_attempt(store.read(INDEX_NAME))
    except FileNotFoundError:
        return None


def _discard(store: ObjectStore, names: Sequence[str]) -> None:
    """Delete this attempt's shards (no index names them); a failure is logged."""
    for name in names:
        try:
            store.delete(name)
        except Exception as exc:
            logger.warning(
                "could not delete %s, a shard of an export that did not commit: %s; "
                "delete it by hand",
                store.location.url_of(name),
                exc,
            )
