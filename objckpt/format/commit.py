"""The commit: index objects, then ``manifest.json`` create-only, then ``.metadata``.

A checkpoint exists if and only if its manifest exists. Everything else the
save wrote is invisible until then, so a crash at any earlier moment leaves the
previous state of the URL untouched.

Nothing a committed manifest names may be written by another attempt. Payload
and index names carry the attempt id; ``.metadata`` (DCP's pickle, for stock
readers) has a fixed name, so it is written only after this attempt's manifest
is on the store: a failed, losing or overwriting attempt never touches the
committed checkpoint's ``.metadata`` before it has won. Until that one PUT
lands, a stock reader sees no ``.metadata`` (a new URL) or the previous
checkpoint's, whose objects are all still there (an overwrite deletes what only
the replaced manifest named after ``.metadata`` is replaced, never before).

Before the manifest, one listing checks that every object it names is there;
any error of the manifest PUT is settled by reading it back
(:mod:`objckpt.format.settle`).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import logging
import os
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from objckpt._torch import storage_info
from objckpt._version import __version__
from objckpt.errors import ManifestError, StoreError
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import IndexShard, encode_metadata
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.format.ref_check import require_referenced
from objckpt.format.refs import is_reference
from objckpt.format.settle import after_commit, put_manifest, require_present
from objckpt.format.superseded import referenced_by_siblings
from objckpt.writers.accounting import RequestCounter, RequestStats, counting, current_counter
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import Crc32c

__all__ = [
    "REQUESTS_FQN",
    "commit_checkpoint",
    "commit_manifest",
    "delete_superseded_after",
    "previous_objects",
    "read_manifest",
    "requests_result",
    "save_storage_meta",
    "written_objects",
]

logger = logging.getLogger(__name__)

# The DCP metadata format version DCP's own writers stamp.
_DCP_VERSION = "1.0.0"


#: A rank's write results end with one entry under this name that carries the
#: rank's request counts (not an item: the coordinator sums them for the manifest).
REQUESTS_FQN = "__objckpt_requests__"


def requests_result(stats: RequestStats) -> WriteResult:
    """The entry that carries a rank's request counts among its write results."""
    return WriteResult(index=MetadataIndex(REQUESTS_FQN), size_in_bytes=0, storage_data=stats)


def written_objects(results: Iterable[WriteResult]) -> tuple[ObjectEntry, ...]:
    """The payload objects a rank's write results place items in, by key."""
    objects = {
        wr.storage_data.relative_path: ObjectEntry(
            wr.storage_data.relative_path,
            wr.storage_data.object_size,
            wr.storage_data.object_crc32c,
        )
        for wr in results
        if isinstance(wr.storage_data, StoredItem)
    }
    return tuple(objects[k] for k in sorted(objects))


def _put_index(store: ObjectStore, shards: list[IndexShard]) -> list[ObjectEntry]:
    """Write the index objects, several at once (one per writing rank: 1,024 at 1,024 ranks)."""

    def put(shard: IndexShard) -> ObjectEntry:
        store.put(shard.key, shard.data)
        crc = Crc32c()
        crc.update(shard.data)
        return ObjectEntry(shard.key, len(shard.data), crc.hexdigest())

    if len(shards) <= 1:
        return [put(s) for s in shards]
    with concurrent.futures.ThreadPoolExecutor(
        min(16, len(shards)), thread_name_prefix="objckpt-index"
    ) as pool:  # each task in a copy of this context, so its requests are counted
        futures = [pool.submit(contextvars.copy_context().run, put, s) for s in shards]
        return [f.result() for f in futures]


def save_storage_meta(
    metadata: Metadata, url: str, checkpoint_id: str | os.PathLike[str] | None, attempt: str
) -> StorageMeta:
    """The ``StorageMeta`` a save records: the checkpoint id as the caller gave it (the
    store URL when None) and the attempt id as the save id."""
    meta = metadata.storage_meta or StorageMeta()
    return dataclasses.replace(
        meta, checkpoint_id=url if checkpoint_id is None else checkpoint_id, save_id=attempt
    )


