"""CRC32C helpers.

CRC32C is what S3 and GCS use for their own object checksums, so one value can be
compared against either store later. The ``crc32c`` package is chosen over
``google-crc32c`` because it hashes any buffer (memoryviews of tensor storage
included) with the CPU's CRC instruction, so checksums are computed on the bytes
as they stream past, without a copy or a second pass.
"""

from __future__ import annotations

import base64

import crc32c as _crc32c

__all__ = ["BytesLike", "Crc32c", "format_crc", "parse_crc"]

BytesLike = bytes | bytearray | memoryview


class Crc32c:
    """A running CRC32C over bytes fed in order."""

    __slots__ = ("value",)

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def update(self, data: BytesLike) -> None:
        self.value = _crc32c.crc32c(data, self.value)

    def hexdigest(self) -> str:
        return format_crc(self.value)


def format_crc(value: int) -> str:
    """The manifest's form of a CRC32C: 8 lowercase hex digits."""
    return f"{value:08x}"


def crc_from_base64(text: str) -> str:
    """The manifest's form of a CRC32C that a store reports as base64 of 4
    big-endian bytes (S3's ``ChecksumCRC32C``, GCS's ``crc32c``)."""
    raw = base64.b64decode(text)
    if len(raw) != 4:
        raise ValueError(f"a CRC32C is 4 bytes, got {len(raw)} from {text!r}")
    return raw.hex()


def parse_crc(text: str) -> int:
    """Parse the manifest's 8-hex-digit form; raises ValueError otherwise."""
    if len(text) != 8:
        raise ValueError(f"CRC32C must be 8 hex digits, got {text!r}")
    return int(text, 16)
