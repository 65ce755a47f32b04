"""The one validation boundary for what a reader takes from a store.

Bucket contents are untrusted input: anyone who can write to the bucket can write a
manifest, an index object or a stock ``.metadata``, and re-encode it so every
recorded size and CRC32C matches. So every decoder of stored metadata passes what
it read through the checks here, and each check runs before anything it guards is
allocated or requested:

* **Sizes.** A metadata object is at most ``ReadOptions.max_metadata_bytes``, judged
  from its recorded size where there is one (an index object's manifest entry, a
  ``.metadata``'s listing) and otherwise by reading at most that many bytes plus one
  (the manifest), never by reading it whole first.
* **JSON.** At most :data:`MAX_JSON_DEPTH` levels of nesting, integers inside a
  signed 64-bit range, floats finite, no ``NaN``/``Infinity``: checked on the raw
  bytes before :func:`json.loads` builds anything (it has no depth option, and a
  deeply nested document is otherwise a ``RecursionError`` naming nothing).
* **Keys.** Relative, inside the checkpoint: no ``..``, no absolute path, no
  backslash, URL scheme, NUL or empty segment (but a sibling step's object,
  :mod:`objckpt.format.refs`); a name where a name is expected.
* **Counts and extents.** Every count, offset and length is bounded by what the
  rest of the metadata allows: a tensor's chunk count by its element count, a
  chunk by its tensor, a tensor's bytes by the payload the checkpoint holds, a run
  by the column it fills, an item's ``offset + length`` by its object's recorded
  size, and a tensor item's length by its dtype and chunk shape.

Each refusal is a :class:`~objckpt.errors.ManifestError` naming the object's URL
and the numbers involved, the error a reader already falls back on (a backup, the
next root) as it does for a missing manifest.

The manifest's checks (sizes, JSON, keys) run in torch-free worker interpreters too
(promotion, the local tier's copies): this module imports torch's DCP metadata
classes only inside the two checks that take DCP metadata, which run where torch is
already loaded.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import TYPE_CHECKING, Any

from objckpt.errors import ManifestError
from objckpt.format.refs import is_reference, split_reference
from objckpt.options import ReadOptions

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

__all__ = [
    "DEFAULT_MAX_METADATA_BYTES",
    "FRAME_SLACK",
    "MAX_DIMS",
    "MAX_INT",
    "MAX_JSON_DEPTH",
    "check_count",
    "check_int",
    "check_item",
    "check_key",
    "check_metadata",
    "check_name",
    "check_size",
    "column_extent",
    "load_json",
    "tensor_bytes",
]

#: ``ReadOptions.max_metadata_bytes``'s default, for decoders called without options.
DEFAULT_MAX_METADATA_BYTES: int = ReadOptions.max_metadata_bytes
#: Deepest JSON nesting read. objckpt's own documents nest 7 levels; user metadata
#: deeper than this cannot be read back.
MAX_JSON_DEPTH = 100
#: Integers must lie in [-MAX_INT, MAX_INT): what torch sizes and store offsets hold.
MAX_INT = 2**63
#: Most dimensions a stored tensor may have (torch's own limit is lower in practice).
MAX_DIMS = 64
#: Most bytes a stored tensor item may hold beyond its raw data: the ``torch.save``
#: container around it (about 1 KiB with 64-byte record alignment; generous for
#: other alignments and torch versions).
FRAME_SLACK = 64 * 1024

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_LONG_INT = re.compile(rb"-?[0-9]{19,}")  # shorter ones are < 10**18 < MAX_INT
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_DEPTH_STEP = [0] * 256
for _open, _close in (b"[]", b"{}"):
    _DEPTH_STEP[_open], _DEPTH_STEP[_close] = 1, -1


def check_size(size: int, limit: int, *, what: str, url: str, exact: bool = True) -> None:
    """Refuse a metadata object of ``size`` bytes above ``limit``.

    Args:
        size: Its size (``exact=False``: what a read of ``limit + 1`` bytes returned).
        limit: ``ReadOptions.max_metadata_bytes``.
        what: What the object is, for the message.
        url: The object's URL, for the message.
        exact: Whether ``size`` is the object's whole size.

    Raises:
        ManifestError: Naming ``url``, both numbers and the option that sets the limit.
    """
    if size > limit:
        measured = f"{size} bytes" if exact else f"over {limit} bytes"
        raise ManifestError(
            f"{what} {url} is {measured}, more than ReadOptions.max_metadata_bytes "
            f"= {limit}; objckpt refuses to read it (raise the option for a checkpoint "
            "you trust whose metadata is that large)"
        )


def load_json(data: bytes, *, what: str, url: str, max_bytes: int | None = None) -> Any:
    """Parse a stored JSON document, bounded: size, nesting depth and numbers.

    Args:
        data: The object's bytes.
        what: What the object is, for messages ("manifest", "index").
        url: The object's URL, for messages.
        max_bytes: The size limit (None: :data:`DEFAULT_MAX_METADATA_BYTES`).

    Raises:
        ManifestError: Too large, too deep, a number out of range, or not JSON.
    """
    limit = DEFAULT_MAX_METADATA_BYTES if max_bytes is None else max_bytes
    check_size(len(data), limit, what=what, url=url)
    # Strings out of the way (their brackets and digits are text), then C-speed scans.
    bare = _STRING.sub(b"", data)
    depth = max(
        itertools.accumulate(map(_DEPTH_STEP.__getitem__, bare.translate(None, _NOT_BRACKETS))),
        default=0,
    )
    if depth > MAX_JSON_DEPTH:
        raise ManifestError(
            f"{what} {url} nests {depth} levels deep; objckpt reads at most {MAX_JSON_DEPTH}"
        )
    for match in _LONG_INT.finditer(bare):
        digits = match.group()
        if len(digits) > 20 or not -MAX_INT <= int(digits) < MAX_INT:
            raise ManifestError(
                f"{what} {url} holds the integer {digits[:40].decode()}"
                f"{'...' if len(digits) > 40 else ''}, outside the 64-bit range objckpt reads"
            )
    try:
        return json.loads(
            data, parse_float=_finite(what, url), parse_constant=_no_constant(what, url)
        )
    except ManifestError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ManifestError(f"{what} {url} is not valid JSON ({exc})") from exc


def _finite(what: str, url: str) -> Any:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ManifestError(f"{what} {url} holds the number {text[:40]}, which is not finite")
        return value

    return parse


def _no_constant(what: str, url: str) -> Any:
    def parse(text: str) -> float:
        raise ManifestError(f"{what} {url} holds {text}, which is not a JSON number")

    return parse


def check_key(key: object, where: str) -> str:
    """An object key relative to the checkpoint URL, which must stay inside it, or a
    reference to a sibling step's object (``../step-<N>/<key>``, :mod:`~objckpt.format.refs`).

    Raises:
        ManifestError: Not a non-empty string, or it could name anything outside the
            checkpoint (``..``, ``.`` or empty segments, an absolute path, a
            backslash, a URL scheme, a NUL) other than a well-formed reference.
    """
    if not isinstance(key, str) or not key:
        raise ManifestError(f"{where}: object key must be a non-empty string, got {key!r}")
    if is_reference(key):
        split_reference(key, f"{where}: object key {key!r} escapes the checkpoint directory")
        return key
    parts = key.split("/")
    if (
        key.startswith("/")
        or "\\" in key
        or "://" in key
        or "\x00" in key
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ManifestError(f"{where}: object key {key!r} escapes the checkpoint directory")
    return key


def check_name(name: object, where: str) -> str:
    """An object name directly under the checkpoint (a key without any separator).

    Raises:
        ManifestError: Not a valid key, or it holds a ``/``.
    """
    key = check_key(name, where)
    if "/" in key:
        raise ManifestError(f"{where}: {key!r} must be a name directly in the checkpoint")
    return key


def check_int(value: object, where: str, *, low: int = 0, high: int = MAX_INT) -> int:
    """An integer (not a bool, not a float) in ``[low, high)``.

    Raises:
        ManifestError: Naming ``where``, the value and the range.
    """
    if type(value) is not int or not low <= value < high:
        raise ManifestError(f"{where} is {value!r}; expected an integer in [{low}, {high})")
    return value


def check_count(value: object, where: str, *, at_most: int, because: str) -> int:
    """A count in ``[0, at_most]``; ``because`` says what bounds it, for the message.

    Raises:
        ManifestError: Naming ``where``, the count, the bound and why.
    """
    count = check_int(value, where)
    if count > at_most:
        raise ManifestError(f"{where} is {count}, more than {at_most} ({because})")
    return count


def column_extent(doc: Any, length: int, where: str) -> tuple[int, int]:
    """The smallest and largest value of an integer column (:mod:`objckpt.format.columns`)
    of ``length`` values, found without expanding its runs.

    Raises:
        ManifestError: Not a column of ``length`` integers in the 64-bit range.
    """
    if isinstance(doc, list):
        if len(doc) != length or any(type(v) is not int for v in doc):
            raise ManifestError(f"{where}: expected {length} integers")
        values = doc
    elif isinstance(doc, dict) and isinstance(doc.get("runs"), list) and len(doc) == 1:
        runs = doc["runs"]
        if len(runs) % 3 or any(type(v) is not int for v in runs):
            raise ManifestError(f"{where}: runs must be (start, step, count) integer triples")
        values, total = [], 0
        for k in range(0, len(runs), 3):
            start, step, count = runs[k : k + 3]
            if count < 1:
                raise ManifestError(f"{where}: run {runs[k : k + 3]!r} has no values")
            total += count
            values += [start, start + step * (count - 1)]
        if total != length:
            raise ManifestError(f"{where}: runs hold {total} values, expected {length}")
    else:
        raise ManifestError(f"{where}: expected a list of integers or {{'runs': [...]}}")
    if not values:
        return 0, 0
    low, high = min(values), max(values)
    if not (low >= -MAX_INT and high < MAX_INT):
        raise ManifestError(f"{where}: values reach {high}, outside the 64-bit range")
    return low, high


def tensor_bytes(dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, limit: int) -> int:
    """Bytes of a ``dtype`` tensor of ``shape``, or ``limit + 1`` once past ``limit``
    (so a crafted shape never builds a huge integer)."""
    total = dtype.itemsize
    for dim in shape:
        total *= dim
        if total > limit:
            return limit + 1
    return total


def check_metadata(metadata: Metadata, *, where: str, payload_bytes: int, items: int) -> None:
    """DCP metadata whose every tensor fits the checkpoint (stock and format 1).

    Args:
        metadata: The decoded metadata.
        where: The object it came from, for messages.
        payload_bytes: Bytes the checkpoint's payload objects hold: no tensor holds more.
        items: Stored items the checkpoint lists: no tensor has more chunks.

    Raises:
        ManifestError: A tensor's dimensions, chunk count or chunks do not fit.
    """
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorStorageMetadata,
    )

    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise ManifestError(f"{where}: {fqn!r} is a {type(md).__name__}, not DCP metadata")
        size = tuple(md.size)
        check_dims(size, fqn, md.properties.dtype, where=where, payload_bytes=payload_bytes)
        check_count(
            len(md.chunks),
            f"{where}: chunk count of {fqn!r}",
            at_most=items,
            because="the items the checkpoint stores",
        )
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(
                    type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > d
                    for o, s, d in zip(offsets, sizes, size, strict=True)
                )
            ):
                raise ManifestError(
                    f"{where}: a chunk of {fqn!r} at {list(offsets)} of size {list(sizes)} "
                    f"lies outside the tensor's {list(size)}"
                )


def check_dims(
    size: tuple[Any, ...], fqn: str, dtype: torch.dtype, *, where: str, payload_bytes: int
) -> int:
    """A tensor's dimensions: integers, at most :data:`MAX_DIMS`, and no more bytes
    than the payload holds. Returns its element count.

    Raises:
        ManifestError: Naming the tensor and the numbers.
    """
    if len(size) > MAX_DIMS:
        raise ManifestError(f"{where}: {fqn!r} has {len(size)} dimensions, more than {MAX_DIMS}")
    for d, dim in enumerate(size):
        check_int(dim, f"{where}: dimension {d} of {fqn!r}")
    nbytes = tensor_bytes(dtype, size, payload_bytes)
    if nbytes > payload_bytes:
        raise ManifestError(
            f"{where}: {fqn!r} of shape {list(size)} ({dtype}) needs more bytes than "
            f"the checkpoint's {payload_bytes} bytes of payload"
        )
    return math.prod(size)


def check_item(
    index: MetadataIndex,
    offset: object,
    length: object,
    object_size: int,
    metadata: Metadata,
    *,
    where: str,
    key: str,
    transformed: bool = False,
    raw_length: int | None = None,
) -> None:
    """One stored item against what the rest of the metadata allows: inside its
    object, and (a tensor chunk) as long as its dtype and shape need, give or take
    the ``torch.save`` container (``transformed``: its ``raw_length``, if recorded).

    Args:
        index: The item.
        offset: Its offset in its object.
        length: Its length.
        object_size: Its object's recorded size.
        metadata: The checkpoint's DCP metadata (the chunk's dtype and shape).
        where: The object that placed it, for messages (``key``: its object's).

    Raises:
        ManifestError: Naming ``where``, the item and the numbers.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    start = check_int(offset, f"{where}: offset of {index.fqn!r}")
    size = check_int(length, f"{where}: length of {index.fqn!r}")
    if start + size > object_size:
        raise ManifestError(
            f"{where}: {index.fqn!r} lies at bytes {start}-{start + size} of {key!r}, "
            f"which holds {object_size}"
        )
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return
    chunk = _chunk_of(md, index)
    if chunk is None:
        return  # not a chunk of the tensor: the planner never asks for it
    need = tensor_bytes(md.properties.dtype, tuple(chunk.sizes), MAX_INT)
    if transformed:  # compressed: judged by its length before (its decoding is bounded)
        if raw_length is None:
            return
        size = check_int(raw_length, f"{where}: raw_length of {index.fqn!r}")
    if not need <= size <= need + FRAME_SLACK:
        takes = need if need <= MAX_INT else f"more than {MAX_INT}"
        raise ManifestError(
            f"{where}: {index.fqn!r} at {list(chunk.offsets)} is {size} bytes, but a "
            f"{md.properties.dtype} chunk of shape {list(chunk.sizes)} takes {takes} "
            f"(plus at most {FRAME_SLACK} of framing)"
        )


def _chunk_of(md: TensorStorageMetadata, index: MetadataIndex) -> Any:
    pos = index.index
    if pos is not None and 0 <= pos < len(md.chunks) and md.chunks[pos].offsets == index.offset:
        return md.chunks[pos]
    offset = tuple(index.offset or ())
    return next((c for c in md.chunks if tuple(c.offsets) == offset), None)
