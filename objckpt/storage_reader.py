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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import logging
import os
import pickle
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from fsspec import AbstractFileSystem
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from objckpt.checksum import Crc32c
from objckpt.dcp_json import StoredItem, metadata_from_json
from objckpt.errors import (
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ManifestError,
    SizeMismatchError,
    StateDictError,
)
from objckpt.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    is_entropy_dir,
    is_objckpt_payload,
    list_names,
    read_whole,
)
from objckpt.location import Location
from objckpt.manifest import Manifest
from objckpt.options import ReadOptions
from objckpt.retry import RetryPolicy, retry_call
from objckpt.translate import translate

__all__ = ["ObjectStoreReader"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Range:
    """One coalesced span of an object and the reads it serves."""

    key: str
    start: int
    end: int
    reads: list[tuple[ReadItem, StoredItem]]


class ObjectStoreReader(StorageReader):
    """Load a committed checkpoint (or a stock DCP one) from any fsspec URL.

    Args:
        url: Checkpoint URL.
        storage_options: Passed untouched to fsspec.
        verify: Check each item's CRC32C (objckpt checkpoints only).
        read: Range sizing and read-ahead; ``verify`` overrides its field.

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
        verify: bool = True,
        read: ReadOptions | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__()
        self.location = Location.parse(url, storage_options, retry)
        self.options = dataclasses.replace(read or ReadOptions(), verify=verify)
        self._fs: AbstractFileSystem | None = None
        self._fs_pid = -1
        self.manifest: Manifest | None = None
        self._open()

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

    def _open(self) -> None:
        url = self.location.url
        path = self.location.key_path(MANIFEST_KEY)
        try:
            self.fs.invalidate_cache(self.location.path)
            data = retry_call(
                lambda: read_whole(self.fs, path), self.location.retry, f"reading {path}"
            )
        except FileNotFoundError:
            self._open_without_manifest()
            return
        except Exception as exc:
            raise translate(exc, url=url, action="reading the manifest of") from exc
        self.manifest = Manifest.from_json_bytes(data, url=self.location.url_of(MANIFEST_KEY))
        self._metadata, self._items = metadata_from_json(self.manifest.metadata, url=url)
        known = {o.key for o in self.manifest.objects}
        for item in self._items.values():
            if item.relative_path not in known:
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
        try:
            names = list_names(self.fs, self.location.path)
        except Exception as exc:
            raise translate(exc, url=url, action="listing") from exc
        if any(is_objckpt_payload(n) or is_entropy_dir(n) for n in names):
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
            "without checksum verification (its .metadata pickle is trusted)",
            url,
        )
        try:
            blob = read_whole(self.fs, self.location.key_path(METADATA_KEY))
            metadata = pickle.loads(blob)  # stock DCP format; see the trust model in the README
        except Exception as exc:
            raise ManifestError(
                f"{self.location.url_of(METADATA_KEY)} is not a readable DCP metadata file"
            ) from exc
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise ManifestError(f"{self.location.url_of(METADATA_KEY)} is not DCP metadata")
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
            if location != self.location:
                self.location = location
                self._fs = None
                self._open()

    def read_metadata(self) -> Metadata:
        meta = self._metadata.storage_meta or StorageMeta()
        return dataclasses.replace(self._metadata, storage_meta=dataclasses.replace(meta))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Location.is_valid(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        batches = list(self._batches(self._ranges(plan.items)))
        with concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="objckpt-read"
        ) as prefetch:
            pending = prefetch.submit(self._fetch, batches[0]) if batches else None
            for n in range(len(batches)):
                assert pending is not None
                buffers = pending.result()
                if n + 1 < len(batches):
                    pending = prefetch.submit(self._fetch, batches[n + 1])
                for rng, buf in zip(batches[n], buffers, strict=True):
                    self._deliver(rng, buf, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- reading --------------------------------------------------------------------------
    def _item(self, req: ReadItem) -> StoredItem:
        try:
            return self._items[req.storage_index]
        except KeyError:
            raise StateDictError(
                f"{self.location.url} has no stored item for {req.storage_index.fqn!r}"
            ) from None

    def _ranges(self, reads: list[ReadItem]) -> list[_Range]:
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
        batch: list[_Range] = []
        size = 0
        for rng in ranges:
            length = rng.end - rng.start
            if batch and size + length > self.options.max_inflight_bytes:
                yield batch
                batch, size = [], 0
            batch.append(rng)
            size += length
        if batch:
            yield batch

    def _fetch(self, batch: list[_Range]) -> list[bytes]:
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

    def _deliver(self, rng: _Range, buf: bytes, planner: LoadPlanner) -> None:
        view = memoryview(buf)
        for req, item in rng.reads:
            data = view[item.offset - rng.start : item.offset - rng.start + item.length]
            if self.options.verify and item.crc32c is not None:
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
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise StateDictError(
                    f"{req.storage_index.fqn!r}: checkpoint slice has shape "
                    f"{tuple(tensor.size())}, "
                    f"the state dict expects {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
