"""``ObjectStoreReader``: a DCP ``StorageReader`` that trusts only the manifest.

The manifest is read when the reader is built, so "not committed" reaches the
caller directly as a :class:`CheckpointNotCommittedError` (torch 2.13's
``dcp.load`` would otherwise replace any ``read_metadata`` error with an
``AssertionError``). Metadata comes from the manifest's JSON, never from the
``.metadata`` pickle. Payload is fetched with concurrent, coalesced ranged reads
(fsspec's ``cat_ranges``), prefetching the next batch while the current one is
copied into tensors, and every item is checked against its CRC32C.

A stock DCP checkpoint (``.metadata`` and stock payload names, no manifest)
loads read-only and unverified, with a logged notice; an objckpt checkpoint
whose manifest is missing is refused.

With ``local=`` (a copy of the same checkpoint on this node's disk, the local
tier of :class:`~objckpt.LocalTier`) every object is read from that copy when it
is there with the manifest's size, and from the store otherwise: the choice is
per object, so a rank whose disk holds its own part reads only the rest from the
store, and a job restarted on another world size reads whatever mix of tiers
holds the bytes. Local bytes are checked before use; a mismatch is logged
naming the local object, and that object is read from the store instead.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import io
import logging
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from objckpt._torch import narrow
from objckpt.dcp.collective import broadcast_from_rank0, is_distributed
from objckpt.dcp.serialize import Framer, unframe
from objckpt.dcp.shared_reads import Sent, SharedReads, assign_owners, exchange_shared
from objckpt.dcp.stock_metadata import load_stock_metadata
from objckpt.errors import (
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigurationError,
    ManifestError,
    SizeMismatchError,
    StateDictError,
)
from objckpt.format.dcp_json import StoredItem, metadata_from_json
from objckpt.format.index import Locator, decode_index, decode_metadata
from objckpt.format.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    is_entropy_dir,
    is_objckpt_object,
    list_names,
)
from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.options import ReadOptions
from objckpt.writers.accounting import RequestCounter, RequestStats, counting
from objckpt.writers.base import read_whole
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy, retry_call
from objckpt.writers.translate import translate

__all__ = ["ObjectStoreReader"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Range:
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


def _read_options(read: ReadOptions | None, verify: bool | None) -> ReadOptions:
    """``read`` with the ``verify=`` shorthand applied: one switch per setting, so
    the two may not disagree (a silent winner would verify, or not, by surprise)."""
    if verify is None:
        return read or ReadOptions()
    if read is not None and read.verify != verify:
        raise ConfigurationError(
            f"option verify={verify!r} contradicts read=ReadOptions(verify={read.verify!r}); "
            "set it in one place"
        )
    return dataclasses.replace(read or ReadOptions(), verify=verify)


class ObjectStoreReader(StorageReader):
    """Load a committed checkpoint (or a stock DCP one) from any fsspec URL.

    Args:
        url: Checkpoint URL.
        storage_options: Passed untouched to fsspec.
        verify: Shorthand for ``read=ReadOptions(verify=...)`` (check each item's
            CRC32C; on by default). Giving both with different values is an error.
        read: Range sizing, read-ahead and verification.
        broadcast: Read the manifest once, on rank 0 of ``process_group``, and
            send its bytes to the other ranks, instead of every rank fetching it.
            Every rank of the group must then build its reader together (it is a
            collective). Each rank still fetches only the index objects of the
            ranks whose items it loads. It also lets ``dcp.load`` fetch each
            replicated item once and broadcast it (``ReadOptions.share_replicated``).
        process_group: The group for ``broadcast`` (default: the default group).
        allow_stock: Load a stock DCP checkpoint (``.metadata``, no manifest) when
            that is what ``url`` holds. False: only committed objckpt checkpoints
            (the manager's rule: a step exists only once committed).
        local: A local directory holding (some of) this checkpoint's objects under
            the same names: read first, object by object, checked, with ``url``
            for whatever it lacks or holds damaged. Its manifest, when present
            and readable, is used without asking the store.

    Raises:
        CheckpointNotCommittedError: Payload exists but no manifest commits it.
        CheckpointNotFoundError: Nothing checkpoint-like at ``url``.
        ManifestError: The manifest is unreadable or from a newer format.
        StoreError: The store failed (unreachable, access denied, ...).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        verify: bool | None = None,
        read: ReadOptions | None = None,
        retry: RetryPolicy | None = None,
        broadcast: bool = False,
        process_group: Any | None = None,
        allow_stock: bool = True,
        local: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.location = Location.parse(url, storage_options, retry)
        self.local = None if local is None else Location.parse(local)
        if self.local is not None and not self.local.is_local:
            raise ConfigurationError(f"option local={local!r}: expected a local directory")
        self._local_fs: AbstractFileSystem | None = None
        #: Objects of the local copy found usable (True) or not (False), by key.
        self._local_ok: dict[str, bool] = {}
        #: Bytes this reader took from the local copy, and where its manifest came from.
        self.local_bytes_read = 0
        self.manifest_source: str | None = None
        self.options = _read_options(read, verify)
        self._fs: AbstractFileSystem | None = None
        self._fs_pid = -1
        self.manifest: Manifest | None = None
        self._locator: Locator | None = None  # format 2: items load per index object
        self._loaded_shards: set[int] = set()
        self._items: dict[MetadataIndex, StoredItem] = {}
        self._objects: dict[str, ObjectEntry] = {}
        self._broadcast = broadcast
        self._group = process_group
        self._allow_stock = allow_stock
        #: This load's id, drawn anew for each load (as FileSystemReader's ``load_id``).
        self.load_id = uuid.uuid4().hex
        self._rank = 0
        #: Metadata bytes this reader fetched from the store (manifest, index objects).
        self.metadata_bytes_fetched = 0
        self._counter = RequestCounter()
        #: Tensor frames, to read framed tensors without torch.load, and each stored
        #: chunk's dtype and shape by tensor and chunk offsets (built on first read).
        self._framer = Framer()
        self._chunk_shapes: dict[
            str, dict[tuple[int, ...], tuple[torch.dtype, tuple[int, ...]]]
        ] = {}
        self._chunk_shapes_of: Metadata | None = None
        with counting(self._counter):
            self._open()
        # No load has used what _open read yet: a reset(checkpoint_id) naming the same
        # URL (how dcp.load starts) need not read the manifest again (at W ranks that
        # second read is W GETs, or a second broadcast).
        self._unused = True

    # -- opening --------------------------------------------------------------------------
    @property
    def fs(self) -> AbstractFileSystem:
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs = self.location.open_fs(fresh=True)
            self._fs_pid = os.getpid()
        return self._fs

    @property
    def is_stock(self) -> bool:
        """True when loading a stock DCP checkpoint (no manifest, nothing verified)."""
        return self.manifest is None

    def _read_manifest(self) -> bytes | None:
        """The manifest's bytes (the local copy's when it is readable), or None."""
        local = self._read_local_manifest()
        if local is not None:
            self.manifest_source = self.local.url_of(MANIFEST_KEY) if self.local else None
            return local
        self.manifest_source = self.location.url_of(MANIFEST_KEY)
        path = self.location.key_path(MANIFEST_KEY)
        try:
            self.fs.invalidate_cache(self.location.path)
            data = retry_call(
                lambda: read_whole(self.fs, path), self.location.retry, f"reading {path}"
            )
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise translate(exc, url=self.location.url, action="reading the manifest of") from exc
        self.metadata_bytes_fetched += len(data)
        return data

    def _read_local_manifest(self) -> bytes | None:
        """The local copy's manifest when it is there and parses (else None, logged)."""
        if self.local is None:
            return None
        path = self.local.key_path(MANIFEST_KEY)
        try:
            with open(path, "rb") as f:
                data = f.read()
            Manifest.from_json_bytes(data, url=self.local.url_of(MANIFEST_KEY))
        except FileNotFoundError:
            return None
        except Exception as exc:
            logger.warning(
                "local copy %s is unusable (%s); reading the manifest from %s",
                self.local.url_of(MANIFEST_KEY),
                exc,
                self.location.url,
            )
            return None
        return data

    # -- the local copy -------------------------------------------------------------------
    @property
    def local_fs(self) -> AbstractFileSystem:
        if self._local_fs is None:
            assert self.local is not None
            self._local_fs = self.local.open_fs()
        return self._local_fs

    def _is_local(self, key: str) -> bool:
        """Whether ``key`` is read from the local copy: there, with the manifest's size."""
        if self.local is None or self.manifest is None:
            return False
        known = self._local_ok.get(key)
        if known is not None:
            return known
        entry = self._objects.get(key)
        try:
            size = os.stat(self.local.key_path(key)).st_size
        except OSError:
            size = None
        ok = entry is not None and size == entry.size
        if size is not None and not ok:
            logger.warning(
                "local copy %s has %d bytes, the manifest says %s; reading it from %s",
                self.local.url_of(key),
                size,
                entry.size if entry else "nothing",
                self.location.url,
            )
        self._local_ok[key] = ok
        return ok

    def _distrust_local(self, key: str, why: str) -> None:
        assert self.local is not None
        logger.warning(
            "local copy %s is corrupt (%s); reading it from %s instead",
            self.local.url_of(key),
            why,
            self.location.url_of(key),
        )
        self._local_ok[key] = False

    def _open(self) -> None:
        if self._broadcast and is_distributed():
            data = broadcast_from_rank0(self._read_manifest, self._group)
        else:
            data = self._read_manifest()
        if data is None:
            self._open_without_manifest()
            return
        url = self.location.url
        self.manifest = Manifest.from_json_bytes(data, url=self.location.url_of(MANIFEST_KEY))
        self._objects = {o.key: o for o in self.manifest.objects}
        if self.manifest.version >= 2:
            self._metadata, self._locator = decode_metadata(self.manifest.metadata, url=url)
            self._items, self._loaded_shards = {}, set()
            for key in self._locator.index_keys:
                if key is not None and key not in self._objects:
                    raise ManifestError(
                        f"manifest of {url} names index object {key!r}, "
                        "which its object list does not"
                    )
            return
        self._metadata, self._items = metadata_from_json(self.manifest.metadata, url=url)
        self._check_items(self._items.values())

    def _check_items(self, items: Iterable[StoredItem]) -> None:
        url = self.location.url
        for item in items:
            if item.relative_path not in self._objects:
                raise ManifestError(
                    f"manifest of {url} places an item in {item.relative_path!r}, "
                    "which its object list does not name"
                )
            if item.transform_descriptors:
                raise ManifestError(
                    f"{url} uses stream transforms {item.transform_descriptors}, "
                    "which objckpt does not support"
                )

    def _open_without_manifest(self) -> None:
        url = self.location.url
        if not self._allow_stock:
            raise CheckpointNotFoundError(f"no committed checkpoint at {url}: no {MANIFEST_KEY}")
        try:
            names = list_names(self.fs, self.location.path)
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
        meta_url = self.location.url_of(METADATA_KEY)
        try:
            blob = read_whole(self.fs, self.location.key_path(METADATA_KEY))
        except Exception as exc:
            raise translate(exc, url=meta_url, action="reading") from exc
        metadata = load_stock_metadata(blob, url=meta_url)
        self._metadata = metadata
        self._items = {
            index: StoredItem(
                relative_path=info.relative_path,
                offset=int(info.offset),
                length=int(info.length),
                transform_descriptors=tuple(getattr(info, "transform_descriptors", None) or ())
                or None,
            )
            for index, info in metadata.storage_data.items()
        }

    # -- DCP protocol ---------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            location = Location.parse(
                checkpoint_id, self.location.storage_options, self.location.retry
            )
            if self._unused and location.url == self.location.url:
                self._unused = False
                self.load_id = uuid.uuid4().hex  # still a new load
                return
            # A new load (DCP calls this first): read the manifest again, as the URL
            # may have been overwritten since, but keep the warm client when the
            # protocol and options are the same.
            if (location.protocol, location.storage_options) != (
                self.location.protocol,
                self.location.storage_options,
            ):
                self._fs = None
            self.location = location
            self.load_id = uuid.uuid4().hex
            self.manifest, self._locator = None, None
            self._items, self._loaded_shards = {}, set()
            self._local_ok = {}
            self._counter = RequestCounter()
            with counting(self._counter):
                self._open()

    def read_metadata(self) -> Metadata:
        meta = self._metadata.storage_meta or StorageMeta()
        return dataclasses.replace(self._metadata, storage_meta=dataclasses.replace(meta))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank(self._group) if is_distributed() else 0
        self._rank = int(rank)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Index objects are fetched in read_data, once the global plan says which
        # items this rank reads itself and which it receives from another rank.
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self._broadcast and self.options.share_replicated and is_distributed():
            locator, metadata = self._locator, self._metadata
            if locator is None:
                return assign_owners(plans)
            return assign_owners(plans, lambda idx: locator.shard_of(idx, metadata))
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Location.is_valid(checkpoint_id)

    @property
    def requests(self) -> RequestStats:
        """Store requests this reader made on this rank (opening included)."""
        return self._counter.snapshot()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._unused = False  # a later reset(url) is a new load: read the manifest again
        with counting(self._counter):
            self._read_plan(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        reads = list(plan.items)
        shared = plan.storage_data
        if isinstance(shared, SharedReads):
            owned = {idx for idx, _ in shared.entries}
            exchange_shared(
                shared,
                [r for r in reads if r.storage_index in owned],
                self._fetch_shared,
                lambda rs, sent, data: self._deliver_shared(rs, sent, data, planner),
                rank=self._rank,
                process_group=self._group,
                batch_bytes=self.options.max_in_flight_bytes // 2,
                url=self.location.url,
            )
            reads = [r for r in reads if r.storage_index not in owned]
        self._read(reads, planner)

    def _read(self, reads: list[ReadItem], planner: LoadPlanner) -> None:
        """Fetch and deliver ``reads``, the next batch prefetched while one is copied."""
        batches = list(self._batches(self._ranges(reads)))
        with concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="objckpt-read"
        ) as prefetch:
            # Each fetch runs in a copy of this context, so its requests are counted.
            def fetch(batch: list[_Range]) -> concurrent.futures.Future[list[bytes]]:
                return prefetch.submit(contextvars.copy_context().run, self._fetch, batch)

            pending = fetch(batches[0]) if batches else None
            for n in range(len(batches)):
                assert pending is not None
                buffers = pending.result()
                if n + 1 < len(batches):
                    pending = fetch(batches[n + 1])
                for rng, buf in zip(batches[n], buffers, strict=True):
                    self._deliver(rng, buf, planner)

    def _fetch_shared(self, indices: list[MetadataIndex]) -> list[tuple[Sent, bytes]]:
        """Owner: the whole stored items this rank shares with the others."""
        self._locate(indices)
        items = [self._item_at(idx) for idx in indices]
        ranges = [
            _Range(it.relative_path, it.offset, it.offset + it.length, [], [it]) for it in items
        ]
        out: list[tuple[Sent, bytes]] = []
        for batch in self._batches(ranges):
            out += [
                (Sent(rng.key, rng.end - rng.start, it.crc32c), data)
                for rng, data, it in zip(
                    batch, self._fetch(batch), items[len(out) : len(out) + len(batch)], strict=True
                )
            ]
        return out

    def _deliver_shared(
        self, reads: list[ReadItem], sent: Sent, data: memoryview, planner: LoadPlanner
    ) -> None:
        """Receiver (and owner): copy a shared item into this rank's targets."""
        item = StoredItem(sent.key, 0, sent.length, sent.crc32c)
        self._deliver(_Range(sent.key, 0, sent.length, [(r, item) for r in reads]), data, planner)

    # -- reading --------------------------------------------------------------------------
    def _locate(self, indices: Iterable[MetadataIndex]) -> None:
        """Fetch the index objects (format 2) that locate ``indices`` and are not loaded yet."""
        locator = self._locator
        if locator is None or self.manifest is None:
            return
        wanted: set[int] = set()
        for index in indices:
            shard = locator.shard_of(index, self._metadata)
            if shard is not None and shard not in self._loaded_shards:
                wanted.add(shard)
        if not wanted:
            return
        keys = {shard: locator.index_keys[shard] for shard in sorted(wanted)}
        found = self._local_index(keys)
        paths = {
            shard: self.location.key_path(k)
            for shard, k in keys.items()
            if k is not None and shard not in found
        }
        blobs: Any = {}
        if paths:
            try:
                blobs = retry_call(
                    lambda: self.fs.cat(list(paths.values())),
                    self.location.retry,
                    f"reading {len(paths)} index objects of {self.location.url}",
                )
            except Exception as exc:
                raise translate(exc, url=self.location.url, action="reading the index of") from exc
            if not isinstance(blobs, dict):
                blobs = {next(iter(paths.values())): blobs}
        attempt = self.manifest.attempt
        for shard, key in keys.items():
            if key is None:
                continue
            if shard in found:
                blob = found[shard]
            else:
                blob = bytes(blobs[paths[shard]])
                self.metadata_bytes_fetched += len(blob)
                self._verify_object(key, blob)
            items = decode_index(
                blob,
                rank=shard,
                attempt=attempt,
                metadata=self._metadata,
                url=self.location.url_of(key),
            )
            self._check_items(items.values())
            self._items.update(items)
            self._loaded_shards.add(shard)

    def _local_index(self, keys: Mapping[int, str | None]) -> dict[int, bytes]:
        """The index objects the local copy holds intact, by shard."""
        out: dict[int, bytes] = {}
        for shard, key in keys.items():
            if key is None or not self._is_local(key):
                continue
            assert self.local is not None
            with open(self.local.key_path(key), "rb") as f:
                blob = f.read()
            try:
                self._verify_object(key, blob)
            except (SizeMismatchError, ChecksumMismatchError) as exc:
                self._distrust_local(key, str(exc))
                continue
            self.local_bytes_read += len(blob)
            out[shard] = blob
        return out

    def _verify_object(self, key: str, blob: bytes) -> None:
        """A whole metadata object against its manifest entry (always: it says where
        every byte is, so a damaged one must never be followed)."""
        entry = self._objects[key]
        url = self.location.url_of(key)
        if len(blob) != entry.size:
            raise SizeMismatchError(f"{url} has {len(blob)} bytes, the manifest says {entry.size}")
        crc = Crc32c()
        crc.update(blob)
        if crc.hexdigest() != entry.crc32c:
            raise ChecksumMismatchError(
                f"{url}: CRC32C is {crc.hexdigest()}, the manifest says {entry.crc32c}; "
                "the index object is corrupt"
            )

    def _item(self, req: ReadItem) -> StoredItem:
        return self._item_at(req.storage_index)

    def _item_at(self, index: MetadataIndex) -> StoredItem:
        try:
            return self._items[index]
        except KeyError:
            raise StateDictError(
                f"{self.location.url} has no stored item for {index.fqn!r}"
            ) from None

    def _ranges(self, reads: list[ReadItem]) -> list[_Range]:
        self._locate(r.storage_index for r in reads)
        by_key: dict[str, list[tuple[ReadItem, StoredItem]]] = {}
        for req in reads:
            item = self._item(req)
            by_key.setdefault(item.relative_path, []).append((req, item))
        opts = self.options
        ranges: list[_Range] = []
        for key, entries in by_key.items():
            entries.sort(key=lambda e: e[1].offset)
            cur: _Range | None = None
            for req, item in entries:
                end = item.offset + item.length
                if (
                    cur is not None
                    and item.offset - cur.end <= opts.coalesce_gap
                    and end - cur.start <= opts.range_size
                ):
                    cur.end = max(cur.end, end)
                    cur.reads.append((req, item))
                else:
                    cur = _Range(key, item.offset, end, [(req, item)])
                    ranges.append(cur)
        return ranges

    def _batches(self, ranges: list[_Range]) -> Iterator[list[_Range]]:
        """Ranges in batches of at most half of ``max_in_flight_bytes`` (at least one
        range each): one batch is copied into tensors while the next is fetched."""
        limit = self.options.max_in_flight_bytes // 2
        batch: list[_Range] = []
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

    def _fetch(self, batch: list[_Range]) -> list[bytes]:
        """Every range of a batch: from the local copy what it holds intact, the rest
        from the store."""
        if self.local is None:
            return self._fetch_remote(batch)
        out: list[bytes | None] = [None] * len(batch)
        for n, rng in enumerate(batch):
            if self._is_local(rng.key):
                out[n] = self._read_local(rng)
        remote = [n for n, data in enumerate(out) if data is None]
        if remote:
            for n, data in zip(remote, self._fetch_remote([batch[n] for n in remote]), strict=True):
                out[n] = data
        return [d for d in out if d is not None]

    def _read_local(self, rng: _Range) -> bytes | None:
        """A span of the local copy, its items checked; None when it is not usable."""
        assert self.local is not None
        try:
            with open(self.local.key_path(rng.key), "rb") as f:
                f.seek(rng.start)
                data = f.read(rng.end - rng.start)
        except OSError as exc:
            self._distrust_local(rng.key, str(exc))
            return None
        if len(data) != rng.end - rng.start:
            self._distrust_local(
                rng.key, f"{len(data)} bytes at {rng.start}, not {rng.end - rng.start}"
            )
            return None
        if self.options.verify:
            view = memoryview(data)
            for item in rng.stored():
                if item.crc32c is None:
                    continue
                crc = Crc32c()
                crc.update(view[item.offset - rng.start : item.offset - rng.start + item.length])
                if crc.hexdigest() != item.crc32c:
                    self._distrust_local(
                        rng.key,
                        f"CRC32C of bytes {item.offset}-{item.offset + item.length} is "
                        f"{crc.hexdigest()}, the manifest says {item.crc32c}",
                    )
                    return None
        self.local_bytes_read += len(data)
        rng.verified = self.options.verify
        return data

    def _fetch_remote(self, batch: list[_Range]) -> list[bytes]:
        """Fetch every range of a batch concurrently; big ranges in parallel pieces."""
        paths, starts, ends, owner = [], [], [], []
        step = self.options.range_size
        for n, rng in enumerate(batch):
            for start in range(rng.start, rng.end, step) if rng.end > rng.start else [rng.start]:
                paths.append(self.location.key_path(rng.key))
                starts.append(start)
                ends.append(min(start + step, rng.end))
                owner.append(n)
        # A response cut off mid-body fails the batch; the whole batch is retried.
        return retry_call(
            lambda: self._fetch_once(batch, paths, starts, ends, owner),
            self.location.retry,
            f"reading {len(paths)} ranges of {self.location.url}",
        )

    def _fetch_once(
        self,
        batch: list[_Range],
        paths: list[str],
        starts: list[int],
        ends: list[int],
        owner: list[int],
    ) -> list[bytes]:
        try:
            pieces = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        except Exception as exc:
            raise translate(exc, url=self.location.url, action="reading") from exc
        out: list[list[bytes]] = [[] for _ in batch]
        for n, piece, start, end in zip(owner, pieces, starts, ends, strict=True):
            if isinstance(piece, BaseException):
                url = self.location.url_of(batch[n].key)
                if isinstance(piece, FileNotFoundError):
                    raise SizeMismatchError(
                        f"{url} is missing, but the manifest lists it"
                    ) from piece
                raise translate(piece, url=url, action="reading") from piece
            if len(piece) != end - start:
                raise SizeMismatchError(
                    f"{self.location.url_of(batch[n].key)} is shorter than the manifest says "
                    f"(bytes {start}-{end} requested, {len(piece)} returned)"
                )
            out[n].append(piece)
        return [p[0] if len(p) == 1 else b"".join(p) for p in out]

    def _plain_value(self, data: memoryview, fqn: str, item: StoredItem) -> io.BytesIO:
        """A non-tensor value, unpickled safely: DCP's planner runs full ``torch.load``
        on what it is given, so it is given a re-pickling of what
        ``weights_only=True`` accepted (plain values), never the stored bytes."""
        if self.options.trust_pickles:
            return io.BytesIO(data)
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise StateDictError(
                f"{self.location.url_of(item.relative_path)}: entry {fqn!r} is not a plain "
                f"value ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); objckpt "
                "never unpickles arbitrary objects. For a checkpoint you trust, load with "
                "ReadOptions(trust_pickles=True)"
            ) from exc
        out = io.BytesIO()
        torch.save(value, out)
        out.seek(0)
        return out

    def _unframed(self, data: memoryview, req: ReadItem) -> torch.Tensor | None:
        """The stored chunk as a view of ``data`` when it is framed as objckpt writes
        tensors (:func:`~objckpt.dcp.serialize.unframe`): no unpickling, no copy."""
        if self._chunk_shapes_of is not self._metadata:  # a reset to another checkpoint
            self._chunk_shapes, self._chunk_shapes_of = {}, self._metadata
        fqn = req.storage_index.fqn
        shapes = self._chunk_shapes.get(fqn)
        if shapes is None:
            # One pass over the tensor's chunks (W of them for a tensor sharded over W
            # ranks), not one per chunk read.
            md = self._metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                return None
            shapes = self._chunk_shapes[fqn] = {
                tuple(c.offsets): (md.properties.dtype, tuple(c.sizes)) for c in md.chunks
            }
        found = shapes.get(tuple(req.storage_index.offset or ()))
        if found is None:
            return None
        dtype, shape = found
        return unframe(data, self._framer.frame_for(dtype, shape), dtype, shape)

    def _deliver(self, rng: _Range, buf: bytes | memoryview, planner: LoadPlanner) -> None:
        view = memoryview(buf)
        for req, item in rng.reads:
            data = view[item.offset - rng.start : item.offset - rng.start + item.length]
            if self.options.verify and item.crc32c is not None and not rng.verified:
                crc = Crc32c()
                crc.update(data)
                if crc.hexdigest() != item.crc32c:
                    raise ChecksumMismatchError(
                        f"{self.location.url_of(item.relative_path)}: "
                        f"CRC32C of {req.storage_index.fqn!r} "
                        f"(bytes {item.offset}-{item.offset + item.length}) is {crc.hexdigest()}, "
                        f"the manifest says {item.crc32c}; the object is corrupt"
                    )
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, self._plain_value(data, req.storage_index.fqn, item))
                continue
            tensor = self._unframed(data, req)
            if tensor is None:
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            tensor = narrow(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise StateDictError(
                    f"{req.storage_index.fqn!r}: checkpoint slice has shape "
                    f"{tuple(tensor.size())}, "
                    f"the state dict expects {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
