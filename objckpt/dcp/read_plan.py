"""Which byte ranges a load fetches: items located, coalesced, and batched.

A format-2 manifest does not say where each item is: per-rank index objects do,
so a rank fetches only the index objects of the ranks whose items it loads (the
local copy's when intact), each no longer than the manifest records and checked
whole against it first, since it says where every byte is and a damaged one must
never be followed; then every item it places is checked against the manifest's
objects and the tensor's chunk (:func:`~objckpt.dcp.manifest_source.check_items`)
before any range is planned. Formats 1 and stock place every item when the
checkpoint is opened.

Items of one object lying close together are fetched as one ranged read (up to
``ReadOptions.range_size``, across gaps up to ``coalesce_gap``): fewer requests
for many small items. Ranges are grouped in batches of half
``max_in_flight_bytes``, so the batch being copied into tensors and the next one
being fetched stay within the bound together.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from objckpt.dcp.local_copy import LocalCopy
from objckpt.dcp.manifest_source import Opened, check_items
from objckpt.errors import ChecksumMismatchError, SizeMismatchError, StateDictError
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import decode_index
from objckpt.options import ReadOptions
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = ["ItemIndex", "Range", "batches", "plan_ranges"]


@dataclasses.dataclass
class Range:
    """One coalesced span of an object and the reads it serves."""

    key: str
    start: int
    end: int
    reads: list[tuple[ReadItem, StoredItem]]
    #: Items checked when the span comes from the local tier (whole items it holds).
    items: list[StoredItem] = dataclasses.field(default_factory=list)
    #: Its items were checked already (read from the local copy).
    verified: bool = False

    def stored(self) -> list[StoredItem]:
        return self.items or [it for _, it in self.reads]


class ItemIndex:
    """Where each stored item of an opened checkpoint is, located as loads need it.

    Args:
        opened: The checkpoint as opened.
        location: The checkpoint in the store.
        store: The store (called only when the store is asked).
        local: The local copy to take intact index objects from.
    """

    def __init__(
        self,
        opened: Opened,
        location: Location,
        store: Callable[[], ObjectStore],
        local: LocalCopy | None = None,
    ) -> None:
        self._opened = opened
        self._location = location
        self._store = store
        self._local = local
        self._items: dict[MetadataIndex, StoredItem] = dict(opened.items)
        self._loaded_shards: set[int] = set()

    def item_at(self, index: MetadataIndex) -> StoredItem:
        """Where ``index`` is stored (after :meth:`locate`).

        Raises:
            StateDictError: The checkpoint stores no such item.
        """
        try:
            return self._items[index]
        except KeyError:
            raise StateDictError(
                f"{self._location.url} has no stored item for {index.fqn!r}"
            ) from None

    def locate(self, indices: Iterable[MetadataIndex]) -> int:
        """Fetch the index objects (format 2) that locate ``indices`` and are not loaded yet.

        Returns:
            The bytes fetched from the store.

        Raises:
            ManifestError: An index object places an item outside the manifest's objects.
            SizeMismatchError: An index object's size differs from the manifest's.
            ChecksumMismatchError: An index object's CRC32C differs from the manifest's.
            StoreError: The store failed.
        """
        locator = self._opened.locator
        if locator is None or self._opened.manifest is None:
            return 0
        metadata = self._opened.metadata
        wanted: set[int] = set()
        for index in indices:
            shard = locator.shard_of(index, metadata)
            if shard is not None and shard not in self._loaded_shards:
                wanted.add(shard)
        found, fetched = self._read_shards(sorted(wanted))
        for shard, items in found.items():
            self._items.update(items)
            self._loaded_shards.add(shard)
        return fetched

    def check_shard(self, shard: int) -> int:
        """Fetch index object ``shard`` and check it as :meth:`locate` does (whole
        against the manifest's size and CRC32C, every column bounded, every item
        inside its object and as long as its chunk needs), keeping none of it:
        ``objckpt verify`` and ``info`` refuse what a load would. Returns the bytes
        fetched.

        Raises:
            ManifestError, SizeMismatchError, ChecksumMismatchError, StoreError:
                As :meth:`locate`.
        """
        return self._read_shards([shard])[1]

    def _read_shards(
        self, shards: list[int]
    ) -> tuple[dict[int, dict[MetadataIndex, StoredItem]], int]:
        """The checked items of each index object in ``shards``, and the bytes fetched."""
        locator, manifest = self._opened.locator, self._opened.manifest
        if locator is None or manifest is None or not shards:
            return {}, 0
        metadata = self._opened.metadata
        keys = {shard: locator.index_keys[shard] for shard in shards}
        found = self._local_index(keys)
        remote = {shard: k for shard, k in keys.items() if k is not None and shard not in found}
        paths = {shard: self._location.key_path(k) for shard, k in remote.items()}
        rkeys = list(remote.values())
        blobs: dict[str, bytes] = {}
        if paths:
            # Each no longer than the manifest records (plus one byte, to tell a
            # longer one): a replaced index object costs its recorded size at most.
            ends = [self._opened.objects[k].size + 1 for k in remote.values()]
            try:
                got = self._store().retrying(
                    lambda: _raise_first(self._store().read_ranges(rkeys, [0] * len(ends), ends)),
                    f"reading {len(paths)} index objects of {self._location.url}",
                )
            except Exception as exc:
                raise translate(exc, url=self._location.url, action="reading the index of") from exc
            blobs = dict(zip(paths.values(), got, strict=True))
        fetched = 0
        out: dict[int, dict[MetadataIndex, StoredItem]] = {}
        for shard, key in keys.items():
            if key is None:
                continue
            if shard in found:
                blob = found[shard]
            else:
                blob = bytes(blobs[paths[shard]])
                fetched += len(blob)
                self._verify_object(key, blob)
            items = decode_index(
                blob,
                rank=shard,
                attempt=manifest.attempt,
                metadata=metadata,
                url=self._location.url_of(key),
            )
            check_items(
                items, self._opened.objects, metadata, where=f"index {self._location.url_of(key)}"
            )
            out[shard] = items
        return out, fetched

    def _local_index(self, keys: Mapping[int, str | None]) -> dict[int, bytes]:
        """The index objects the local copy holds intact, by shard."""
        out: dict[int, bytes] = {}
        if self._local is None:
            return out
        for shard, key in keys.items():
            if key is None or not self._local.holds(key):
                continue
            blob = self._local.read_object(key, functools.partial(self._verify_object, key))
            if blob is not None:
                out[shard] = blob
        return out

    def _verify_object(self, key: str, blob: bytes) -> None:
        """A whole metadata object against its manifest entry (always: it says where
        every byte is, so a damaged one must never be followed)."""
        entry = self._opened.objects[key]
        url = self._location.url_of(key)
        if len(blob) != entry.size:
            raise SizeMismatchError(f"{url} has {len(blob)} bytes, the manifest says {entry.size}")
        crc = Crc32c()
        crc.update(blob)
        if crc.hexdigest() != entry.crc32c:
            raise ChecksumMismatchError(
                f"{url}: CRC32C is {crc.hexdigest()}, the manifest says {entry.crc32c}; "
                "the index object is corrupt"
            )


def _raise_first(pieces: list[Any]) -> list[bytes]:
    """``cat_ranges``' answers, raising the first error among them (so it is retried
    or translated as a failed request is)."""
    for piece in pieces:
        if isinstance(piece, BaseException):
            raise piece
    return [bytes(p) for p in pieces]


def plan_ranges(
    located: Iterable[tuple[ReadItem, StoredItem]], options: ReadOptions
) -> list[Range]:
    """The ranged reads serving ``located`` reads: per object, items in offset order,
    merged while the gap is at most ``coalesce_gap`` and the span ``range_size``."""
    by_key: dict[str, list[tuple[ReadItem, StoredItem]]] = {}
    for req, item in located:
        by_key.setdefault(item.relative_path, []).append((req, item))
    ranges: list[Range] = []
    for key, entries in by_key.items():
        entries.sort(key=lambda e: e[1].offset)
        cur: Range | None = None
        for req, item in entries:
            end = item.offset + item.length
            if (
                cur is not None
                and item.offset - cur.end <= options.coalesce_gap
                and end - cur.start <= options.range_size
            ):
                cur.end = max(cur.end, end)
                cur.reads.append((req, item))
            else:
                cur = Range(key, item.offset, end, [(req, item)])
                ranges.append(cur)
    return ranges


def batches(ranges: list[Range], max_in_flight_bytes: int) -> Iterator[list[Range]]:
    """Ranges in batches of at most half of ``max_in_flight_bytes`` (at least one
    range each): one batch is copied into tensors while the next is fetched."""
    limit = max_in_flight_bytes // 2
    batch: list[Range] = []
    size = 0
    for rng in ranges:
        length = rng.end - rng.start
        if batch and size + length > limit:
            yield batch
            batch, size = [], 0
        batch.append(rng)
        size += length
    if batch:
        yield batch
