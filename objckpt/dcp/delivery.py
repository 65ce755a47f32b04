"""Fetched bytes into DCP's planner: checked, decoded without running pickles, copied.

Every item is checked against its CRC32C before use (unless it came checked from
the local copy, or verification is off). Tensors objckpt wrote are framed
(:func:`~objckpt.dcp.serialize.unframe`) and read as a view of the fetched bytes:
no unpickling and no copy before the one into the target. Other tensors go
through ``torch.load(weights_only=True)``. DCP's planner runs a full ``torch.load``
on non-tensor values, so it is handed a re-pickling of what ``weights_only=True``
accepted, never the stored bytes, unless ``ReadOptions.trust_pickles``.

Fetching and copying overlap: the next batch is fetched while one is delivered.

**Bytes land where they belong.** Before a load's first fetch, :class:`LoadTargets`
resolves every tensor read's target once, where the planner is DCP's own (its
targets are views of the state dict, its commit a no-op); before each batch,
:meth:`Delivery.place` lays the range's bytes out (:class:`Placed`): a framed tensor
read whole into a plain CPU tensor of its dtype and shape, contiguous, whose memory
no other read of the load targets, gets its raw bytes written straight into that
memory as they arrive; frames, gaps and every other item go to scratch. Its CRC32C is then
computed over the frame and the target's memory (once per byte, as before) and
checked before the planner is told the tensor is loaded; its frame is compared
byte for byte as :func:`~objckpt.dcp.serialize.unframe` does, and an unexpected one
is reassembled and read the general way. The copy a load made from fetched bytes
into the target (one pass over every byte, page faults of the fetched buffer
included) is gone. A load that fails (a checksum, a store error) may leave targets
partly written, as any DCP load that raises part-way does.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextvars
import dataclasses
import io
import itertools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from objckpt._torch import narrow
from objckpt.dcp.read_plan import Range
from objckpt.dcp.serialize import Framer, unframe
from objckpt.dcp.serialize import tensor_bytes as memory_of
from objckpt.errors import ChecksumMismatchError, SizeMismatchError, StateDictError
from objckpt.format.bounds import FRAME_SLACK, MAX_INT, tensor_bytes
from objckpt.format.chunk_runs import chunk_of
from objckpt.format.compress import undo_transforms
from objckpt.format.dcp_json import StoredItem
from objckpt.format.ref_check import stored_where
from objckpt.options import ReadOptions
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location
from objckpt.writers.reads import SpanSink

__all__ = ["Delivery", "LoadTargets", "Placed", "fetch_and_deliver"]

P = TypeVar("P")

#: The most a transformed non-tensor value may decode to (its dtype and shape bound
#: nothing; a stock checkpoint does not even record its size before the transforms).
MAX_UNDECLARED = 1024**3


def fetch_and_deliver(
    batches: list[list[Range]],
    place: Callable[[list[Range]], list[P]],
    fetch: Callable[[list[Range], list[P]], None],
    deliver: Callable[[Range, P], None],
) -> None:
    """Fetch and deliver ``batches`` in order, the next batch prefetched while one is
    delivered (so two batches at most are held at once). ``place`` runs on this
    thread (it may ask the planner for targets), ``fetch`` on the prefetch thread."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-read") as prefetch:
        # Each fetch runs in a copy of this context, so its requests are counted.
        def submit(batch: list[Range]) -> tuple[concurrent.futures.Future[None], list[P]]:
            placed = place(batch)
            return prefetch.submit(contextvars.copy_context().run, fetch, batch, placed), placed

        pending = submit(batches[0]) if batches else None
        for n in range(len(batches)):
            assert pending is not None
            done, placed = pending
            done.result()
            if n + 1 < len(batches):
                pending = submit(batches[n + 1])
            for rng, where in zip(batches[n], placed, strict=True):
                deliver(rng, where)


