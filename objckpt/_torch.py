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
from typing import IO, Any, cast

import torch

__all__ = [
    "group_store",
    "local_offsets",
    "narrow",
    "save_state_dict_fn",
    "save_tensor",
    "storage_info",
    "tensor_frame",
]


def storage_info(
    relative_path: str,
    offset: int,
    length: int,
    transform_descriptors: Sequence[str] | None = None,
) -> Any:
    """DCP's ``_StorageInfo`` (what stock readers expect in ``Metadata.storage_data``),
    with the item's stream-transform descriptors when it has any (as DCP's writers
    leave the field out otherwise)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if transform_descriptors:
        return _StorageInfo(relative_path, offset, length, list(transform_descriptors))
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


class _FrameRecorder:
    """A file-like that keeps what ``torch.save`` writes and notes where, under
    ``skip_data``, it seeks over a storage's bytes instead of writing them."""

    def __init__(self) -> None:
        self.chunks: list[bytes | int] = []  # bytes written, or a skipped length
        self.pos = 0

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.chunks.append(chunk)
        self.pos += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1 and offset > 0:
            self.chunks.append(offset)
            self.pos += offset
        elif (whence, offset) not in ((0, self.pos), (1, 0)):
            raise OSError("tensor framing: unexpected seek")
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        return None


def tensor_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """The bytes ``torch.save`` writes around a contiguous tensor's data: ``head`` +
    the tensor's raw bytes + ``tail`` is a file ``torch.load`` reads as that tensor.

    The zip container, the pickle and the record alignment depend only on dtype and
    shape (the zip CRC32 is off, see :func:`save_tensor`), so one frame serves every
    tensor of that dtype and shape, and serializing a tensor is three writes instead
    of a pickling pass; and a process that holds only the bytes (an upload worker)
    needs no torch. Built with ``torch.serialization.skip_data`` over an uninitialized
    tensor (its pages are never touched). None when this torch cannot (the caller
    then runs ``torch.save`` itself).
    """
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is None:  # pragma: no cover - older torch
        return None
    recorder = _FrameRecorder()
    template = torch.empty(shape, dtype=dtype)
    nbytes = template.numel() * template.element_size()
    try:
        with skip_data():
            save_tensor(template, cast(IO[bytes], recorder))
    except (OSError, RuntimeError, TypeError):  # pragma: no cover - other torch versions
        return None
    skipped = [i for i, c in enumerate(recorder.chunks) if isinstance(c, int)]
    if nbytes == 0 and not skipped:
        head = b"".join(c for c in recorder.chunks if isinstance(c, bytes))
        return head, b""
    if len(skipped) != 1 or recorder.chunks[skipped[0]] != nbytes:
        return None  # not one data record of the tensor's size: do not guess
    at = skipped[0]
    head = b"".join(cast(list[bytes], recorder.chunks[:at]))
    tail = b"".join(cast(list[bytes], recorder.chunks[at + 1 :]))
    return head, tail


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
