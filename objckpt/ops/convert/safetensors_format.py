"""Safetensors on a store: shard names, headers and the index; a source read without trust.

A safetensors file is an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, then the raw bytes. A sharded export is
several such files plus ``model.safetensors.index.json`` (Hugging Face's layout),
whose ``weight_map`` names the file that holds each tensor.

Why shard names carry the export's attempt id (``model-00001-of-00003.<attempt>
.safetensors``): two exports racing to one destination, or a zombie export still
running after another committed, must never write bytes under a name a committed
index points at. Hugging Face tools read shard names from ``weight_map`` and accept
any name there; only the index's name is fixed, and it is the export's commit
(create-only, written last). Exports made before attempt ids (``model-00001-of-00003
.safetensors``) read the same way.

This module holds the naming, the header encoding and the reading of a source to
import, which trusts nothing in it; writing and committing are :mod:`objckpt.ops.convert.export`'s.

**Reading a safetensors source without trusting it: the index, each header, each tensor.**

``objckpt import`` turns whatever a safetensors directory holds into a committed
checkpoint, and that directory is as untrusted as a bucket: a crafted index can name
a shard outside it, a crafted header can claim byte ranges that overlap, run past
the file or add up to far more than the file holds. So, as for a load
(:mod:`objckpt.format.bounds`), everything is checked before anything it names is
allocated, requested or written, and each refusal is a
:class:`~objckpt.errors.SafetensorsError` naming the file (and the tensor or shard):

* **The index** (``model.safetensors.index.json``): at most ``max_header_bytes``,
  JSON bounded in depth and numbers, a ``weight_map`` of tensor name -> shard *file
  name*: no ``/``, ``\\`` or NUL, not ``.`` or ``..``, and joined to the source it
  must stay directly in it. The check is on the name: a link that a local source
  directory holds is followed, as the Hugging Face hub cache keeps
  ``snapshots/<rev>/`` as links into ``blobs/`` (a bucket holds no links).
* **Each header**: its length at most ``max_header_bytes`` (by default the format's
  own cap, 100,000,000 bytes) and inside the file; it starts with ``{`` and is
  bounded JSON; ``__metadata__`` maps strings to strings; every tensor has a dtype
  objckpt imports, a shape of at most 64 non-negative integers and ``data_offsets``
  ``[begin, end]`` inside the data section with ``end - begin`` = dtype size x
  elements; and, as the format requires, the ranges sorted by offset cover the data
  section exactly: contiguous, no overlap, no gap, nothing after the last.
* **Across shards**: each tensor in exactly one shard, the one ``weight_map`` names,
  and every tensor ``weight_map`` places in a shard is in its header.

Covering the data section exactly is what bounds a header's claims by the file's
size (3,000 tensors over the same 1 MiB are refused, not read 3,000 times), and
:func:`read_tensor` reads one tensor at a time, so an import holds one tensor's bytes
at once, not the model's.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import struct
from typing import Any

import torch

from objckpt.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    ManifestError,
    ObjckptError,
    SafetensorsError,
)
from objckpt.format.bounds import MAX_DIMS, load_json, tensor_bytes
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "Entry",
    "Shard",
    "Stored",
    "encode_header",
    "index_attempt",
    "index_document",
    "read_header",
    "read_source",
    "read_tensor",
    "shard_name",
]

INDEX_NAME = "model.safetensors.index.json"

#: torch dtype -> safetensors dtype name (the format's own spelling).
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of an export: its key, shape, dtype as exported and as stored."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as exported (after any conversion)
    source_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def shard_name(n: int, total: int, attempt: str) -> str:
    """Shard ``n`` of ``total`` of export ``attempt``, named as ``save_pretrained``
    names shards plus the attempt id (see the module docstring for why)."""
    return f"model-{n:05d}-of-{total:05d}.{attempt}.safetensors"


def encode_header(entries: list[Entry]) -> bytes:
    """The shard's length-prefixed JSON header, padded so tensor data is 8-byte aligned."""
    fields: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for e in entries:
        fields[e.key] = {
            "dtype": DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [at, at + e.nbytes],
        }
        at += e.nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index_document(
    *,
    total_size: int,
    weight_map: dict[str, str],
    source: str,
    attempt: str,
    crc32c: dict[str, str],
) -> dict[str, Any]:
    """The index Hugging Face reads (``metadata.total_size``, ``weight_map``), plus
    ``metadata.objckpt``: the source, the attempt that wrote it (how a retried commit
    recognises its own index) and each shard's CRC32C (a copy can be checked without
    re-reading the source)."""
    return {
        "metadata": {
            "total_size": total_size,
            "format": "pt",
            "objckpt": {"source": source, "attempt": attempt, "crc32c": crc32c},
        },
        "weight_map": dict(sorted(weight_map.items())),
    }


