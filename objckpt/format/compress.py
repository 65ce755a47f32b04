"""Opt-in compression of stored items: byte grouping for floating point, then zstd.

Why per item and in DCP's own terms: DCP records, per stored item, the stream
transforms applied to its bytes (``_StorageInfo.transform_descriptors``), and its
stock readers undo them through an ``ExtensionRegistry``. An item stored as
``zstd(torch.save bytes)`` under torch's own descriptor ``stream.zstd/1`` loads
with torch's default registry; one whose float bytes were grouped first also
names ``objckpt.bytegroup/1``, which a stock reader undoes once objckpt's
extension class is registered (:class:`objckpt.ByteGrouping`). Descriptors are in
DCP's order: the first is undone first, on the stored bytes.

Why byte grouping (as ZipNN does): a float's bytes differ in kind. The exponent
byte of trained weights takes few values, the low mantissa bytes look random.
Laid out element by element, zstd sees one mixed stream; laid out as planes (every
element's byte 0, then every byte 1, ...) the exponent plane compresses well and
the random planes cost what they must. Only the tensor's raw bytes are grouped,
never the ``torch.save`` container around them; the grouped stream starts with a
small header saying where the grouped region is and its width, so it undoes
itself without knowing the dtype.

CRC32C and the content hash are taken over the STORED (compressed) bytes, like
every other item. Decompression is bounded: the output of a crafted frame may
never exceed the uncompressed size the index declares for the item.

This module is torch-free: the upload workers, which never import torch, compress
with it. ``zstandard`` is an optional dependency (``objckpt[compress]``), imported
when compression is configured or a compressed item is read.
"""

from __future__ import annotations

import dataclasses
import io
import re
import struct
from collections.abc import Sequence
from typing import Any, Protocol

from objckpt.errors import ConfigurationError, IntegrityError, ManifestError, SizeMismatchError

__all__ = [
    "BYTEGROUP",
    "ZSTD",
    "Codec",
    "group_bytes",
    "group_stream",
    "grouping_width",
    "parse_compression",
    "undo_transforms",
    "ungroup_bytes",
    "ungroup_stream",
    "zstd_available",
    "zstd_decompress",
]

#: torch's own ZStandard extension's descriptor (stock default registries know it).
ZSTD = "stream.zstd/1"
#: objckpt's byte-grouping extension (:class:`objckpt.ByteGrouping` undoes it).
BYTEGROUP_NAME = "objckpt.bytegroup"
BYTEGROUP = f"{BYTEGROUP_NAME}/1"

#: Element widths of the floating-point dtypes whose bytes are grouped.
_FLOAT_WIDTHS = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_SPEC = re.compile(r"(bytegroup\+)?zstd(?::(-?\d+))?")
_HEADER = struct.Struct("<4sBQQ")  # magic, width, region start, region length
_MAGIC = b"OBG1"
#: The first output buffer of a decompression when the input is tiny.
_FIRST_BUFFER = 1 << 20
#: Slack over the declared size allowed to an intermediate stage (a grouping header).
_STAGE_SLACK = _HEADER.size


class _Registry(Protocol):
    """What DCP's ``ExtensionRegistry`` offers (duck-typed: this module is torch-free)."""

    def from_descriptor_list(self, descriptors: Sequence[str]) -> Sequence[Any]: ...


def _zstandard() -> Any:
    import zstandard  # optional: objckpt[compress]

    return zstandard


