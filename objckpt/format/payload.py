"""A payload object: items written back to back, each checksummed on the way.

What an item's bytes are (a ``torch.save`` file, a pickled value) is decided by
the caller; this module only lays items into one upload and records where each
landed with its CRC32C and xxh3-128 (what the next save compares to reuse an
unchanged item, :mod:`objckpt.format.reused`), hashing every byte once per hash.
It imports no torch, so the upload worker processes that write staged tensors
never load it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from objckpt.errors import InternalError
from objckpt.format.reused import BaseItem, new_hasher
from objckpt.writers.accounting import RequestStats
from objckpt.writers.base import ObjectUpload
from objckpt.writers.checksum import BytesLike, Crc32c

__all__ = ["PayloadRecord", "PayloadWriter", "close_payload"]

#: A write is hashed and handed to the upload in blocks of this many bytes, so that
#: every pass over a block after the first (xxh3, CRC32C, a part buffer's copy)
#: reads it from the CPU's cache instead of memory: a tensor of many MiB passed
#: whole cost a trip to memory per pass.
CACHE_BLOCK = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class PayloadRecord:
    """What writing one payload object produced: its size, CRC32C and item places."""

    size: int
    crc32c: str
    #: (item id, offset, length, crc32c, xxh3) of each item written.
    places: tuple[tuple[int, int, int, str, str], ...]
    #: Store requests the upload made (set by the upload worker that made them).
    requests: RequestStats = dataclasses.field(default_factory=RequestStats)
    #: (item id, the base item it equals) of each item not written: reused.
    reused: tuple[tuple[int, BaseItem], ...] = ()
    #: (item id, stream-transform descriptors, length before them) of each item
    #: stored transformed (compressed: :mod:`objckpt.format.compress`).
    transforms: tuple[tuple[int, tuple[str, ...], int], ...] = ()


class PayloadWriter:
    """The file-like items are written into, in order (``torch.save`` writes here too).

    Each byte goes to the upload once and is hashed once: the upload's CRC32C of a
    write (when the store tracks one) is reused for the item's and the object's.
    Call :meth:`begin_item` before each item's bytes, :meth:`end_item` after.
    """

    def __init__(self, upload: ObjectUpload) -> None:
        self.upload = upload
        self.pos = 0
        self._object_crc = Crc32c()
        self._item_crc = Crc32c()
        self._item: tuple[int, int] | None = None  # (id, start)
        self._item_hash = new_hasher()
        self._item_digest: str | None = None  # known before the item was written
        self._places: list[tuple[int, int, int, str, str]] = []
        # An upload that checksums its parts knows the object's CRC32C already.
        self._own_crc = not upload.tracks_crc32c
        #: The store's error, kept because torch.save replaces it with its own
        #: ("unexpected pos ...") that names neither the object nor the cause.
        self.error: BaseException | None = None

    def begin_item(self, ident: int, xxh3: str | None = None) -> None:
        """Start an item; ``xxh3``: its hash when the caller computed it already."""
        self._item = (ident, self.pos)
        self._item_crc = Crc32c()
        self._item_digest = xxh3
        if xxh3 is None:
            self._item_hash.reset()

    def end_item(self) -> None:
        if self._item is None:
            raise InternalError("internal: end_item without begin_item")
        ident, start = self._item
        digest = self._item_digest or self._item_hash.hexdigest()
        self._places.append((ident, start, self.pos - start, self._item_crc.hexdigest(), digest))
        self._item = None

    def write_item(
        self,
        ident: int,
        chunks: tuple[BytesLike, ...],
        *,
        kept: bool = False,
        xxh3: str | None = None,
    ) -> None:
        """One item made of ``chunks`` (e.g. a tensor's frame head, data and tail).
        ``kept``: the caller keeps them valid until the upload ends
        (:meth:`~objckpt.writers.base.ObjectUpload.write_kept`), so they need no copy.
        ``xxh3``: the item's hash, when the caller computed it (a reuse check)."""
        self.begin_item(ident, xxh3)
        for chunk in chunks:
            self.write(chunk, kept=kept)
        self.end_item()

    def write(self, data: BytesLike, *, kept: bool = False) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes <= CACHE_BLOCK:
            return self._write_block(view, kept) if view.nbytes else 0
        for at in range(0, view.nbytes, CACHE_BLOCK):
            self._write_block(view[at : at + CACHE_BLOCK], kept)
        return view.nbytes

    def _write_block(self, view: memoryview, kept: bool) -> int:
        if self._own_crc:
            self._object_crc.update(view)
        if self._item_digest is None:
            self._item_hash.update(view)
        try:
            crc = self.upload.write_kept(view) if kept else self.upload.write(view)
        except BaseException as exc:
            self.error = exc
            raise
        self._item_crc.feed(view, crc)
        self.pos += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        return None

    def tell(self) -> int:
        return self.pos

    def record(self) -> PayloadRecord:
        """Every item so far; the object CRC32C is filled in by :func:`close_payload`
        when the upload computes it."""
        crc = self._object_crc.hexdigest() if self._own_crc else ""
        return PayloadRecord(self.pos, crc, tuple(self._places))


def close_payload(
    upload: ObjectUpload, record: PayloadRecord
) -> tuple[PayloadRecord, concurrent.futures.Future[None]]:
    """Close ``upload``; the record completed with the object CRC32C the upload
    computed itself, when it did (see ``ObjectUpload.tracks_crc32c``)."""
    done = upload.close()
    if upload.tracks_crc32c:
        if upload.crc32c is None:
            raise InternalError(f"internal: {upload.key} closed without its CRC32C")
        record = dataclasses.replace(record, crc32c=upload.crc32c)
    return record, done
