"""Every private torch API objckpt uses, in one place, each with a fallback.

torch's checkpoint internals change between releases. Keeping each private name
behind one small function here means a torch upgrade breaks (at worst) this module,
and each function says what it falls back to when the private name is gone.
Tested on the torch the project pins (``constraints.txt``); ``pyproject.toml``'s
floor is the oldest release the suite has been run on.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

__all__ = [
    "group_store",
    "local_offsets",
    "narrow",
    "save_state_dict_fn",
    "save_tensor",
    "storage_info",
]


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's ``_StorageInfo`` (what stock readers expect in ``Metadata.storage_data``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """``tensor`` narrowed to ``lengths`` elements from ``offsets`` along each dimension."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def local_offsets(dtensor: Any) -> tuple[int, ...]:
    """Where a DTensor's local shard starts in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    return tuple(offsets)


def save_state_dict_fn() -> Callable[..., Any]:
    """DCP's save without the public entry point's per-call logging wrapper
    (``dcp.save`` logs ~0.1 ms per tensor); ``dcp.save`` itself when it is gone."""
    from torch.distributed.checkpoint import state_dict_saver

    inner = getattr(state_dict_saver, "_save_state_dict", None)
    if inner is None:
        import torch.distributed.checkpoint as dcp

        return dcp.save
    result: Callable[..., Any] = inner
    return result


def group_store(process_group: Any | None = None) -> Any:
    """The c10d store of ``process_group`` (the default group when None)."""
    from torch.distributed import distributed_c10d as c10d

    if process_group is None:
        return c10d._get_default_store()
    return c10d._get_process_group_store(process_group)


def save_tensor(tensor: torch.Tensor, stream: IO[bytes]) -> None:
    """``torch.save(tensor, stream)`` without the zip container's CRC32.

    objckpt checksums every item and object with CRC32C already; torch's CRC32 would
    be a second pass over every byte (~0.3 CPU s/GiB), and ``torch.load`` reads
    records without one. ``torch.serialization.set_crc32_options`` would do the same
    process-wide, which objckpt must not change in a training process, so the zip
    writer is built here with it off. Plain ``torch.save`` when the internals differ.
    """
    serialization = torch.serialization
    writer_cls = getattr(torch._C, "PyTorchFileWriter", None)
    save = getattr(serialization, "_save", None)
    alignment = getattr(serialization, "_get_storage_alignment", None)
    if writer_cls is None or save is None or alignment is None:
        torch.save(tensor, stream)
        return
    try:
        writer = writer_cls(stream, False, alignment())
    except TypeError:  # another constructor signature
        torch.save(tensor, stream)
        return
    save(tensor, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    stream.flush()


def load_everything(storage_reader: Any) -> dict[str, Any]:
    """Every entry of a checkpoint, nested as saved, without a template state dict,
    loaded in this process alone (``no_dist``).

    ``dcp.load`` fills only the keys its argument already has; DCP's own way to load
    without one is private (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``,
    which ``_load_state_dict_from_keys`` wraps, deciding ``no_dist`` by itself).
    """
    from torch.distributed.checkpoint import default_planner, state_dict_loader

    load = getattr(state_dict_loader, "_load_state_dict", None)
    planner_cls = getattr(default_planner, "_EmptyStateDictLoadPlanner", None)
    if load is None or planner_cls is None:  # pragma: no cover - other torch versions
        return dict(state_dict_loader._load_state_dict_from_keys(storage_reader=storage_reader))
    state: dict[str, Any] = {}
    load(
        state_dict=state,
        storage_reader=storage_reader,
        planner=planner_cls(),
        no_dist=True,
    )
    return state
