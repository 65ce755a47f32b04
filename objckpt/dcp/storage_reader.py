"""``ObjectStoreReader``: a DCP ``StorageReader`` that trusts only the manifest.

The manifest is read when the reader is built, so "not committed" reaches the
caller directly as a :class:`CheckpointNotCommittedError` (torch 2.13's
``dcp.load`` would otherwise replace any ``read_metadata`` error with an
``AssertionError``). Metadata comes from the manifest's JSON, never from the
``.metadata`` pickle. Payload is fetched with concurrent, coalesced ranged reads
(fsspec's ``cat_ranges``), prefetching the next batch while the current one is
copied into tensors, and every item is checked against its CRC32C.

The plugin holds the resources of a load and walks DCP's calls; the work is done
by one module per step:

- :mod:`~objckpt.dcp.manifest_source`: open the manifest (local copy, store, or
  broadcast from rank 0) or a stock DCP checkpoint's ``.metadata``;
- :mod:`~objckpt.dcp.read_plan`: locate items (format-2 index objects), coalesce
  them into ranges, batch the ranges;
- :mod:`~objckpt.dcp.shared_reads`: replicated items fetched once and broadcast;
- :mod:`~objckpt.dcp.fetch`: the ranges' bytes, from the local copy
  (:mod:`~objckpt.dcp.local_copy`) or the store;
- :mod:`~objckpt.dcp.delivery`: checked, decoded, copied into the planner's targets.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from objckpt._removed import READER, removed_keywords
from objckpt.dcp.collective import Collectives, is_distributed
from objckpt.dcp.delivery import Delivery, LoadTargets, Placed, fetch_and_deliver
from objckpt.dcp.fetch import fetch_ranges
from objckpt.dcp.local_copy import LocalCopy
from objckpt.dcp.manifest_source import open_checkpoint
from objckpt.dcp.read_plan import ItemIndex, Range, batches, plan_ranges
from objckpt.dcp.shared_reads import (
    Sent,
    SharedReads,
    assign_owners,
    exchange_shared,
)
from objckpt.errors import ConfigurationError, ObjckptError
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import Locator
from objckpt.format.layout import writer_rank
from objckpt.format.manifest import Manifest
from objckpt.options import ReadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.accounting import RequestCounter, RequestStats, counting
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

logger = logging.getLogger(__name__)

__all__ = ["ObjectStoreReader", "PeerSource", "PlanData"]


class PeerSource(Protocol):
    """Objects a rank's node lacks, fetched from the node of a rank that holds them,
    before the load reads (the manager's restore from a local tier's replicas)."""

    def schedule(self, needs: list[set[str]]) -> list[Any]:
        """Coordinator: from what each rank reads (object keys, by rank), what each
        rank's ``fetch`` walks (the same transfers for every rank, in one order)."""
        ...

    def fetch(self, planned: Any) -> None:
        """Every rank, in ``read_data``: walk the transfers ``schedule`` planned,
        receiving this rank's missing objects; raise after the last one when any
        failed."""
        ...


@dataclasses.dataclass(frozen=True)
class PlanData:
    """A rank's plan data when peers are involved: the shared reads and its fetches."""

    shared: Any
    peers: Any