@dataclasses.dataclass(frozen=True)
class _Direct:
    """A read whose tensor bytes land in its target: where they lie in the object."""

    target: torch.Tensor
    start: int
    end: int
    head: bytes
    tail: bytes


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where a range's bytes landed: scratch, and the targets of its direct reads.

    Args:
        start: The range's first byte in its object.
        scratch: The range's bytes outside direct targets, in order.
        direct: The direct reads, by their position in the range's reads.
        ends: Where each direct span ends in the object, in order.
        before: How many direct bytes lie before each of those ends.
    """

    start: int
    scratch: memoryview
    direct: dict[int, _Direct] = dataclasses.field(default_factory=dict)
    ends: tuple[int, ...] = ()
    before: tuple[int, ...] = ()

    @classmethod
    def plain(cls, start: int, data: bytes | bytearray | memoryview) -> Placed:
        """A range whose bytes are all in ``data`` (a peer's, the local copy's)."""
        return cls(start, memoryview(data))

    def sink(self) -> SpanSink:
        """The range laid out: scratch between the direct targets' memory."""
        views, at, used = [], self.start, 0
        for d in sorted(self.direct.values(), key=lambda d: d.start):
            views.append(self.scratch[used : used + d.start - at])
            used += d.start - at
            views.append(memory_of(d.target))
            at = d.end
        views.append(self.scratch[used:])
        return SpanSink(views)

    def scratch_of(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of the object, lying in scratch."""
        n = bisect.bisect_right(self.ends, offset)
        at = offset - self.start - (self.before[n - 1] if n else 0)
        return self.scratch[at : at + length]


class LoadTargets:
    """Every tensor target of one load, resolved once, and which may take bytes directly.

    Bytes fetched into a target are checked there after the fetch, so a direct
    target must be memory no other read of the load writes: not a view shared by
    two names (tied weights), not overlapping another target, in this batch or any
    other. And the planner must be DCP's own (``resolve_tensor`` a view of the state
    dict, ``commit_tensor`` a no-op), whose targets can be resolved before the fetch
    and are the memory the state dict holds; a planner that stages through buffers
    of its own (as torch's ``LoadPlanner`` contract allows) gets every read copied,
    resolved and committed one by one as DCP's readers do.

    Args:
        planner: The load's planner.
        reads: Every read of the load this rank fetches itself.
    """

    def __init__(self, planner: LoadPlanner, reads: list[ReadItem]) -> None:
        self.planner = planner
        self._targets: dict[int, torch.Tensor] = {}
        self._exclusive: set[int] = set()
        if not _stock(planner):
            return
        spans: list[tuple[int, int, int]] = []
        opaque = False
        for req in reads:
            if req.type != LoadItemType.TENSOR:
                continue
            target = planner.resolve_tensor(req).detach()
            self._targets[id(req)] = target
            try:
                span = _span(target)
            except _Opaque:
                opaque = True  # its memory may be any other target's: none is placed
                continue
            if span is not None:
                spans.append((*span, id(req)))
        if opaque:
            return
        shared = _overlapping([(a, b) for a, b, _ in spans])
        self._exclusive = {ident for n, (_, _, ident) in enumerate(spans) if n not in shared}

    def target(self, req: ReadItem) -> torch.Tensor:
        """``req``'s target (resolved once per load where the planner is DCP's own)."""
        found = self._targets.get(id(req))
        return found if found is not None else self.planner.resolve_tensor(req).detach()

    def direct(self, req: ReadItem) -> torch.Tensor | None:
        """``req``'s target where bytes may be fetched straight into it: DCP's own
        planner, a plain dense CPU tensor, memory no other read of the load targets."""
        if id(req) not in self._exclusive:
            return None
        target = self._targets[id(req)]
        if (
            type(target) is torch.Tensor
            and target.device.type == "cpu"
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
        ):
            return target
        return None


def _stock(planner: LoadPlanner) -> bool:
    """Whether ``planner`` resolves and commits tensors as DCP's default planner does."""
    cls = type(planner)
    return isinstance(planner, DefaultLoadPlanner) and all(
        getattr(cls, name) is getattr(DefaultLoadPlanner, name)
        for name in ("resolve_tensor", "commit_tensor", "lookup_tensor", "transform_tensor")
    )


