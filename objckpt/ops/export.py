"""Export a committed checkpoint to Hugging Face safetensors, store to store (and back).

Why a streaming writer and not ``safetensors.torch.save_file``: that needs every
tensor of a shard in memory and a local file. A safetensors file is an 8-byte
header length, a JSON header naming each tensor's dtype, shape and byte range, then
the raw bytes; the checkpoint's metadata gives every tensor's dtype and shape up
front, so each shard's header is written first and the tensors are streamed after it
into one multipart upload, a few tensors at a time (read with ranged GETs and
consolidated from however many ranks' shards by DCP's own load). Memory stays at
``max_batch_bytes`` plus the parts in flight; no local temp copy.

The index (``model.safetensors.index.json``, Hugging Face's sharded layout) is written
last and create-only: an export that stopped half-way has shards but no index, and
nothing that reads the index mistakes it for a complete one.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    ManifestError,
)
from objckpt.options import ReadOptions, UploadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.retry import RetryPolicy

__all__ = [
    "INDEX_NAME",
    "ExportReport",
    "export_safetensors",
    "import_safetensors",
    "parse_size",
]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"

#: torch dtype -> safetensors dtype name (the format's own spelling).
_DTYPES: dict[torch.dtype, str] = {
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
_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5,000,000,000 (as Hugging Face's ``max_shard_size``); ints pass."""
    if isinstance(text, int):
        return text
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGIB")
    unit = raw[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigurationError(
            f"option shard_size={text!r} is invalid: expected bytes or e.g. '5GB', '500MiB'"
        ) from None
    if value < 1:
        raise ConfigurationError(f"option shard_size={text!r} is invalid: expected > 0 bytes")
    return int(value)


@dataclasses.dataclass(frozen=True)
class _Entry:
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


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What an export wrote.

    Attributes:
        dest: The destination URL (the index and shards are directly under it).
        files: Shard file names, in order, with their sizes and CRC32Cs.
        tensors: Number of tensors exported.
        total_size: Bytes of tensor data (the index's ``metadata.total_size``).
    """

    dest: str
    files: tuple[tuple[str, int, str], ...]
    tensors: int
    total_size: int


def _select(
    reader: ObjectStoreReader, keys: Sequence[str] | None, dtype: torch.dtype | None
) -> list[_Entry]:
    meta = reader.read_metadata().state_dict_metadata
    out = []
    for key in sorted(meta):
        item = meta[key]
        if not isinstance(item, TensorStorageMetadata):
            continue  # plain values (step counters, configs) have no safetensors form
        if keys and not any(fnmatch.fnmatchcase(key, pattern) for pattern in keys):
            continue
        source = item.properties.dtype
        target = dtype if dtype is not None and source.is_floating_point else source
        if target not in _DTYPES:
            raise ConfigurationError(
                f"{key!r} in {reader.location.url} has dtype {target}, which safetensors "
                "cannot store"
            )
        out.append(_Entry(key, tuple(item.size), target, source))
    if not out:
        wanted = f" matching {list(keys)}" if keys else ""
        raise ConfigurationError(f"no tensors{wanted} in {reader.location.url}")
    return out


def _shards(entries: list[_Entry], shard_size: int) -> list[list[_Entry]]:
    """Tensors in key order, cut into shards of at most ``shard_size`` bytes (a larger
    tensor gets a shard of its own), as Hugging Face's ``save_pretrained`` does."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _header(entries: list[_Entry]) -> bytes:
    """The shard's length-prefixed JSON header, padded so tensor data is 8-byte aligned."""
    fields: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for e in entries:
        fields[e.key] = {
            "dtype": _DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [at, at + e.nbytes],
        }
        at += e.nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _batches(entries: list[_Entry], limit: int) -> Iterator[list[_Entry]]:
    batch: list[_Entry] = []
    size = 0
    for e in entries:
        if batch and size + e.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch


def _load(reader: ObjectStoreReader, batch: list[_Entry]) -> dict[str, torch.Tensor]:
    """The batch's tensors, whole, in their stored dtype (DCP consolidates the shards)."""
    state = {e.key: torch.empty(e.shape, dtype=e.source_dtype) for e in batch}
    dcp.load(
        state,
        storage_reader=reader,
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    return state


def export_safetensors(
    step_url: str,
    dest_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    dtype: str | torch.dtype | None = None,
    keys: Sequence[str] | None = None,
    shard_size: int | str = "5GB",
    max_batch_bytes: int = 256 * 2**20,
    retry: RetryPolicy | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ExportReport:
    """Write the committed checkpoint at ``step_url`` as safetensors shards under ``dest_url``.

    Args:
        storage_options: fsspec options for ``step_url``.
        dest_storage_options: For ``dest_url`` (default: ``storage_options``).
        dtype: Convert floating-point tensors, e.g. ``"bf16"`` (others keep theirs).
        keys: Glob patterns (``"model.*"``); only matching tensors are read and written.
        shard_size: Most bytes per shard file (``"5GB"``, as Hugging Face's default).
        max_batch_bytes: Tensor bytes held in memory at once while streaming.
        progress: Called as tensors are written with (bytes just written, total bytes).

    Raises:
        CheckpointExistsError: ``dest_url`` already holds an export's index.
        ConfigurationError: A bad option, no matching tensor, an unstorable dtype.
        StoreError, IntegrityError: Reading or writing failed (nothing is indexed then).
    """
    target = _DTYPE_NAMES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and target is None:
        raise ConfigurationError(
            f"option dtype={dtype!r} is invalid: expected one of {sorted(_DTYPE_NAMES)}"
        )
    limit = parse_size(shard_size)
    reader = ObjectStoreReader(
        step_url,
        storage_options=storage_options,
        read=ReadOptions(),
        retry=retry,
        allow_stock=False,
    )
    entries = _select(reader, keys, target)
    shards = _shards(entries, limit)
    total = sum(e.nbytes for e in entries)
    dest = Location.parse(
        dest_url, storage_options if dest_storage_options is None else dest_storage_options, retry
    )
    store = open_store(dest, UploadOptions())
    try:
        if store.exists(INDEX_NAME):
            raise CheckpointExistsError(
                f"{dest.url_of(INDEX_NAME)} already exists: {dest.url} holds an export; "
                "choose another destination or delete it"
            )
        files = []
        weight_map: dict[str, str] = {}
        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            size, crc = _write_shard(
                store,
                reader,
                name,
                shard,
                max_batch_bytes,
                (lambda n: progress(n, total)) if progress is not None else None,
            )
            files.append((name, size, crc))
            weight_map.update({e.key: name for e in shard})
        index = {
            "metadata": {
                "total_size": total,
                "format": "pt",
                # Not read by transformers; lets a copy be checked without re-reading it.
                "objckpt": {"source": reader.location.url, "crc32c": {f: c for f, _, c in files}},
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        store.create(INDEX_NAME, json.dumps(index, indent=2).encode())
    finally:
        store.close()
    logger.info(
        "exported %d tensors (%d bytes) from %s to %s in %d shard(s)",
        len(entries),
        total,
        reader.location.url,
        dest.url,
        len(files),
    )
    return ExportReport(dest.url, tuple(files), len(entries), total)


def _write_shard(
    store: ObjectStore,
    reader: ObjectStoreReader,
    name: str,
    shard: list[_Entry],
    max_batch_bytes: int,
    progress: Callable[[int], None] | None,
) -> tuple[int, str]:
    header = _header(shard)
    size = len(header) + sum(e.nbytes for e in shard)
    upload = store.begin(name, size)
    crc = Crc32c()
    try:
        crc.feed(header, upload.write(header))
        for batch in _batches(shard, max_batch_bytes):
            tensors = _load(reader, batch)
            for e in batch:
                t = tensors.pop(e.key).to(e.dtype).contiguous().reshape(-1)
                data = t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
                crc.feed(data, upload.write(data))
                if progress is not None:
                    progress(e.nbytes)
        upload.close().result()
    except BaseException:
        upload.abort()
        raise
    return size, crc.hexdigest()


_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}


def _safetensors_files(fs: Any, base: str) -> list[str]:
    """The shard paths under ``base`` (its index names them), or ``base`` itself."""
    if base.endswith(".safetensors"):
        return [base]
    try:
        index = json.loads(fs.cat_file(f"{base}/{INDEX_NAME}"))
    except FileNotFoundError:
        single = f"{base}/model.safetensors"
        if fs.exists(single):
            return [single]
        raise CheckpointNotFoundError(
            f"no {INDEX_NAME} or model.safetensors under {base}: not a safetensors export"
        ) from None
    return [f"{base}/{name}" for name in sorted(set(index["weight_map"].values()))]


def _read_shard(fs: Any, path: str, url: str) -> dict[str, torch.Tensor]:
    """One shard's tensors: the header by a ranged read, each tensor's bytes by one more."""
    (length,) = struct.unpack("<Q", fs.cat_file(path, start=0, end=8))
    if length > 100 * 2**20:
        raise ManifestError(f"{url}: safetensors header of {length} bytes; not a safetensors file")
    header = json.loads(fs.cat_file(path, start=8, end=8 + length))
    header.pop("__metadata__", None)
    out = {}
    for key, field in header.items():
        dtype = _FROM_NAME.get(field["dtype"])
        if dtype is None:
            raise ConfigurationError(f"{url}: {key!r} has dtype {field['dtype']}, unsupported")
        begin, end = field["data_offsets"]
        if end > begin:
            data = bytearray(fs.cat_file(path, start=8 + length + begin, end=8 + length + end))
            flat = torch.frombuffer(data, dtype=torch.uint8)
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        out[key] = flat.view(dtype).reshape(field["shape"])
    return out


def import_safetensors(
    src_url: str,
    step_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    keys: Sequence[str] | None = None,
    retry: RetryPolicy | None = None,
) -> int:
    """Write the safetensors checkpoint at ``src_url`` (a directory with
    ``model.safetensors.index.json`` or ``model.safetensors``, or one ``.safetensors``
    file) as a committed DCP checkpoint at ``step_url``, which a sharded job of any
    world size loads (DCP reshards whole tensors on load). Returns the tensor count.

    The tensors are held in memory once (DCP saves a whole state dict at a time);
    reading takes one ranged GET per tensor.
    """
    src = Location.parse(src_url, storage_options, retry)
    fs = src.open_fs(fresh=True)
    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(fs, src.path.rstrip("/")):
        for key, tensor in _read_shard(fs, path, src.url).items():
            if keys and not any(fnmatch.fnmatchcase(key, p) for p in keys):
                continue
            state[key] = tensor
    if not state:
        wanted = f" matching {list(keys)}" if keys else ""
        raise ConfigurationError(f"no tensors{wanted} in {src.url}")
    writer = ObjectStoreWriter(
        step_url,
        storage_options=storage_options if dest_storage_options is None else dest_storage_options,
        retry=retry,
    )
    dcp.save(state, storage_writer=writer, no_dist=True)
    logger.info("imported %d tensors from %s into %s", len(state), src.url, writer.location.url)
    return len(state)
