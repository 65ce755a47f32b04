"""An item a committed base step stores, and the test that a new item equals it.

A save with reuse (``CheckpointManager(reuse_unchanged=True)``, or an explicit
``reuse_from``) looks up, for each item it is about to write, the item of the
same identity (fqn and chunk offsets) that the base step stores. The writer (an
upload worker, or the synchronous writer) hashes the new item's stored bytes and
skips the upload when the base item has the same length and the same xxh3-128:
128 bits make a collision across every item of every step as good as impossible,
where CRC32C's 32 bits would not (a silent wrong restore), so CRC32C is never the
test. A base item without a hash (written before #28) is never matched.

This module is torch-free: upload workers import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import xxhash

from objckpt.format.refs import reference_key
from objckpt.writers.checksum import BytesLike

if TYPE_CHECKING:  # torch-free at run time: upload workers import this module
    from objckpt.format.dcp_json import StoredItem

__all__ = ["BaseItem", "item_digest", "new_hasher"]


@dataclasses.dataclass(frozen=True)
class BaseItem:
    """Where a base step's item is, as the new step's index will name it.

    Attributes:
        key: The reference key (``../step-<N>/<key>``, :func:`objckpt.format.refs.reference_key`).
        offset: Byte offset of the item inside the referenced object.
        length: Its stored length.
        crc32c: Its CRC32C (8 hex digits), copied from the base index.
        xxh3: Its xxh3-128 (32 hex digits).
        object_size: Size of the referenced object (the base manifest's entry).
        object_crc32c: CRC32C of the referenced object (the base manifest's entry).
        descriptors: The stream transforms its stored bytes went through (compression,
            DCP extensions), as its index records them; None: none. Never read from
            an index that lacks them: absent means untransformed.
    """

    key: str
    offset: int
    length: int
    crc32c: str | None
    xxh3: str
    object_size: int
    object_crc32c: str
    descriptors: tuple[str, ...] | None = None

    @classmethod
    def stored_at(
        cls, step_dir: str, stored: StoredItem, object_size: int, object_crc32c: str
    ) -> BaseItem:
        """The item ``stored`` (its index record, ``xxh3`` set) of the object it lies
        in, as a step after ``step_dir`` references it (whether the base was read
        from the store or remembered from this process's own save)."""
        if stored.xxh3 is None:
            raise ValueError(f"{stored.relative_path}: an item without an xxh3 is never reused")
        return cls(
            key=reference_key(step_dir, stored.relative_path),
            offset=stored.offset,
            length=stored.length,
            crc32c=stored.crc32c,
            xxh3=stored.xxh3,
            object_size=object_size,
            object_crc32c=object_crc32c,
            descriptors=stored.transform_descriptors,
        )

    def matches(self, length: int, digest: str, descriptors: tuple[str, ...] | None = None) -> bool:
        """Whether an item of ``length`` stored bytes hashing to ``digest``, stored
        through the transforms ``descriptors``, is this one (the same bytes under
        another chain of transforms would decode to other values)."""
        return (
            self.length == length
            and self.xxh3 == digest
            and tuple(self.descriptors or ()) == tuple(descriptors or ())
        )


def new_hasher() -> xxhash.xxh3_128:
    """The streaming hash of one item's stored bytes."""
    return xxhash.xxh3_128()


def item_digest(chunks: Iterable[BytesLike]) -> tuple[int, str]:
    """``(length, xxh3-128 hex)`` of an item stored as ``chunks`` back to back."""
    hasher = xxhash.xxh3_128()
    length = 0
    for chunk in chunks:
        view = memoryview(chunk)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        hasher.update(view)
        length += view.nbytes
    return length, hasher.hexdigest()
