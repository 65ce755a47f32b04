"""Opening a checkpoint for reading: where its manifest comes from, and what it says.

The manifest is the one object that commits a checkpoint, so a reader trusts
nothing else: its DCP metadata comes from the manifest's JSON, never from the
``.metadata`` pickle. It is read from this node's local copy when that holds a
readable one (no request at all), else from the store, or once on rank 0 and
broadcast (one GET per job instead of one per rank, and one answer for all).

Without a manifest, a stock DCP checkpoint (``.metadata`` and stock payload
names) opens read-only and unverified, with a logged notice, its pickle read
through an allow-list; an objckpt checkpoint whose manifest is missing is refused
as not committed, since the save that wrote its payload never finished.

Whatever describes the checkpoint passes the reader's validation boundary
(:mod:`objckpt.format.bounds`) before anything it names is requested: its size is
bounded before it is read (the manifest by a ranged read of at most
``ReadOptions.max_metadata_bytes`` + 1 bytes, a ``.metadata`` by its listed size,
each index object by its manifest entry), and every item it places must lie
inside the checkpoint, inside its object's recorded size, and be as long as its
tensor chunk's dtype and shape need. The stock path gets the same checks, its
object sizes from the listing it makes anyway.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from objckpt.dcp.collective import Collectives, is_distributed
from objckpt.dcp.local_copy import LocalCopy
from objckpt.dcp.stock_metadata import load_stock_metadata
from objckpt.errors import CheckpointNotCommittedError, CheckpointNotFoundError, ManifestError
from objckpt.format.bounds import (
    DEFAULT_MAX_METADATA_BYTES,
    check_item,
    check_key,
    check_metadata,
    check_size,
)
from objckpt.format.dcp_json import StoredItem, metadata_from_json
from objckpt.format.index import Locator, decode_metadata
from objckpt.format.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    is_entropy_dir,
    is_objckpt_object,
)
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.format.refs import require_step_directory
from objckpt.writers.base import ObjectStore
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = ["Opened", "check_items", "open_checkpoint", "opened_from"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Opened:
    """A checkpoint as opened on this rank.

    Attributes:
        manifest: The manifest; None for a stock DCP checkpoint.
        metadata: DCP metadata (format 2: without the items' locations).
        objects: The manifest's objects by key (none for a stock checkpoint).
        items: Where each stored item is, for what the manifest or ``.metadata``
            places (formats 1 and stock: every item; format 2: none).
        locator: Format 2: which index object places each item.
        source: URL this rank read the manifest from (None: received by broadcast).
        fetched: Bytes this rank fetched from the store for the manifest.
    """

    manifest: Manifest | None
    metadata: Metadata
    objects: Mapping[str, ObjectEntry]
    items: Mapping[MetadataIndex, StoredItem]
    locator: Locator | None = None
    source: str | None = None
    fetched: int = 0


@dataclasses.dataclass
class _Read:
    """What this rank read itself (a rank the manifest was broadcast to read nothing)."""

    source: str | None = None
    fetched: int = 0


def open_checkpoint(
    location: Location,
    store: Callable[[], ObjectStore],
    *,
    local: LocalCopy | None = None,
    broadcast: bool = False,
    collectives: Collectives | None = None,
    allow_stock: bool = True,
    max_bytes: int = DEFAULT_MAX_METADATA_BYTES,
) -> Opened:
    """Read and check the description of the checkpoint at ``location``.

    Args:
        location: The checkpoint in the store.
        store: The store (called only when the store is asked).
        local: A local copy whose manifest, when readable, is used instead.
        broadcast: Read on rank 0 of the group and send the bytes to the other
            ranks (a collective: every rank must call it together); a rank opening
            another URL than rank 0 reads its own.
        collectives: The group's collectives for ``broadcast`` (default: the
            default group's).
        allow_stock: Open a stock DCP checkpoint when that is what is there.
        max_bytes: ``ReadOptions.max_metadata_bytes``: the largest manifest, index
            object or ``.metadata`` accepted, judged before it is fetched.

    Raises:
        CheckpointNotCommittedError: Payload exists but no manifest commits it.
        CheckpointNotFoundError: Nothing checkpoint-like at ``location``.
        ManifestError: The manifest (or ``.metadata``) is unreadable, too large,
            inconsistent, places anything outside the checkpoint, or is from a
            newer format.
        StoreError: The store failed.
    """
    read = _Read()
    same = False
    data = None
    if broadcast and is_distributed():
        logger.debug(
            "manifest of %s: read on rank 0 of the group for every rank (a collective; "
            "broadcast=False reads it on this rank alone)",
            location.url,
        )
        same, data = (collectives or Collectives()).from_rank0_if_same(
            location.url, lambda: _read_manifest(location, store, local, read, max_bytes)
        )
    if not same:  # no group, or rank 0 opened another checkpoint: read this one here
        data = _read_manifest(location, store, local, read, max_bytes)
    if data is None:
        metadata, items = _open_stock(location, store, allow_stock, max_bytes)
        return Opened(None, metadata, {}, items, source=read.source, fetched=read.fetched)
    manifest_url = location.url_of(MANIFEST_KEY)
    manifest = Manifest.from_json_bytes(data, url=manifest_url, max_bytes=max_bytes)
    opened = opened_from(manifest, location, max_bytes=max_bytes)
    return dataclasses.replace(opened, source=read.source, fetched=read.fetched)


def opened_from(
    manifest: Manifest, location: Location, *, max_bytes: int = DEFAULT_MAX_METADATA_BYTES
) -> Opened:
    """Check a parsed manifest as a load does before it requests anything it names:
    references only in a step directory, the DCP metadata decoded within what the
    manifest's objects allow, each index object's recorded size within
    ``max_bytes`` and not empty (format 1: every item inside its object).

    ``open_checkpoint`` calls it for every load; ``objckpt verify`` and ``info``
    call it too, so that what a load refuses never verifies.

    Raises:
        ManifestError: Naming the manifest and the bound.
    """
    url = location.url
    manifest_url = location.url_of(MANIFEST_KEY)
    objects = {o.key: o for o in manifest.objects}
    require_step_directory(url, objects, f"manifest {manifest_url}")
    if manifest.version >= 2:
        metadata, locator = decode_metadata(manifest.metadata, url=manifest_url, objects=objects)
        for key in locator.index_keys:
            if key is None:
                continue
            entry = objects[key]  # decode_metadata refused an unlisted one
            # Judged by the size the manifest records, before any index is fetched
            # (and each is fetched no longer than that, then checked whole).
            check_size(entry.size, max_bytes, what="index object", url=location.url_of(key))
            if entry.size == 0:
                raise ManifestError(f"manifest of {url} records index object {key!r} as empty")
        return Opened(manifest, metadata, objects, {}, locator)
    metadata, items = metadata_from_json(manifest.metadata, url=manifest_url)
    where = f"manifest {manifest_url}"
    check_metadata(metadata, where=where, payload_bytes=manifest.total_bytes, items=len(items))
    check_items(items, objects, metadata, where=where)
    return Opened(manifest, metadata, objects, items)


def check_items(
    items: Mapping[MetadataIndex, StoredItem],
    objects: Mapping[str, ObjectEntry],
    metadata: Metadata,
    *,
    where: str,
) -> None:
    """Refuse items placed outside what the checkpoint lists.

    Each item must lie in an object ``objects`` lists, inside its recorded size, and
    a tensor chunk must be as long as its dtype and shape need (give or take the
    ``torch.save`` container; for an item stored transformed, e.g. compressed, its
    recorded length before the transforms), all before any of it is requested.

    Args:
        items: The items, by DCP index.
        objects: The checkpoint's objects by key (the manifest's, or the listing's).
        metadata: The checkpoint's DCP metadata.
        where: The object that places the items (``manifest <url>``, ``index <url>``).

    Raises:
        ManifestError: Naming ``where`` and the first such item.
    """
    for index, item in items.items():
        entry = objects.get(item.relative_path)
        if entry is None:
            raise ManifestError(
                f"{where} places an item in {item.relative_path!r}, "
                "which is not an object of the checkpoint"
            )
        check_item(
            index,
            item.offset,
            item.length,
            entry.size,
            metadata,
            where=where,
            transformed=bool(item.transform_descriptors),
            raw_length=item.raw_length,
            key=item.relative_path,
        )


def _read_manifest(
    location: Location,
    store: Callable[[], ObjectStore],
    local: LocalCopy | None,
    read: _Read,
    max_bytes: int,
) -> bytes | None:
    """The manifest's bytes (the local copy's when it is readable), or None.

    Raises:
        ManifestError: It is larger than ``max_bytes`` (at most ``max_bytes`` + 1
            bytes were read to tell).
    """
    if local is not None:
        data = local.read_manifest(location.url)
        if data is not None:
            read.source = local.location.url_of(MANIFEST_KEY)
            return data
    read.source = location.url_of(MANIFEST_KEY)
    path = location.key_path(MANIFEST_KEY)
    try:
        store().forget_listings()
        data = store().retrying(
            lambda: store().read_bounded(MANIFEST_KEY, max_bytes), f"reading {path}"
        )
    except FileNotFoundError:
        return None
    except Exception as exc:
        raise translate(exc, url=location.url, action="reading the manifest of") from exc
    read.fetched += len(data)
    check_size(len(data), max_bytes, what="manifest", url=read.source, exact=False)
    return data


def _open_stock(
    location: Location, store: Callable[[], ObjectStore], allow_stock: bool, max_bytes: int
) -> tuple[Metadata, dict[MetadataIndex, StoredItem]]:
    """A stock DCP checkpoint's metadata and item locations, from its ``.metadata``,
    checked against the listing: every item inside the checkpoint and its object."""
    url = location.url
    if not allow_stock:
        raise CheckpointNotFoundError(f"no committed checkpoint at {url}: no {MANIFEST_KEY}")
    try:
        listed = store().listing()
    except Exception as exc:
        raise translate(exc, url=url, action="listing") from exc
    if any(is_objckpt_object(n) or is_entropy_dir(n) for n in listed):
        raise CheckpointNotCommittedError(
            f"{url} is not committed: it holds objckpt payload objects but no {MANIFEST_KEY} "
            "(the save that wrote them failed or is still running). "
            "Load an earlier checkpoint; "
            "`objckpt gc` removes the leftovers."
        )
    if METADATA_KEY not in listed:
        raise CheckpointNotFoundError(
            f"no checkpoint at {url}: no {MANIFEST_KEY} and no {METADATA_KEY}"
        )
    logger.warning(
        "%s has no objckpt manifest: loading it as a stock DCP checkpoint, read-only and "
        "without checksum verification (its .metadata is unpickled through an allow-list "
        "of DCP metadata classes)",
        url,
    )
    meta_url = location.url_of(METADATA_KEY)
    check_size(listed[METADATA_KEY], max_bytes, what="stock DCP metadata", url=meta_url)
    try:
        blob = store().read_bounded(METADATA_KEY, max_bytes)
    except Exception as exc:
        raise translate(exc, url=meta_url, action="reading") from exc
    check_size(len(blob), max_bytes, what="stock DCP metadata", url=meta_url, exact=False)
    metadata = load_stock_metadata(blob, url=meta_url)
    items: dict[MetadataIndex, StoredItem] = {}
    try:
        for index, info in metadata.storage_data.items():
            if not isinstance(index, MetadataIndex):
                raise ManifestError(f"{meta_url} places {index!r}, which is not a DCP index")
            items[index] = StoredItem(
                relative_path=check_key(info.relative_path, meta_url),
                offset=info.offset,
                length=info.length,
                transform_descriptors=tuple(getattr(info, "transform_descriptors", None) or ())
                or None,
            )
    except AttributeError as exc:
        raise ManifestError(f"{meta_url} holds a malformed storage entry ({exc})") from exc
    objects = {name: ObjectEntry(name, size, "") for name, size in listed.items()}
    payload = sum(size for name, size in listed.items() if name != METADATA_KEY)
    check_metadata(metadata, where=meta_url, payload_bytes=payload, items=len(items))
    check_items(items, objects, metadata, where=meta_url)
    return metadata, items