class _Opaque(Exception):
    """A target whose memory cannot be seen (a wrapper subclass: its bytes are in
    tensors it holds, its own ``data_ptr`` 0 or refused)."""


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``tensor`` may touch, ``[first, last + 1)``; None for no host memory
    (empty, or not on the CPU).

    Raises:
        _Opaque: Its memory cannot be seen.
    """
    if tensor.numel() == 0 or tensor.device.type != "cpu":
        return None
    try:
        start = tensor.data_ptr()
    except RuntimeError as exc:  # "Cannot access data pointer of Tensor that doesn't have storage"
        raise _Opaque from exc
    if start == 0:
        raise _Opaque
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + extent * tensor.element_size()


def _overlapping(spans: list[tuple[int, int]]) -> set[int]:
    """The positions in ``spans`` of those that share a byte with another."""
    order = sorted(range(len(spans)), key=lambda n: spans[n])
    out: set[int] = set()
    reach, holder = -1, -1  # the furthest end so far, and whose
    for k, n in enumerate(order):
        start, end = spans[n]
        if start < reach:
            out.update((n, holder))
        if k + 1 < len(order) and spans[order[k + 1]][0] < end:
            out.add(n)
        if end > reach:
            reach, holder = end, n
    return out


#: Tensors smaller than this are copied from scratch (placing them costs more).
DIRECT_ABOVE = 64 * 1024


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

    def place(self, rng: Range, targets: LoadTargets, metadata: Metadata) -> Placed:
        """Lay ``rng``'s bytes out before it is fetched: each framed tensor read whole
        into a target :meth:`LoadTargets.direct` allows, of its dtype and shape, and
        sharing no stored byte with another read of the range, straight into that
        target; the rest into scratch."""
        items = [(it.offset, it.offset + it.length) for _, it in rng.reads]
        crossed = _overlapping(items)  # the same item read twice, or items overlapping
        direct: dict[int, _Direct] = {}
        for n, (req, item) in enumerate(rng.reads):
            if n in crossed:
                continue
            found = self._direct_frame(req, item, metadata)
            target = targets.direct(req) if found is not None else None
            if found is None or target is None:
                continue
            head, tail, dtype, shape = found
            if target.dtype == dtype and tuple(target.size()) == shape:
                start = item.offset + len(head)
                direct[n] = _Direct(
                    target, start, item.offset + item.length - len(tail), head, tail
                )
                # Bytes written behind torch's back: the version counter moves as a
                # copy_ would move it, so what watches it (a save's deferred copy,
                # autograd) sees the tensor changed, before any byte lands.
                torch.autograd.graph.increment_version(target)
        spans = sorted((d.start, d.end) for d in direct.values())
        held = sum(end - start for start, end in spans)
        scratch = torch.empty(rng.end - rng.start - held, dtype=torch.uint8)
        before = list(itertools.accumulate(end - start for start, end in spans))
        ends = tuple(end for _, end in spans)
        return Placed(rng.start, memory_of(scratch), direct, ends, tuple(before))

    def _direct_frame(
        self, req: ReadItem, item: StoredItem, metadata: Metadata
    ) -> tuple[bytes, bytes, torch.dtype, tuple[int, ...]] | None:
        """The frame of a tensor item ``req`` reads whole, when one can be placed."""
        stored = None if item.transform_descriptors else _stored_chunk(req, metadata)
        if req.type != LoadItemType.TENSOR or stored is None:
            return None
        dtype, shape = stored
        if any(req.storage_offsets) or tuple(req.lengths) != shape:
            return None
        frame = self._framer.frame_for(dtype, shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if frame is None or nbytes < DIRECT_ABOVE:
            return None
        if item.length != len(frame[0]) + nbytes + len(frame[1]):
            return None
        return frame[0], frame[1], dtype, shape

    def deliver(
        self,
        rng: Range,
        placed: Placed,
        targets: LoadTargets,
        metadata: Metadata,
        location: Location,
    ) -> None:
        """Check each item ``rng`` serves and hand it to the load's planner.

        Args:
            rng: The range and the reads it serves.
            placed: Where the range's bytes landed.
            targets: The load's planner and its targets.
            metadata: The checkpoint's DCP metadata (stored chunks' dtypes and shapes).
            location: The checkpoint, for messages.

        Raises:
            ChecksumMismatchError: An item's CRC32C differs from the manifest's.
            StateDictError: A value is not plain, or a slice's shape is not the target's.
        """
        check = self.options.verify and not rng.verified
        planner = targets.planner
        for n, (req, item) in enumerate(rng.reads):
            d = placed.direct.get(n)
            if d is not None:
                head = placed.scratch_of(item.offset, len(d.head))
                tail = placed.scratch_of(d.end, len(d.tail))
                body = memory_of(d.target)
                if check and item.crc32c is not None:
                    self._check(item, req, location, head, body, tail)
                if head == d.head and tail == d.tail:
                    planner.commit_tensor(req, d.target)
                    continue
                # Not the frame this torch writes: reassembled, read the general way.
                data = memoryview(bytes(head) + bytes(body) + bytes(tail))
            else:
                data = placed.scratch_of(item.offset, item.length)
                if check and item.crc32c is not None:
                    self._check(item, req, location, data)
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
            target = d.target if d is not None else targets.target(req)
            if target.size() != tensor.size():
                raise StateDictError(
                    f"{req.storage_index.fqn!r}: checkpoint slice has shape "
                    f"{tuple(tensor.size())}, "
                    f"the state dict expects {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    @staticmethod
    def _check(item: StoredItem, req: ReadItem, location: Location, *parts: memoryview) -> None:
        crc = Crc32c()
        for part in parts:
            crc.update(part)
        if crc.hexdigest() != item.crc32c:
            raise ChecksumMismatchError(
                f"{location.url_of(item.relative_path)}"
                f"{stored_where(location, item.relative_path)}: "
                f"CRC32C of {req.storage_index.fqn!r} "
                f"(bytes {item.offset}-{item.offset + item.length}) is {crc.hexdigest()}, "
                f"the manifest says {item.crc32c}; the object is corrupt"
            )

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
        stored = _stored_chunk(req, metadata)
        if stored is None:
            return None
        dtype, shape = stored
        return unframe(data, self._framer.frame_for(dtype, shape), dtype, shape)


def _stored_chunk(req: ReadItem, metadata: Metadata) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The dtype and shape of the stored chunk ``req`` reads, where the metadata has it."""
    md = metadata.state_dict_metadata.get(req.storage_index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    # By position (one chunk built), not a map of the tensor's W chunks.
    chunk = chunk_of(md, req.storage_index)
    return None if chunk is None else (md.properties.dtype, tuple(chunk.sizes))
