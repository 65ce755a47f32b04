"""Export a committed checkpoint to Hugging Face safetensors, store to store (and back).

Export reads the checkpoint's metadata, picks the tensors, cuts them into shards in
key order as ``save_pretrained`` does, and streams each shard to the destination
(:func:`write_shards`); the index (``model.safetensors.index.json``) is
written last and create-only, naming shard files that carry the export's attempt id
(:mod:`objckpt.ops.convert.safetensors_format`). An export that stopped half-way, or lost a
race with another export to the same destination, leaves no index of its own, and
deletes the shards it wrote: nothing that reads the index mistakes it for a complete
one, and no committed index ever names bytes another attempt wrote.

Import is the way back: a safetensors directory (sharded or ``model.safetensors``)
saved as a committed DCP checkpoint. Its source is untrusted input, checked whole
before anything is read or written (:mod:`objckpt.ops.convert.safetensors_format`), then
read a tensor at a time as the writer asks for each.

**Writing one export** (:func:`write_shards`, :func:`commit_index`): shards streamed
from a checkpoint, then the commit.

Why a streaming writer and not ``safetensors.torch.save_file``: that needs every
tensor of a shard in memory and a local file. The checkpoint's metadata gives every
tensor's dtype and shape up front, so each shard's header is written first and the
tensors are streamed after it into one multipart upload, a few tensors at a time
(read with ranged GETs and consolidated from however many ranks' shards by DCP's
own load). Memory stays at ``max_batch_bytes`` plus the parts in flight; no local
temp copy.

The commit is the checkpoints' protocol applied to an export: every shard is named
with the export's attempt id, and the index is written last with a create-only PUT.
Whatever does not end in this attempt's committed index is deleted by this attempt:
the shards it wrote when a shard fails, and all of them when another export
committed first. A create-only PUT that meets an existing index, or whose answer is
lost, is settled by reading the index back: this attempt's id means the export
committed (a retried PUT met its own write), and its shards stay.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem

from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.dcp.torch_errors import unwrap
from objckpt.errors import CheckpointExistsError, ConfigurationError
from objckpt.format.layout import new_attempt_id
from objckpt.format.settle import create_settled
from objckpt.ops.convert.safetensors_format import (
    DTYPES,
    INDEX_NAME,
    MAX_HEADER_BYTES,
    Entry,
    Shard,
    Stored,
    encode_header,
    index_attempt,
    index_document,
    read_source,
    read_tensor,
    shard_name,
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
) -> list[Entry]:
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
        if target not in DTYPES:
            raise ConfigurationError(
                f"{key!r} in {reader.location.url} has dtype {target}, which safetensors "
                "cannot store"
            )
        out.append(Entry(key, tuple(item.size), target, source))
    if not out:
        wanted = f" matching {list(keys)}" if keys else ""
        raise ConfigurationError(f"no tensors{wanted} in {reader.location.url}")
    return out


def _shards(entries: list[Entry], shard_size: int) -> list[list[Entry]]:
    """Tensors in key order, cut into shards of at most ``shard_size`` bytes (a larger
    tensor gets a shard of its own), as Hugging Face's ``save_pretrained`` does."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


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

    The shards are named ``model-0000i-of-0000N.<attempt>.safetensors`` and the index,
    ``model.safetensors.index.json``, is written last and create-only (one shard is
    still indexed: Hugging Face loaders read a one-entry index as any other). An
    export that fails, or that another export to ``dest_url`` beats to the commit,
    deletes the shards it wrote.

    Raises:
        CheckpointExistsError: ``dest_url`` already holds an export's index, or another
            export committed there while this one ran (its index URL is named).
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
        # Read here alone, whatever the process group; committed checkpoints only.
        read=ReadOptions(allow_stock=False, broadcast=False),
        retry=retry,
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
        attempt = new_attempt_id()
        named = [(shard_name(n, len(shards), attempt), s) for n, s in enumerate(shards, 1)]
        files = write_shards(
            store,
            reader,
            named,
            max_batch_bytes,
            (lambda n: progress(n, total)) if progress is not None else None,
        )
        index = index_document(
            total_size=total,
            weight_map={e.key: name for name, shard in named for e in shard},
            source=reader.location.url,
            attempt=attempt,
            crc32c={f: c for f, _, c in files},
        )
        commit_index(store, index, attempt, [f for f, _, _ in files])
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


