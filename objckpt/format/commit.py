"""The commit: one sequence of steps, run by one of two strategies.

The steps, in this order, whichever strategy runs them:

1. the index objects, one per writing rank (``__index_<rank>.<attempt>.json``);
2. the manifest's ``metadata`` document, and ``.metadata`` (DCP's pickle, for stock
   readers) prepared, not yet written, where the strategy builds it before the
   commit (the manifest then names it with its size and CRC32C);
3. one listing checks that every object the manifest names is there, then
   ``manifest.json`` is written create-only: the commit point (any error of that PUT
   is settled by reading it back, :mod:`objckpt.format.settle`);
4. ``.metadata`` is written (built now where step 2 did not), then what only a
   replaced checkpoint named is deleted.

A checkpoint exists if and only if its manifest exists. Everything else the save
wrote is invisible until then, so a crash at any earlier moment leaves the previous
state of the URL untouched. The outcome is therefore decided at step 3, and a
distributed save tells the other ranks there (:func:`commit_sequence`'s
``committed``), before step 4: at 8,192 ranks ``.metadata`` is 1.2 GB, and no rank
should wait for its upload to learn what the manifest already says. Rank 0's save
completes after step 4, so a stock reader finds ``.metadata`` once rank 0's save
has completed (a failed step 4 is logged, and the step stays committed).

Nothing a committed manifest names may be written by another attempt. Payload and
index names carry the attempt id; ``.metadata`` has a fixed name, so it is written
only after this attempt's manifest is on the store: a failed, losing or overwriting
attempt never touches the committed checkpoint's ``.metadata`` before it has won.
Until that one PUT lands, a stock reader sees no ``.metadata`` (a new URL) or the
previous checkpoint's, whose objects are all still there (an overwrite deletes what
only the replaced manifest named after ``.metadata`` is replaced, never before).

Why two strategies (:class:`CommitStrategy`): ``.metadata`` costs O(items), 9.8
million entries at 8,192 ranks. :class:`InThread` builds it in the committing
process itself, before the commit, from the write results it holds: what a
synchronous ``dcp.save`` and a store only this process reaches (``file://`` that
may be node-local, ``memory://``) need. The helper-process strategy
(:mod:`objckpt.pipeline.coordinator`) builds it in rank 0's commit helper from the
index objects every rank wrote itself, so an async save's commit does not hold the
training process, and after the commit unless the last one can be renamed (its
template): the manifest's ``writer`` columns come from the global plan
(:attr:`Layout.writers`), each rank having checked that its index places what the
plan gave it (:func:`write_rank_index`), so no rank waits for ten million items to
be decoded to learn the outcome. Both decode the same index bytes with the same code
(:func:`build_stock`) into the same ``.metadata`` pickle
(:mod:`objckpt.format.metadata_stream`): where a checkpoint was saved does not change
its bytes. A manifest names ``.metadata`` only where it was built before the commit;
either way ``.metadata`` is replaced, never deleted, by a later overwrite's step 4.
:func:`commit_sequence` is the one place the steps' order is written.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from objckpt._torch import storage_info
from objckpt._version import __version__
from objckpt.errors import InternalError, ManifestError, StoreError, UploadError
from objckpt.format.bounds import check_size
from objckpt.format.dcp_json import StoredItem, encode_storage_meta
from objckpt.format.index import (
    IndexShard,
    decode_index,
    decode_metadata,
    encode_metadata,
    encode_rank_index,
    layout_doc,
    writer_columns,
)
from objckpt.format.layout import METADATA_KEY
from objckpt.format.manifest import Manifest, ObjectEntry, read_manifest
from objckpt.format.metadata_stream import MetadataStream
from objckpt.format.ref_check import require_referenced
from objckpt.format.refs import is_reference, step_token, stock_path
from objckpt.format.settle import (
    finish_commit,
    finish_without_metadata,
    put_manifest,
    require_present,
)
from objckpt.format.superseded import previous_objects
from objckpt.writers.accounting import RequestCounter, RequestStats, counting, current_counter
from objckpt.writers.base import ObjectStore
from objckpt.writers.checksum import Crc32c
from objckpt.writers.deadline import each_in_context

__all__ = [
    "IN_THREAD_TEMPLATE_BYTES",
    "REQUESTS_FQN",
    "CommitStrategy",
    "GlobalPlan",
    "InThread",
    "Layout",
    "Prepared",
    "RankReport",
    "StockLayout",
    "StockTemplate",
    "build_stock",
    "commit_checkpoint",
    "commit_manifest",
    "commit_sequence",
    "metadata_entry",
    "plan_metadata",
    "read_indexes",
    "read_manifest",
    "requests_result",
    "save_storage_meta",
    "stock_digest",
    "write_rank_index",
    "written_objects",
]

logger = logging.getLogger(__name__)

# The DCP metadata format version DCP's own writers stamp.
_DCP_VERSION = "1.0.0"


#: The largest ``.metadata`` an in-thread commit keeps as its plan's template: a
#: one-rank job's (2 MB at 10,000 tensors), not a node-local tier's at thousands of
#: ranks (1.2 GB at 8,192), which rank 0's training process would hold between saves.
IN_THREAD_TEMPLATE_BYTES = 64 << 20
#: Index objects written or read at once (:func:`_each_index`).
_INDEX_FETCHERS = 16

#: A rank's write results end with one entry under this name that carries the
#: rank's request counts (not an item: the coordinator sums them for the manifest).
REQUESTS_FQN = "__objckpt_requests__"


def requests_result(stats: RequestStats) -> WriteResult:
    """The entry that carries a rank's request counts among its write results."""
    return WriteResult(index=MetadataIndex(REQUESTS_FQN), size_in_bytes=0, storage_data=stats)


