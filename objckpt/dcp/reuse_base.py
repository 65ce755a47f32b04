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

A base whose manifest is whole may still name bytes that are gone: a step it
references was damaged by hand (an object deleted, or replaced with other bytes).
Referencing them again would fail every later save at the commit, each time, until
someone deleted the base. So before an item is referenced, the object holding it is
asked for (one HEAD per object the rank would reference, concurrently, beside the
copy): an object that is missing, has another size, or, where the store keeps a
full-object CRC32C (GCS, S3 objects written with one), another CRC32C than the
base's manifest records, costs the reuse of the items in it only: they are
uploaded again, with one warning naming the base and the object. Bytes replaced
with others of the same size on a store that keeps no CRC32C are found by
``objckpt verify``, not here (that would read the whole base every save).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

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
from objckpt.format.refs import is_step_directory, split_reference
from objckpt.format.reused import BaseItem
from objckpt.options import ReadOptions
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import crc32c_of
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import Location
from objckpt.writers.translate import describe

__all__ = ["BaseReader", "BaseTable", "base_location", "identity"]

logger = logging.getLogger(__name__)

Identity = tuple[str, tuple[int, ...] | None]

#: HEADs in flight at once when a rank checks the objects it would reference.
CHECK_CONCURRENCY = 16
#: Objects named in the warning about a damaged base (the rest are counted).
_NAMED = 4


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
    index objects it needs, and a HEAD of each object it would reference.
    :meth:`prefetch` does that ahead for this rank's own items (an async save runs
    it on another thread beside the copy, so the lookup at queueing time, which may
    be inside ``save()``, finds them read); :meth:`table` does whatever else it needs.

    A base that cannot be used (see the module docstring) gives no table, with one
    warning naming the save, never an error; a damaged object of the base costs the
    items in it, with one warning naming the base and the object.
    """

    def __init__(
        self, store: ObjectStore, base: Location, *, target_url: str, limit: int | None = None
    ) -> None:
        self._store = store  # the saving step's: references resolve beside it
        self._base = base
        self._target_url = target_url
        self._limit = limit or ReadOptions().max_metadata_bytes
        self._lock = threading.Lock()  # one read of each object, whichever thread asks first
        self._opened: tuple[Manifest, Metadata, Locator] | None = None
        #: The base's manifest as the load received it (None: read it from the store).
        self._given: Manifest | None = None
        self._shards: dict[int, dict[MetadataIndex, StoredItem]] = {}
        self._failed: BaseException | None = None
        self._deadline: Deadline | None = None
        self._known: dict[Identity, BaseItem] | None = None
        #: Reference key -> what is wrong with the object there (None: it is whole).
        self._objects: dict[str, str | None] = {}
        self._warned: set[str] = set()

    def given(self, manifest: Manifest) -> None:
        """Take the base's manifest from the load that read it (every rank received
        it there): no rank reads it again, which at a restart of W ranks would be W
        GETs of one object. Its index objects and the HEADs are as without it."""
        self._given = manifest

    def remember(self, items: Mapping[Identity, BaseItem]) -> None:
        """Take this rank's items of the base from memory (what it wrote in that
        save, :mod:`objckpt.pipeline.reuse_memory`): :meth:`table` reads neither the
        manifest nor an index object, only HEADs the objects it would reference in
        older steps. Objects of the base step itself are not asked for: this process
        wrote them and saw that step commit, and at 1,024 ranks a HEAD of each on
        every save is a burst on one prefix for nothing (a hand deletion of those is
        found by ``verify``, or by the next save that reads the base from the store)."""
        self._known = dict(items)
        own = f"../{self._base.url.rstrip('/').rsplit('/', 1)[-1]}/"
        for item in self._known.values():
            if item.key.startswith(own):
                self._objects.setdefault(item.key, None)

    def bound(self, deadline: Deadline | None) -> None:
        """Bound every read of the base, and :meth:`table`'s wait for a read in
        flight, by ``deadline`` (the save's): past it, no reuse."""
        self._deadline = deadline

    def prefetch(self, rank: int) -> None:
        """Read the manifest and the index object rank ``rank`` wrote (its own when
        the world size is unchanged), or take the remembered items, and check the
        objects holding them; any failure is kept for :meth:`table`."""
        with self._lock, bounded_by(self._deadline):
            try:
                if self._known is not None:
                    self._check_objects(self._known.values())
                    return
                _, _, locator = self._open()
                if rank < len(locator.index_keys):
                    self._check_objects(self._shard_items(rank, None).values())
            except Exception as exc:
                self._failed = self._failed or exc

    def table(self, wanted: Sequence[MetadataIndex]) -> BaseTable | None:
        """The base's items of the identities in ``wanted`` whose objects are whole
        (None: no reuse).

        Called inside DCP's collective (an async save's ``write_data``): it waits
        for a read in flight at most until the save's deadline (:meth:`bound`), then
        gives up the reuse rather than stall every rank.
        """
        if not wanted:
            return None
        deadline = self._deadline
        wait = -1.0 if deadline is None else max(0.0, deadline.remaining())
        if not self._lock.acquire(timeout=wait):
            self._give_up(None)
            return None
        try:
            if self._failed is not None:
                raise self._failed
            with bounded_by(deadline):
                return BaseTable(self._base.url, self._usable(self._items(wanted)))
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

    def _items(self, wanted: Sequence[MetadataIndex]) -> dict[Identity, BaseItem]:
        """The base's items of ``wanted``, from memory or from its index objects."""
        want = {identity(i) for i in wanted}
        if self._known is not None:
            known = self._known
            found = {i: known[i] for i in want if i in known}
            logger.debug(
                "base %s from memory: %d of %d items", self._base.url, len(found), len(want)
            )
            return found
        _, metadata, locator = self._open()
        shards = set()
        for index in wanted:
            if index.fqn in metadata.state_dict_metadata:
                shard = locator.shard_of(MetadataIndex(index.fqn, index.offset), metadata)
                if shard is not None:
                    shards.add(shard)
        items: dict[Identity, BaseItem] = {}
        for shard in sorted(shards):
            items.update(self._shard_items(shard, want))
        logger.debug("base %s: %d of %d items hashed", self._base.url, len(items), len(want))
        return items

    def _usable(self, items: Mapping[Identity, BaseItem]) -> dict[Identity, BaseItem]:
        """``items`` but those whose object is damaged (missing, another size or
        CRC32C than the base's manifest records): one warning names the base and
        each such object the first time it costs this save items."""
        damaged = self._check_objects(items.values())
        if not damaged:
            return dict(items)
        kept = {i: item for i, item in items.items() if item.key not in damaged}
        new = sorted(k for k in damaged if k not in self._warned)
        if new:
            self._warned.update(new)
            at = self._store.location
            named = "; ".join(f"{at.url_of(k)} {damaged[k]}" for k in new[:_NAMED])
            if len(new) > _NAMED:
                named += f"; and {len(new) - _NAMED} more"
            logger.warning(
                "saving %s: its base %s names damaged bytes, so %d items it would have "
                "referenced there are uploaded again (%s)",
                self._target_url,
                self._base.url,
                len(items) - len(kept),
                named,
            )
        return kept

    def _check_objects(self, items: Iterable[BaseItem]) -> dict[str, str]:
        """Ask for every object holding one of ``items`` not asked for yet (a HEAD
        each, :data:`CHECK_CONCURRENCY` at once); what is wrong with each damaged one.

        Raises:
            StoreError: A HEAD failed other than with "not found" (the base is
                then not used at all).
        """
        by_key = {item.key: item for item in items}
        todo = [by_key[k] for k in sorted(by_key) if k not in self._objects]
        if todo:
            workers = min(CHECK_CONCURRENCY, len(todo))
            with concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="objckpt-base-check"
            ) as pool:
                # Each HEAD in a copy of this thread's context: the save's deadline.
                futures = [
                    pool.submit(contextvars.copy_context().run, self._damage, item) for item in todo
                ]
                found = [f.result() for f in futures]
            for item, problem in zip(todo, found, strict=True):
                self._objects[item.key] = problem
        return {k: p for k in by_key if (p := self._objects[k]) is not None}

    def _damage(self, item: BaseItem) -> str | None:
        """What is wrong with the object holding ``item`` (None: nothing the store tells)."""
        try:
            size, crc = self._store.digest(item.key)
        except FileNotFoundError:
            return "is missing"
        if size != item.object_size:
            return f"is {size} bytes, not the {item.object_size} the base's manifest records"
        if crc is not None and crc != item.object_crc32c:
            return f"has CRC32C {crc}, not the {item.object_crc32c} the base's manifest records"
        return None

    @functools.cached_property
    def _base_store(self) -> ObjectStore:
        """The base step's objects, read on the saving store's client."""
        return self._store.at(self._base)

    def _open(self) -> tuple[Manifest, Metadata, Locator]:
        if self._opened is None:
            base, limit = self._base, self._limit
            url = base.url_of(MANIFEST_KEY)
            manifest = self._given
            if manifest is None:
                data = self._base_store.read_bounded(MANIFEST_KEY, limit)
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
            blob = self._base_store.read_bounded(key, min(entry.size, self._limit))
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

    def _shard_items(self, shard: int, want: set[Identity] | None) -> dict[Identity, BaseItem]:
        """The hashed items of index object ``shard`` (of ``want``; None: all) as
        a later step references them."""
        manifest, _, _ = self._open()
        base = self._base
        step_dir = base.path.rstrip("/").rsplit("/", 1)[-1]
        objects = {o.key: o for o in manifest.objects}
        items: dict[Identity, BaseItem] = {}
        for index, stored in self._shard(shard).items():
            ident = identity(index)
            obj = objects.get(stored.relative_path)
            if (want is not None and ident not in want) or stored.xxh3 is None or obj is None:
                continue
            if stored.offset + stored.length > obj.size:
                raise ManifestError(
                    f"the index of {base.url} places {index.fqn!r} at "
                    f"{stored.offset}+{stored.length}, past the {obj.size} bytes of "
                    f"{stored.relative_path!r}"
                )
            items[ident] = BaseItem.stored_at(step_dir, stored, obj.size, obj.crc32c)
        return items
