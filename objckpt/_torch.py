"""Every private torch API objckpt uses, in one place, each with a fallback.

torch's checkpoint internals change between releases. Keeping each private name
behind one small function here means a torch upgrade breaks (at worst) this module,
and each function says what it falls back to when the private name is gone: the
public equivalent where one exists, DCP's own (slower) path where objckpt only
speeds DCP up, and a refusal naming the releases that have it where a feature
cannot work without it (never a silent change of what is saved or loaded).
Every private name here exists on torch 2.9 through 2.15: CI runs the full suite on
the pinned release (``constraints.txt``) and a subset on the floor in
``pyproject.toml`` and on the newest release (``make test-torch TORCH=...``).
``tests/api/test_private_torch.py`` keeps every other module to public names.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any, cast

import torch

from objckpt.errors import ConfigurationError

__all__ = [
    "METADATA_PICKLE_PRIVATES",
    "STREAM_TRANSFORMS",
    "TESTED_RELEASES",
    "LoadPlanHelpers",
    "StreamTransformExtension",
    "collect_traversal_cycles",
    "group_store",
    "has_cpu_backend",
    "load_everything",
    "load_plan_helpers",
    "local_offsets",
    "narrow",
    "require_stream_transforms",
    "save_state_dict_fn",
    "save_tensor",
    "storage_info",
    "tensor_frame",
    "version_counters",
]

#: The releases every private name below has been run on (``make test-torch``), for
#: the refusals of features that cannot work without one.
TESTED_RELEASES = "torch 2.9 through 2.15"

try:  # DCP's stream transforms: experimental in DCP, hence the private module.
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    STREAM_TRANSFORMS = True
except ImportError:  # pragma: no cover - a torch without them

    class StreamTransformExtension:  # type: ignore[no-redef]
        """Stand-in base so objckpt's own transforms still import; ``_extensions``
        refuses (see :func:`require_stream_transforms`)."""

    STREAM_TRANSFORMS = False


#: The private torch names a stock DCP ``.metadata`` pickle refers to, as
#: ``(module, name)``: its items' ``_StorageInfo``, how memory formats and layouts
#: pickle. The unpickler of stock metadata (``objckpt.dcp.stock_metadata``) resolves
#: these beside DCP's public classes. Nothing to fall back to: a torch that renames
#: one writes pickles naming the new name, which that unpickler refuses with a
#: ``ManifestError`` naming the class (never resolving an unlisted one).
METADATA_PICKLE_PRIVATES: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch.layout values by name
    }
)


def require_stream_transforms(what: str) -> None:
    """Refuse ``what`` (a DCP stream-transform feature) on a torch without them.

    Raises:
        ConfigurationError: This torch has no ``torch.distributed.checkpoint._extension``.
    """
    if not STREAM_TRANSFORMS:  # pragma: no cover - a torch without them
        raise ConfigurationError(
            f"{what} needs DCP's stream transforms "
            f"(torch.distributed.checkpoint._extension), which torch {torch.__version__} "
            f"does not have; {TESTED_RELEASES} do"
        )


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
        fields = {f.name for f in dataclasses.fields(_StorageInfo)}
        if "transform_descriptors" not in fields:  # pragma: no cover - older torch
            raise ConfigurationError(
                f"an item stored with stream transforms {list(transform_descriptors)} "
                f"needs DCP's _StorageInfo.transform_descriptors, which torch "
                f"{torch.__version__} does not have; {TESTED_RELEASES} do"
            )
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


def has_cpu_backend(group: Any | None = None) -> bool:
    """Whether ``group`` (the default group when None) runs collectives on CPU tensors.

    A group answers for itself (``ProcessGroup._get_backend``); without that, its
    backend string does (``cpu:gloo,cuda:nccl``, or a name whose devices
    ``Backend.backend_capability`` lists).
    """
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    get_backend = getattr(pg, "_get_backend", None)
    if get_backend is not None:
        try:
            get_backend(torch.device("cpu"))
        except RuntimeError:
            return False
        return True
    name = str(dist.get_backend(pg))  # pragma: no cover - other torch versions
    if ":" in name:  # pragma: no cover
        return any(part.split(":")[0] == "cpu" for part in name.split(","))
    return "cpu" in dist.Backend.backend_capability.get(name, [])  # pragma: no cover


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


def version_counters(tensors: Sequence[torch.Tensor]) -> list[int] | None:
    """Each tensor's version counter (``Tensor._version``, bumped by every in-place
    op); None when one has none (inference tensors) or this torch hides them, and
    the caller then copies at once instead of trusting a promise it cannot check."""
    try:
        return [t._version for t in tensors]
    except (AttributeError, RuntimeError):
        return None


@dataclasses.dataclass(frozen=True)
class LoadPlanHelpers:
    """DCP's private pieces of ``create_default_local_load_plan``, so a planner can
    plan as DCP does while choosing which stored chunks to look at."""

    #: ``_create_read_items(fqn, md, obj)``: DCP's reads of one entry.
    create_read_items: Callable[..., list[Any]]
    #: ``_create_chunk_list(obj)``: the local chunks of a tensor, DTensor or ShardedTensor.
    create_chunk_list: Callable[[Any], list[Any]]
    #: ``_create_read_item_for_tensor(...)``: one tensor read.
    create_read_item_for_tensor: Callable[..., Any]
    #: ``_shards_get_overlap_region_wrt_saved_tensor(saved_shard=, current_shard=)``.
    overlap_region: Callable[..., list[tuple[int, int, int, int]]]
    #: The state dict flattened as torch 2.3 did (DefaultLoadPlanner's way to load a
    #: checkpoint saved before torch 2.4).
    flatten_as_torch_2_3: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]]


def load_plan_helpers() -> LoadPlanHelpers | None:
    """DCP's load-planning helpers; None when one is gone, and the caller then plans
    with ``DefaultLoadPlanner``'s own code (the same plans, found more slowly)."""
    try:
        from torch.distributed.checkpoint import _version
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.planner_helpers import (
            _create_chunk_list,
            _create_read_item_for_tensor,
            _create_read_items,
        )
        from torch.distributed.checkpoint.resharding import (
            _shards_get_overlap_region_wrt_saved_tensor,
        )
    except ImportError:  # pragma: no cover - other torch versions
        return None
    if not hasattr(_version, "_derived_version"):  # pragma: no cover
        return None

    def flatten_as_torch_2_3(state_dict: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        _version._derived_version = "2_3"
        try:
            return flatten_state_dict(state_dict)
        finally:
            _version._derived_version = None

    return LoadPlanHelpers(
        create_read_items=_create_read_items,
        create_chunk_list=_create_chunk_list,
        create_read_item_for_tensor=_create_read_item_for_tensor,
        overlap_region=_shards_get_overlap_region_wrt_saved_tensor,
        flatten_as_torch_2_3=flatten_as_torch_2_3,
    )


def collect_traversal_cycles() -> bool:
    """Collect now, on a torch whose state-dict traversal leaves a reference cycle;
    whether it did.

    DCP flattens every save's state dict with ``traverse_state_dict``, whose
    recursive inner function refers to itself: until torch deleted it after use
    (pytorch#170431; torch 2.9 has the cycle, 2.13 does not), each flattened dict of
    staged views stays reachable from that cycle until Python's next collection, and
    a closed checkpointer's staging segments stay mapped. One traversal of a
    one-entry dict tells (does the cycle keep its visitor?); only then is the
    collection paid.
    """
    try:
        from torch.distributed.checkpoint._traverse import traverse_state_dict
    except ImportError:  # pragma: no cover - other torch versions: cannot tell
        gc.collect()
        return True

    def visit(path: Any, value: Any) -> None:
        return None

    before = sys.getrefcount(visit)
    traverse_state_dict({"probe": 0}, visit)
    if sys.getrefcount(visit) == before:
        return False
    gc.collect()
    return True