def _numpy() -> Any:
    """numpy when installed (it transposes planes ~10x faster than strided slices;
    an upload worker imports it once), else None."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def zstd_available() -> bool:
    """Whether the optional ``zstandard`` package can be imported."""
    try:
        _zstandard()
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Codec:
    """How items are compressed: zstd at ``level``, floats byte-grouped first.

    Attributes:
        level: zstd's level (1 fastest; 3 its default; up to 22).
        byte_grouping: Group the bytes of floating-point tensors into planes first.
    """

    level: int = 3
    byte_grouping: bool = False

    def descriptors(self, dtype: str | None) -> tuple[str, ...]:
        """The descriptors of an item of ``dtype`` (None: bytes, or a tensor whose
        raw bytes are not laid out as a frame), in DCP's order."""
        if self.byte_grouping and grouping_width(dtype):
            return (ZSTD, BYTEGROUP)
        return (ZSTD,)

    def apply(
        self, chunks: Sequence[Any], dtype: str | None = None
    ) -> tuple[bytes, tuple[str, ...], int]:
        """One item's stored bytes, descriptors and length before compression.

        Args:
            chunks: The item's bytes: a framed tensor's (head, raw bytes, tail), or
                one chunk (bytes, or a tensor as ``torch.save`` wrote it).
            dtype: The tensor's dtype name when ``chunks`` is a frame (its raw
                bytes may be grouped), else None.
        """
        dtype = dtype if len(chunks) == 3 else None
        raw = sum(memoryview(c).nbytes for c in chunks)
        return self.encode(chunks, dtype=dtype), self.descriptors(dtype), raw

    def encode(
        self, chunks: Sequence[Any], *, dtype: str | None = None, data_chunk: int = 1
    ) -> bytes:
        """The stored bytes of an item made of ``chunks`` (e.g. frame head, tensor
        bytes, frame tail). With byte grouping and a float ``dtype``,
        ``chunks[data_chunk]`` (the tensor's raw bytes) is grouped."""
        views = [memoryview(c).cast("B") for c in chunks]
        width = grouping_width(dtype) if self.byte_grouping else 0
        if width and len(views) > data_chunk:
            start = sum(v.nbytes for v in views[:data_chunk])
            region = views[data_chunk].nbytes - views[data_chunk].nbytes % width
            header = _HEADER.pack(_MAGIC, width, start, region)
            grouped = memoryview(group_bytes(views[data_chunk][:region], width))
            rest = views[data_chunk][region:]
            views = [
                memoryview(header),
                *views[:data_chunk],
                grouped,
                rest,
                *views[data_chunk + 1 :],
            ]
        total = sum(v.nbytes for v in views)
        cctx = _zstandard().ZstdCompressor(level=self.level, write_content_size=True)
        obj = cctx.compressobj(size=total)
        out = [obj.compress(v) for v in views if v.nbytes]
        out.append(obj.flush())
        return b"".join(out)


def parse_compression(value: object) -> Codec | None:
    """``UploadOptions.compression`` as a codec: None (off), ``"zstd"`` (torch's
    own descriptor: stock readers load it with their default registry),
    ``"bytegroup+zstd"`` (floats grouped first: a better ratio, and stock readers
    need :class:`objckpt.ByteGrouping` registered), either with ``":<level>"``.

    Raises:
        ConfigurationError: Another value, or ``zstandard`` is not installed.
    """
    if value is None:
        return None
    match = _SPEC.fullmatch(value) if isinstance(value, str) else None
    level = int(match.group(2)) if match and match.group(2) else 3
    if match is None or not 1 <= level <= 22:
        raise ConfigurationError(
            f"option compression={value!r} is invalid: expected None, 'zstd' or "
            "'bytegroup+zstd', optionally with ':<level>' (1 to 22), e.g. 'zstd:1'"
        )
    if not zstd_available():
        raise ConfigurationError(
            f"option compression={value!r} needs the zstandard package, which is not "
            "installed: pip install 'objckpt[compress]'"
        )
    return Codec(level=level, byte_grouping=bool(match.group(1)))


def grouping_width(dtype: str | None) -> int:
    """The element width whose bytes are grouped for ``dtype`` (0: not grouped)."""
    return _FLOAT_WIDTHS.get(dtype or "", 0)


def group_bytes(data: Any, width: int) -> bytes:
    """``data`` (a multiple of ``width`` bytes) as ``width`` planes: every element's
    byte 0, then every byte 1, and so on."""
    view = memoryview(data).cast("B")
    np = _numpy()
    if np is not None:
        return np.frombuffer(view, np.uint8).reshape(-1, width).T.tobytes()
    return b"".join(view[i::width].tobytes() for i in range(width))


def ungroup_bytes(planes: Any, width: int, into: Any = None) -> Any:
    """The inverse of :func:`group_bytes`, written into ``into`` (a writable buffer
    of the same size) or a new bytearray; returns what it wrote into."""
    view = memoryview(planes).cast("B")
    n = view.nbytes // width
    out = bytearray(view.nbytes) if into is None else into
    np = _numpy()
    if np is not None:
        np.frombuffer(out, np.uint8).reshape(n, width)[:] = (
            np.frombuffer(view, np.uint8).reshape(width, n).T
        )
        return out
    dest = memoryview(out).cast("B")
    for i in range(width):
        dest[i::width] = view[i * n : (i + 1) * n]
    return out


def group_stream(data: Any, width: int) -> bytes:
    """A whole stream byte-grouped by ``width`` (its tail of fewer than ``width``
    bytes kept as it is), with the header :func:`ungroup_stream` reads."""
    view = memoryview(data).cast("B")
    region = view.nbytes - view.nbytes % width
    header = _HEADER.pack(_MAGIC, width, 0, region)
    return header + group_bytes(view[:region], width) + view[region:].tobytes()


