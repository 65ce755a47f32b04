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
from typing import IO, cast

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from objckpt._torch import save_tensor, tensor_frame
from objckpt.dcp.plan import ObjectPlan
from objckpt.errors import StateDictError
from objckpt.format.dcp_json import StoredItem
from objckpt.format.payload import PayloadRecord, PayloadWriter, close_payload
from objckpt.writers.base import ObjectUpload
from objckpt.writers.checksum import BytesLike

__all__ = [
    "Framer",
    "PayloadRecord",
    "WrittenObject",
    "close_payload",
    "resolve_bytes_items",
    "resolve_entries",
    "serialized_tensor",
    "tensor_bytes",
    "unframe",
    "write_payload",
    "written_object",
]


@dataclasses.dataclass(frozen=True)
class _Placed:
    item: WriteItem
    offset: int
    length: int
    crc32c: str


@dataclasses.dataclass(frozen=True)
class WrittenObject:
    """A payload object handed to the store; ``done`` resolves once it is visible."""

    key: str
    size: int
    crc32c: str
    placed: tuple[_Placed, ...]
    done: concurrent.futures.Future[None]

    def write_results(self) -> list[WriteResult]:
        return [
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
                ),
            )
            for p in self.placed
        ]


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


def write_payload(
    upload: ObjectUpload,
    entries: Iterable[tuple[int, torch.Tensor | BytesLike]],
    framer: Framer | None = None,
) -> PayloadRecord:
    """Serialize ``entries`` (id, tensor or raw bytes) into ``upload``, in order.

    Tensors are stored as ``torch.save`` files (DCP's own payload format, so stock
    readers load them): a framed tensor as three writes (frame head, its bytes,
    frame tail), any other through ``torch.save`` itself. Bytes go as they are.
    The caller closes or aborts ``upload``.
    """
    framer = framer or Framer()
    out = PayloadWriter(upload)
    for ident, data in entries:
        if not isinstance(data, torch.Tensor):
            out.write_item(ident, (data,))
            continue
        t = _cpu_tensor(data)
        frame = framer.frame(t)
        if frame is not None:
            # Sent from the tensor's memory, no copy into part buffers: the caller
            # holds the state dict unchanged until the save returns (as with DCP's
            # own writers), and the view keeps ``t`` alive until the upload is done.
            out.write_item(ident, (frame[0], tensor_bytes(t), frame[1]), kept=True)
            continue
        out.begin_item(ident)
        try:
            save_tensor(t, cast(IO[bytes], out))
        except Exception as exc:
            if out.error is not None:
                raise out.error from exc
            raise
        out.end_item()
    return out.record()


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
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        value = state.get(item.index.fqn)
        if isinstance(value, torch.Tensor):
            _refuse_unwritable_tensor(item.index.fqn, value)


def _refuse_unwritable_tensor(fqn: str, data: torch.Tensor) -> None:
    if type(data) is not torch.Tensor and hasattr(data, "to_local"):
        data = data.to_local()  # a DTensor: its local shard is what is written
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
        _refuse_unwritable_tensor(item.index.fqn, data)
        yield pos, data


def written_object(
    obj: ObjectPlan,
    items: list[WriteItem],
    record: PayloadRecord,
    done: concurrent.futures.Future[None],
) -> WrittenObject:
    """Pair a payload record with the write items it placed."""
    placed = tuple(
        _Placed(items[ident], off, length, crc) for ident, off, length, crc in record.places
    )
    return WrittenObject(obj.key, record.size, record.crc32c, placed, done)
