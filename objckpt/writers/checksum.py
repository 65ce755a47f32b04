"""CRC32C helpers.

CRC32C is what S3 and GCS use for their own object checksums, so one value can be
compared against either store later. The ``crc32c`` package is chosen over
``google-crc32c`` because it hashes any buffer (memoryviews of tensor storage
included) with the CPU's CRC instruction, so checksums are computed on the bytes
as they stream past, without a copy or a second pass.
"""

from __future__ import annotations

import base64
import functools

import crc32c as _crc32c

__all__ = [
    "COMBINE_ABOVE",
    "BytesLike",
    "Crc32c",
    "crc32c_combine",
    "crc32c_of",
    "format_crc",
    "parse_crc",
    "to_base64",
]

BytesLike = bytes | bytearray | memoryview

#: Writes at least this long reuse a CRC computed elsewhere through
#: :func:`crc32c_combine`; shorter ones are hashed again (cheaper than combining).
COMBINE_ABOVE = 64 * 1024


class Crc32c:
    """A running CRC32C over bytes fed in order."""

    __slots__ = ("value",)

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def update(self, data: BytesLike) -> None:
        self.value = _crc32c.crc32c(data, self.value)

    def extend(self, crc: int, length: int) -> None:
        """Continue over ``length`` bytes whose own CRC32C someone already computed."""
        self.value = crc32c_combine(self.value, crc, length)

    def feed(self, data: BytesLike, crc: int | None) -> None:
        """Continue over ``data``, reusing its CRC32C ``crc`` when one is given and
        the bytes are many (combining costs more than hashing a short write)."""
        if crc is None or len(data) < COMBINE_ABOVE:
            self.update(data)
        else:
            self.extend(crc, len(data))

    def hexdigest(self) -> str:
        return format_crc(self.value)


_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _gf2_times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.cache
def _zeros_operator(power: int) -> tuple[int, ...]:
    """The GF(2) matrix that appends 2**power zero bytes to a CRC register."""
    if power == 0:
        one_bit = (_POLY, *(1 << n for n in range(31)))
        op = one_bit
        for _ in range(3):  # 1 bit -> 2 -> 4 -> 8 bits: one byte
            op = tuple(_gf2_times(op, op[n]) for n in range(32))
        return op
    half = _zeros_operator(power - 1)
    return tuple(_gf2_times(half, half[n]) for n in range(32))


@functools.cache
def _zeros_tables(power: int) -> tuple[tuple[int, ...], ...]:
    """``_zeros_operator(power)`` as four 256-entry tables, one per byte of the CRC
    register: applying it is then four lookups, not a 32-step loop in Python."""
    op = _zeros_operator(power)
    tables = []
    for k in range(4):
        table = [0] * 256
        for b in range(1, 256):
            low = b & -b  # each entry is an earlier one plus its lowest set bit's column
            table[b] = table[b ^ low] ^ op[8 * k + low.bit_length() - 1]
        tables.append(tuple(table))
    return tuple(tables)


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``a + b`` from CRC32C(a), CRC32C(b) and len(b) (zlib's method).

    Lets an upload checksum each part once and still know the whole object's
    CRC32C, instead of hashing every byte twice.
    """
    while len2:  # one operator per set bit of len2
        low = len2 & -len2
        t0, t1, t2, t3 = _zeros_tables(low.bit_length() - 1)
        crc1 = t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24]
        len2 ^= low
    return crc1 ^ crc2


def crc32c_of(data: BytesLike, value: int = 0) -> int:
    """The CRC32C of one buffer (continuing from ``value``, the CRC32C of what precedes it)."""
    return int(_crc32c.crc32c(data, value))


def to_base64(value: int) -> str:
    """A CRC32C as S3's ``ChecksumCRC32C`` header wants it: base64 of 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


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
