"""Serialize write items into one payload object, checksumming on the way.

Each tensor is written with ``torch.save`` exactly as DCP's own writers do, so a
stock ``FileSystemReader``/``FsspecReader`` can load an objckpt checkpoint.
``torch.save`` streams into a sink that feeds the store's upload directly and
updates two CRC32Cs (the item's and the object's) on the same bytes, so there is
no second pass and no whole-object buffer unless the store family needs one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
from collections.abc import Iterable, Iterator
from typing import IO, cast

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from objckpt._torch import save_tensor
from objckpt.dcp.plan import ObjectPlan
from objckpt.errors import StateDictError
from objckpt.format.dcp_json import StoredItem
from objckpt.writers.accounting import RequestStats
from objckpt.writers.base import ObjectUpload
from objckpt.writers.checksum import BytesLike, Crc32c

__all__ = [
    "PayloadRecord",
    "WrittenObject",
    "close_payload",
    "resolve_bytes_items",
    "resolve_entries",
    "write_payload",
    "written_object",
]


class _Sink:
    """The file-like ``torch.save`` writes into."""

    def __init__(self, upload: ObjectUpload) -> None:
        self.upload = upload
        self.pos = 0
        self.object_crc = Crc32c()
        self.item_crc = Crc32c()
        # An upload that checksums its parts knows the object's CRC32C already.
        self.own_crc = not upload.tracks_crc32c
        #: The store's error, kept because torch.save replaces it with its own
        #: ("unexpected pos ...") that names neither the object nor the cause.
        self.error: BaseException | None = None

    def write(self, data: BytesLike) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if self.own_crc:
            self.object_crc.update(view)
        try:
            crc = self.upload.write(view)
        except BaseException as exc:
            self.error = exc
            raise
        self.item_crc.feed(view, crc)
        self.pos += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        return None

    def tell(self) -> int:
        return self.pos


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


@dataclasses.dataclass(frozen=True)
class PayloadRecord:
    """What writing one payload object produced: its size, CRC32C and item places."""

    size: int
    crc32c: str
    places: tuple[tuple[int, int, int, str], ...]  # (item id, offset, length, crc32c)
    #: Store requests the upload made (set by the upload worker that made them).
    requests: RequestStats = dataclasses.field(default_factory=RequestStats)


def write_payload(
    upload: ObjectUpload, entries: Iterable[tuple[int, torch.Tensor | BytesLike]]
) -> PayloadRecord:
    """Serialize ``entries`` (id, tensor or raw bytes) into ``upload``, in order.

    Tensors are written with ``torch.save`` (DCP's own payload format); bytes as
    they are. Used by the synchronous writer and by the upload workers alike. The
    caller closes or aborts ``upload``.
    """
    sink = _Sink(upload)
    places = []
    for ident, data in entries:
        start = sink.pos
        sink.item_crc = Crc32c()
        if isinstance(data, torch.Tensor):
            try:
                save_tensor(_cpu_tensor(data), cast(IO[bytes], sink))
            except Exception as exc:
                if sink.error is not None:
                    raise sink.error from exc
                raise
        else:
            sink.write(data)
        places.append((ident, start, sink.pos - start, sink.item_crc.hexdigest()))
    crc = sink.object_crc.hexdigest() if sink.own_crc else ""  # set by close_payload
    return PayloadRecord(sink.pos, crc, tuple(places))


def close_payload(
    upload: ObjectUpload, record: PayloadRecord
) -> tuple[PayloadRecord, concurrent.futures.Future[None]]:
    """Close ``upload``; the record completed with the object CRC32C the upload
    computed itself, when it did (see ``ObjectUpload.tracks_crc32c``)."""
    done = upload.close()
    if upload.tracks_crc32c:
        if upload.crc32c is None:
            raise StateDictError(f"internal: {upload.key} closed without its CRC32C")
        record = dataclasses.replace(record, crc32c=upload.crc32c)
    return record, done


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
