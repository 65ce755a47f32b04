"""Assign one rank's write items to payload objects.

DCP's own writers put a rank's whole state into one file (or one per thread).
On an object store that serialises the upload behind one stream and makes every
ranged read pay for a huge object. objckpt packs small items together up to
``object_size`` and gives each large item its own object, so a save becomes many
moderate objects uploading in parallel, and the same objects stay cheap to read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

__all__ = ["ObjectPlan", "RankPlan", "assign_objects", "estimate_size"]

KeyFn = Callable[[int], str]

# torch.save's zip envelope around a tensor's bytes: headers, pickle, alignment.
_TENSOR_OVERHEAD = 1024
_BYTES_ESTIMATE = 4096


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    rank: int
    attempt: str


@dataclasses.dataclass(frozen=True)
class ObjectPlan:
    """One payload object: its key and the write items it holds, in order."""

    key: str
    items: tuple[WriteItem, ...]
    size_hint: int


def estimate_size(item: WriteItem) -> int:
    """Bytes an item will take in its object (exact for tensors up to the envelope)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return _BYTES_ESTIMATE
    numel = math.prod(item.tensor_data.size)
    itemsize = item.tensor_data.properties.dtype.itemsize
    return numel * itemsize + _TENSOR_OVERHEAD


def assign_objects(items: list[WriteItem], object_size: int, key_of: KeyFn) -> list[ObjectPlan]:
    """Pack ``items`` into objects of about ``object_size`` bytes.

    Items at least half an object big get their own object; the rest are packed
    in plan order (which keeps a module's tensors together) until the next one
    would overflow. Byte items go first so a state dict that cannot be
    serialized fails before any tensor bytes are uploaded.
    """
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    objects: list[ObjectPlan] = []
    current: list[WriteItem] = []
    current_size = 0

    def flush() -> None:
        nonlocal current, current_size
        if current:
            objects.append(ObjectPlan(key_of(len(objects)), tuple(current), current_size))
            current, current_size = [], 0

    for item in ordered:
        size = estimate_size(item)
        if size >= object_size // 2:
            objects.append(ObjectPlan(key_of(len(objects)), (item,), size))
            continue
        if current and current_size + size > object_size:
            flush()
        current.append(item)
        current_size += size
    flush()
    return objects
