"""Serialize write items into one payload object, checksumming on the way.

Each tensor is stored as the file ``torch.save`` writes, exactly as DCP's own
writers do, so a stock ``FileSystemReader``/``FsspecReader`` can load an objckpt
checkpoint. The container around a tensor's bytes depends only on its dtype and
shape, so it is built once per (dtype, shape) (:class:`Framer`) and each tensor
goes out as frame head, its raw bytes, frame tail, straight into the store's
upload (:class:`~objckpt.format.payload.PayloadWriter`), hashed once, with no
whole-object buffer unless the store family needs one.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import io
import math
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from objckpt._torch import save_tensor, tensor_frame
from objckpt.dcp.plan import ObjectPlan
from objckpt.errors import StateDictError
from objckpt.format.dcp_json import StoredItem
from objckpt.format.payload import PayloadRecord, close_payload
from objckpt.format.reused import BaseItem
from objckpt.writers.checksum import BytesLike

__all__ = [
    "Framer",
    "PayloadRecord",
    "WrittenObject",
    "close_payload",
    "resolve_bytes_items",
    "resolve_entries",
    "serialized_tensor",
    "stored_chunks",
    "tensor_bytes",
    "unframe",
    "with_transforms",
    "written_object",
]


@dataclasses.dataclass(frozen=True)
class _Placed:
    item: WriteItem
    offset: int
    length: int
    crc32c: str
    xxh3: str


@dataclasses.dataclass(frozen=True)
class WrittenObject:
    """A payload object handed to the store; ``done`` resolves once it is visible."""

    key: str
    size: int
    crc32c: str
    placed: tuple[_Placed, ...]
    done: concurrent.futures.Future[None]
    #: Items not written because the base step stores the same bytes.
    reused: tuple[tuple[WriteItem, BaseItem], ...] = ()
    #: (item, descriptors, length before them) of items stored transformed.
    transforms: tuple[tuple[WriteItem, tuple[str, ...], int], ...] = ()

    def write_results(self) -> list[WriteResult]:
        results = [
            WriteResult(
                index=p.item.index,
                size_in_bytes=p.length,
                storage_data=StoredItem(
                    relative_path=self.key,
                    offset=p.offset,
                    length=p.length,
                    crc32c=p.crc32c,
                    object_size=self.size,
                    object_crc32c=self.crc32c,
                    xxh3=p.xxh3,
                ),
            )
            for p in self.placed
        ]
        results.extend(
            WriteResult(
                index=item.index,
                size_in_bytes=base.length,
                storage_data=StoredItem(
                    relative_path=base.key,
                    offset=base.offset,
                    length=base.length,
                    crc32c=base.crc32c,
                    object_size=base.object_size,
                    object_crc32c=base.object_crc32c,
                    xxh3=base.xxh3,
                ),
            )
            for item, base in self.reused
        )
        return with_transforms(results, self.transforms)


def _cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its elements.

    ``torch.save`` writes a view's whole storage, so views of larger tensors are
    cloned first (as DCP's own writer does).
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def resolve_bytes_items(items: list[WriteItem], planner: SavePlanner) -> dict[int, io.BytesIO]:
    """Serialize every non-tensor entry up front, so a bad one fails before any upload.

    Raises:
        StateDictError: An entry cannot be pickled; the message names its key.
    """
    out: dict[int, io.BytesIO] = {}
    for n, item in enumerate(items):
        if item.type != WriteItemType.BYTE_IO:
            continue
        try:
            data = planner.resolve_data(item)
        except Exception as exc:
            raise StateDictError(
                f"state-dict entry {item.index.fqn!r} cannot be serialized "
                f"({type(exc).__name__}: {exc}); store tensors, or picklable plain values"
            ) from exc
        if not isinstance(data, io.BytesIO):
            raise StateDictError(
                f"planner returned {type(data).__name__} for bytes entry {item.index.fqn!r}"
            )
        out[n] = data
    return out


class Framer:
    """Tensor frames (:func:`objckpt._torch.tensor_frame`) by dtype and shape.

    A state dict has few distinct shapes (a transformer's layers repeat), so a
    writer that keeps one framer builds each frame once and then serializes every
    tensor as head + raw bytes + tail. Bounded, oldest dropped first.
    """

    def __init__(self, max_frames: int = 4096) -> None:
        self._frames: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, bytes] | None] = {}
        self._max = max_frames
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type[Framer], tuple[int]]:
        return Framer, (self._max,)  # a copy in another process starts empty

    def frame(self, tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
        """The frame of ``tensor`` saved as a contiguous CPU tensor of its own, or
        None when its kind cannot be framed (sparse, quantized, subclasses,
        conjugate/negative views): then ``torch.save`` serializes it."""
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            return None
        return self.frame_for(tensor.dtype, tuple(tensor.shape))

    def frame_for(self, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
        """The frame of a plain contiguous tensor of ``dtype`` and ``shape``."""
        key = (dtype, shape)
        with self._lock:
            if key in self._frames:
                return self._frames[key]
        frame = tensor_frame(*key)
        with self._lock:
            if len(self._frames) >= self._max:
                self._frames.pop(next(iter(self._frames)))
            self._frames[key] = frame
        return frame


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16
    included). The view keeps ``tensor`` alive, so an upload may send from it after
    the caller has let the tensor go (e.g. a contiguous copy made for the save)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    raw = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    raw.owner = tensor  # type: ignore[attr-defined]  # the view's buffer holds `raw`
    return memoryview(raw).cast("B")


def unframe(
    data: memoryview, frame: tuple[bytes, bytes] | None, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The tensor in ``data`` without ``torch.load``, when ``data`` is exactly
    ``frame``'s head, the raw bytes of a ``dtype``/``shape`` tensor, and its tail (as
    objckpt's writers frame it, and as this torch's ``torch.save`` writes it). A
    view of ``data`` (read-only: copy out of it); None when anything differs — then
    the caller runs ``torch.load``, which knows every other layout.

    Nothing is unpickled here: the head that would be unpickled is compared byte for
    byte with one this process built from ``dtype`` and ``shape``.
    """
    if frame is None:
        return None
    head, tail = frame
    nbytes = math.prod(shape) * dtype.itemsize
    if len(data) != len(head) + nbytes + len(tail):
        return None
    if data[: len(head)] != head or data[len(head) + nbytes :] != tail:
        return None
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": only read
        flat = torch.frombuffer(data[len(head) : len(head) + nbytes], dtype=dtype)
    return flat.view(shape)


def serialized_tensor(tensor: torch.Tensor, framer: Framer) -> bytes:
    """``tensor`` as the bytes DCP's writers store (for a worker that gets bytes)."""
    t = _cpu_tensor(tensor)
    frame = framer.frame(t)
    if frame is None:
        buf = io.BytesIO()
        save_tensor(t, buf)
        return buf.getvalue()
    return frame[0] + bytes(tensor_bytes(t)) + frame[1]


def stored_chunks(
    data: torch.Tensor | BytesLike, framer: Framer
) -> tuple[tuple[BytesLike, ...], bool]:
    """An entry's stored bytes as chunks, and whether they are the caller's memory
    kept unchanged until the upload ends (a framed tensor) rather than a copy."""
    if not isinstance(data, torch.Tensor):
        return (data,), False
    t = _cpu_tensor(data)
    frame = framer.frame(t)
    if frame is not None:
        return (frame[0], tensor_bytes(t), frame[1]), True
    buf = io.BytesIO()
    save_tensor(t, buf)
    return (buf.getbuffer(),), False


def refuse_unwritable(items: list[WriteItem], planner: SavePlanner) -> None:
    """Refuse, before any upload, a tensor entry no payload can hold: a sparse or
    other non-strided layout, or a meta tensor (no data); the message names its key,
    as the async path's staging does.

    Looks the entries up in the planner's (flattened) state dict rather than
    resolving them, so a planner whose ``resolve_data`` does work is not asked
    twice; a planner without one is checked item by item as it is written
    (:func:`resolve_entries`).

    Raises:
        StateDictError: Such an entry; the message names its key.
    """
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        return
    checked: set[str] = set()  # a ShardedTensor's entry has one item per local shard
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or fqn in checked:
            continue
        checked.add(fqn)
        value = state.get(fqn)
        if isinstance(value, torch.Tensor):
            for local in _local_tensors(value):
                _refuse_unwritable_tensor(fqn, local)


def _local_tensors(value: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors this rank writes for a state-dict entry.

    A wrapper's own ``layout``/``is_meta`` are not the written data's: a DTensor's
    describe its local shard only through ``to_local()``, and a ShardedTensor's
    ``is_meta`` raises ``NotImplementedError`` when the rank holds more than one
    local shard (which DCP saves, one item per shard), so each shard is asked.
    """
    local_shards = getattr(value, "local_shards", None)
    if callable(local_shards):  # a ShardedTensor
        return [shard.tensor for shard in local_shards()]
    if type(value) is not torch.Tensor and hasattr(value, "to_local"):  # a DTensor
        return [value.to_local()]
    return [value]


def _refuse_unwritable_tensor(fqn: str, data: torch.Tensor) -> None:
    if data.layout != torch.strided:
        raise StateDictError(
            f"state-dict entry {fqn!r} is a {data.layout} tensor, which objckpt cannot "
            "save; convert it (e.g. .to_dense()) before saving"
        )
    if data.is_meta:
        raise StateDictError(
            f"state-dict entry {fqn!r} is a meta tensor (it has no data); "
            "materialize it before saving"
        )


def resolve_entries(
    obj: ObjectPlan, planner: SavePlanner, resolved: dict[int, io.BytesIO], position: dict[int, int]
) -> Iterator[tuple[int, torch.Tensor | BytesLike]]:
    """The (plan position, data) pairs of ``obj``, resolved lazily through the planner."""
    for item in obj.items:
        pos = position[id(item)]
        if item.type == WriteItemType.BYTE_IO:
            yield pos, resolved[pos].getbuffer()
            continue
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise StateDictError(
                f"entry {item.index.fqn!r} was planned as a tensor but is {type(data).__name__}"
            )
        for local in _local_tensors(data):
            _refuse_unwritable_tensor(item.index.fqn, local)
        yield pos, data


def written_object(
    obj: ObjectPlan,
    items: list[WriteItem],
    record: PayloadRecord,
    done: concurrent.futures.Future[None],
) -> WrittenObject:
    """Pair a payload record with the write items it placed (and those it reused)."""
    placed = tuple(
        _Placed(items[ident], off, length, crc, digest)
        for ident, off, length, crc, digest in record.places
    )
    reused = tuple((items[ident], base) for ident, base in record.reused)
    transforms = tuple((items[ident], desc, raw) for ident, desc, raw in record.transforms)
    return WrittenObject(obj.key, record.size, record.crc32c, placed, done, reused, transforms)


def with_transforms(
    results: list[WriteResult], transforms: Iterable[tuple[WriteItem, tuple[str, ...], int]]
) -> list[WriteResult]:
    """``results`` with the stream transforms each item's stored bytes went through
    (the same for a reused item: equal stored bytes under equal options)."""
    applied = {item.index: (desc, raw) for item, desc, raw in transforms}
    if not applied:
        return results
    out = []
    for r in results:
        desc_raw = applied.get(r.index)
        if desc_raw is not None and isinstance(r.storage_data, StoredItem):
            data = dataclasses.replace(
                r.storage_data, transform_descriptors=desc_raw[0], raw_length=desc_raw[1]
            )
            r = dataclasses.replace(r, storage_data=data)
        out.append(r)
    return out
