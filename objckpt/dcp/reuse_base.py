"""The base step of a save with reuse: which of this rank's items it already stores.

A save with reuse (:mod:`objckpt.format.reused`) compares each item it writes
with the item of the same identity (fqn and chunk offsets) in its base step: the
latest committed step of the same root (a :class:`~objckpt.CheckpointManager`
knows it), or the committed sibling step named by ``reuse_from``. Each rank reads
only what it needs of the base: its manifest, and the index objects of the ranks
that wrote the items this rank writes (its own when the world size is unchanged;
the manifest's writer columns tell which, as load planning does), all bounded and
checked like any load.

A base that cannot be used (gone, not committed, written before item hashes
existed, damaged, refused by the bounds) means no reuse for this save, logged once
as a warning, never a failed save. Each rank decides for its own items, so ranks
may differ without harm: whatever a rank references, the commit checks is there
(:mod:`objckpt.format.ref_check`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from objckpt.dcp.manifest_source import read_bounded
from objckpt.errors import (
    ChecksumMismatchError,
    ConfigurationError,
    ManifestError,
    SaveDeadlineError,
)
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import Locator, decode_index, decode_metadata
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import Manifest
from objckpt.format.ref_check import sibling
from objckpt.format.refs import is_step_directory, reference_key, split_reference
from objckpt.format.reused import BaseItem
from objckpt.options import ReadOptions
from objckpt.writers.checksum import crc32c_of
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import Location
from objckpt.writers.translate import describe

__all__ = ["BaseReader", "BaseTable", "base_location", "identity"]

logger = logging.getLogger(__name__)

Identity = tuple[str, tuple[int, ...] | None]


def identity(index: MetadataIndex) -> Identity:
    """What makes two items the same item across steps: fqn and chunk offsets."""
    return index.fqn, None if index.offset is None else tuple(index.offset)


def base_location(target: Location, reuse_from: str | None) -> Location | None:
    """The base step's location, checked to be a sibling step of ``target``.

    Raises:
        ConfigurationError: ``target`` is not itself a step directory, or
            ``reuse_from`` is not a step directory beside it (references only ever
            point between the ``step-<N>`` directories of one root: only those are
            kept whole by the root's live set, and readers honour them nowhere else).
    """
    if reuse_from is None:
        return None
    if not is_step_directory(target.url):
        raise ConfigurationError(
            f"option reuse_from={reuse_from!r} needs the checkpoint {target.url} to be a "
            "step directory (<root>/step-<10 digits>) of the same root as the base: "
            "nothing else keeps referenced bytes alive"
        )
    base = Location.parse(reuse_from, target.storage_options, target.retry)
    name = base.path.rstrip("/").rsplit("/", 1)[-1]
    try:
        split_reference(f"../{name}/x")
    except ManifestError:
        name = ""
    here = sibling(target, name).path if name else ""
    if not name or base.protocol != target.protocol or here != base.path.rstrip("/"):
        raise ConfigurationError(
            f"option reuse_from={reuse_from!r} must name a committed step directory "
            f"(step-<10 digits>) beside the checkpoint {target.url}"
        )
    if base.path.rstrip("/") == target.path.rstrip("/"):
        raise ConfigurationError(
            f"option reuse_from={reuse_from!r} is the checkpoint {target.url} itself"
        )
    return base


class BaseTable:
    """The base step's items this rank may reuse, by identity."""

    def __init__(self, url: str, items: Mapping[Identity, BaseItem]) -> None:
        self.url = url
        self.items = dict(items)

    def for_items(self, items: Iterable[tuple[int, WriteItem]]) -> dict[int, BaseItem]:
        """The base item of each ``(position, write item)`` that has one."""
        out = {}
        for pos, item in items:
            base = self.items.get(identity(item.index))
            if base is not None:
                out[pos] = base
        return out


class BaseReader:
    """What this rank reads of one base step, each object once: the manifest and the
    index objects it needs. :meth:`prefetch` reads the manifest and this rank's own
    index object ahead (an async save runs it on another thread beside the copy, so
    the lookup at queueing time, which may be inside ``save()``, finds them read);
    :meth:`table` reads whatever else it needs.

    A base that cannot be used (see the module docstring) gives no table, with one
    warning naming the save, never an error.
    """

    def __init__(
        self, fs: AbstractFileSystem, base: Location, *, target_url: str, limit: int | None = None
    ) -> None:
        self._fs = fs
        self._base = base
        self._target_url = target_url
        self._limit = limit or ReadOptions().max_metadata_bytes
        self._lock = threading.Lock()  # one read of each object, whichever thread asks first
        self._opened: tuple[Manifest, Metadata, Locator] | None = None
        self._shards: dict[int, dict[MetadataIndex, StoredItem]] = {}
        self._failed: BaseException | None = None
        self._deadline: Deadline | None = None
        self._known: dict[Identity, BaseItem] | None = None

    def remember(self, items: Mapping[Identity, BaseItem]) -> None:
        """Take this rank's items of the base from memory (what it wrote in that
        save, :mod:`objckpt.pipeline.reuse_memory`): :meth:`table` reads nothing."""
        self._known = dict(items)

    def bound(self, deadline: Deadline | None) -> None:
        """Bound every read of the base, and :meth:`table`'s wait for a read in
        flight, by ``deadline`` (the save's): past it, no reuse."""
        self._deadline = deadline

    def prefetch(self, rank: int) -> None:
        """Read the manifest and the index object rank ``rank`` wrote (its own when
        the world size is unchanged), keeping any failure for :meth:`table`."""
        with self._lock, bounded_by(self._deadline):
            try:
                _, _, locator = self._open()
                if rank < len(locator.index_keys):
                    self._shard(rank)
            except Exception as exc:
                self._failed = self._failed or exc

    def table(self, wanted: Sequence[MetadataIndex]) -> BaseTable | None:
        """The base's items of the identities in ``wanted`` (None: no reuse).

        Called inside DCP's collective (an async save's ``write_data``): it waits
        for a read in flight at most until the save's deadline (:meth:`bound`), then
        gives up the reuse rather than stall every rank.
        """
        if not wanted:
            return None
        if self._known is not None:
            known = self._known
            found = {i: known[i] for i in map(identity, wanted) if i in known}
            logger.debug(
                "base %s from memory: %d of %d items", self._base.url, len(found), len(wanted)
            )
            return BaseTable(self._base.url, found)
        deadline = self._deadline
        wait = -1.0 if deadline is None else max(0.0, deadline.remaining())
        if not self._lock.acquire(timeout=wait):
            self._give_up(None)
            return None
        try:
            if self._failed is not None:
                raise self._failed
            with bounded_by(deadline):
                return self._table(wanted)
        except Exception as exc:  # a base that cannot be used costs the reuse only
            self._failed = exc
            self._give_up(exc)
            return None
        finally:
            self._lock.release()

    def _give_up(self, exc: BaseException | None) -> None:
        """Log once why this save reuses nothing (``exc`` None or a deadline: slow)."""
        deadline = self._deadline
        if deadline is not None and (exc is None or isinstance(exc, SaveDeadlineError)):
            why = f"reading it took longer than {deadline.seconds:g} s ({deadline.who})"
        else:
            why = describe(exc) if exc is not None else "reading it did not end"
        logger.warning(
            "saving %s without reuse: its base %s cannot be used (%s)",
            self._target_url,
            self._base.url,
            why,
        )

    def _open(self) -> tuple[Manifest, Metadata, Locator]:
        if self._opened is None:
            base, limit = self._base, self._limit
            url = base.url_of(MANIFEST_KEY)
            data = read_bounded(self._fs, base.key_path(MANIFEST_KEY), limit)
            manifest = Manifest.from_json_bytes(data, url=url, max_bytes=limit)
            if manifest.version < 2:
                raise ManifestError(f"{url} is format {manifest.version}: no item hashes")
            objects = {o.key: o for o in manifest.objects}
            metadata, locator = decode_metadata(manifest.metadata, url=url, objects=objects)
            self._opened = (manifest, metadata, locator)
        return self._opened

    def _shard(self, shard: int) -> dict[MetadataIndex, StoredItem]:
        found = self._shards.get(shard)
        if found is not None:
            return found
        manifest, metadata, locator = self._open()
        key = locator.index_keys[shard]
        if key is None:
            found = {}
        else:
            base = self._base
            entry = manifest.object(key)
            if entry is None:  # decode_metadata refuses this; kept for the type checker
                raise ManifestError(f"{base.url} names index {key!r} but not as an object")
            blob = read_bounded(self._fs, base.key_path(key), min(entry.size, self._limit))
            if len(blob) != entry.size or f"{crc32c_of(blob):08x}" != entry.crc32c:
                raise ChecksumMismatchError(
                    f"index {base.url_of(key)} is {len(blob)} bytes with another CRC32C than "
                    f"the {entry.size} bytes its manifest records"
                )
            found = decode_index(
                blob, rank=shard, attempt=manifest.attempt, metadata=metadata, url=base.url_of(key)
            )
        self._shards[shard] = found
        return found

    def _table(self, wanted: Sequence[MetadataIndex]) -> BaseTable:
        manifest, metadata, locator = self._open()
        base = self._base
        step_dir = base.path.rstrip("/").rsplit("/", 1)[-1]
        objects = {o.key: o for o in manifest.objects}
        want = {identity(i) for i in wanted}
        shards = set()
        for index in wanted:
            if index.fqn in metadata.state_dict_metadata:
                shard = locator.shard_of(MetadataIndex(index.fqn, index.offset), metadata)
                if shard is not None:
                    shards.add(shard)
        items: dict[Identity, BaseItem] = {}
        for shard in sorted(shards):
            for index, stored in self._shard(shard).items():
                ident = identity(index)
                obj = objects.get(stored.relative_path)
                if ident not in want or stored.xxh3 is None or obj is None:
                    continue
                if stored.offset + stored.length > obj.size:
                    raise ManifestError(
                        f"the index of {base.url} places {index.fqn!r} at "
                        f"{stored.offset}+{stored.length}, past the {obj.size} bytes of "
                        f"{stored.relative_path!r}"
                    )
                items[ident] = BaseItem(
                    key=reference_key(step_dir, stored.relative_path),
                    offset=stored.offset,
                    length=stored.length,
                    crc32c=stored.crc32c,
                    xxh3=stored.xxh3,
                    object_size=obj.size,
                    object_crc32c=obj.crc32c,
                    descriptors=stored.transform_descriptors,
                )
        logger.debug("base %s: %d of %d items hashed", base.url, len(items), len(want))
        return BaseTable(base.url, items)