def index_attempt(raw: bytes) -> str:
    """The attempt id an index records; ``"unknown"`` for one without (written by
    another tool, or by objckpt before attempt ids)."""
    try:
        doc = json.loads(raw)
        return str(doc["metadata"]["objckpt"]["attempt"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


# -- reading a source without trusting it ------------------------------------------------
#: The format's own cap on a header (the safetensors library's ``MAX_HEADER_SIZE``):
#: the default, and the most, of ``max_header_bytes``.
MAX_HEADER_BYTES = 100_000_000

_FROM_NAME = {name: dtype for dtype, name in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor where a checked header places it: ``begin`` and ``end`` are byte
    offsets in the file (not in its data section)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Shard:
    """One checked safetensors file: the store it is read through, its key there, its
    URL (for messages) and its tensors in file order."""

    store: ObjectStore
    key: str
    url: str
    tensors: tuple[Stored, ...]


def read_source(location: Location, *, max_header_bytes: int = MAX_HEADER_BYTES) -> list[Shard]:
    """Every shard of the source at ``location``, each header and the index checked
    (see the module docstring), before any tensor is read.

    Args:
        location: A directory holding ``model.safetensors.index.json`` or
            ``model.safetensors``, or one ``.safetensors`` file.
        max_header_bytes: Most bytes of a header or index read.

    Raises:
        CheckpointNotFoundError: Neither an index nor ``model.safetensors`` there.
        SafetensorsError: A malformed index or header (the message names the file).
        ConfigurationError: ``max_header_bytes`` outside [1, :data:`MAX_HEADER_BYTES`].
        StoreError: Reading failed.
    """
    if type(max_header_bytes) is not int or not 1 <= max_header_bytes <= MAX_HEADER_BYTES:
        raise ConfigurationError(
            f"option max_header_bytes={max_header_bytes!r} is invalid: expected an integer "
            f"in [1, {MAX_HEADER_BYTES}] (the safetensors format's own cap)"
        )
    base = location.path.rstrip("/")
    if base.endswith(".safetensors"):
        parent = open_store(location.parent())
        return [read_header(parent, base.rsplit("/", 1)[-1], max_header_bytes)]
    store = open_store(location)
    index_url = location.url_of(INDEX_NAME)
    raw = _read_index(store, INDEX_NAME, max_header_bytes)
    if raw is None:
        try:
            single = read_header(store, "model.safetensors", max_header_bytes)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"no {INDEX_NAME} or model.safetensors under {location.url}: "
                "not a safetensors export"
            ) from None
        return [single]
    weight_map = _weight_map(raw, index_url, base, location.url, max_header_bytes)
    shards = []
    for name in sorted(set(weight_map.values())):
        try:
            shard = read_header(store, name, max_header_bytes)
        except CheckpointNotFoundError as exc:
            raise SafetensorsError(
                f"{index_url}: weight_map names the shard {name!r}, but "
                f"{location.url_of(name)} does not exist"
            ) from exc
        _check_against_index(shard, name, weight_map, index_url)
        shards.append(shard)
    return shards


def read_header(store: ObjectStore, key: str, max_header_bytes: int) -> Shard:
    """One safetensors file's header, checked against the file's size and the format.

    Raises:
        CheckpointNotFoundError: No file at ``key``.
        SafetensorsError: The header is malformed (the message names ``url``).
        StoreError: Reading failed.
    """
    url = store.location.url_of(key)
    size = _size(store, key)
    if size < 8:
        raise SafetensorsError(
            f"{url} is {size} bytes: too short for a safetensors file (an 8-byte header "
            "length comes first)"
        )
    (length,) = struct.unpack("<Q", _read(store, key, 0, 8))
    if length > max_header_bytes:
        raise SafetensorsError(
            f"{url}: header of {length} bytes, more than the {max_header_bytes} objckpt "
            f"reads (max_header_bytes; the format allows at most {MAX_HEADER_BYTES})"
        )
    if length > size - 8:
        raise SafetensorsError(
            f"{url}: header of {length} bytes, but the file holds only {size - 8} after "
            "the header length"
        )
    raw = _read(store, key, 8, 8 + length)
    if not raw.startswith(b"{"):
        raise SafetensorsError(f"{url}: the header does not start with '{{': not safetensors")
    doc = _json(raw, "safetensors header of", url, max_header_bytes)
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{url}: the header is {_brief(doc)}, not a JSON object")
    start, data_size = 8 + length, size - 8 - length
    tensors = []
    for name, field in doc.items():
        if name == "__metadata__":
            if not isinstance(field, dict) or not all(isinstance(v, str) for v in field.values()):
                raise SafetensorsError(
                    f"{url}: __metadata__ is {_brief(field)}; the format allows only a "
                    "map of strings to strings"
                )
            continue
        tensors.append(_tensor(name, field, url, start, data_size))
    ordered = sorted(tensors, key=lambda t: (t.begin, t.end))
    _check_cover(ordered, url, start, data_size)
    return Shard(store, key, url, tuple(ordered))


def read_tensor(shard: Shard, stored: Stored) -> torch.Tensor:
    """One tensor's values, read with one ranged request of exactly its bytes.

    Raises:
        SafetensorsError: The file holds fewer bytes than its checked header said
            (it changed since).
        StoreError: Reading failed.
    """
    if stored.end == stored.begin:
        return torch.empty(stored.shape, dtype=stored.dtype)
    data = bytearray(_read(shard.store, shard.key, stored.begin, stored.end))
    return torch.frombuffer(data, dtype=stored.dtype).reshape(stored.shape)


def _tensor(key: str, field: object, url: str, start: int, data_size: int) -> Stored:
    where = f"{url}: tensor {key!r}"
    if not key:
        raise SafetensorsError(f"{url}: a tensor has an empty name")
    if not isinstance(field, dict):
        raise SafetensorsError(
            f"{where} is {_brief(field)}, not an object of dtype, shape and data_offsets"
        )
    name = field.get("dtype")
    if not isinstance(name, str) or name not in _FROM_NAME:
        raise SafetensorsError(
            f"{where} has dtype {_brief(name)}; objckpt imports {', '.join(sorted(_FROM_NAME))}"
        )
    shape = field.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or any(type(d) is not int or d < 0 for d in shape)
    ):
        raise SafetensorsError(
            f"{where} has shape {_brief(shape)}; expected a list of at most {MAX_DIMS} "
            "non-negative integers"
        )
    offsets = field.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or any(type(o) is not int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise SafetensorsError(
            f"{where} has data_offsets {_brief(offsets)}; expected [begin, end] with "
            f"0 <= begin <= end <= {data_size}, the size of the file's data section"
        )
    begin, end = offsets
    dtype = _FROM_NAME[name]
    need = tensor_bytes(dtype, tuple(shape), data_size)
    if end - begin != need:
        takes = need if need <= data_size else f"more than the {data_size} the file holds"
        raise SafetensorsError(
            f"{where} holds bytes {begin}-{end} ({end - begin} bytes), but a {name} tensor "
            f"of shape {shape} takes {takes}"
        )
    return Stored(key, dtype, tuple(shape), start + begin, start + end)


def _check_cover(ordered: list[Stored], url: str, start: int, data_size: int) -> None:
    """The tensors, sorted by offset, cover the data section exactly (the format's rule:
    a byte no tensor holds could hide anything, a byte two hold is read twice)."""
    at, prev = start, None
    for t in ordered:
        if t.begin > at:
            after = f" after {prev.key!r}" if prev is not None else ""
            raise SafetensorsError(
                f"{url}: bytes {at - start}-{t.begin - start} of the data section belong "
                f"to no tensor (before {t.key!r}{after}); the format allows no gaps"
            )
        if t.begin < at and prev is not None:
            raise SafetensorsError(
                f"{url}: tensor {t.key!r} at bytes {t.begin - start}-{t.end - start} "
                f"overlaps {prev.key!r} at {prev.begin - start}-{prev.end - start} of the "
                "data section; tensors may not share bytes"
            )
        at, prev = t.end, t
    if at != start + data_size:
        last = f" (after {prev.key!r})" if prev is not None else ""
        raise SafetensorsError(
            f"{url}: bytes {at - start}-{data_size} of the data section belong to no "
            f"tensor{last}; the format allows no bytes after the last tensor"
        )


def _read_index(store: ObjectStore, key: str, max_bytes: int) -> bytes | None:
    """The index's bytes (None: there is none), its size checked before it is read."""
    url = store.location.url_of(key)
    try:
        size = _size(store, key)
    except CheckpointNotFoundError:
        return None
    if size > max_bytes:
        raise SafetensorsError(
            f"{url} is {size} bytes, more than the {max_bytes} objckpt reads (max_header_bytes)"
        )
    return _read(store, key, 0, size)


def _weight_map(raw: bytes, url: str, base: str, src_url: str, max_bytes: int) -> dict[str, str]:
    doc = _json(raw, "safetensors index", url, max_bytes)
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{url} is {_brief(doc)}, not a JSON object")
    if not isinstance(doc.get("metadata", {}), dict):
        raise SafetensorsError(f"{url}: metadata is {_brief(doc['metadata'])}, not an object")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SafetensorsError(
            f"{url}: weight_map is {_brief(weight_map)}; expected a non-empty object of "
            "tensor name -> shard file name"
        )
    root = posixpath.normpath(base)
    for key, name in weight_map.items():
        if (
            not key
            or not isinstance(name, str)
            or name in ("", ".", "..")
            or any(c in name for c in "/\\\x00")
            or posixpath.dirname(posixpath.normpath(f"{base}/{name}")) != root
        ):
            raise SafetensorsError(
                f"{url}: weight_map places {key!r} in {_brief(name)}, which is not a file "
                f"name inside {src_url} (a shard name holds no '/', '\\' or NUL and is "
                "not '.' or '..')"
            )
    return weight_map


def _check_against_index(shard: Shard, name: str, weight_map: dict[str, str], url: str) -> None:
    """Each tensor of ``shard`` is where ``weight_map`` places it, and nothing
    ``weight_map`` places there is missing."""
    for t in shard.tensors:
        placed = weight_map.get(t.key)
        if placed != name:
            where = f"places it in {placed!r}" if placed is not None else "does not list it"
            raise SafetensorsError(
                f"{shard.url}: tensor {t.key!r} is in this shard, but the weight_map of "
                f"{url} {where}; a tensor must be in exactly one shard, the one the index names"
            )
    held = {t.key for t in shard.tensors}
    missing = sorted(k for k, n in weight_map.items() if n == name and k not in held)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SafetensorsError(
            f"{url}: weight_map places {missing[0]!r}{more} in {name!r}, whose header "
            f"({shard.url}) does not hold it"
        )


def _json(raw: bytes, what: str, url: str, max_bytes: int) -> Any:
    """Bounded JSON (:func:`~objckpt.format.bounds.load_json`), refused as safetensors."""
    try:
        return load_json(raw, what=what, url=url, max_bytes=max_bytes)
    except SafetensorsError:
        raise
    except ManifestError as exc:
        raise SafetensorsError(str(exc)) from exc


def _size(store: ObjectStore, key: str) -> int:
    try:
        return store.head(key).size
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{store.location.url_of(key)} does not exist") from exc


def _read(store: ObjectStore, key: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the file, all of them or an error naming it."""
    url = store.location.url_of(key)
    try:
        data = store.read_range(key, start, end)
    except ObjckptError:
        raise
    except Exception as exc:
        raise translate(exc, url=url, action="reading") from exc
    if len(data) != end - start:
        raise SafetensorsError(
            f"{url}: bytes {start}-{end} read as {len(data)} bytes; the file is shorter "
            "than its header says, or changed while it was read"
        )
    return bytes(data)


def _brief(value: object) -> str:
    """``repr`` of a value from the file, cut short for a message."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:197]}..."
