"""A payload item written in cache-sized blocks records what hashing it whole gives.

``PayloadWriter`` hands a large write to its hashes and its upload a block at a time
(``CACHE_BLOCK``), so every pass after the first reads from cache (#47). The item's
CRC32C, xxh3 and the object's CRC32C must be those of the whole bytes, whatever the
block edges, for an upload that checksums its parts and for one that does not.
"""

from __future__ import annotations

import os

import pytest

from objckpt.format.payload import CACHE_BLOCK, PayloadWriter
from objckpt.format.reused import item_digest
from objckpt.writers.checksum import crc32c_of, format_crc


class _Upload:
    """An upload that keeps what it was given, checksumming it when asked to."""

    def __init__(self, tracks: bool) -> None:
        self.tracks_crc32c = tracks
        self.got = bytearray()
        self.writes = 0

    def write(self, data: memoryview) -> int | None:
        self.got += data
        self.writes += 1
        return crc32c_of(data) if self.tracks_crc32c else None

    write_kept = write


@pytest.mark.parametrize("tracks", [True, False])
def test_an_item_written_in_blocks_records_the_checksums_of_its_whole_bytes(tracks: bool) -> None:
    head, body, tail = os.urandom(37), os.urandom(3 * CACHE_BLOCK + 12345), os.urandom(11)
    upload = _Upload(tracks)
    writer = PayloadWriter(upload)  # type: ignore[arg-type]
    writer.write_item(7, (head, memoryview(body), tail), kept=True)
    whole = head + body + tail
    ((ident, offset, length, crc, xxh3),) = writer.record().places
    assert (ident, offset, length) == (7, 0, len(whole))
    assert crc == format_crc(crc32c_of(whole))
    assert xxh3 == item_digest([whole])[1]
    assert bytes(upload.got) == whole
    assert upload.writes == 2 + 4  # head, tail, and the body in four blocks
    if not tracks:  # the object's CRC32C is the writer's own, block by block
        assert writer.record().crc32c == format_crc(crc32c_of(whole))
