"""Fetched bytes into DCP's planner: checked, decoded without running pickles, copied.

Every item is checked against its CRC32C before use (unless it came checked from
the local copy, or verification is off). Tensors objckpt wrote are framed
(:func:`~objckpt.dcp.serialize.unframe`) and read as a view of the fetched bytes:
no unpickling and no copy before the one into the target. Other tensors go
through ``torch.load(weights_only=True)``. DCP's planner runs a full ``torch.load``
on non-tensor values, so it is handed a re-pickling of what ``weights_only=True``
accepted, never the stored bytes, unless ``ReadOptions.trust_pickles``.

Fetching and copying overlap: the next batch is fetched while one is delivered.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from objckpt._torch import narrow
from objckpt.dcp.read_plan import Range
from objckpt.dcp.serialize import Framer, unframe
from objckpt.errors import ChecksumMismatchError, SizeMismatchError, StateDictError
from objckpt.format.bounds import FRAME_SLACK, MAX_INT, tensor_bytes
from objckpt.format.chunk_runs import chunk_of
from objckpt.format.compress import undo_transforms
from objckpt.format.dcp_json import StoredItem
from objckpt.format.ref_check import stored_where
from objckpt.options import ReadOptions
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location

__all__ = ["Delivery", "fetch_and_deliver"]

#: The most a transformed non-tensor value may decode to (its dtype and shape bound
#: nothing; a stock checkpoint does not even record its size before the transforms).
MAX_UNDECLARED = 1024**3


def fetch_and_deliver(
    batches: list[list[Range]],
    fetch: Callable[[list[Range]], list[bytes]],
    deliver: Callable[[Range, bytes], None],
) -> None:
    """Fetch and deliver ``batches`` in order, the next batch prefetched while one is
    delivered (so two batches at most are held at once)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-read") as prefetch:
        # Each fetch runs in a copy of this context, so its requests are counted.
        def submit(batch: list[Range]) -> concurrent.futures.Future[list[bytes]]:
            return prefetch.submit(contextvars.copy_context().run, fetch, batch)

        pending = submit(batches[0]) if batches else None
        for n in range(len(batches)):
            assert pending is not None
            buffers = pending.result()
            if n + 1 < len(batches):
                pending = submit(batches[n + 1])
            for rng, buf in zip(batches[n], buffers, strict=True):
                deliver(rng, buf)


class Delivery:
    """Copies fetched ranges into the planner's targets.

    Args:
        options: Whether to verify, and whether to trust pickles.
    """

    def __init__(self, options: ReadOptions, registry: Any | None = None) -> None:
        self.options = options
        #: DCP's ``ExtensionRegistry`` for stream transforms objckpt does not know.
        self.registry = registry
        #: Tensor frames, to read framed tensors without torch.load.
        self._framer = Framer()

    def deliver(
        self,
        rng: Range,
        buf: bytes | memoryview,
        planner: LoadPlanner,
        metadata: Metadata,
        location: Location,
    ) -> None:
        """Check each item ``rng`` serves and hand it to ``planner``.

        Args:
            rng: The range and the reads it serves.
            buf: The range's bytes.
            planner: DCP's load planner.
            metadata: The checkpoint's DCP metadata (stored chunks' dtypes and shapes).
            location: The checkpoint, for messages.

        Raises:
            ChecksumMismatchError: An item's CRC32C differs from the manifest's.
            StateDictError: A value is not plain, or a slice's shape is not the target's.
        """
        view = memoryview(buf)
        for req, item in rng.reads:
            data = view[item.offset - rng.start : item.offset - rng.start + item.length]
            if self.options.verify and item.crc32c is not None and not rng.verified:
                crc = Crc32c()
                crc.update(data)
                if crc.hexdigest() != item.crc32c:
                    raise ChecksumMismatchError(
                        f"{location.url_of(item.relative_path)}"
                        f"{stored_where(location, item.relative_path)}: "
                        f"CRC32C of {req.storage_index.fqn!r} "
                        f"(bytes {item.offset}-{item.offset + item.length}) is {crc.hexdigest()}, "
                        f"the manifest says {item.crc32c}; the object is corrupt"
                    )
            if item.transform_descriptors:
                data = self._decoded(data, req, item, metadata, location)
            if req.type == LoadItemType.BYTE_IO:
                value = self._plain_value(data, req.storage_index.fqn, item, location)
                planner.load_bytes(req, value)
                continue
            tensor = self._unframed(data, req, metadata)
            if tensor is None:
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            tensor = narrow(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise StateDictError(
                    f"{req.storage_index.fqn!r}: checkpoint slice has shape "
                    f"{tuple(tensor.size())}, "
                    f"the state dict expects {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    def _decoded(
        self,
        data: memoryview,
        req: ReadItem,
        item: StoredItem,
        metadata: Metadata,
        location: Location,
    ) -> memoryview:
        """The item's bytes before its stream transforms (decompressed), no longer
        than its recorded length before them, or, where none is recorded (a stock
        checkpoint), than its chunk's dtype and shape allow."""
        what = f"{location.url_of(item.relative_path)} item {req.storage_index.fqn!r}"
        declared, exact = item.raw_length, True
        if declared is not None and req.type == LoadItemType.BYTE_IO and declared > MAX_UNDECLARED:
            # A tensor's recorded size was checked against its shape; a value's
            # bounds nothing, so a bomb could claim any size.
            raise SizeMismatchError(
                f"{what} declares {declared} bytes before its transforms, more than the "
                f"{MAX_UNDECLARED} objckpt decodes for a non-tensor value; refused"
            )
        if declared is None:
            exact = False
            md = metadata.state_dict_metadata.get(req.storage_index.fqn)
            declared = MAX_UNDECLARED
            if isinstance(md, TensorStorageMetadata):
                chunk = chunk_of(md, req.storage_index)
                if chunk is not None:
                    need = tensor_bytes(md.properties.dtype, tuple(chunk.sizes), MAX_INT)
                    declared = need + FRAME_SLACK
        out = undo_transforms(
            data,
            item.transform_descriptors or (),
            declared,
            exact=exact,
            what=what,
            registry=self.registry,
        )
        return memoryview(out)

    def _plain_value(
        self, data: memoryview, fqn: str, item: StoredItem, location: Location
    ) -> io.BytesIO:
        """A non-tensor value, unpickled safely: DCP's planner runs full ``torch.load``
        on what it is given, so it is given a re-pickling of what
        ``weights_only=True`` accepted (plain values), never the stored bytes."""
        if self.options.trust_pickles:
            return io.BytesIO(data)
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise StateDictError(
                f"{location.url_of(item.relative_path)}: entry {fqn!r} is not a plain "
                f"value ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); objckpt "
                "never unpickles arbitrary objects. For a checkpoint you trust, load with "
                "ReadOptions(trust_pickles=True)"
            ) from exc
        out = io.BytesIO()
        torch.save(value, out)
        out.seek(0)
        return out

    def _unframed(self, data: memoryview, req: ReadItem, metadata: Metadata) -> torch.Tensor | None:
        """The stored chunk as a view of ``data`` when it is framed as objckpt writes
        tensors (:func:`~objckpt.dcp.serialize.unframe`): no unpickling, no copy."""
        md = metadata.state_dict_metadata.get(req.storage_index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return None
        # By position (one chunk built), not a map of the tensor's W chunks.
        chunk = chunk_of(md, req.storage_index)
        if chunk is None:
            return None
        dtype, shape = md.properties.dtype, tuple(chunk.sizes)
        return unframe(data, self._framer.frame_for(dtype, shape), dtype, shape)
