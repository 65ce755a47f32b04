"""``.metadata`` on demand: what makes a committed step loadable by stock DCP readers.

A save above ``UploadOptions.stock_metadata_max_ranks`` writes no ``.metadata``
(#46): the pickle holds every item of every rank (1.2 GB at 8,192 ranks of the
scale bench's model) and costs rank 0's node about 150 CPU-s to build, for readers
objckpt's own never need. Its manifest says so (``Manifest.stock_metadata`` False).
:func:`write_stock_metadata` builds it afterwards, for a step someone wants to read
with ``FileSystemReader`` or ``FsspecReader``, with the code a save builds it with
(:func:`objckpt.format.commit.build_stock`): the manifest's layout, each rank's index
object read and checked against the size and CRC32C the manifest records, each
chunk's rank checked against the manifest's. Tensor properties are those the
manifest keeps (dtype and ``requires_grad``; layout and memory format DCP's
defaults, as every tensor a save records has them; ``pin_memory`` False).

The manifest does not name it (a manifest is never rewritten), so it is checked as a
save's unnamed ``.metadata`` is: ``objckpt verify`` reports one that names another
attempt, ``objckpt cp`` copies it where it names this one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import StorageMeta

from objckpt.errors import CheckpointExistsError, ManifestError
from objckpt.format.commit import StockLayout, build_stock, metadata_entry, read_indexes
from objckpt.format.index import decode_metadata
from objckpt.format.layout import METADATA_KEY
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.ops.maintain.verify import open_manifest, unnamed_metadata_check
from objckpt.options import ReadOptions
from objckpt.writers import open_store
from objckpt.writers.base import ObjectStore
from objckpt.writers.location import Location

__all__ = ["write_stock_metadata"]

logger = logging.getLogger(__name__)


def write_stock_metadata(
    url: str | Location,
    *,
    storage_options: Mapping[str, Any] | None = None,
    read: ReadOptions | None = None,
) -> ObjectEntry:
    """Write ``.metadata`` for the committed step at ``url``, so stock DCP readers load
    it; returns its entry (key, size, CRC32C). Nothing is written where the step has
    one already: named by its manifest, or unnamed and naming its attempt (a save's
    built after its commit, or an earlier call's). One of another attempt (a replaced
    checkpoint's) is replaced.

    Memory and time are O(items) on the calling machine: every rank's index object is
    read (96 KB each at 8,192 ranks of the scale bench's model, each refused above
    ``read.max_metadata_bytes`` before it is fetched, none read past its recorded
    size), and the pickle is built in
    memory (1.2 GB there) before its one PUT. The manifest is read again before the
    PUT (a save that overwrote the step meanwhile wins: nothing is written) and after
    it (the PUT may have landed after such a save's own ``.metadata``: then it is
    left, since it may be that save's by then, and the error says so; ``objckpt
    verify`` reports one of another attempt, and running this again replaces it).
    Like every overwrite of one URL by two writers at once, what a stock reader finds
    in that window is not defined; objckpt's readers follow the manifest.

    Args:
        storage_options: fsspec options for ``url`` given as a string.
        read: ``max_metadata_bytes`` bounds each index object (default: its default).

    Raises:
        CheckpointNotFoundError, CheckpointNotCommittedError: No committed step there.
        ManifestError: A manifest without index objects (format 1: its save wrote
            ``.metadata``), one that names a ``.metadata`` that is gone, an index
            object above ``read.max_metadata_bytes``, or index objects that place a
            chunk elsewhere than the manifest.
        UploadError: An index object is gone or holds other bytes than the manifest
            records.
        CheckpointExistsError: Another save overwrote (or removed) the step meanwhile.
        StoreError: A read or the PUT failed.
    """
    if isinstance(url, Location):
        location = url
    else:
        location = Location.parse(url, dict(storage_options or {}))
    limit = (read or ReadOptions()).max_metadata_bytes
    store = open_store(location)
    try:
        manifest = open_manifest(store)
        named = manifest.object(METADATA_KEY)
        if named is not None:
            if not store.exists(METADATA_KEY):
                raise ManifestError(
                    f"{location.url}'s manifest names {METADATA_KEY}, which is gone: the "
                    "checkpoint is damaged (`objckpt verify` reports it); objckpt's "
                    "readers load it, and it cannot be rebuilt to the recorded CRC32C"
                )
            logger.info("%s names its %s already", location.url, METADATA_KEY)
            return named
        check = unnamed_metadata_check(store, manifest.attempt, required=False)
        if check is not None and check.problem is None:
            logger.info("%s has its %s already", location.url, METADATA_KEY)
            return ObjectEntry(METADATA_KEY, check.size, check.crc32c)
        blob = _build(store, manifest, limit)
        if _overwritten(store, manifest):
            raise CheckpointExistsError(
                f"{location.url} was overwritten or removed while its {METADATA_KEY} was "
                "built; nothing was written (run it again for the new checkpoint)"
            )
        store.put(METADATA_KEY, blob)
        if _overwritten(store, manifest):  # not deleted: it may be the new save's by now
            raise CheckpointExistsError(
                f"{location.url} was overwritten or removed while its {METADATA_KEY} was "
                f"written: the {METADATA_KEY} there may name the replaced attempt "
                f"{manifest.attempt} (`objckpt verify` reports it; `objckpt stock-metadata` "
                "replaces it)"
            )
    finally:
        store.close()
    entry = metadata_entry(blob)
    logger.info("wrote %s (%d bytes)", location.url_of(METADATA_KEY), entry.size)
    return entry


def _overwritten(store: ObjectStore, manifest: Manifest) -> bool:
    """Whether the step's manifest is another attempt's than ``manifest`` now (or is
    gone, or no longer reads)."""
    try:
        return read_manifest(store).attempt != manifest.attempt
    except (FileNotFoundError, ManifestError):
        return True


def _build(store: ObjectStore, manifest: Manifest, limit: int) -> bytes:
    """``.metadata`` of ``manifest``'s save, its writers checked against the manifest's."""
    url = store.location.url
    doc = dict(manifest.metadata)
    keys = doc.get("index")
    if not isinstance(keys, list):
        raise ManifestError(
            f"manifest of {url} has no index objects (format 1): its save wrote "
            f"{METADATA_KEY}, and objckpt cannot build one without them"
        )
    objects = {o.key: o for o in manifest.objects}
    # The load's bounded decode first (the manifest is untrusted): no tensor may claim
    # more chunks than the index objects can place, before the build expands them all.
    metadata, _ = decode_metadata(doc, url=url, objects=objects)
    indexes = [(rank, objects[key]) for rank, key in enumerate(keys) if key is not None]
    storage_meta = metadata.storage_meta or StorageMeta(save_id=manifest.attempt)
    layout = StockLayout(doc, {}, metadata.planner_data, storage_meta)
    blobs = read_indexes(store, indexes, limit)
    blob, placed = build_stock(layout, manifest.attempt, indexes, blobs, url)
    state = doc.get("state_dict")
    recorded = {f: e.get("writer") for f, e in state.items()} if isinstance(state, dict) else {}
    wrong = sorted(f for f in placed if placed[f] != recorded.get(f))
    if wrong:
        raise ManifestError(
            f"the index objects of {url} place {len(wrong)} entries on other ranks than "
            f"its manifest does, {wrong[:3]!r} first: {METADATA_KEY} not written"
        )
    return blob