def written_objects(results: Iterable[WriteResult]) -> tuple[ObjectEntry, ...]:
    """The payload objects a rank's write results place items in, by key."""
    objects = {
        wr.storage_data.relative_path: ObjectEntry(
            wr.storage_data.relative_path,
            wr.storage_data.object_size,
            wr.storage_data.object_crc32c,
        )
        for wr in results
        if isinstance(wr.storage_data, StoredItem)
    }
    return tuple(objects[k] for k in sorted(objects))


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What one rank reports for the commit: small, whatever the world size (a rank's
    bytes per save do not grow with it, and the coordinator decodes W small records
    instead of every rank's write results).

    Attributes:
        index: This rank's index object (None: it stored no item).
        objects: The payload objects its items are in.
        requests: Its store requests so far, its index PUT included.
    """

    index: ObjectEntry | None
    objects: tuple[ObjectEntry, ...]
    requests: RequestStats
    #: :func:`stock_digest` of its items (None: not given): equal on every rank
    #: between two saves, and ``.metadata`` differs only by the attempt id and the
    #: save's ``StorageMeta``.
    stock_digest: str | None = None
    #: The length before their transforms of its items stored transformed (the
    #: manifest's ``raw_bytes`` is the ranks' sum; 0: none is).
    raw_bytes: int = 0


def write_rank_index(
    store: ObjectStore,
    results: Iterable[WriteResult],
    rank: int,
    attempt: str,
    requests: Callable[[], RequestStats],
    planned: Iterable[MetadataIndex],
    stock: bool = True,
) -> RankReport:
    """Step 1 on one rank (the helper-process strategy): check that the rank's write
    results place exactly the items its plan gave it (``planned``), then encode and
    PUT this rank's index object; its report (``requests`` is read after the PUT, so
    it counts it). Without ``stock`` (the save writes no ``.metadata``) the rank
    reports no :func:`stock_digest`: nothing would use it.

    The check is what lets the manifest take each chunk's writer from the global plan
    (:attr:`Layout.writers`) instead of decoding every rank's index before the commit
    (ten million items at 8,192 ranks): each rank proves its own index places what
    the plan says it wrote, O(its items), before any rank reports.

    Raises:
        ManifestError: An item has no chunk position, or the results place other
            items than ``planned``.
        StoreError: The PUT failed (the save must fail on every rank).
    """
    results = list(results)
    items = {wr.index: wr.storage_data for wr in results if isinstance(wr.storage_data, StoredItem)}
    _require_planned(items.keys(), planned, rank)
    objects = written_objects(results)
    if not items:
        return RankReport(None, objects, requests())
    shard = encode_rank_index(items, rank, attempt)
    store.put(shard.key, shard.data)
    raw = sum(it.raw_length or 0 for it in items.values() if it.transform_descriptors)
    digest = stock_digest(items, attempt, store.location.url) if stock else None
    return RankReport(_entry(shard), objects, requests(), digest, raw)


def _require_planned(
    stored: Iterable[MetadataIndex], planned: Iterable[MetadataIndex], rank: int
) -> None:
    """Raise ManifestError unless ``stored`` and ``planned`` are the same items
    (their fqn, offsets and chunk position, which is what places them)."""

    def keys(indexes: Iterable[MetadataIndex]) -> set[tuple[Any, ...]]:
        return {(i.fqn, None if i.offset is None else tuple(i.offset), i.index) for i in indexes}

    have, want = keys(stored), keys(planned)
    if have != want:
        lost, extra = sorted(want - have, key=repr), sorted(have - want, key=repr)
        raise ManifestError(
            f"rank {rank}'s write results place {len(have)} items, its plan {len(want)}: "
            + "; ".join(
                f"{what} {', '.join(repr(k[0]) + f' chunk {k[2]}' for k in ks[:3])}"
                + (f" and {len(ks) - 3} more" if len(ks) > 3 else "")
                for what, ks in (("not stored:", lost), ("not planned:", extra))
                if ks
            )
            + "; nothing is committed"
        )


def stock_digest(items: Mapping[MetadataIndex, StoredItem], attempt: str, url: str) -> str:
    """xxh3-128 of what a rank's items put into ``.metadata`` (each item's key,
    object name as ``.metadata`` names it from the checkpoint ``url`` with the attempt
    id blanked, offset, length, transforms, raw length), in plan order: O(its
    items), on the rank. Not its CRC32Cs and hashes, which change with every value.
    A spread key's name holds its own step (:func:`~objckpt.format.refs.stock_path`),
    blanked too: the template renames it (:meth:`StockTemplate.renamed`)."""
    hasher = xxhash.xxh3_128()
    blank = "-" * len(attempt)
    token = step_token(url)
    paths: dict[str, str] = {}  # (a rank's items share a few objects)
    for index, item in items.items():
        path = paths.get(item.relative_path)
        if path is None:
            path = stock_path(url, item.relative_path)
            if token is not None and token in path:
                path = path.replace(token, "/" + "-" * (len(token) - 2) + "/")
            paths[item.relative_path] = path
        hasher.update(
            repr(
                (
                    index.fqn,
                    None if index.offset is None else tuple(index.offset),
                    index.index,
                    path.replace(attempt, blank),
                    item.offset,
                    item.length,
                    item.transform_descriptors,
                    item.raw_length,
                )
            ).encode()
        )
    return hasher.hexdigest()


def _entry(shard: IndexShard) -> ObjectEntry:
    crc = Crc32c()
    crc.update(shard.data)
    return ObjectEntry(shard.key, len(shard.data), crc.hexdigest())


def _put_index(store: ObjectStore, shards: list[IndexShard]) -> list[ObjectEntry]:
    """Step 1 in-thread: write every rank's index object, several at once (1,024 at
    1,024 ranks)."""

    def put(shard: IndexShard) -> ObjectEntry:
        store.put(shard.key, shard.data)
        return _entry(shard)

    return _each_index(put, shards)


def _each_index(fn: Callable[[Any], ObjectEntry | bytes], items: Sequence[Any]) -> list[Any]:
    """``fn`` of each of ``items`` (index objects written or read), in order,
    :data:`_INDEX_FETCHERS` at a time, its requests counted and bounded like the
    caller's."""
    return each_in_context(fn, items, lanes=_INDEX_FETCHERS, name="objckpt-index")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the manifest and ``.metadata`` take from one global plan (kept while the
    plan is reused: building it costs O(chunks), a save with it O(tensors)).

    Attributes:
        doc: The manifest's ``metadata`` without writers or index keys.
        placeholder: ``doc`` with a writer any reader accepts on every entry (what
            the index objects are decoded against).
        properties: Each tensor's ``TensorProperties`` (for ``.metadata``).
    """

    doc: dict[str, Any]
    placeholder: dict[str, Any]
    properties: dict[str, TensorProperties]
    #: Names this layout (one per global plan): two saves with the same token and the
    #: same :attr:`RankReport.stock_digest` on every rank have the same items.
    token: str = ""
    #: Each entry's ``writer`` (:func:`~objckpt.format.index.writer_columns`) as the
    #: global plan assigns items to ranks, which every rank checks its own index
    #: against before it reports (:func:`write_rank_index`); None: the plan's
    #: per-rank items were not given.
    writers: dict[str, Any] | None = None

    @classmethod
    def of(
        cls, metadata: Metadata, planned: Sequence[Iterable[MetadataIndex]] | None = None
    ) -> Layout:
        """The layout of ``metadata``'s plan; with ``planned`` (each rank's planned
        items, by rank) its writers too. Both O(chunks), once per global plan."""
        doc = layout_doc(dataclasses.replace(metadata, version=_DCP_VERSION), "0" * 16)
        state = {
            fqn: entry if "writer" in entry else {**entry, "writer": 0}
            for fqn, entry in doc["state_dict"].items()
        }
        writers = None if planned is None else writer_columns(doc, enumerate(planned))
        return cls(
            doc, {**doc, "state_dict": state}, _properties(metadata), uuid.uuid4().hex, writers
        )

    def for_save(
        self, placeholder: bool, index_keys: Sequence[str | None], storage_meta: StorageMeta
    ) -> dict[str, Any]:
        """The document of one save: its index keys and ``StorageMeta``."""
        base = self.placeholder if placeholder else self.doc
        return {
            **base,
            "index": list(index_keys),
            "storage_meta": encode_storage_meta(storage_meta),
        }


class GlobalPlan:
    """Rank 0's global plan as its commits keep it across the saves of one plan.

    DCP's ``Metadata`` holds a Python object per chunk and its offsets: 39 million
    objects, 2 GiB, at 8,192 ranks, every one walked by each full garbage collection
    of the training process. A commit from the ranks' index objects needs only the
    plan's :class:`Layout` (the manifest's columns, O(tensors) with regular sharding),
    so once the layout is built the ``Metadata`` is let go. A commit from write
    results (:func:`commit_checkpoint`, in this thread: one rank, a node-local tier)
    needs the ``Metadata``: it is kept until a layout is built, and rebuilt from the
    layout if one asks for it after that (then kept again, so that a checkpointer
    whose saves alternate between the two rebuilds it once, not per save).

    The manifest's writer columns (which rank the plan gives each chunk,
    :attr:`Layout.writers`) come from DCP's gathered write results, kept until the
    layout is built or an in-thread commit encodes them (:meth:`note_writers`).

    Built once per global plan (DCP's ``finish``) and shared by the saves that
    replay the plan; thread-safe, since a save's commit thread builds the layout
    while the next save may already hold the plan.
    """

    def __init__(
        self, metadata: Metadata, results: Sequence[Iterable[WriteResult]] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._metadata: Metadata | None = metadata
        #: Each rank's write results as DCP gathered them for ``finish`` (on an async
        #: save, placeholders naming its planned items), until the writers are taken
        #: from them (None: not given, or taken).
        self._results = results
        #: The manifest's writer columns, where an in-thread commit gave them
        #: (:meth:`note_writers`) before any layout was built.
        self._writers: dict[str, Any] | None = None
        self._layout: Layout | None = None
        #: Names this plan in a template's key (:class:`StockTemplate`).
        self.token = uuid.uuid4().hex
        #: The last ``.metadata`` an in-thread commit of this plan built whole, kept
        #: where it is small (:data:`IN_THREAD_TEMPLATE_BYTES`).
        self.stock = StockTemplate()
        #: DCP's flatten mapping and ``StorageMeta``, as the plan recorded them.
        self.planner_data = metadata.planner_data
        self.storage_meta = metadata.storage_meta

    @property
    def holds_metadata(self) -> bool:
        """Whether the plan still keeps DCP's ``Metadata`` (no layout was built yet)."""
        return self._metadata is not None

    def layout(self) -> Layout:
        """The plan's layout, built on first use (the ``Metadata`` is let go then)."""
        with self._lock:
            if self._layout is None:
                assert self._metadata is not None
                planned = None
                if self._results is not None:
                    planned = [
                        (wr.index for wr in rank if wr.index.fqn != REQUESTS_FQN)
                        for rank in self._results
                    ]
                layout = Layout.of(self._metadata, planned)
                if layout.writers is None and self._writers is not None:
                    layout = dataclasses.replace(layout, writers=self._writers)
                self._layout = layout
                self._metadata, self._results, self._writers = None, None, None
            return self._layout

    def note_writers(self, writers: Mapping[str, Any]) -> None:
        """Keep the writer columns an in-thread commit of this plan encoded from every
        rank's write results, and let the gathered placeholders go: rank 0 would keep
        W lists of them (about 40 million objects at 8,192 ranks) for as long as the
        plan is reused. A later commit of the plan through the helper (the plan cache
        does not key plans by store) takes its writers from these."""
        placed = all(_placed(w) for w in writers.values())
        with self._lock:  # only a whole set of writers replaces the results
            if placed and self._layout is None and self._results is not None:
                self._writers = dict(writers)
                self._results = None

    def metadata(self) -> Metadata:
        """DCP's ``Metadata`` of the plan: kept, or rebuilt from the layout (and kept)."""
        with self._lock:
            if self._metadata is None:
                layout = self._layout
                assert layout is not None
                # The placeholder names rank 0 as every entry's writer: decoding wants
                # it indexed.
                doc = {**layout.placeholder, "index": ["(rank 0)"]}
                self._metadata = plan_metadata(
                    doc, layout.properties, self.planner_data, self.storage_meta
                )
            return self._metadata


def _placed(writer: Any) -> bool:
    """Whether a writer column names a rank for every chunk (no -1: unplaced)."""
    if isinstance(writer, int):
        return writer >= 0
    if isinstance(writer, list):
        return all(isinstance(w, int) and w >= 0 for w in writer)
    runs = writer.get("runs") if isinstance(writer, dict) else None
    if not isinstance(runs, list) or len(runs) % 3:
        return False
    return all(
        min(start, start + step * (count - 1)) >= 0
        for start, step, count in zip(runs[::3], runs[1::3], runs[2::3], strict=True)
    )


def plan_metadata(
    doc: Mapping[str, Any],
    properties: Mapping[str, TensorProperties],
    planner_data: Any,
    storage_meta: StorageMeta | None,
    url: str = "the plan's layout",
) -> Metadata:
    """DCP's ``Metadata`` of a plan from a layout document: each tensor's properties
    as the plan recorded them (the document keeps only dtype and ``requires_grad``),
    and every chunk built once, as a plain list (a lazy run-length list would build a
    chunk per item looked up, and ``.metadata`` would build them all again)."""
    metadata, _ = decode_metadata(doc, url=url)
    sd_md: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            md = TensorStorageMetadata(
                properties=properties.get(fqn, md.properties),
                size=md.size,
                chunks=cast(list[ChunkStorageMetadata], list(md.chunks)),
            )
        sd_md[fqn] = md
    return dataclasses.replace(
        metadata, state_dict_metadata=sd_md, planner_data=planner_data, storage_meta=storage_meta
    )


def _properties(metadata: Metadata) -> dict[str, TensorProperties]:
    return {
        fqn: md.properties
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


@dataclasses.dataclass(frozen=True)
class StockLayout:
    """What building ``.metadata`` needs of the global plan besides the index objects.

    Attributes:
        doc: A manifest ``metadata`` document of this save every entry of which has
            a writer (real, or :attr:`Layout.placeholder`'s), with its index keys.
        properties: Each tensor's ``TensorProperties`` as the plan recorded them
            (the manifest keeps only dtype and ``requires_grad``).
        planner_data: DCP's flatten mapping, as the plan has it.
        storage_meta: What ``.metadata`` records as the save's ``StorageMeta``.
    """

    doc: dict[str, Any]
    properties: dict[str, TensorProperties]
    planner_data: Any
    storage_meta: StorageMeta
    #: The :attr:`Layout.token` it came from ("": none, never a template's).
    token: str = ""


@dataclasses.dataclass(frozen=True)
class _Kept:
    """The last ``.metadata`` built whole, and what a save must share with it."""

    key: Any
    attempt: str
    #: The pickle without its tail (StorageMeta, version, the end). A ``bytearray``:
    #: its ``replace`` gives a bytearray the new tail extends in place (a realloc),
    #: where bytes would be copied whole (1.2 GB at 8,192 ranks) to append it.
    body: bytearray
    version: Any
    #: ``/<step directory>/`` when the body names it (spread keys' paths), else None.
    step: str | None = None


class StockTemplate:
    """The last ``.metadata`` built whole for one plan, kept so that a later save of
    the plan with the same items renames it instead of building it (#46; the
    template's full story is :mod:`objckpt.pipeline.stock_task`'s, whose helper
    process keeps one; an in-thread commit keeps its own in the plan).

    ``key`` is what a save must share with the template: the plan and every writing
    rank's :func:`stock_digest`. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: _Kept | None = None

    @property
    def holds(self) -> bool:
        """Whether a template is kept (a save's key is worth computing)."""
        return self._kept is not None

    def clear(self) -> None:
        """Forget the template (before a new one of up to 1 GB is built beside it)."""
        with self._lock:
            self._kept = None

    def renamed(
        self, key: Any, attempt: str, storage_meta: StorageMeta, url: str
    ) -> bytearray | None:
        """``.metadata`` of the save ``attempt`` to ``url`` from the template, or None
        when it does not apply. A template
        whose paths name its step (spread keys) is renamed to ``url``'s step too."""
        with self._lock:
            kept = self._kept
        if key is None or kept is None or kept.key != key or len(kept.attempt) != len(attempt):
            return None
        token = step_token(url)
        if kept.step is not None and (token is None or len(token) != len(kept.step)):
            return None
        blob = kept.body.replace(kept.attempt.encode(), attempt.encode())
        if kept.step is not None and token is not None and token != kept.step:
            blob = blob.replace(kept.step.encode(), token.encode())
        blob.extend(MetadataStream.tail(storage_meta, kept.version))
        return blob

    def keep(
        self,
        key: Any,
        attempt: str,
        layout: StockLayout,
        blob: bytes | bytearray,
        url: str,
    ) -> None:
        """Keep ``blob`` (just built whole for ``attempt``) as the template under
        ``key``, when its tail is the one :meth:`MetadataStream.tail` writes and the
        attempt id appears only in names (None key: nothing is kept)."""
        if key is None:
            return
        version = layout.doc.get("version")
        tail = MetadataStream.tail(layout.storage_meta, version)
        if not blob.endswith(tail):
            return  # another version field than the layout's: build the next one whole
        end = len(blob) - len(tail)
        names = blob.find(b"storage_data", 0, end)
        if blob.find(attempt.encode(), 0, names if names >= 0 else end - 1) >= 0:
            return  # a tensor's name holds the attempt id: never rename it
        token = step_token(url)
        step = None
        if token is not None and blob.find(token.encode(), max(names, 0), end) >= 0:
            if blob.find(token.encode(), 0, names if names >= 0 else end - 1) >= 0:
                return  # a tensor's name holds the step's directory name: the same
            step = token
        body = bytearray(memoryview(blob)[:end])
        with self._lock:
            self._kept = _Kept(key, attempt, body, version, step)


def build_stock(
    layout: StockLayout,
    attempt: str,
    indexes: Sequence[tuple[int, ObjectEntry]],
    blobs: list[bytes],
    url: str,
) -> tuple[bytes, dict[str, Any]]:
    """``.metadata``, the same code in both strategies: DCP's pickle and each entry's
    ``writer`` as the index objects place the items (``blobs[n]`` is the bytes of
    ``indexes[n]``, a (rank, entry) pair; each is released once decoded). The helper
    compares those writers with the manifest's (the plan's) before it writes it.

    Raises:
        ManifestError: An index does not match the plan's layout, or a chunk of the
            plan is in no rank's index (a rank's items went missing).
    """
    # The index objects are decoded against the plan's chunks, and each item's key
    # holds its chunk's offsets (in memory: the stream writes them again per batch).
    metadata = plan_metadata(
        layout.doc, layout.properties, layout.planner_data, layout.storage_meta, url
    )
    sd_md = metadata.state_dict_metadata
    # .metadata is written as the ranks are decoded, a batch of items at a time: only
    # the chunks and one rank's items are alive at once (metadata_stream's doc).
    stream = MetadataStream()
    stream.begin(sd_md, layout.planner_data)
    paths: dict[str, str] = {}

    def path_of(key: str) -> str:
        """``key`` as ``.metadata`` names it (each object's worked out once)."""
        if not key.startswith(("../", "spread-")):
            return key
        path = paths.get(key)
        if path is None:
            path = paths[key] = stock_path(url, key)
        return path

    def decoded() -> Iterator[tuple[int, Iterable[Any]]]:
        """Each rank's items, one rank at a time (never all of them at once: 10 million
        at 8,192 ranks), into ``.metadata`` on the way."""
        for n, (rank, entry) in enumerate(indexes):
            items = decode_index(
                blobs[n], rank=rank, attempt=attempt, metadata=metadata, url=entry.key
            )
            blobs[n] = b""
            stream.add(
                (
                    i,
                    storage_info(
                        path_of(it.relative_path),
                        it.offset,
                        it.length,
                        it.transform_descriptors,
                    ),
                )
                for i, it in items.items()
            )
            yield rank, items.keys()

    writers = writer_columns(layout.doc, decoded())
    return stream.end(layout.storage_meta, metadata.version), writers


def read_indexes(
    store: ObjectStore, indexes: Sequence[tuple[int, ObjectEntry]], max_bytes: int | None = None
) -> list[bytes]:
    """The bytes of the (rank, entry) index objects, 16 at a time, each checked against
    its entry's size and CRC32C (UploadError naming the object where it differs or is
    gone): what :func:`build_stock` decodes. ``max_bytes``
    (``ReadOptions.max_metadata_bytes``) refuses an entry larger than that before
    anything is fetched, and reads no object past its entry's size, where the entries
    come from a manifest (untrusted), not from the ranks of this save.

    Raises:
        ManifestError: An entry is larger than ``max_bytes``.
        UploadError: An index object is gone or holds other bytes than its entry.
    """
    if max_bytes is not None:
        for _, entry in indexes:
            url = store.location.url_of(entry.key)
            check_size(entry.size, max_bytes, what="index object", url=url)

    def get(entry: ObjectEntry) -> bytes:
        try:  # bounded where the entries are untrusted: never more than size + 1 bytes
            data = (
                store.read(entry.key)
                if max_bytes is None
                else store.read_bounded(entry.key, entry.size)
            )
        except FileNotFoundError:
            raise UploadError(f"index object {store.location.url_of(entry.key)} is gone") from None
        crc = Crc32c()
        crc.update(data)
        if len(data) != entry.size or crc.hexdigest() != entry.crc32c:
            raise UploadError(
                f"index object {store.location.url_of(entry.key)} holds {len(data)} bytes "
                f"(CRC32C {crc.hexdigest()}), not the {entry.size} bytes (CRC32C "
                f"{entry.crc32c}) its rank wrote"
            )
        return data

    return _each_index(get, [e for _, e in indexes])


def metadata_entry(blob: bytes | bytearray) -> ObjectEntry:
    """``.metadata``'s entry in the manifest's object list."""
    crc = Crc32c()
    crc.update(blob)
    return ObjectEntry(METADATA_KEY, len(blob), crc.hexdigest())


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a strategy's step 2 gives the commit point.

    Attributes:
        doc: The manifest's ``metadata`` document.
        metadata: ``.metadata``'s entry (the pickle stays with the strategy until
            step 4), or None where the strategy builds it only after the commit (the
            manifest then does not name it; see :class:`CommitStrategy`).
        requests: The store requests step 2 made, for the manifest's totals.
        stock: Whether the save writes ``.metadata`` at all (False: above
            ``UploadOptions.stock_metadata_max_ranks``; the manifest says so).
    """

    doc: dict[str, Any]
    metadata: ObjectEntry | None
    requests: RequestStats
    stock: bool = True


class CommitStrategy(abc.ABC):
    """Where steps 2 and 4 of one commit run (the module doc says why there are two).

    One instance per commit: :meth:`prepare` once, then :meth:`publish` once the
    manifest is committed, or :meth:`discard` when it was not.
    """

    @abc.abstractmethod
    def prepare(self) -> Prepared:
        """Step 2: the manifest's document and ``.metadata`` (kept, not written), or
        none where it is built after the commit; with ``overwrite``, read what the
        replaced manifest named."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Forget what :meth:`prepare` holds: the manifest was not written."""

    @abc.abstractmethod
    def publish(self, named: frozenset[str]) -> bool:
        """Step 4, after the commit: write ``.metadata`` (built now where
        :meth:`prepare` did not), then delete what only the replaced checkpoint named
        (not in ``named``, the new manifest's keys). Whether ``.metadata`` was
        written; a failure is logged (the save stays committed)."""


class InThread(CommitStrategy):
    """Steps 2 and 4 in the committing thread, from the index objects it wrote itself."""

    def __init__(
        self,
        store: ObjectStore,
        layout: StockLayout,
        shards: Sequence[IndexShard],
        attempt: str,
        overwrite: bool,
        template: tuple[StockTemplate, Callable[[], Any]] | None = None,
        stock: bool = True,
    ) -> None:
        self._store = store
        self._stock = stock
        self._layout = layout
        # (the plan's template, what computes this save's key: O(items), so only
        # where a template is kept or one will be), or None
        self._template = template
        self._shards = list(shards)
        self._attempt = attempt
        self._overwrite = overwrite
        self._blob: bytes | bytearray | None = None
        self._superseded: set[str] = set()

    def prepare(self) -> Prepared:
        store = self._store
        self._superseded = previous_objects(store) if self._overwrite else set()
        if not self._stock:
            self._shards = []
            return Prepared(self._layout.doc, None, RequestStats(), stock=False)
        indexes = [(s.rank, _entry(s)) for s in self._shards]
        blobs = [s.data for s in self._shards]
        self._shards = []
        template, make_key = self._template or (None, None)
        key, renamed = None, None
        if template is not None and make_key is not None and template.holds:
            key = make_key()
            renamed = template.renamed(
                key, self._attempt, self._layout.storage_meta, store.location.url
            )
        if renamed is not None:  # the last save's, renamed: the same items
            blob: bytes | bytearray = renamed
        else:
            if template is not None:
                template.clear()
            blob, _ = build_stock(self._layout, self._attempt, indexes, blobs, store.location.url)
            small = len(blob) <= IN_THREAD_TEMPLATE_BYTES
            if template is not None and make_key is not None and small:
                key = make_key() if key is None else key
                template.keep(key, self._attempt, self._layout, blob, store.location.url)
        self._blob = blob
        return Prepared(self._layout.doc, metadata_entry(blob), RequestStats())

    def discard(self) -> None:
        self._blob = None

    def publish(self, named: frozenset[str]) -> bool:
        store, blob = self._store, self._blob
        self._blob = None
        doomed = self._superseded - named
        if not self._stock:
            return finish_without_metadata(store, doomed) is None
        if blob is None:
            raise InternalError("internal: InThread.publish without a prepared .metadata")
        write = lambda: store.put(METADATA_KEY, blob)  # noqa: E731
        return finish_commit(store, f"writing {METADATA_KEY}", write, doomed) is None


def commit_sequence(
    store: ObjectStore,
    strategy: CommitStrategy,
    reports: Sequence[RankReport],
    *,
    attempt: str,
    world_size: int,
    overwrite: bool,
    user: Mapping[str, Any] | None,
    requests: RequestStats | None,
    base: str | None,
    committed: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Steps 2 to 4 once every rank's index object (step 1) is on the store, as
    ``reports`` say: the one implementation of the commit's order (the module doc).

    Args:
        requests: The ranks' requests and step 1's, for the manifest (None: not counted).
        base: The URL of the step this save reused items of (``reuse_from``), or None.
        committed: Called once the manifest is committed, before step 4: the save's
            outcome is decided there, so the other ranks learn it without waiting for
            ``.metadata`` (1.2 GB at 8,192 ranks) to be written.

    Raises:
        CheckpointExistsError: Another attempt committed this URL first.
        UploadError: An object the manifest would name is gone (nothing committed).
    """
    prepared = strategy.prepare()
    objects = {o.key: o for r in reports for o in r.objects}
    objects.update((r.index.key, r.index) for r in reports if r.index is not None)
    if prepared.metadata is not None:
        objects[METADATA_KEY] = prepared.metadata
    try:
        manifest = commit_manifest(
            store,
            attempt=attempt,
            world_size=world_size,
            objects=objects.values(),
            metadata=prepared.doc,
            user=user,
            requests=None if requests is None else requests + prepared.requests,
            overwrite=overwrite,
            base=base,
            stock_metadata=prepared.stock,
        )
    except BaseException:
        strategy.discard()
        raise
    if committed is not None:
        try:
            committed(manifest)
        except Exception as exc:  # committed all the same: step 4 still runs
            logger.error(
                "%s committed, but telling the other ranks failed: %s", store.location.url, exc
            )
    # .metadata is replaced by step 4, never deleted as superseded, named or not.
    strategy.publish(frozenset(o.key for o in manifest.objects) | {METADATA_KEY})
    return manifest


def save_storage_meta(
    planned: StorageMeta | None,
    url: str,
    checkpoint_id: str | os.PathLike[str] | None,
    attempt: str,
) -> StorageMeta:
    """The ``StorageMeta`` a save records: the plan's (``planned``) with the checkpoint
    id as the caller gave it (the store URL when None) and the attempt id as the save id."""
    meta = planned or StorageMeta()
    return dataclasses.replace(
        meta, checkpoint_id=url if checkpoint_id is None else checkpoint_id, save_id=attempt
    )


def commit_checkpoint(
    store: ObjectStore,
    metadata: Metadata,
    results: Iterable[Iterable[WriteResult]],
    *,
    attempt: str,
    world_size: int,
    overwrite: bool,
    user: Mapping[str, Any] | None = None,
    checkpoint_id: str | os.PathLike[str] | None = None,
    base: str | None = None,
    committed: Callable[[Manifest], None] | None = None,
    plan: GlobalPlan | None = None,
    stock: bool = True,
) -> Manifest:
    """The whole commit in this thread (:class:`InThread`) from every rank's write
    results: the index objects, then the manifest, then ``.metadata``; returns the
    manifest. With ``overwrite``, the replaced checkpoint stays whole (every byte its
    manifest names) until this manifest is committed.

    Args:
        checkpoint_id: What DCP's ``StorageMeta.checkpoint_id`` records (the id as
            the caller gave it; the store URL when None).
        base: The URL of the step this save reused items of (``reuse_from``), or None.
        committed: Called once the manifest is committed (:func:`commit_sequence`).
        plan: The global plan ``metadata`` is of, kept across saves (None: a save
            of its own): a later save of it whose ranks' items are the same renames
            the last ``.metadata`` instead of building it (``GlobalPlan.stock``;
            the same bytes, at 10,000 tensors about half of this commit's CPU).
        stock: Whether to write ``.metadata``
            (``UploadOptions.writes_stock_metadata``; False: the manifest says none
            was written, and an overwrite deletes the replaced one).

    Raises:
        CheckpointExistsError: Another attempt committed this URL first.
        UploadError: An object the manifest would name is gone (nothing committed).
    """
    by_rank: list[dict[MetadataIndex, StoredItem]] = []
    objects: list[tuple[ObjectEntry, ...]] = []
    ranks_requests = RequestStats()
    counted = False
    for rank_results in results:
        mine: dict[MetadataIndex, StoredItem] = {}
        for wr in rank_results:
            item = wr.storage_data
            if isinstance(item, RequestStats):
                ranks_requests, counted = ranks_requests + item, True
                continue
            if not isinstance(item, StoredItem):
                raise StoreError(f"unexpected storage_data {type(item).__name__} from a rank")
            mine[wr.index] = item
        by_rank.append(mine)
        objects.append(
            tuple(
                {
                    i.relative_path: ObjectEntry(i.relative_path, i.object_size, i.object_crc32c)
                    for i in mine.values()
                }.values()
            )
        )
    storage_meta = save_storage_meta(
        metadata.storage_meta, store.location.url, checkpoint_id, attempt
    )
    ours = dataclasses.replace(metadata, version=_DCP_VERSION, storage_meta=storage_meta)
    # The index objects' bytes are what each rank's encode_rank_index gives; they are
    # placed here from the global plan, so a planner that leaves DCP's index hints out works.
    doc, shards = encode_metadata(ours, by_rank, attempt)
    if plan is not None:
        state = doc["state_dict"]
        plan.note_writers({fqn: entry.get("writer", -1) for fqn, entry in state.items()})
    commit_counter = RequestCounter(parent=current_counter())
    with counting(commit_counter):  # step 1
        entries = {e.key: e for e in _put_index(store, shards)}
    reports = [
        RankReport(entries.get(k) if k is not None else None, objects[rank], RequestStats())
        for rank, k in enumerate(doc["index"])
    ]
    layout = StockLayout(doc, _properties(metadata), metadata.planner_data, storage_meta)
    template = None
    if plan is not None and stock:
        token = plan.token

        def key() -> tuple[str, tuple[tuple[int, str], ...]]:
            url = store.location.url
            return token, tuple((r, stock_digest(it, attempt, url)) for r, it in enumerate(by_rank))

        template = (plan.stock, key)
    return commit_sequence(
        store,
        InThread(store, layout, shards, attempt, overwrite, template, stock),
        reports,
        attempt=attempt,
        world_size=world_size,
        overwrite=overwrite,
        user=user,
        requests=ranks_requests + commit_counter.snapshot() if counted else None,
        base=base,
        committed=committed,
    )


def commit_manifest(
    store: ObjectStore,
    *,
    attempt: str,
    world_size: int,
    objects: Iterable[ObjectEntry],
    metadata: Mapping[str, Any],
    user: Mapping[str, Any] | None,
    requests: RequestStats | None,
    overwrite: bool,
    base: str | None = None,
    stock_metadata: bool = True,
) -> Manifest:
    """Check that every object but ``.metadata`` is there (one listing), then write the
    manifest create-only (settled by read-back): the commit. ``.metadata``, which
    ``objects`` lists, is for the caller to write after it. A step that references
    objects of other steps also needs its ``base`` step (the URL of the step it
    reused items of) still committed (:func:`objckpt.format.ref_check.require_referenced`).

    Raises:
        CheckpointExistsError: Another attempt committed this URL first.
        UploadError: An object the manifest would name is gone (nothing committed).
    """
    entries = sorted(objects, key=lambda o: o.key)
    counter = RequestCounter(parent=current_counter())
    with counting(counter):
        # .metadata is written after the commit: everything else must be there now,
        # the objects it reuses from other steps too (one listing per step, #28).
        own = [o for o in entries if o.key != METADATA_KEY and not is_reference(o.key)]
        require_present(store, own)
        base_dir = None if base is None else base.rstrip("/").rsplit("/", 1)[-1]
        require_referenced(store, (o for o in entries if is_reference(o.key)), base=base_dir)
    manifest = Manifest(
        attempt=attempt,
        created=Manifest.now(),
        world_size=world_size,
        objckpt_version=__version__,
        torch_version=torch.__version__,
        objects=tuple(entries),
        metadata=metadata,
        user=dict(user or {}),
        requests=None if requests is None else requests + counter.snapshot(),
        stock_metadata=stock_metadata,
    )
    put_manifest(store, manifest.to_json_bytes(), overwrite=overwrite)
    url = store.location.url
    logger.info(
        "committed %s (%d objects, %d bytes)", url, len(manifest.objects), manifest.total_bytes
    )
    return manifest
