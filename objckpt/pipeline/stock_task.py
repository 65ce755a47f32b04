"""What rank 0's commit helper process runs: the O(W) half of an async commit.

Every rank writes its own index object before it reports (format/index.py),
so rank 0's training process gathers only small records. What still needs every
rank's items is done here, in a long-lived helper process of rank 0
(:class:`~objckpt.pipeline.workers.WorkerPool` of one, started at rank 0's first
commit from reports and again after it died or was stopped; unlike the upload
workers it imports torch, for DCP's classes):

1. :func:`prepare_stock` (before the manifest), built whole: fetch every index object, check each
   against the size and CRC32C its rank reported, decode it against the plan's
   layout, and from the items build which rank wrote each chunk (the manifest's
   ``writer`` columns) and DCP's ``.metadata`` pickle for stock readers (~153 MB at
   1,024 ranks), written as the index objects are decoded: the commit's step 2,
   :func:`objckpt.format.commit.build_stock`, the code the in-thread commit runs. The
   pickle stays here; its size and CRC32C go back for the manifest's object list.
   With ``overwrite``, it also reads the manifest being replaced (what to delete once
   ``.metadata`` is replaced).
2. :func:`publish_stock` (after the manifest committed): PUT ``.metadata``, then
   delete the objects only the replaced checkpoint named, exactly as
   ``format/commit.py``'s ``InThread`` does, within the settle bound; a failure leaves
   the save committed (the training process logs it). :func:`discard_stock`
   forgets a prepared pickle whose manifest was never written.

State kept here lives only in the helper process, by attempt id.

**The template (#46).** Between two saves of one global plan the items rarely change:
the same tensors, in the same objects, at the same offsets; what changes is the
attempt id in every object's name and the save's ``StorageMeta`` (its URL and save
id). Each rank reports a digest of what its items put into ``.metadata``
(:func:`~objckpt.format.commit.stock_digest`, computed on the rank). When the plan's
layout and every rank's digest equal those of the last ``.metadata`` built here,
the new one is that pickle with the old attempt id replaced by the new one (same
length: every name keeps its length) and a new ending
(:meth:`~objckpt.format.metadata_stream.MetadataStream.tail`), and the writer columns
and ``raw_bytes`` are the last save's. On a store that verifies each PUT against
its CRC32C (:attr:`~objckpt.writers.base.ObjectStore.verifies_writes`: S3) the index
objects are then not read at all (8,192 GETs, 790 MB at 8,192 ranks): nothing is
decoded from them, each rank's PUT was checked against the CRC32C it reported, and
the commit's listing (step 3) finds each with its size before the manifest names
it; elsewhere they are still read back and checked, not decoded. At
8,192 ranks that is the difference between reading and decoding ten million items
and pickling them again (87-102 CPU-s, 1.2 GB) and two copies of the bytes (see
``docs/guides/at-scale.md``). A
changed digest (an item reused or compressed differently, a new plan), an attempt
id found where no name could hold it, or a restarted helper builds it whole, as
before, and keeps it as the next template. Both give the same bytes
(``tests/pipeline/test_rank_commit.py``). The template itself is
:class:`~objckpt.format.commit.StockTemplate`; an in-thread commit (one rank, a
node-local tier) keeps its own in the plan (``GlobalPlan.stock``), where it is small.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import logging
import threading
from collections.abc import Iterator
from typing import Any

from objckpt.errors import UploadError
from objckpt.format.commit import StockLayout, StockTemplate, build_stock, metadata_entry
from objckpt.format.layout import METADATA_KEY
from objckpt.format.manifest import ObjectEntry
from objckpt.format.settle import SETTLE_SECONDS, finish_commit
from objckpt.format.superseded import previous_objects
from objckpt.options import UploadOptions
from objckpt.pipeline.upload_task import worker_store
from objckpt.writers.accounting import RequestCounter, RequestStats, counting
from objckpt.writers.checksum import Crc32c
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import Location

__all__ = ["StockLayout", "StockPrepared", "discard_stock", "prepare_stock", "publish_stock"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: attempt -> (the .metadata pickle, what the replaced manifest named)
_PREPARED: dict[str, tuple[bytes | bytearray, set[str]]] = {}
_FETCHERS = 16


#: This helper's template (one: the helper serves one checkpointer).
_TEMPLATE = StockTemplate()


@dataclasses.dataclass(frozen=True)
class StockPrepared:
    """:func:`prepare_stock`'s answer: the manifest's writers and ``.metadata`` entry."""

    writers: dict[str, Any]
    metadata: ObjectEntry
    requests: RequestStats
    #: The manifest's ``raw_bytes`` (0: no item is stored transformed).
    raw_bytes: int = 0


def prepare_stock(
    location: Location,
    options: UploadOptions,
    deadline: Deadline | None,
    attempt: str,
    layout: StockLayout,
    indexes: list[tuple[int, ObjectEntry]],
    overwrite: bool,
    digests: list[str | None] | None = None,
) -> StockPrepared:
    """Helper side, before the commit (see module doc); ``indexes`` are (rank, entry)
    as the ranks reported them, ``digests`` their ranks' ``stock_digest`` (the
    template's test; None: build it whole).

    Raises:
        UploadError: An index object is missing or differs from its rank's report.
        ManifestError: An index does not match the plan's layout.
    """
    store = worker_store(location, options)
    key = _template_key(layout, indexes, digests)
    with _no_cyclic_gc():
        renamed = _TEMPLATE.renamed(key, attempt, layout.storage_meta, location.url)
    with counting(RequestCounter()) as counter, bounded_by(deadline):
        # From the template the index objects are not decoded. Where the store
        # verified each rank's PUT against its CRC32C they are not read either: the
        # commit's listing finds each with its rank's size. Elsewhere the read-back
        # is what proves their bytes.
        read = renamed is None or not store.verifies_writes
        blobs = _fetch(store, indexes) if read else []  # _fetch checks each against its report
        superseded = previous_objects(store) if overwrite else set()
    if renamed is not None:  # from the template (blobs, if read, were only the proof)
        blob, writers, raw = renamed
        with _LOCK:
            _PREPARED[attempt] = (blob, superseded)
        return StockPrepared(writers, metadata_entry(blob), counter.snapshot(), raw)
    with _no_cyclic_gc():
        return _prepare(location, attempt, layout, indexes, blobs, superseded, counter, key)


def _template_key(
    layout: StockLayout, indexes: list[tuple[int, ObjectEntry]], digests: list[str | None] | None
) -> tuple[str, tuple[tuple[int, str], ...]] | None:
    """What a save shares with the template when it may use it (None: never)."""
    if not layout.token or digests is None or len(digests) != len(indexes):
        return None
    pairs = []
    for (rank, _), digest in zip(indexes, digests, strict=True):
        if digest is None:
            return None
        pairs.append((rank, digest))
    return layout.token, tuple(pairs)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector paused (this helper process's own, never a training
    process's): ``.metadata`` is millions of small acyclic objects (5 per chunk), and
    each allocation burst would otherwise start a collection that walks all of them
    again (about a fifth of the helper's CPU). Reference counting still frees them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _prepare(
    location: Location,
    attempt: str,
    layout: StockLayout,
    indexes: list[tuple[int, ObjectEntry]],
    blobs: list[bytes],
    superseded: set[str],
    counter: RequestCounter,
    key: Any = None,
) -> StockPrepared:
    """:func:`prepare_stock` once the index objects are fetched: built whole, and
    kept as the template under ``key`` (None: not kept)."""
    _TEMPLATE.clear()  # a stale template is not kept beside a new pickle of 1 GB
    blob, writers, raw = build_stock(layout, attempt, indexes, blobs, location.url)
    with _LOCK:
        _PREPARED[attempt] = (blob, superseded)
    _TEMPLATE.keep(key, attempt, layout, blob, writers, raw, location.url)
    return StockPrepared(writers, metadata_entry(blob), counter.snapshot(), raw)


def _fetch(store: Any, indexes: list[tuple[int, ObjectEntry]]) -> list[bytes]:
    def get(entry: ObjectEntry) -> bytes:
        try:
            data = store.read(entry.key)
        except FileNotFoundError:
            raise UploadError(
                f"index object {store.location.url_of(entry.key)} is gone before the commit"
            ) from None
        crc = Crc32c()
        crc.update(data)
        if len(data) != entry.size or crc.hexdigest() != entry.crc32c:
            raise UploadError(
                f"index object {store.location.url_of(entry.key)} holds {len(data)} bytes "
                f"(CRC32C {crc.hexdigest()}), not the {entry.size} bytes (CRC32C "
                f"{entry.crc32c}) its rank wrote"
            )
        return data

    if len(indexes) <= 1:
        return [get(e) for _, e in indexes]
    import contextvars

    with concurrent.futures.ThreadPoolExecutor(
        min(_FETCHERS, len(indexes)), thread_name_prefix="objckpt-index-get"
    ) as pool:  # each in a copy of this context: counted and bounded like the caller
        futures = [pool.submit(contextvars.copy_context().run, get, e) for _, e in indexes]
        return [f.result() for f in futures]


def publish_stock(
    location: Location,
    options: UploadOptions,
    attempt: str,
    named: frozenset[str],
    settle: float | None = None,
) -> str | None:
    """Helper side, after the commit: write the prepared ``.metadata``, then delete
    what only the replaced checkpoint named (not in ``named``, the new manifest's
    keys), all within ``settle`` seconds (None: the settle bound). Returns None once
    ``.metadata`` is written, else why not (the training process logs it: this
    process has no logging configured)."""
    with _LOCK:
        prepared = _PREPARED.pop(attempt, None)
    if prepared is None:
        return f"the helper holds no {METADATA_KEY} for attempt {attempt} (it was restarted)"
    store = worker_store(location, options)
    blob, superseded = prepared
    seconds = SETTLE_SECONDS if settle is None else settle
    bound = Deadline.start(seconds, f"writing {location.url}'s {METADATA_KEY}")
    return finish_commit(
        store,
        f"writing {METADATA_KEY} (within {seconds:g} s)",
        lambda: store.put(METADATA_KEY, blob),
        superseded - named,
        bound=bound,
    )


def discard_stock(attempt: str) -> None:
    """Forget a prepared ``.metadata`` whose manifest was not written."""
    with _LOCK:
        _PREPARED.pop(attempt, None)