def ungroup_stream(data: Any, *, what: str) -> bytearray:
    """A byte-grouped stream (header, then the item with its region grouped) back
    to the item's bytes.

    Raises:
        IntegrityError: The header does not describe a region inside the stream.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < _HEADER.size:
        raise IntegrityError(f"{what}: byte-grouped data is {view.nbytes} bytes, no header")
    magic, width, start, length = _HEADER.unpack_from(view)
    body = view[_HEADER.size :]
    if magic != _MAGIC or width < 1 or length % width or start + length > body.nbytes:
        raise IntegrityError(
            f"{what}: byte-grouping header (width {width}, bytes {start}-{start + length}) "
            f"does not fit the {body.nbytes} bytes that follow it"
        )
    out = bytearray(body)
    with memoryview(out) as dest:
        ungroup_bytes(body[start : start + length], width, into=dest[start : start + length])
    return out


def zstd_decompress(data: Any, limit: int, *, what: str) -> bytearray:
    """Decompress ``data`` (one or more zstd frames) into at most ``limit`` bytes:
    a frame that would produce more is refused once ``limit + 1`` bytes came out,
    whatever its header claims. The output buffer grows with what actually comes
    out (from a few times the input), so a declared size is never allocated on
    trust either.

    Raises:
        SizeMismatchError: The data decompresses to more than ``limit`` bytes.
        IntegrityError: The data is not valid zstd.
    """
    zstd = _zstandard()
    view = memoryview(data).cast("B")
    out = bytearray(min(limit + 1, max(8 * view.nbytes, _FIRST_BUFFER)))
    filled = 0
    try:
        with zstd.ZstdDecompressor().stream_reader(view, read_across_frames=True) as reader:
            while filled <= limit:
                if filled == len(out):
                    out += bytes(min(len(out), limit + 1 - len(out)))  # at most doubles
                with memoryview(out) as dest:
                    got = reader.readinto(dest[filled:])
                if not got:
                    break
                filled += got
    except zstd.ZstdError as exc:
        raise IntegrityError(f"{what}: stored bytes are not valid zstd ({exc})") from exc
    if filled > limit:
        raise SizeMismatchError(
            f"{what}: zstd data decompresses to more than the {limit} bytes declared for it; "
            "refused (a crafted or corrupt frame)"
        )
    del out[filled:]
    return out


def undo_transforms(
    stored: Any,
    descriptors: Sequence[str],
    declared: int,
    *,
    what: str,
    exact: bool = True,
    registry: _Registry | None = None,
) -> Any:
    """The item's bytes before the transforms ``descriptors`` name (DCP's order: the
    first is undone first), never more than ``declared`` bytes (the uncompressed
    size the index records; a stage may hold a few bytes of header more). With
    ``exact`` False, ``declared`` is only a bound (a stock checkpoint records no
    size before its transforms: a tensor's is bounded by its dtype and shape).

    objckpt's own transforms are undone here; any other through ``registry``
    (DCP's ``ExtensionRegistry``, e.g. a reader's ``_extension_registry``), its
    output read no further than the bound.

    Raises:
        SizeMismatchError: A stage produces more than the bound, or the result is
            not ``declared`` bytes long.
        IntegrityError: The stored bytes do not decode.
        ManifestError: A descriptor nothing here or in ``registry`` knows.
    """
    data = stored
    for n, desc in enumerate(descriptors):
        # A stage followed by a grouping holds its header too.
        limit = declared + (_STAGE_SLACK if BYTEGROUP in descriptors[n + 1 :] else 0)
        if desc == ZSTD:
            data = zstd_decompress(data, limit, what=what)
        elif desc == BYTEGROUP:
            data = ungroup_stream(data, what=what)
        else:
            data = _through_registry(data, desc, limit, what=what, registry=registry)
    if len(data) != declared if exact else len(data) > declared:
        raise SizeMismatchError(
            f"{what}: decodes to {len(data)} bytes, but "
            f"{declared if exact else f'at most {declared}'} are declared for it"
        )
    return data


def _through_registry(
    data: Any, desc: str, limit: int, *, what: str, registry: _Registry | None
) -> bytes:
    if registry is None:
        raise ManifestError(
            f"{what} is stored with stream transform {desc!r}, which objckpt does not know; "
            "register its extension in an ExtensionRegistry and pass it as "
            "ObjectStoreReader(_extension_registry=...)"
        )
    try:
        (ext,) = registry.from_descriptor_list([desc])
    except ValueError as exc:
        raise ManifestError(f"{what}: stream transform {desc!r}: {exc}") from exc
    stream = ext.transform_from(io.BytesIO(bytes(data)))
    out = bytearray()
    while len(out) <= limit:
        piece = stream.read(limit + 1 - len(out))
        if not piece:
            break
        out += piece
    if len(out) > limit:
        raise SizeMismatchError(
            f"{what}: stream transform {desc!r} produces more than the {limit} bytes "
            "declared for it; refused"
        )
    return bytes(out)
