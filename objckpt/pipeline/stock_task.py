"""What rank 0's commit helper process runs: the O(W) half of an async commit.

Every rank writes its own index object before it reports (format/index.py),
so rank 0's training process gathers only small records. What still needs every
rank's items is done here, in a long-lived helper process of rank 0
(:class:`~objckpt.pipeline.workers.WorkerPool` of one, started at rank 0's first
commit from reports and again after it died or was stopped; unlike the upload
workers it imports torch, for DCP's classes):

1. :func:`prepare_stock` (before the manifest): with ``overwrite``, read the manifest
   being replaced (what to delete once ``.metadata`` is replaced); on a store that
   does not verify PUTs against their CRC32C, fetch every index object and check it
   against the size and CRC32C its rank reported; and where the template applies
   (below), rename it: the manifest then names ``.metadata`` with its size and
   CRC32C. Otherwise nothing is built before the commit: the manifest's ``writer``
   columns come from the global plan (each rank checked its own index against it),
   so the outcome never waits for ten million items to be decoded.
2. :func:`publish_stock` (after the manifest committed): where nothing was renamed,
   build ``.metadata`` whole (fetch the index objects not read yet, decode each
   against the plan's layout, write DCP's pickle as they are decoded:
   :func:`objckpt.format.commit.build_stock`, the code the in-thread commit runs,
   ~153 MB at 1,024 ranks) and check that the index objects place every chunk on the
   rank the manifest says; then PUT it, then delete the objects only the replaced
   checkpoint named, exactly as ``format/commit.py``'s ``InThread`` does, within its
   bound; a failure leaves the save committed without ``.metadata`` (the training
   process logs it). :func:`discard_stock` forgets what a commit that never
   happened prepared.

State kept here lives only in the helper process, by attempt id.

**The template (#46).** Between two saves of one global plan the items rarely change:
the same tensors, in the same objects, at the same offsets; what changes is the
attempt id in every object's name and the save's ``StorageMeta`` (its URL and save
id). Each rank reports a digest of what its items put into ``.metadata``
(:func:`~objckpt.format.commit.stock_digest`, computed on the rank). When the plan's
layout and every rank's digest equal those of the last ``.metadata`` built here,
the new one is that pickle with the old attempt id replaced by the new one (same
length: every name keeps its length) and a new ending
(:meth:`~objckpt.format.metadata_stream.MetadataStream.tail`). On a store that
verifies each PUT against its CRC32C
(:attr:`~objckpt.writers.base.ObjectStore.verifies_writes`: S3) the index objects
are then not read at all (8,192 GETs, 790 MB at 8,192 ranks): nothing is
decoded from them, each rank's PUT was checked against the CRC32C it reported, and
the commit's listing (step 3) finds each with its size before the manifest names
it; elsewhere they are still read back and checked, not decoded. At
8,192 ranks that is the difference between reading and decoding ten million items
and pickling them again (87-102 CPU-s, 1.2 GB) and two copies of the bytes (see
``docs/guides/at-scale.md``). A
changed digest (an item reused or compressed differently, a new plan), an attempt
id found where no name could hold it, or a restarted helper builds it whole after
the commit, and keeps it as the next template. Both give the same bytes
(``tests/pipeline/test_rank_commit.py``). The template itself is
:class:`~objckpt.format.commit.StockTemplate`; an in-thread commit (one rank, a
node-local tier) keeps its own in the plan (``GlobalPlan.stock``), where it is small.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from objckpt.errors import ManifestError, UploadError
from objckpt.format.commit import (
    StockLayout,
    StockTemplate,
    build_stock,
    metadata_entry,
    read_indexes,
)
from objckpt.format.layout import METADATA_KEY
from objckpt.format.manifest import ObjectEntry
from objckpt.format.settle import SETTLE_SECONDS, finish_commit, finish_without_metadata
from objckpt.format.superseded import previous_objects
from objckpt.options import UploadOptions
from objckpt.pipeline.upload_task import worker_store
from objckpt.writers.accounting import RequestCounter, RequestStats, counting
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.location import Location

__all__ = [
    "StockLayout",
    "StockPrepared",
    "after_commit",
    "discard_stock",
    "prepare_stock",
    "publish_stock",
]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Held:
    """What :func:`prepare_stock` keeps for :func:`publish_stock`, by attempt id."""

    #: The ``.metadata`` renamed from the template, or None: built after the commit.
    blob: bytes | bytearray | None
    #: What the replaced manifest named (with ``overwrite``).
    superseded: set[str]
    #: What a build after the commit needs: the layout, the ranks' index entries,
    #: their bytes where they were read back before the commit (None: read then),
    #: and the template key to keep the result under.
    layout: StockLayout | None = None
    indexes: list[tuple[int, ObjectEntry]] = dataclasses.field(default_factory=list)
    blobs: list[bytes] | None = None
    key: Any = None
    #: Whether the save writes ``.metadata`` (False: above
    #: ``UploadOptions.stock_metadata_max_ranks``; step 4 deletes any at the URL).
    stock: bool = True


_PREPARED: dict[str, _Held] = {}


#: This helper's template (one: the helper serves one checkpointer).
_TEMPLATE = StockTemplate()


@dataclasses.dataclass(frozen=True)
class StockPrepared:
    """:func:`prepare_stock`'s answer: ``.metadata``'s entry for the manifest (None:
    it is built after the commit, and the manifest does not name it)."""

    metadata: ObjectEntry | None
    requests: RequestStats


def prepare_stock(
    location: Location,
    options: UploadOptions,
    deadline: Deadline | None,
    attempt: str,
    layout: StockLayout | None,
    indexes: list[tuple[int, ObjectEntry]],
    overwrite: bool,
    digests: list[str | None] | None = None,
) -> StockPrepared:
    """Helper side, before the commit (see module doc); ``indexes`` are (rank, entry)
    as the ranks reported them, ``digests`` their ranks' ``stock_digest`` (the
    template's test; None: built whole, after the commit). Without a ``layout`` (a
    save above ``UploadOptions.stock_metadata_max_ranks``) no ``.metadata`` is
    renamed, built or written, and the template is let go; the index objects are
    still read back where the store does not verify PUTs.

    Raises:
        UploadError: An index object is missing or differs from its rank's report
            (read back on a store that does not verify PUTs).
    """
    store = worker_store(location, options)
    key = None if layout is None else _template_key(layout, indexes, digests)
    renamed = None
    if layout is not None:
        with _no_cyclic_gc():
            renamed = _TEMPLATE.renamed(key, attempt, layout.storage_meta, location.url)
    else:
        _TEMPLATE.clear()  # up to 1.2 GB no save of this size renames
    with counting(RequestCounter()) as counter, bounded_by(deadline):
        # Where the store verified each rank's PUT against its CRC32C the index
        # objects are not read before the commit: its listing finds each with its
        # rank's size. Elsewhere the read-back is what proves their bytes (and a
        # build after the commit decodes the bytes read here).
        blobs = None if store.verifies_writes else read_indexes(store, indexes)
        superseded = previous_objects(store) if overwrite else set()
    if layout is None:  # blobs, if read, were only the proof
        held = _Held(None, superseded, stock=False)
    elif renamed is not None:
        held = _Held(renamed, superseded)
    else:
        held = _Held(None, superseded, layout, list(indexes), blobs, key)
    with _LOCK:
        _PREPARED[attempt] = held
    entry = None if held.blob is None else metadata_entry(held.blob)
    return StockPrepared(entry, counter.snapshot())


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


def _build(
    store: Any, held: _Held, attempt: str, url: str, writers: dict[str, Any] | None
) -> bytes:
    """``.metadata`` built whole after the commit from the index objects (read now
    where they were not before it), checked against the manifest's ``writers`` (the
    plan's), and kept as the template."""
    assert held.layout is not None
    blobs = held.blobs if held.blobs is not None else read_indexes(store, held.indexes)
    _TEMPLATE.clear()  # a stale template is not kept beside a new pickle of 1 GB
    with _no_cyclic_gc():
        blob, placed = build_stock(held.layout, attempt, held.indexes, blobs, url)
    if writers is not None and placed != writers:
        wrong = sorted(f for f in writers if placed.get(f) != writers[f])
        raise ManifestError(
            f"the index objects place {len(wrong)} entries on other ranks than the "
            f"manifest (the global plan) does, {wrong[:3]!r} first: not written; the "
            "checkpoint contradicts itself there, and objckpt's readers refuse those "
            "entries (a defect: please report it)"
        )
    _TEMPLATE.keep(held.key, attempt, held.layout, blob, url)
    return blob