def import_safetensors(
    src_url: str,
    step_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    keys: Sequence[str] | None = None,
    retry: RetryPolicy | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> int:
    """Write the safetensors checkpoint at ``src_url`` (a directory with
    ``model.safetensors.index.json`` or ``model.safetensors``, or one ``.safetensors``
    file) as a committed DCP checkpoint at ``step_url``, which a sharded job of any
    world size loads (DCP reshards whole tensors on load). Returns the tensor count.

    The source is untrusted input: the index and every header are checked before
    anything is read or written (:mod:`objckpt.ops.convert.safetensors_format`), then each
    tensor is read with one ranged GET as the writer asks for it, so memory holds
    about one tensor at a time (plus the writer's part buffers), not the model.

    Args:
        storage_options: fsspec options for ``src_url``.
        dest_storage_options: For ``step_url`` (default: ``storage_options``).
        keys: Glob patterns (``"model.*"``); only matching tensors are imported.
        max_header_bytes: Most bytes of a header or index read (default and most:
            the format's own cap, 100,000,000).

    Raises:
        SafetensorsError: A malformed index or header (a shard name outside the
            source, byte ranges that overlap, leave gaps or run past the file, a
            shape or dtype the format does not allow); the message names the file.
            Nothing is written at ``step_url``.
        CheckpointNotFoundError: No safetensors export at ``src_url``.
        CheckpointExistsError: ``step_url`` holds a committed checkpoint.
        ConfigurationError: No tensor matches ``keys``; a bad option.
        StoreError: Reading or writing failed (nothing is committed then).
    """
    src = Location.parse(src_url, storage_options, retry)
    shards = read_source(src, max_header_bytes=max_header_bytes)
    chosen = {
        t.key: (shard, t)
        for shard in shards
        for t in shard.tensors
        if not keys or any(fnmatch.fnmatchcase(t.key, p) for p in keys)
    }
    if not chosen:
        wanted = f" matching {list(keys)}" if keys else ""
        raise ConfigurationError(f"no tensors{wanted} in {src.url}")
    writer = ObjectStoreWriter(
        step_url,
        storage_options=storage_options if dest_storage_options is None else dest_storage_options,
        retry=retry,
    )
    planner = _SourcePlanner(chosen)
    try:
        dcp.save(planner.placeholders(), storage_writer=writer, planner=planner, no_dist=True)
    except BaseException as exc:
        inner = unwrap(exc)
        if inner is exc:
            raise
        raise inner from exc
    logger.info("imported %d tensors from %s into %s", len(chosen), src.url, writer.location.url)
    return len(chosen)


class _SourcePlanner(DefaultSavePlanner):
    """DCP's default save planner over placeholders, each tensor read from its shard
    only when the writer asks for it (:meth:`resolve_data`).

    ``dcp.save`` plans from a state dict's shapes and dtypes; handing it the real
    tensors would hold the whole model at once. A placeholder is one element
    broadcast to the tensor's shape (strided, not meta, so the writer's checks pass)
    and is never read: the writer resolves every item through the planner.
    """

    def __init__(self, tensors: dict[str, tuple[Shard, Stored]]) -> None:
        super().__init__()
        self._tensors = tensors

    def placeholders(self) -> dict[str, torch.Tensor]:
        """What ``dcp.save`` plans from: each tensor's dtype and shape, no bytes."""
        return {
            key: torch.empty((), dtype=t.dtype).expand(t.shape)
            for key, (_, t) in self._tensors.items()
        }

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        shard, stored = self._tensors[write_item.index.fqn]
        return read_tensor(shard, stored)


# -- writing one export: shards, then the commit -----------------------------------------
def _batches(entries: list[Entry], limit: int) -> Iterator[list[Entry]]:
    batch: list[Entry] = []
    size = 0
    for e in entries:
        if batch and size + e.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch


def _load(reader: ObjectStoreReader, batch: list[Entry]) -> dict[str, torch.Tensor]:
    """The batch's tensors, whole, in their stored dtype (DCP consolidates the shards)."""
    state = {e.key: torch.empty(e.shape, dtype=e.source_dtype) for e in batch}
    dcp.load(
        state,
        storage_reader=reader,
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    return state


def _write_shard(
    store: ObjectStore,
    reader: ObjectStoreReader,
    name: str,
    shard: list[Entry],
    max_batch_bytes: int,
    progress: Callable[[int], None] | None,
) -> tuple[int, str]:
    header = encode_header(shard)
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


def write_shards(
    store: ObjectStore,
    reader: ObjectStoreReader,
    shards: Sequence[tuple[str, list[Entry]]],
    max_batch_bytes: int,
    progress: Callable[[int], None] | None,
) -> list[tuple[str, int, str]]:
    """Write each ``(name, entries)`` shard; returns (name, size, CRC32C) per shard.

    A failure deletes the shards already written (they are this attempt's alone, and
    no index will name them) before it is raised.
    """
    files: list[tuple[str, int, str]] = []
    try:
        for name, entries in shards:
            size, crc = _write_shard(store, reader, name, entries, max_batch_bytes, progress)
            files.append((name, size, crc))
    except BaseException:
        _discard(store, [f for f, _, _ in files])
        raise
    return files


def commit_index(
    store: ObjectStore, index: dict[str, Any], attempt: str, shards: Sequence[str]
) -> None:
    """Write the index create-only, settled by read-back: the export's commit, through
    the one create-then-settle every commit uses
    (:func:`~objckpt.format.settle.create_settled`).

    Raises:
        CheckpointExistsError: Another export committed the destination first (this
            attempt's ``shards`` are deleted before it is raised).
        StoreError: The index could not be written, and reading it back does not
            show it committed (the shards are deleted when no index is there; kept
            when the read-back failed too, the outcome then unknown).
    """
    try:
        create_settled(
            store,
            INDEX_NAME,
            json.dumps(index, indent=2).encode(),
            holder=_index_holder,
            lost=lambda: _discard(store, shards),
        )
    except CheckpointExistsError as exc:
        raise CheckpointExistsError(
            f"{exc}; this export (attempt {attempt}) wrote {len(shards)} shard(s), "
            "deleted again unless the index could not be read"
        ) from exc


def _index_holder(raw: bytes, url: str) -> str:
    """Who wrote the index ``raw``, for messages."""
    winner = index_attempt(raw)
    if winner == "unknown":
        return "another writer (an index without an objckpt attempt)"
    return f"another export (attempt {winner})"


def _discard(store: ObjectStore, names: Sequence[str]) -> None:
    """Delete this attempt's shards (no index names them); a failure is logged."""
    for name in names:
        try:
            store.delete(name)
        except Exception as exc:
            logger.warning(
                "could not delete %s, a shard of an export that did not commit: %s; "
                "delete it by hand",
                store.location.url_of(name),
                exc,
            )
