"""CRC32C combining: the object and part checksums built from per-piece CRCs must be
exactly the CRC32C of the concatenated bytes (S3 rejects a part whose declared
checksum is wrong, and a load rejects an item whose manifest CRC is)."""

from __future__ import annotations

import random

import crc32c
import pytest

from objckpt.writers.checksum import COMBINE_ABOVE, Crc32c, crc32c_combine

_LENGTHS = [0, 1, 3, 255, 256, 4096, 65_535, 65_536, 65_537, 262_144, 1_000_003, 4 << 20]


@pytest.mark.parametrize("len2", _LENGTHS)
def test_combine_equals_the_crc_of_the_concatenation(len2: int) -> None:
    rng = random.Random(len2)
    a = rng.randbytes(rng.randrange(0, 5000))
    b = rng.randbytes(len2)
    got = crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b))
    assert got == crc32c.crc32c(a + b)


def test_running_crc_fed_pieces_with_and_without_their_crc() -> None:
    rng = random.Random(7)
    pieces = [rng.randbytes(n) for n in (10, COMBINE_ABOVE, 3, COMBINE_ABOVE + 1, 200_000)]
    running = Crc32c()
    for n, piece in enumerate(pieces):
        # Every other piece comes with its CRC (combined); the rest are hashed here.
        running.feed(piece, crc32c.crc32c(piece) if n % 2 else None)
    assert running.value == crc32c.crc32c(b"".join(pieces))
