"""The synchronous writer's upload loop: one payload object after another.

Each object's entries are hashed against the base step's items first when the
save reuses (:mod:`objckpt.format.reused`): equal items are referenced, not
written, and an object all of whose items are reused is never created. The rest
go to the store as ``torch.save`` files (:mod:`objckpt.dcp.serialize`), several
objects in flight at once; any failure aborts its upload and lets the others
settle before it is raised.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from objckpt.dcp.plan import ObjectPlan
from objckpt.dcp.reuse_base import BaseTable
from objckpt.dcp.serialize import (
    Framer,
    PayloadRecord,
    WrittenObject,
    close_payload,
    stored_chunks,
    written_object,
)
from objckpt.format.payload import PayloadWriter
from objckpt.format.reused import BaseItem, item_digest
from objckpt.writers.base import ObjectStore, ObjectUpload
from objckpt.writers.checksum import BytesLike

__all__ = ["StoredEntry", "split_reused", "write_objects", "write_stored"]

#: An entry as its stored bytes: (id, chunks, kept, xxh3 when already hashed).
StoredEntry = tuple[int, tuple[BytesLike, ...], bool, "str | None"]


def split_reused(
    entries: Iterable[tuple[int, torch.Tensor | BytesLike]],
    framer: Framer,
    reuse: Mapping[int, BaseItem],
) -> tuple[list[StoredEntry], list[tuple[int, BaseItem]]]:
    """The entries to write, and those whose stored bytes equal their base item's
    (length and xxh3-128: :mod:`objckpt.format.reused`), hashed before any request."""
    to_write: list[StoredEntry] = []
    reused: list[tuple[int, BaseItem]] = []
    for ident, data in entries:
        base = reuse.get(ident)
        chunks, kept = stored_chunks(data, framer)
        digest = None
        if base is not None:
            length, digest = item_digest(chunks)
            # This writer sees an item's transforms only once its bytes are consumed;
            # the index then records this save's own chain for the reused item
            # (with_transforms), which decodes the equal stored bytes alike.
            if base.matches(length, digest, base.descriptors):
                reused.append((ident, base))
                continue
        to_write.append((ident, chunks, kept, digest))
    return to_write, reused


def _streamed(
    entries: Iterable[tuple[int, torch.Tensor | BytesLike]], framer: Framer
) -> Iterator[StoredEntry]:
    for ident, data in entries:
        chunks, kept = stored_chunks(data, framer)
        yield ident, chunks, kept, None


def write_stored(upload: ObjectUpload, entries: Iterable[StoredEntry]) -> PayloadRecord:
    """Write entries prepared by :func:`split_reused` into ``upload``, in order (the
    caller closes or aborts it). Framed tensors are sent from their memory, which the
    caller keeps unchanged until the save returns, as with DCP's own writers."""
    out = PayloadWriter(upload)
    for ident, chunks, kept, digest in entries:
        out.write_item(ident, chunks, kept=kept, xxh3=digest)
    return out.record()


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
                to_write, reused = split_reused(entries_of(obj), framer, reuse)
            else:  # streamed: each item resolved as it is written, none held ahead
                to_write, reused = _streamed(entries_of(obj), framer), []
            if reuse and not to_write:  # every item reused: the object is never created
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                done.set_result(None)
                record = PayloadRecord(0, "", (), reused=tuple(reused))
                written.append(written_object(obj, items, record, done))
                continue
            upload = store.begin(obj.key, obj.size_hint)
            try:
                record, done = close_payload(upload, write_stored(upload, to_write))
                record = dataclasses.replace(record, reused=tuple(reused))
                written.append(written_object(obj, items, record, done))
                created += 1
            except BaseException:
                upload.abort()
                raise
        results: list[WriteResult] = []
        for w in written:
            w.done.result()
            results.extend(w.write_results())
    except BaseException:
        for w in written:  # let in-flight uploads settle (they abort themselves on failure)
            w.done.exception()
        raise
    return results, created
