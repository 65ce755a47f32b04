"""A save planner that splits large replicated tensors so the replicas share their upload.

DCP already writes a replicated item once: ``dedup_save_plans`` keeps each
``MetadataIndex`` in one rank's plan, choosing the rank with the least planned
bytes. But it keeps a 1 GiB replicated embedding whole, so one rank uploads it
while its replicas idle. Here each rank cuts every large replicated chunk into row
slices of at least ``slice_bytes`` (one multipart part or more) before planning,
identically on every replica, so DCP's dedup hands the slices out across the
replicas and each uploads a share. The slices are ordinary DCP chunks: stock
readers and resharded loads assemble them like any sharded tensor.

Which chunks are replicated: plain tensors in a process group (DDP keeps a full
copy per rank) and DTensors with a ``Replicate`` placement (fully replicated, or
HSDP's replica dimension). Sharded chunks are left whole: no other rank holds them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from objckpt._torch import local_offsets
from objckpt.errors import ConfigurationError

__all__ = ["ReplicaSlicingPlanner", "split_rows"]


def split_rows(rows: int, row_bytes: int, slice_bytes: int, replicas: int) -> list[tuple[int, int]]:
    """Row ranges ``(start, count)`` cutting ``rows`` into at most ``replicas`` slices of
    at least ``slice_bytes`` each (one range: not worth splitting)."""
    total = rows * row_bytes
    pieces = min(replicas, rows, total // max(slice_bytes, 1))
    if pieces < 2:
        return [(0, rows)]
    base, extra = divmod(rows, pieces)
    out, start = [], 0
    for n in range(pieces):
        count = base + (1 if n < extra else 0)
        out.append((start, count))
        start += count
    return out


def _is_replicated(value: Any, distributed: bool) -> bool:
    placements = getattr(value, "placements", None)
    if placements is not None:  # DTensor
        from torch.distributed.tensor import Replicate

        return any(isinstance(p, Replicate) for p in placements)
    return distributed and isinstance(value, torch.Tensor)


class ReplicaSlicingPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that row-slices large replicated chunks (see module doc).

    Args:
        replicas: How many ranks may share a replicated chunk's upload (the world
            size; slices beyond the true replica count just land on fewer ranks).
        slice_bytes: Smallest slice; below twice this a chunk stays whole.
    """

    def __init__(self, *, replicas: int, slice_bytes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if replicas < 1 or slice_bytes < 1:
            raise ConfigurationError(
                f"replicas={replicas!r} and slice_bytes={slice_bytes!r} must be >= 1"
            )
        self.replicas = replicas
        self.slice_bytes = slice_bytes

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if self.replicas < 2:
            return plan
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        items: list[WriteItem] = []
        for item in plan.items:
            value = self.state_dict.get(item.index.fqn)
            if item.type == WriteItemType.BYTE_IO or not _is_replicated(value, distributed):
                items.append(item)
                continue
            items.extend(self._slices(item))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _slices(self, item: WriteItem) -> list[WriteItem]:
        data = item.tensor_data
        if data is None or len(data.chunk.sizes) == 0:
            return [item]
        chunk = data.chunk
        rows = chunk.sizes[0]
        row_elems = 1
        for s in chunk.sizes[1:]:
            row_elems *= s
        row_bytes = row_elems * data.properties.dtype.itemsize
        ranges = split_rows(rows, row_bytes, self.slice_bytes, self.replicas)
        if len(ranges) == 1:
            return [item]
        out = []
        for start, count in ranges:
            offsets = torch.Size([chunk.offsets[0] + start, *chunk.offsets[1:]])
            sizes = torch.Size([count, *chunk.sizes[1:]])
            out.append(
                dataclasses.replace(
                    item,
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=dataclasses.replace(
                        data, chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes)
                    ),
                )
            )
        return out

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = write_item.tensor_data
        value = self.state_dict.get(write_item.index.fqn)
        if data is None or not isinstance(value, torch.Tensor):
            return super().resolve_data(write_item)
        local, base = _local_chunk(value)
        if tuple(data.chunk.offsets) == base and data.chunk.sizes == local.size():
            return super().resolve_data(write_item)
        # One of our slices: rows of this rank's full copy.
        view = local
        for dim, (off, size) in enumerate(zip(data.chunk.offsets, data.chunk.sizes, strict=True)):
            view = view.narrow(dim, off - base[dim], size)
        return view


def _local_chunk(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's tensor and its offsets in the global tensor."""
    if getattr(value, "placements", None) is None:
        return value, (0,) * value.dim()
    dtensor: Any = value
    return dtensor.to_local(), local_offsets(dtensor)