def commit_checkpoint(
    store: ObjectStore,
    metadata: Metadata,
    results: Iterable[Iterable[WriteResult]],
    *,
    attempt: str,
    world_size: int,
    overwrite: bool,
    user: Mapping[str, Any] | None = None,
    checkpoint_id: str | os.PathLike[str] | None = None,
    base: str | None = None,
) -> Manifest:
    """Write the index objects, then the manifest, then ``.metadata``; returns the
    manifest. With ``overwrite``, the replaced checkpoint stays whole (every byte its
    manifest names) until this manifest is committed.

    Args:
        checkpoint_id: What DCP's ``StorageMeta.checkpoint_id`` records (the id as
            the caller gave it; the store URL when None).
        base: The URL of the step this save reused items of (``reuse_from``), or None.

    Raises:
        CheckpointExistsError: Another attempt committed this URL first.
        UploadError: An object the manifest would name is gone (nothing committed).
    """
    items: dict[MetadataIndex, StoredItem] = {}
    by_rank: list[dict[MetadataIndex, StoredItem]] = []
    objects: dict[str, ObjectEntry] = {}
    ranks_requests = RequestStats()
    counted = False
    for rank_results in results:
        mine: dict[MetadataIndex, StoredItem] = {}
        for wr in rank_results:
            item = wr.storage_data
            if isinstance(item, RequestStats):
                ranks_requests, counted = ranks_requests + item, True
                continue
            if not isinstance(item, StoredItem):
                raise StoreError(f"unexpected storage_data {type(item).__name__} from a rank")
            items[wr.index] = mine[wr.index] = item
            objects[item.relative_path] = ObjectEntry(
                item.relative_path, item.object_size, item.object_crc32c
            )
        by_rank.append(mine)

    storage_meta = save_storage_meta(metadata, store.location.url, checkpoint_id, attempt)
    stock = dataclasses.replace(
        metadata,
        version=_DCP_VERSION,
        storage_meta=storage_meta,
        storage_data={
            index: storage_info(
                item.relative_path, item.offset, item.length, item.transform_descriptors
            )
            for index, item in items.items()
        },
    )
    blob = pickle.dumps(stock)
    crc = Crc32c()
    crc.update(blob)
    objects[METADATA_KEY] = ObjectEntry(METADATA_KEY, len(blob), crc.hexdigest())

    ours = dataclasses.replace(metadata, version=_DCP_VERSION, storage_meta=storage_meta)
    doc, shards = encode_metadata(ours, by_rank, attempt)
    commit_counter = RequestCounter(parent=current_counter())
    with counting(commit_counter):
        for entry in _put_index(store, shards):
            objects[entry.key] = entry
    superseded = previous_objects(store) if overwrite else set()
    manifest = commit_manifest(
        store,
        attempt=attempt,
        world_size=world_size,
        objects=objects.values(),
        metadata=doc,
        user=user,
        requests=ranks_requests + commit_counter.snapshot() if counted else None,
        overwrite=overwrite,
        base=base,
    )
    written = after_commit(store, f"writing {METADATA_KEY}", lambda: store.put(METADATA_KEY, blob))
    delete_superseded_after(store, written, superseded - {o.key for o in manifest.objects})
    return manifest


def commit_manifest(
    store: ObjectStore,
    *,
    attempt: str,
    world_size: int,
    objects: Iterable[ObjectEntry],
    metadata: Mapping[str, Any],
    user: Mapping[str, Any] | None,
    requests: RequestStats | None,
    overwrite: bool,
    base: str | None = None,
) -> Manifest:
    """Check that every object but ``.metadata`` is there (one listing), then write the
    manifest create-only (settled by read-back): the commit. ``.metadata``, which
    ``objects`` lists, is for the caller to write after it. A step that references
    objects of other steps also needs its ``base`` step (the URL of the step it
    reused items of) still committed (:func:`objckpt.format.ref_check.require_referenced`).

    Raises:
        CheckpointExistsError: Another attempt committed this URL first.
        UploadError: An object the manifest would name is gone (nothing committed).
    """
    entries = sorted(objects, key=lambda o: o.key)
    counter = RequestCounter(parent=current_counter())
    with counting(counter):
        # .metadata is written after the commit: everything else must be there now,
        # the objects it reuses from other steps too (one listing per step, #28).
        own = [o for o in entries if o.key != METADATA_KEY and not is_reference(o.key)]
        require_present(store, own)
        base_dir = None if base is None else base.rstrip("/").rsplit("/", 1)[-1]
        require_referenced(store, (o for o in entries if is_reference(o.key)), base=base_dir)
    manifest = Manifest(
        attempt=attempt,
        created=Manifest.now(),
        world_size=world_size,
        objckpt_version=__version__,
        torch_version=torch.__version__,
        objects=tuple(entries),
        metadata=metadata,
        user=dict(user or {}),
        requests=None if requests is None else requests + counter.snapshot(),
    )
    put_manifest(store, manifest.to_json_bytes(), overwrite=overwrite)
    url = store.location.url
    logger.info(
        "committed %s (%d objects, %d bytes)", url, len(manifest.objects), manifest.total_bytes
    )
    return manifest


def delete_superseded_after(store: ObjectStore, written: bool, keys: set[str]) -> None:
    """After ``.metadata`` was replaced (``written``): delete ``keys``, what only the
    replaced manifest named, but for those another step of the same root references
    (:func:`objckpt.format.superseded.referenced_by_siblings`). Until it is replaced,
    stock readers load the replaced checkpoint, whose objects must stay: then they
    are kept, and that is logged."""
    # Another step's objects (references) are never this step's to delete; nor are
    # its own objects that later steps of its root reference (#28).
    keys = {k for k in keys - {MANIFEST_KEY} if not is_reference(k)}
    if written:
        _delete_superseded(store, keys - referenced_by_siblings(store, keys))
    elif keys:
        logger.warning(
            "the objects only the checkpoint %s replaced named are kept (its %s still "
            "points at them); `objckpt gc` removes them",
            store.location.url,
            METADATA_KEY,
        )


def previous_objects(store: ObjectStore) -> set[str]:
    """What the manifest an overwrite replaces names (empty when there is none)."""
    try:
        return {o.key for o in read_manifest(store).objects}
    except (FileNotFoundError, ManifestError):
        return set()


def _delete_superseded(store: ObjectStore, keys: set[str]) -> None:
    """After an overwrite commits (never before): delete the payload and index
    objects only the replaced manifest named, so re-saving a URL leaves no garbage.
    A failure only leaves garbage behind (``objckpt gc`` removes it) and is logged."""
    if not keys:
        return
    try:
        store.delete_many(sorted(keys))
    except Exception as exc:
        logger.warning(
            "could not delete %d objects of the checkpoint %s replaced (%s); "
            "`objckpt gc` removes them",
            len(keys),
            store.location.url,
            exc,
        )
        return
    logger.info("deleted %d objects of the checkpoint %s replaced", len(keys), store.location.url)
