"""``ObjectStoreWriter``: a DCP ``StorageWriter`` for any fsspec URL.

DCP calls, in order (rank 0 is the coordinator)::

    reset(checkpoint_id)            every rank (dcp.save with checkpoint_id)
    set_up_storage_writer(...)      every rank
    prepare_local_plan(plan)        coordinator: preflight the store, refuse a committed URL
    prepare_global_plan(plans)      coordinator: pick the attempt id, name each rank
    write_data(plan, planner)       every rank: serialize + upload its payload objects
    finish(metadata, results)       coordinator: index objects, the manifest (commit),
                                    then .metadata

Only the coordinator preflights a synchronous save (``needs_preflight``), on every
save: every rank would multiply its requests by the world size, and a rank that
cannot write fails its first upload, so nothing is committed. An async checkpointer
attaches each save's writer (:meth:`ObjectStoreWriter.attach`) so that every rank
preflights, once per bucket, before its first copy (``objckpt.writers.base`` says
the same of the store's call order).

Errors raised here reach the caller wrapped in torch's ``CheckpointException``,
which carries the objckpt error per rank.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from objckpt._removed import WRITER, removed_keywords
from objckpt._torch import StreamTransformExtension
from objckpt.dcp.plan import ObjectPlan, RankPlan, assign_objects
from objckpt.dcp.reuse_base import BaseReader, BaseTable, base_location
from objckpt.dcp.serialize import (
    Framer,
    WrittenObject,
    refuse_unwritable,
    resolve_bytes_items,
    resolve_entries,
    stored_chunks,
    with_transforms,
    written_object,
)
from objckpt.dcp.transforms import ItemTransforms
from objckpt.dcp.upload import StoredEntry, split_reused, upload_payload
from objckpt.errors import CheckpointExistsError, ConfigurationError, ManifestError
from objckpt.format.commit import commit_checkpoint, read_manifest, requests_result
from objckpt.format.layout import (
    MANIFEST_KEY,
    METADATA_KEY,
    is_objckpt_object,
    new_attempt_id,
    payload_key,
)
from objckpt.format.manifest import Manifest
from objckpt.format.payload import PayloadRecord
from objckpt.format.refs import holds_spread
from objckpt.format.reused import BaseItem
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.accounting import RequestCounter, RequestStats, counting
from objckpt.writers.checksum import BytesLike
from objckpt.writers.clients import OwnedClients
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy
from objckpt.writers.translate import translate

__all__ = ["ObjectStoreWriter"]

logger = logging.getLogger(__name__)


@removed_keywords(WRITER)
class ObjectStoreWriter(StorageWriter):
    """Save a DCP checkpoint to an object store, committed by a create-only manifest.

    Args:
        url: Checkpoint URL (``s3://bucket/run/step-100``, ``gs://...``,
            ``file:///...``, ``memory://...``, or a local path).
        storage_options: Passed untouched to fsspec (endpoint, credentials, ...).
        overwrite: Replace a committed checkpoint at ``url``. The old one stays
            loadable until the new manifest replaces it in one write.
        upload: Object and part sizing, upload concurrency, the save's deadline and
            its preflight's bound (:class:`~objckpt.UploadOptions`).
        user_metadata: JSON-serializable values stored in the manifest's ``user``.
        reuse_from: A committed step beside ``url`` (``<root>/step-<N>``) whose equal
            items (fqn, chunk, length, xxh3-128) are referenced, not uploaded again.
        _extensions: DCP stream transforms applied to each item, as torch's
            ``FileSystemWriter(_extensions=...)`` applies them (experimental in
            DCP); ``upload.compression`` is objckpt's own, in the same format.

    Raises:
        ConfigurationError: Bad URL, protocol or option (at construction).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        upload: UploadOptions | None = None,
        user_metadata: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        reuse_from: str | None = None,
        _extensions: Sequence[StreamTransformExtension] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(overwrite, bool):
            raise ConfigurationError(
                f"option overwrite={overwrite!r} is invalid: expected True or False"
            )
        self.location = Location.parse(url, storage_options, retry)
        base_location(self.location, reuse_from)  # a misnamed base fails here
        self.reuse_from = reuse_from
        self._base: BaseReader | None = None
        #: The checkpoint id as the caller gave it (DCP's ``StorageMeta.checkpoint_id``).
        self.checkpoint_id: str | os.PathLike[str] = url
        self.overwrite = overwrite
        self.upload = upload or UploadOptions()
        _check_spread(self.location, self.upload)
        self.transforms = ItemTransforms(self.upload.compression, _extensions)
        self.preflight_timeout = float(self.upload.preflight_timeout)
        self.user_metadata = dict(user_metadata or {})
        #: Tensor frames by dtype and shape, kept across the saves of a reused writer.
        self.framer = Framer()
        self._store: ObjectStore | None = None
        self._store_pid = -1
        # A checkpointer's clients, shared across its saves (in the process that
        # attached them; a worker opens its own).
        self._clients: OwnedClients | None = None
        self._clients_pid = -1
        # None: the coordinator's saves only (see preflight_timeout); attach() decides
        # for a checkpointer's writers.
        self._needs_preflight: bool | None = None
        self._agreed_attempt: str | None = None  # set by attach(): all ranks agreed on it
        self._check_existing = True  # attach(check_existing=False): the owner asks, or knows
        self._rank = 0
        self._is_coordinator = True
        self._attempt: str | None = None
        #: This save's id, drawn anew for each save (as FileSystemWriter's): on the
        #: coordinator it becomes the attempt id that names the payload objects.
        self.save_id = new_attempt_id()
        #: The manifest of the last commit this writer made (coordinator only).
        self.last_manifest: Manifest | None = None
        self._counter = RequestCounter()
        self._counter_attached = False
        self._deadline: Deadline | None = None

    def attach(
        self,
        *,
        clients: OwnedClients | None = None,
        preflight: bool | None = None,
        attempt: str | None = None,
        requests: RequestCounter | None = None,
        check_existing: bool | None = None,
    ) -> None:
        """Bind this writer to what a long-lived owner (an async checkpointer) holds.

        A training job saves many times; paying for a new HTTP session, a preflight
        round trip and an attempt-id exchange on every save would lengthen each
        stall. The owner keeps those and hands them to each save's writer here.

        Args:
            clients: The owner's store clients, this writer's store built on them
                (only in the process that attached them; workers open their own).
            preflight: Whether ``prepare_local_plan`` must still prove the bucket
                is reachable and writable (False once a save to it succeeded;
                None leaves it as it is).
            attempt: The attempt id every rank already agreed on; the coordinator
                uses it instead of drawing a new one, and ``storage_meta`` names it.
            requests: The counter of the save this writer serves, kept for its
                whole life (by default each save gets a new one).
            check_existing: Whether ``prepare_local_plan`` asks "already
                committed?" (False: the owner knows, or asks off the training
                thread with :meth:`refuse_existing`; None leaves it as it is).
        """
        if clients is not None:
            self._clients, self._clients_pid = clients, os.getpid()
        if preflight is not None:
            self._needs_preflight = preflight
        if attempt is not None:
            self._agreed_attempt = self._attempt = self.save_id = attempt
        if requests is not None:
            self._counter, self._counter_attached = requests, True
        if check_existing is not None:
            self._check_existing = check_existing

    @property
    def rank(self) -> int:
        """This process's rank, as DCP set it up (0 before ``set_up_storage_writer``)."""
        return self._rank

    @property
    def requests(self) -> RequestStats:
        """Store requests this rank made for the current (or last) save."""
        return self._counter.snapshot()

    @property
    def request_counter(self) -> RequestCounter:
        """The running tally behind ``requests`` (an async save adds its workers' to it)."""
        return self._counter

    @property
    def needs_preflight(self) -> bool:
        """Whether ``prepare_local_plan`` will prove the bucket writable first."""
        if self._needs_preflight is None:
            return self._is_coordinator
        return self._needs_preflight

    @property
    def attempt(self) -> str | None:
        """The attempt id of the save in progress (None before it is planned)."""
        return self._attempt

    # -- DCP protocol ---------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            new = Location.parse(checkpoint_id, self.location.storage_options, self.location.retry)
            _check_spread(new, self.upload)
            if new.protocol != self.location.protocol and self._store is not None:
                self._close_store()
            self.location = new
            self.checkpoint_id = checkpoint_id
            if self._store is not None:
                self._store.location = new
        self._attempt = self._agreed_attempt
        self.save_id = self._agreed_attempt or new_attempt_id()
        self._base = None  # read anew for this save's location

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator
        if not self._counter_attached:
            self._counter = RequestCounter()  # one per save
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._rank = int(rank)
        # The save's clock starts here: preflight, uploads and the commit share it.
        self._deadline = Deadline.start(
            self.upload.deadline, f"rank {self._rank} saving {self.location.url}"
        )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._attempt or self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with counting(self._counter), bounded_by(self._deadline):
            return self._check_target(plan)

    def _check_target(self, plan: SavePlan) -> SavePlan:
        store = self.store
        if self.needs_preflight:
            store.preflight(self.preflight_timeout)
        # Only the coordinator asks "already committed?": one LIST per save instead of
        # one per rank, and DCP raises its refusal on every rank.
        if not self.overwrite and self._is_coordinator and self._check_existing:
            self._refuse_existing(store)
        return plan

    def refuse_existing(self) -> None:
        """Raise when the URL already holds a checkpoint (nothing with ``overwrite``):
        one LIST, and a GET of a manifest found. An async save runs it on another
        thread, beside the copy, and holds its uploads until it answers.

        Raises:
            CheckpointExistsError: A committed (or stock DCP) checkpoint is there.
            StoreError: The listing failed.
        """
        if self.overwrite:
            return
        with counting(self._counter), bounded_by(self._deadline):
            self._refuse_existing(self.store)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        attempt = self._agreed_attempt or self.save_id
        self._attempt = attempt
        return [
            dataclasses.replace(p, storage_data=RankPlan(rank=i, attempt=attempt))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, RankPlan):
            raise ConfigurationError("ObjectStoreWriter.write_data got a plan it did not prepare")
        self._attempt = rank_plan.attempt
        with counting(self._counter), bounded_by(self._deadline):
            results = self._write(plan, rank_plan, planner)
        results.append(requests_result(self._counter.snapshot()))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(
        self, plan: SavePlan, rank_plan: RankPlan, planner: SavePlanner
    ) -> list[WriteResult]:
        store = self.store
        items = list(plan.items)
        refuse_unwritable(items, planner)
        resolved = resolve_bytes_items(items, planner)
        position = {id(item): n for n, item in enumerate(items)}
        objects = assign_objects(
            items,
            self.upload.object_size,
            lambda i: payload_key(
                rank_plan.rank,
                i,
                rank_plan.attempt,
                self.upload.prefix_entropy,
                self.upload.persistent_prefixes,
            ),
        )
        entries_of, applied = self.transforms.wrap(
            lambda obj: resolve_entries(obj, planner, resolved, position), self.framer
        )
        results, created = write_objects(
            store, objects, items, entries_of, self.framer, self.base_table(items)
        )
        results = with_transforms(results, applied(items))
        logger.debug("rank %d wrote %d objects to %s", rank_plan.rank, created, self.location.url)
        return results

    def base_reader(self) -> BaseReader | None:
        """What this save reads of ``reuse_from`` (None: no reuse), read once."""
        if (base := base_location(self.location, self.reuse_from)) is None:
            return None  # none, or given up (reuse_from reset): no earlier reader is used
        if self._base is None:
            self._base = BaseReader(self.store, base, target_url=self.location.url)
        return self._base

    def base_table(self, items: list[WriteItem]) -> BaseTable | None:
        """The items of ``reuse_from`` this rank may reference (None: no reuse)."""
        return None if (r := self.base_reader()) is None else r.table([i.index for i in items])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._attempt is None:
            raise ConfigurationError("ObjectStoreWriter.finish called before a plan was prepared")
        with counting(self._counter), bounded_by(self._deadline):
            self._commit(metadata, results, self._attempt)

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]], attempt: str) -> None:
        self.last_manifest = commit_checkpoint(
            self.store,
            metadata,
            results,
            attempt=attempt,
            world_size=len(results),
            overwrite=self.overwrite,
            user=self.user_metadata,
            checkpoint_id=self.checkpoint_id,
            base=self.reuse_from,
            stock=self.upload.writes_stock_metadata(len(results)),
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Location.is_valid(checkpoint_id)

    # -- helpers ----------------------------------------------------------------------------
    @property
    def store(self) -> ObjectStore:
        """This process's store object (built lazily, never shared across processes)."""
        if self._store is None or self._store_pid != os.getpid():
            mine = self._clients if self._clients_pid == os.getpid() else None
            self._store = open_store(self.location, self.upload, clients=mine)
            self._store_pid = os.getpid()
        return self._store

    def _refuse_existing(self, store: ObjectStore) -> None:
        url = self.location.url
        try:
            names = list(store.listing())
        except Exception as exc:
            raise translate(exc, url=url, action="listing") from exc
        if MANIFEST_KEY in names:
            try:
                attempt = read_manifest(store).attempt
            except ManifestError:
                raise CheckpointExistsError(
                    f"{url} holds a manifest objckpt cannot read; "
                    "refusing to write over it (pass overwrite=True)"
                ) from None
            raise CheckpointExistsError(
                f"{url} already holds a committed checkpoint (attempt {attempt}); "
                "pass overwrite=True to replace it"
            )
        if METADATA_KEY in names and not any(is_objckpt_object(n) for n in names):
            raise CheckpointExistsError(
                f"{url} already holds a stock DCP checkpoint (.metadata without a manifest); "
                "pass overwrite=True to replace it"
            )

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def close(self) -> None:
        """Release the thread pool and clients this writer opened."""
        self._close_store()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = None  # filesystem clients never cross a process boundary
        state["_clients"] = None
        return state


# The synchronous writer's upload loop: one payload object after another, through
# the upload path the workers share (objckpt.dcp.upload). Each object's entries are
# hashed against the base step's items first when the save reuses: equal items are
# referenced, not written, and an object all of whose items are reused is never
# created. Several objects are in flight at once; any failure aborts its upload and
# lets the others settle before it is raised.


def _check_spread(location: Location, upload: UploadOptions) -> None:
    """Refuse persistent prefixes for a checkpoint that is no step directory: its
    spread directories would sit beside it, outside any root's step directories,
    where nothing (retention, gc, ``rm``) counts them as the checkpoint's."""
    if upload.persistent_prefixes and not holds_spread(location):
        raise ConfigurationError(
            f"option persistent_prefixes=True needs the checkpoint {location.url} to be a "
            "step directory of a root below the bucket (<root>/step-<10 digits>, as a "
            "CheckpointManager saves): its payloads are stored under <root>/spread-<hex>/"
        )


def _stored(
    entries: Iterable[tuple[int, torch.Tensor | BytesLike]], framer: Framer
) -> Iterator[tuple[int, tuple[BytesLike, ...], bool]]:
    """Each entry as its stored chunks, resolved as it is consumed."""
    for ident, data in entries:
        chunks, kept = stored_chunks(data, framer)
        yield ident, chunks, kept


def write_objects(
    store: ObjectStore,
    objects: Sequence[ObjectPlan],
    items: list[WriteItem],
    entries_of: Callable[[ObjectPlan], Iterable[tuple[int, torch.Tensor | BytesLike]]],
    framer: Framer,
    base: BaseTable | None,
) -> tuple[list[WriteResult], int]:
    """Write ``objects``; their items' write results and how many objects were created."""
    position = {id(item): n for n, item in enumerate(items)}
    written: list[WrittenObject] = []
    created = 0
    try:
        for obj in objects:
            reuse = base.for_items((position[id(i)], i) for i in obj.items) if base else {}
            to_write: Iterable[StoredEntry]
            reused: list[tuple[int, BaseItem]]
            if reuse:  # hashed first: an object whose items are all reused is never begun
                to_write, reused = split_reused(_stored(entries_of(obj), framer), reuse)
            else:  # streamed: each item resolved as it is written, none held ahead
                stored = _stored(entries_of(obj), framer)
                to_write, reused = ((i, c, k, None) for i, c, k in stored), []
            if reuse and not to_write:  # every item reused: the object is never created
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                done.set_result(None)
                record = PayloadRecord(0, "", (), reused=tuple(reused))
                written.append(written_object(obj, items, record, done))
                continue
            record, done = upload_payload(store, obj.key, to_write, obj.size_hint, reused)
            written.append(written_object(obj, items, record, done))
            created += 1
        results: list[WriteResult] = []
        for w in written:
            w.done.result()
            results.extend(w.write_results())
    except BaseException:
        for w in written:  # let in-flight uploads settle (they abort themselves on failure)
            w.done.exception()
        raise
    return results, created