def publish_stock(
    location: Location,
    options: UploadOptions,
    attempt: str,
    named: frozenset[str],
    settle: float | None = None,
    writers: dict[str, Any] | None = None,
    until: float | None = None,
) -> str | None:
    """Helper side, after the commit: write the prepared ``.metadata`` (built whole
    now where :func:`prepare_stock` did not rename the template, its writers checked
    against the manifest's ``writers``), then delete what only the replaced
    checkpoint named (not in ``named``, the new manifest's keys). The PUT and the
    deletes get ``settle`` seconds (None: the settle bound) once ``.metadata`` is
    ready, and everything ends by ``until`` (a ``time.monotonic()``; None: no bound
    but that). Returns None once ``.metadata`` is written, else why not (the
    training process logs it: this process has no logging configured)."""
    with _LOCK:
        held = _PREPARED.pop(attempt, None)
    if held is None:
        return f"the helper holds no {METADATA_KEY} for attempt {attempt} (it was restarted)"
    store = worker_store(location, options)
    seconds = SETTLE_SECONDS if settle is None else settle
    if not held.stock:
        bound = after_commit(seconds, f"{location.url}'s step 4")
        return finish_without_metadata(store, held.superseded - named, bound=bound)
    blob = held.blob
    failure: Exception | None = None
    if blob is None:
        left = None if until is None else until - time.monotonic()
        if left is not None and left <= 0:  # nothing built could still be written
            failure = UploadError(f"no time was left to build {METADATA_KEY} by its bound")
        else:
            try:
                with bounded_by(after_commit(left, f"building {location.url}'s {METADATA_KEY}")):
                    blob = _build(store, held, attempt, location.url, writers)
            except Exception as exc:  # reported as the step's reason, below
                failure = exc
    if until is not None:
        seconds = max(0.0, min(seconds, until - time.monotonic()))
    bound = after_commit(seconds, f"writing {location.url}'s {METADATA_KEY}")

    def write() -> None:
        if failure is not None:
            raise failure
        assert blob is not None
        store.put(METADATA_KEY, blob)

    what = "writing" if held.blob is not None else "building and writing"
    return finish_commit(
        store,
        f"{what} {METADATA_KEY} (its PUT within {seconds:g} s)",
        write,
        held.superseded - named,
        bound=bound,
    )


def after_commit(seconds: float | None, who: str) -> Deadline | None:
    """The bound of a step after the commit (None: none), whose messages say so."""
    bound = Deadline.start(seconds, who)
    if bound is None:
        return None
    return dataclasses.replace(
        bound,
        option="the commit's step 4 bound (barrier_timeout, UploadOptions.deadline)",
        outcome="the save stays committed without it",
    )


def discard_stock(attempt: str) -> None:
    """Forget a prepared ``.metadata`` whose manifest was not written."""
    with _LOCK:
        _PREPARED.pop(attempt, None)
