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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from objckpt.dcp.collective import broadcast_from_rank0, is_distributed
from objckpt.dcp.local_copy import LocalCopy
from objckpt.dcp.stock_metadata import load_stock_metadata
from objckpt.errors import CheckpointNotCommittedError, CheckpointNotFoundError, ManifestError
from objckpt.format.dcp_json import StoredItem, metadata_from_json
from objckpt.format.index import Locator, decode_metadata
from objckpt.format.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    is_entropy_dir,
    is_objckpt_object,
    list_names,
)
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.writers.base import read_whole
from objckpt.writers.location import Location
from objckpt.writers.retry import retry_call
from objckpt.writers.translate import translate

__all__ = ["Opened", "check_items", "open_checkpoint"]

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
    fs: Callable[[], AbstractFileSystem],
    *,
    local: LocalCopy | None = None,
    broadcast: bool = False,
    process_group: Any | None = None,
    allow_stock: bool = True,
) -> Opened:
    """Read and check the description of the checkpoint at ``location``.

    Args:
        location: The checkpoint in the store.
        fs: The store's filesystem (called only when the store is asked).
        local: A local copy whose manifest, when readable, is used instead.
        broadcast: Read on rank 0 of ``process_group`` and send the bytes to the
            other ranks (a collective: every rank must call it together).
        process_group: The group for ``broadcast`` (default: the default group).
        allow_stock: Open a stock DCP checkpoint when that is what is there.

    Raises:
        CheckpointNotCommittedError: Payload exists but no manifest commits it.
        CheckpointNotFoundError: Nothing checkpoint-like at ``location``.
        ManifestError: The manifest is unreadable, inconsistent or from a newer format.
        StoreError: The store failed.
    """
    read = _Read()
    if broadcast and is_distributed():
        data = broadcast_from_rank0(
            lambda: _read_manifest(location, fs, local, read), process_group
        )
    else:
        data = _read_manifest(location, fs, local, read)
    if data is None:
        metadata, items = _open_stock(location, fs, allow_stock)
        return Opened(None, metadata, {}, items, source=read.source, fetched=read.fetched)
    url = location.url
    manifest = Manifest.from_json_bytes(data, url=location.url_of(MANIFEST_KEY))
    objects = {o.key: o for o in manifest.objects}
    if manifest.version >= 2:
        metadata, locator = decode_metadata(manifest.metadata, url=url)
        for key in locator.index_keys:
            if key is not None and key not in objects:
                raise ManifestError(
                    f"manifest of {url} names index object {key!r}, which its object list does not"
                )
        return Opened(manifest, metadata, objects, {}, locator, read.source, read.fetched)
    metadata, items = metadata_from_json(manifest.metadata, url=url)
    check_items(items.values(), objects, url)
    return Opened(manifest, metadata, objects, items, None, read.source, read.fetched)


def check_items(items: Iterable[StoredItem], objects: Mapping[str, ObjectEntry], url: str) -> None:
    """Refuse items placed in objects the manifest does not list, or stored transformed.

    Raises:
        ManifestError: Naming the first such item's object or transforms.
    """
    for item in items:
        if item.relative_path not in objects:
            raise ManifestError(
                f"manifest of {url} places an item in {item.relative_path!r}, "
                "which its object list does not name"
            )
        if item.transform_descriptors:
            raise ManifestError(
                f"{url} uses stream transforms {item.transform_descriptors}, "
                "which objckpt does not support"
            )


def _read_manifest(
    location: Location,
    fs: Callable[[], AbstractFileSystem],
    local: LocalCopy | None,
    read: _Read,
) -> bytes | None:
    """The manifest's bytes (the local copy's when it is readable), or None."""
    if local is not None:
        data = local.read_manifest(location.url)
        if data is not None:
            read.source = local.location.url_of(MANIFEST_KEY)
            return data
    read.source = location.url_of(MANIFEST_KEY)
    path = location.key_path(MANIFEST_KEY)
    try:
        fs().invalidate_cache(location.path)
        data = retry_call(lambda: read_whole(fs(), path), location.retry, f"reading {path}")
    except FileNotFoundError:
        return None
    except Exception as exc:
        raise translate(exc, url=location.url, action="reading the manifest of") from exc
    read.fetched += len(data)
    return data


def _open_stock(
    location: Location, fs: Callable[[], AbstractFileSystem], allow_stock: bool
) -> tuple[Metadata, dict[MetadataIndex, StoredItem]]:
    """A stock DCP checkpoint's metadata and item locations, from its ``.metadata``."""
    url = location.url
    if not allow_stock:
        raise CheckpointNotFoundError(f"no committed checkpoint at {url}: no {MANIFEST_KEY}")
    try:
        names = list_names(fs(), location.path)
    except Exception as exc:
        raise translate(exc, url=url, action="listing") from exc
    if any(is_objckpt_object(n) or is_entropy_dir(n) for n in names):
        raise CheckpointNotCommittedError(
            f"{url} is not committed: it holds objckpt payload objects but no {MANIFEST_KEY} "
            "(the save that wrote them failed or is still running). "
            "Load an earlier checkpoint; "
            "`objckpt gc` removes the leftovers."
        )
    if METADATA_KEY not in names:
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
    try:
        blob = read_whole(fs(), location.key_path(METADATA_KEY))
    except Exception as exc:
        raise translate(exc, url=meta_url, action="reading") from exc
    metadata = load_stock_metadata(blob, url=meta_url)
    items = {
        index: StoredItem(
            relative_path=info.relative_path,
            offset=int(info.offset),
            length=int(info.length),
            transform_descriptors=tuple(getattr(info, "transform_descriptors", None) or ()) or None,
        )
        for index, info in metadata.storage_data.items()
    }
    return metadata, items