@removed_keywords(READER)
class ObjectStoreReader(StorageReader):
    """Load a committed checkpoint (or a stock DCP one) from any fsspec URL.

    DCP calls, on every rank unless noted: ``reset(checkpoint_id)``,
    ``read_metadata``, ``set_up_storage_reader``, ``prepare_local_plan``,
    ``prepare_global_plan`` (coordinator only, with every rank's plan), then
    ``read_data`` with this rank's final plan.

    With ``ReadOptions(local=)`` (a copy of the same checkpoint on this node's disk, the local
    tier of :class:`~objckpt.LocalTier`) every object is read from that copy when
    it is there with the manifest's size, and from the store otherwise: the choice
    is per object, so a rank whose disk holds its own part reads only the rest from
    the store. Local bytes are checked before use; a mismatch is logged naming the
    local object, and that object is read from the store instead.

    Args:
        url: Checkpoint URL.
        storage_options: Passed untouched to fsspec.
        read: Range sizing, read-ahead, verification (``ReadOptions.verify``:
            check each item's CRC32C, on by default), how the reads of a process
            group are coordinated (``broadcast``), whether a stock DCP checkpoint
            is accepted (``allow_stock``) and the local copies read first
            (``local``): :class:`~objckpt.ReadOptions`.
        process_group: The group ``ReadOptions.broadcast`` coordinates (default:
            the default group); a ``dcp.load`` on a subgroup passes that subgroup
            here too.
        peers: Where ranks fetch the objects their plan reads and their node
            lacks from another rank's node before reading (the manager's restore
            with ``LocalTier(replicas=)``; :class:`PeerSource`).
        _extension_registry: DCP's ``ExtensionRegistry`` (experimental in DCP, as
            in torch's ``FileSystemReader``) for items stored through stream
            transforms objckpt does not know itself; objckpt's compression
            (zstd, byte grouping) is undone without one.

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
        read: ReadOptions | None = None,
        retry: RetryPolicy | None = None,
        process_group: Any | None = None,
        peers: PeerSource | None = None,
        _extension_registry: Any | None = None,
    ) -> None:
        super().__init__()
        self.location = Location.parse(url, storage_options, retry)
        self.options = read or ReadOptions()
        parsed = [Location.parse(d) for d in self.options.local_dirs]
        if any(not d.is_local for d in parsed):
            raise ConfigurationError(
                f"option ReadOptions.local={self.options.local!r}: expected local directories"
            )
        self.local = parsed[0] if parsed else None
        self._local_copy = (
            None if self.local is None else LocalCopy(self.local, self.location, parsed[1:])
        )
        self._peers = peers
        #: Where the manifest came from.
        self.manifest_source: str | None = None
        # This process's store for the location (its client is the process's shared
        # one, objckpt.writers.clients); a forked child builds its own.
        self._store: ObjectStore | None = None
        self._store_pid = -1
        self.manifest: Manifest | None = None
        self._metadata: Metadata
        self._locator: Locator | None = None  # format 2: items load per index object
        self._index: ItemIndex
        # None: broadcast in a process group, at the first read_metadata() of each load.
        broadcast = self.options.broadcast
        self._broadcast = is_distributed() if broadcast is None else broadcast
        self._at_read_metadata = broadcast is None and self._broadcast
        # Replicated items are fetched once per job wherever the reader coordinates the
        # group: one read path for a plain dcp.load and the manager's load (the owners'
        # table travels in every rank's plan).
        self._share = self._broadcast
        #: The manifest is still to be read, by the next read_metadata() (see above).
        self._pending = False
        #: The group's collectives (the manifest's broadcast, the shared reads).
        self._collectives = Collectives(process_group)
        #: This load's id, drawn anew for each load (as FileSystemReader's ``load_id``).
        self.load_id = uuid.uuid4().hex
        self._rank = 0
        #: Metadata bytes this reader fetched from the store (manifest, index objects).
        self.metadata_bytes_fetched = 0
        self._counter = RequestCounter()
        self._delivery = Delivery(self.options, _extension_registry)
        #: The open's error, kept for dcp.load's first step in a process group.
        self._deferred: Exception | None = None
        self._open_now_or_at_read_metadata()
        # No load has used what _open read yet: a reset(checkpoint_id) naming the same
        # URL (how dcp.load starts) need not read the manifest again (at W ranks that
        # second read is W GETs, or a second broadcast).
        self._unused = True

    @property
    def store(self) -> ObjectStore:
        """Every read of this load goes through it (:mod:`objckpt.writers.base`)."""
        if self._store is None or self._store_pid != os.getpid():
            self._store = open_store(self.location)
            self._store_pid = os.getpid()
        return self._store

    @property
    def fs(self) -> Any:
        """Removed: every read goes through :attr:`store`."""
        raise AttributeError(
            "ObjectStoreReader.fs was removed: read through ObjectStoreReader.store "
            "(an objckpt.writers.ObjectStore: read, read_range, listing, inventory)"
        )

    @property
    def is_stock(self) -> bool:
        """True when loading a stock DCP checkpoint (no manifest, nothing verified).

        Raises:
            ObjckptError: Not known yet: the manifest is read at ``dcp.load``'s
                first step (the default ``broadcast`` in a process group).
        """
        if self._pending:
            raise ObjckptError(f"{self.location.url} is opened by dcp.load's first step")
        return self.manifest is None

    @property
    def local_bytes_read(self) -> int:
        """Bytes this reader took from the local copy."""
        return 0 if self._local_copy is None else self._local_copy.bytes_read

    @property
    def local_damaged(self) -> dict[str, tuple[str, str]]:
        """Objects of the local copy found damaged: key -> (the file, why)."""
        return {} if self._local_copy is None else dict(self._local_copy.damaged)

    @property
    def requests(self) -> RequestStats:
        """Store requests this reader made on this rank (opening included)."""
        return self._counter.snapshot()

    def _open_or_defer(self) -> None:
        """Open the checkpoint; in a process group, keep a failure for ``dcp.load``.

        A reader is built outside DCP's collectives: one rank raising here (its
        node cannot reach the store, the manifest it read is bad) would leave
        that rank's next ``dcp.load`` pairing with this one on the other ranks.
        In a process group the error is raised from ``set_up_storage_reader``
        instead, inside DCP's first step, whose errors DCP raises on every rank.
        """
        self._deferred = None
        try:
            self._open()
        except Exception as exc:
            if not is_distributed():
                raise
            logger.warning("opening %s failed on this rank: %s", self.location.url, exc)
            self._deferred = exc
            self._metadata = Metadata(state_dict_metadata={})

    def _open(self) -> None:
        opened = open_checkpoint(
            self.location,
            lambda: self.store,
            local=self._local_copy,
            broadcast=self._broadcast,
            collectives=self._collectives,
            allow_stock=self.options.allow_stock,
            max_bytes=self.options.max_metadata_bytes,
        )
        if opened.source is not None:
            self.manifest_source = opened.source
        self.metadata_bytes_fetched += opened.fetched
        self.manifest, self._metadata, self._locator = (
            opened.manifest,
            opened.metadata,
            opened.locator,
        )
        self._index = ItemIndex(opened, self.location, lambda: self.store, self._local_copy)
        if self._local_copy is not None:
            objects = None if opened.manifest is None else opened.objects
            self._local_copy.start(self.location, objects)

    # -- DCP protocol, in the order DCP calls it ----------------------------------------
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Location.is_valid(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            location = Location.parse(
                checkpoint_id, self.location.storage_options, self.location.retry
            )
            if self._unused and location.url == self.location.url and not self._at_read_metadata:
                self._unused = False
                self.load_id = uuid.uuid4().hex  # still a new load
                return
            # A new load (DCP calls this first): read the manifest again, as the URL
            # may have been overwritten since. The store names objects under one
            # location; its client stays warm in the process's client cache when the
            # protocol and options are the same.
            self._store = None
            self.location = location
            self.load_id = uuid.uuid4().hex
            self.manifest, self._locator = None, None
            self._counter = RequestCounter()
            self._open_now_or_at_read_metadata()

    def _open_now_or_at_read_metadata(self) -> None:
        """Open now, or (``broadcast=None`` in a process group) in the next
        ``read_metadata()``: ``dcp.load``'s first call on every rank."""
        self._deferred = None
        self.manifest_source = None
        if self._at_read_metadata:
            self._pending = True
            self._metadata = Metadata(state_dict_metadata={})
            return
        with counting(self._counter):
            self._open_or_defer()

    def read_metadata(self) -> Metadata:
        """The checkpoint's DCP metadata; its ``storage_meta.load_id`` is this load's
        ``load_id`` (as torch's own readers fill it). After a failed open in a
        process group it describes nothing, and ``set_up_storage_reader`` raises.

        With the default ``broadcast`` in a process group, the first call of a load
        reads the manifest on rank 0 and broadcasts it: a collective, which
        ``dcp.load`` makes on every rank."""
        if self._pending:
            self._pending = False
            with counting(self._counter):
                self._open_or_defer()
        meta = self._metadata.storage_meta or StorageMeta()
        meta = dataclasses.replace(meta, load_id=self.load_id)
        return dataclasses.replace(self._metadata, storage_meta=meta)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._deferred is not None:
            raise self._deferred
        rank = kwargs.get("rank")
        if rank is None:
            rank = self._collectives.rank
        self._rank = int(rank)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Index objects are fetched in read_data, once the global plan says which
        # items this rank reads itself and which it receives from another rank.
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self._share and is_distributed():
            locator, metadata = self._locator, self._metadata
            if locator is None:
                plans = assign_owners(plans)
            else:
                plans = assign_owners(plans, lambda idx: locator.shard_of(idx, metadata))
        if self._peers is None:
            return plans
        needs = [self._objects_read(rank, p) for rank, p in enumerate(plans)]
        fetches = self._peers.schedule(needs)
        return [
            dataclasses.replace(p, storage_data=PlanData(p.storage_data, f))
            for p, f in zip(plans, fetches, strict=True)
        ]

    def _objects_read(self, rank: int, plan: LoadPlan) -> set[str]:
        """Coordinator: the objects ``rank``'s plan reads itself (not the shared items
        it receives): every object of each rank whose items it reads (format 2, where
        the index objects locating them are not fetched yet), or each item's object."""
        shared = plan.storage_data
        given: set[MetadataIndex] = set()
        if isinstance(shared, SharedReads):
            given = {idx for idx, owner in shared.entries if owner != rank}
        indices = [r.storage_index for r in plan.items if r.storage_index not in given]
        locator, objects = self._locator, self.manifest.objects if self.manifest else ()
        if locator is None:
            self._locate(indices)
            return {self._index.item_at(i).relative_path for i in indices}
        shards = {locator.shard_of(i, self._metadata) for i in indices}
        return {o.key for o in objects if writer_rank(o.key) in shards}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._unused = False  # a later reset(url) is a new load: read the manifest again
        with counting(self._counter):
            self._read_plan(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- read_data's steps ----------------------------------------------------------------
    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Objects from peers' nodes first (every rank walks their transfers), shared
        items through their owners, then the rest, fetched by this rank."""
        reads = list(plan.items)
        shared = plan.storage_data
        fetch_error: Exception | None = None
        if isinstance(shared, PlanData):
            assert self._peers is not None
            try:
                self._peers.fetch(shared.peers)
            except Exception as exc:  # raised after the shared reads' collectives below
                fetch_error = exc
            shared = shared.shared
        if isinstance(shared, SharedReads):
            owned = {idx for idx, _ in shared.entries}
            exchange_shared(
                shared,
                [r for r in reads if r.storage_index in owned],
                self._fetch_shared,
                lambda rs, sent, data: self._deliver_shared(rs, sent, data, planner),
                rank=self._rank,
                collectives=self._collectives,
                batch_bytes=self.options.max_in_flight_bytes // 2,
                url=self.location.url,
            )
            reads = [r for r in reads if r.storage_index not in owned]
        if fetch_error is not None:
            raise fetch_error
        self._read(reads, planner)

    def _read(self, reads: list[ReadItem], planner: LoadPlanner) -> None:
        """Fetch and deliver ``reads``, the next batch prefetched while one is copied."""
        self._locate(r.storage_index for r in reads)
        located = [(r, self._index.item_at(r.storage_index)) for r in reads]
        ranges = plan_ranges(located, self.options)
        targets = LoadTargets(planner, reads)
        fetch_and_deliver(
            list(batches(ranges, self.options.max_in_flight_bytes)),
            lambda batch: [self._delivery.place(rng, targets, self._metadata) for rng in batch],
            self._fetch,
            lambda rng, placed: self._deliver(rng, placed, targets),
        )

    def _locate(self, indices: Iterable[MetadataIndex]) -> None:
        self.metadata_bytes_fetched += self._index.locate(indices)

    def _fetch(self, batch: list[Range], placed: list[Placed]) -> None:
        fetch_ranges(
            batch,
            [p.sink() for p in placed],
            self.location,
            lambda: self.store,
            self._local_copy,
            self.options,
        )

    def _deliver(self, rng: Range, placed: Placed, targets: LoadTargets) -> None:
        self._delivery.deliver(rng, placed, targets, self._metadata, self.location)

    def _fetch_shared(self, indices: list[MetadataIndex]) -> list[tuple[Sent, bytes | memoryview]]:
        """Owner: the whole stored items this rank shares with the others."""
        self._locate(indices)
        items = [self._index.item_at(idx) for idx in indices]
        # Each item whole (one range each, fetched in batches), with what the
        # receivers need to check it.
        ranges = [
            Range(it.relative_path, it.offset, it.offset + it.length, [], [it]) for it in items
        ]
        out: list[tuple[Sent, bytes | memoryview]] = []
        for batch in batches(ranges, self.options.max_in_flight_bytes):
            placed = [Placed.plain(r.start, bytearray(r.end - r.start)) for r in batch]
            self._fetch(batch, placed)
            for rng, data in zip(batch, (p.scratch for p in placed), strict=True):
                it = rng.items[0]
                sent = Sent(
                    rng.key, rng.end - rng.start, it.crc32c, it.transform_descriptors, it.raw_length
                )
                out.append((sent, data))
        return out

    def _deliver_shared(
        self, reads: list[ReadItem], sent: Sent, data: memoryview, planner: LoadPlanner
    ) -> None:
        """Receiver (and owner): copy a shared item into this rank's targets."""
        item = StoredItem(
            sent.key,
            0,
            sent.length,
            sent.crc32c,
            transform_descriptors=sent.transforms,
            raw_length=sent.raw_length,
        )
        rng = Range(sent.key, 0, sent.length, [(r, item) for r in reads])
        self._deliver(rng, Placed.plain(0, data), LoadTargets(planner, []))
