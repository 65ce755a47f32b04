"""One payload object onto the store: the upload path of both savers.

The synchronous writer (:mod:`objckpt.dcp.storage_writer`, in the training
process) and the upload workers (:mod:`objckpt.pipeline.upload_task`, torch-free
processes) write a payload object through these same steps, so a checkpoint's
bytes, checksums and reuse decisions cannot depend on which of them wrote it:

1. :func:`compressed`: each item's stored bytes through the compression codec
   (:mod:`objckpt.format.compress`), recording what was applied;
2. :func:`split_reused`: the items whose stored bytes equal their base step's item
   (length and xxh3-128, :mod:`objckpt.format.reused`) are referenced, not written,
   hashed before any request so an object all of whose items are reused is never
   created;
3. :func:`upload_payload`: the rest through :class:`~objckpt.format.payload.PayloadWriter`
   (per-item CRC32C and xxh3, the object's CRC32C) into one store upload, single
   request or multipart as the store decides from the size hint; a failure aborts
   the upload before it is raised.

Callers bring their items as chunks: a framed tensor's ``(head, bytes, tail)`` or
one chunk of serialized bytes. This module imports no torch: it runs in the
upload workers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence

from objckpt.format.compress import Codec
from objckpt.format.payload import PayloadRecord, PayloadWriter, close_payload
from objckpt.format.reused import BaseItem, item_digest
from objckpt.writers.base import ObjectStore, ObjectUpload
from objckpt.writers.checksum import BytesLike

__all__ = [
    "Applied",
    "StoredEntry",
    "compressed",
    "split_reused",
    "upload_payload",
    "write_stored",
]

#: An entry as its stored bytes: (id, chunks, kept, xxh3 when already hashed).
#: ``kept``: the chunks are the caller's memory, unchanged until the upload ends,
#: so the store may send them without a copy.
StoredEntry = tuple[int, tuple[BytesLike, ...], bool, "str | None"]

#: (item id, descriptors, length before the transforms) of each transformed item.
Applied = tuple[int, tuple[str, ...], int]


def compressed(
    codec: Codec,
    entries: Iterable[tuple[int, Sequence[BytesLike], str | None]],
    applied: list[Applied],
) -> Iterator[tuple[int, bytes]]:
    """Each entry ``(id, chunks, dtype name or None)`` as its compressed stored
    bytes, lazily (one item held at a time); what was applied to each is appended
    to ``applied`` as the entries are consumed."""
    for ident, chunks, dtype in entries:
        stored, descriptors, raw = codec.apply(chunks, dtype)
        applied.append((ident, descriptors, raw))
        yield ident, stored


def split_reused(
    entries: Iterable[tuple[int, tuple[BytesLike, ...], bool]],
    reuse: Mapping[int, BaseItem],
    descriptors: Mapping[int, tuple[str, ...]] | None = None,
) -> tuple[list[StoredEntry], list[tuple[int, BaseItem]]]:
    """The entries to write, and those whose stored bytes equal their base item's,
    hashed here before any request.

    Args:
        entries: ``(id, chunks, kept)`` of each item, as stored.
        reuse: The base step's item of the same identity, by entry id.
        descriptors: The transforms each entry was stored through, by id (the same
            bytes under another chain decode to other values). None when the caller
            records its own chain for a reused item afterwards (the sync writer's
            ``with_transforms``): the base item's chain is then not compared.
    """
    to_write: list[StoredEntry] = []
    reused: list[tuple[int, BaseItem]] = []
    for ident, chunks, kept in entries:
        base = reuse.get(ident)
        digest = None
        if base is not None:
            length, digest = item_digest(chunks)
            chain = base.descriptors if descriptors is None else descriptors.get(ident)
            if base.matches(length, digest, chain):
                reused.append((ident, base))
                continue
        to_write.append((ident, chunks, kept, digest))
    return to_write, reused


def write_stored(upload: ObjectUpload, entries: Iterable[StoredEntry]) -> PayloadRecord:
    """Write ``entries`` into ``upload``, in order (the caller closes or aborts it).
    Kept chunks are sent from their memory, which the caller keeps unchanged until
    the upload ends, as with DCP's own writers."""
    out = PayloadWriter(upload)
    for ident, chunks, kept, digest in entries:
        out.write_item(ident, chunks, kept=kept, xxh3=digest)
    return out.record()


def upload_payload(
    store: ObjectStore,
    key: str,
    entries: Iterable[StoredEntry],
    size_hint: int,
    reused: Sequence[tuple[int, BaseItem]] = (),
) -> tuple[PayloadRecord, concurrent.futures.Future[None]]:
    """Create the object ``key`` from ``entries``: its record (``reused`` recorded
    in it) and the future of its last request. A failure before the close aborts
    the upload (no part is left behind) and is raised."""
    upload = store.begin(key, size_hint)
    try:
        record, done = close_payload(upload, write_stored(upload, entries))
    except BaseException:
        upload.abort()
        raise
    return dataclasses.replace(record, reused=tuple(reused)), done


def stored_size(entries: Iterable[StoredEntry]) -> int:
    """The bytes ``entries`` store: an upload's size hint."""
    return sum(sum(memoryview(c).nbytes for c in chunks) for _, chunks, _, _ in entries)
