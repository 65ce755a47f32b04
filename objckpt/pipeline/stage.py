"""Staging: copy a state dict into host memory objckpt owns, reused across saves.

Staging is the only part of an async save the training loop waits for. Every
tensor is copied into one shared-memory segment (a file in ``/dev/shm`` mapped
by this process and by the upload workers), so workers read the bytes where they
lie: a task names (segment, offset, length, dtype, shape), never the tensor
itself. That avoids torch's per-tensor file-descriptor passing, which for a
state dict of thousands of small tensors runs into the open-file limit.

Segments are kept per state-dict structure (names, shapes, dtypes) and reused
while it is unchanged: allocating and faulting in a GiB of shared memory costs
far more than copying into it. A segment is leased by a save until its uploads
finish, so a second save in flight gets a second segment. For CUDA tensors the
segment is page-locked (``cudaHostRegister``) and the device-to-host copies run
non-blocking, then are waited for before ``stage`` returns, so the caller may
change its tensors as soon as it returns.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import tempfile
import threading
from collections.abc import Hashable
from typing import Any, cast

import torch

from objckpt.errors import StateDictError
from objckpt.pipeline import lifeline
from objckpt.pipeline.host_copy import HostCopier
from objckpt.pipeline.upload_task import SegmentRef

__all__ = ["SegmentRef", "Staged", "Stager", "Wave", "scan"]

logger = logging.getLogger(__name__)
_ALIGN = 64


def _dtensor_local(value: torch.Tensor) -> torch.Tensor | None:
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) and hasattr(value, "device_mesh") else None


def _mesh_id(mesh: Any) -> Hashable:
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.device_type)


def scan(state: Any) -> tuple[tuple[Hashable, ...], list[torch.Tensor], list[str]]:
    """One walk over a state dict: its layout (hashable, values excluded), its
    tensors in traversal order (DTensors as their local shards) and their paths.

    The layout is everything DCP's plan depends on, so equal layouts plan alike:
    paths, types, shapes, dtypes, devices, and for DTensors the global shape,
    placements and mesh.
    """
    layout: list[Hashable] = []
    tensors: list[torch.Tensor] = []
    paths: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            local = _dtensor_local(value)
            if local is None and value.layout != torch.strided:
                raise StateDictError(f"async save does not support {value.layout} tensors ({path})")
            t = value if local is None else local
            entry: tuple[Hashable, ...] = (
                path,
                type(value).__name__,
                tuple(t.shape),
                str(t.dtype),
                t.device.type,
            )
            if local is not None:  # where the shard sits in the global tensor
                dt = cast(Any, value)
                entry += (tuple(value.shape), str(dt.placements), _mesh_id(dt.device_mesh))
            layout.append(entry)
            tensors.append(t)
            paths.append(path)
        elif isinstance(value, dict):
            for k in value:
                walk(value[k], f"{path}.{k}")
        elif isinstance(value, (list, tuple)):
            layout.append((path, type(value).__name__, len(value)))
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        else:
            layout.append((path, type(value).__name__))

    walk(state, "")
    return tuple(layout), tensors, paths


#: Where staging segments live: shared memory where the system has it.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


class _Segment:
    """A shared-memory file mapped into this process."""

    def __init__(self, size: int) -> None:
        fd, self.path = tempfile.mkstemp(prefix=lifeline.segment_prefix(), dir=SHM_DIR)
        try:
            os.ftruncate(fd, max(size, 1))
            self.map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.size = size
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = False

    def view(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        return self.base[offset : offset + nbytes].view(dtype).view(shape)

    def pin(self) -> None:
        """Page-lock the segment so device-to-host copies can run asynchronously."""
        if not self.registered and torch.cuda.is_available():
            ptr = self.base.data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0)
            self.registered = int(err) == 0
            if not self.registered:
                logger.warning("cudaHostRegister failed (%s); D2H copies will be synchronous", err)

    def close(self) -> None:
        """Unlink the segment and drop this object's hold on its mapping.

        The mapping is not closed here: ``torch.frombuffer`` keeps the ``mmap``
        object alive but holds no buffer export, so ``mmap.close()`` would unmap
        memory that a view still in use (a traceback's frame, a caller's
        reference) points at, and touching it would crash the process. The pages
        go when the last view does.
        """
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.registered = False
        del self.base
        del self.map
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclasses.dataclass
class _Buffers:
    """One staging set: a segment and the views laid out in it, by structure."""

    segment: _Segment
    views: list[torch.Tensor]
    refs: dict[int, SegmentRef]  # data_ptr of a view -> where it lives

    @functools.cached_property
    def starts(self) -> list[int]:
        """The views' data pointers, sorted (to find the view a slice lies in)."""
        return sorted(self.refs)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Wave:
    """Copies tensors into a bounded segment, one wave at a time.

    Used when a state dict is larger than the staging budget: the writer copies
    the tensors of a few objects, hands them to the workers, and once the segment
    is full waits for those uploads before reusing it for the next wave.
    """

    def __init__(self, segment: _Segment) -> None:
        self._segment = segment
        self.capacity = segment.size
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + _aligned(nbytes) <= self.capacity

    def fits_all(self, tensors: list[torch.Tensor]) -> bool:
        need = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
        return self.used + need <= self.capacity

    def put(self, tensor: torch.Tensor) -> SegmentRef:
        """Copy ``tensor`` in (non-blocking from CUDA; call ``sync`` before uploading)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.fits(nbytes):
            raise StateDictError(
                f"internal: a {nbytes}-byte tensor does not fit the staging wave "
                f"({self.capacity - self.used} of {self.capacity} bytes free)"
            )
        shape = tuple(tensor.shape)
        view = self._segment.view(self.used, nbytes, tensor.dtype, shape)
        with torch.no_grad():
            view.copy_(tensor.detach(), non_blocking=tensor.device.type == "cuda")
        ref = SegmentRef(
            self._segment.path, self.used, nbytes, str(tensor.dtype).removeprefix("torch."), shape
        )
        self.used += _aligned(nbytes)
        return ref

    @staticmethod
    def sync(tensors_on_cuda: bool) -> None:
        if tensors_on_cuda:
            torch.cuda.synchronize()

    def reset(self) -> None:
        """Start the next wave (the previous wave's uploads must be finished)."""
        self.used = 0


class Copy:
    """The copy of a state dict into its staging views, when it runs after ``save()``
    returned (``AsyncOptions.background_staging``).

    The caller promised not to change the tensors in place until ``finished`` is
    set; the promise is checked: each tensor's version counter (bumped by every
    in-place op, an optimizer step's included) is read when ``save()`` is called
    and again after the copy, and a changed one fails the save instead of saving
    a mix of two steps. (Writes through ``.data`` or a NumPy view bump nothing and
    go unseen.)
    """

    def __init__(
        self,
        sources: list[torch.Tensor],
        views: list[torch.Tensor],
        paths: list[str],
        versions: list[int],
        cuda: bool,
        copier: HostCopier,
    ) -> None:
        self._copier = copier
        self._sources = sources
        self._views = views
        self._paths = paths
        self._versions = versions
        self._cuda = cuda
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._ran = False
        #: Set once the copy has ended (whatever its outcome).
        self.finished = threading.Event()

    def run(self) -> None:
        """Copy (once; later calls re-raise the first outcome).

        Raises:
            StateDictError: A tensor was changed in place before its copy ended.
        """
        with self._lock:
            if not self._ran:
                self._ran = True
                try:
                    self._copier.copy(self._sources, self._views, self._cuda)
                    self._check()
                except BaseException as exc:
                    self._error = exc
                finally:
                    self._sources = []  # the caller's tensors are not held past the copy
                    self.finished.set()
            if self._error is not None:
                raise self._error

    def _check(self) -> None:
        changed = [
            p
            for p, t, v in zip(self._paths, self._sources, self._versions, strict=True)
            if t._version != v
        ]
        if changed:
            shown = ", ".join(repr(p.lstrip(".")) for p in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise StateDictError(
                f"{len(changed)} tensor(s) changed in place before the background copy of "
                f"the save ended ({shown}{more}); nothing of this save is committed. With "
                "AsyncOptions(background_staging=True), call handle.wait_staged() before "
                "changing the state (before optimizer.step())"
            )


def _versions(tensors: list[torch.Tensor]) -> list[int] | None:
    """Each tensor's version counter; None when one has none (inference tensors)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:
        return None


@dataclasses.dataclass(frozen=True)
class Staged:
    """A staged copy of a state dict. ``state`` mirrors the input with tensors in shared memory.

    When the state dict exceeds the staging budget, nothing is copied yet:
    ``state`` is the caller's own and ``wave`` is set; the writer copies wave by
    wave and returns only once every tensor has been copied.
    """

    state: dict[str, Any]
    structure: tuple[Hashable, ...]
    buffers: _Buffers
    wave: Wave | None = None
    cuda: bool = False
    #: The copy still to run (background staging), or None once staged.
    copy: Copy | None = None

    @property
    def pool_key(self) -> tuple[Hashable, ...]:
        """Which idle sets this one can stand in for: same structure, or same wave size."""
        return ("waves", self.buffers.segment.size) if self.wave else self.structure

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in this set's segment (or it has none):
        reading it later reads this staged copy, never the caller's memory."""
        if tensor.numel() == 0:
            return True
        base = self.buffers.segment.base.data_ptr()
        start = tensor.untyped_storage().data_ptr()
        return base <= start and start + tensor.untyped_storage().nbytes() <= base + max(
            self.buffers.segment.size, 1
        )

    def ref_of(self, tensor: torch.Tensor) -> SegmentRef | None:
        """The segment location of a staged tensor, or of a contiguous slice of one
        (a replicated tensor's row slice, :mod:`objckpt.dcp.planner`), if it is one."""
        if not tensor.is_contiguous():
            return None
        dtype = str(tensor.dtype).removeprefix("torch.")
        ptr = tensor.data_ptr()
        ref = self.buffers.refs.get(ptr)
        if ref is not None and tuple(tensor.shape) == ref.shape and ref.dtype == dtype:
            return ref
        nbytes = tensor.numel() * tensor.element_size()
        starts = self.buffers.starts
        at = bisect.bisect_right(starts, ptr) - 1
        if at < 0 or nbytes == 0:
            return None
        parent = self.buffers.refs[starts[at]]
        delta = ptr - starts[at]
        if parent.dtype != dtype or delta + nbytes > parent.nbytes:
            return None
        return SegmentRef(parent.path, parent.offset + delta, nbytes, dtype, tuple(tensor.shape))


def _rebuild(state: Any, views: list[torch.Tensor]) -> Any:
    """``state`` with each tensor replaced by its staged view, in traversal order."""
    it = iter(views)

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            view = next(it)
            if _dtensor_local(value) is None:
                return view
            from torch.distributed.tensor import DTensor

            dt = cast(Any, value)
            return DTensor.from_local(
                view,
                dt.device_mesh,
                dt.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return walk(state)


class Stager:
    """Owns the staging segments of one checkpointer (close it to free them).

    Args:
        max_cached_sets: Idle staging sets kept for reuse.
        budget: Bytes one staging set may take; a larger state dict is staged in
            waves (see :class:`Wave`). None: no bound.
        copy_threads: Threads a copy into staging may use (see :class:`HostCopier`).
    """

    def __init__(
        self, max_cached_sets: int = 2, budget: int | None = None, copy_threads: int = 1
    ) -> None:
        self._copier = HostCopier(copy_threads)
        self._free: dict[tuple[Hashable, ...], list[_Buffers]] = {}
        self._idle: list[tuple[tuple[Hashable, ...], _Buffers]] = []  # oldest first
        self._max = max_cached_sets
        self._budget = budget
        self._lock = threading.Lock()
        self._all: list[_Buffers] = []
        # Segments of processes that died without cleaning up (SIGKILL) hold host memory.
        lifeline.sweep_stale_segments(SHM_DIR)

    def _allocate(self, tensors: list[torch.Tensor]) -> _Buffers:
        layout, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append((offset, nbytes, t.dtype, tuple(t.shape)))
            offset += _aligned(nbytes)
        segment = _Segment(offset)
        views, refs = [], {}
        for off, nbytes, dtype, shape in layout:
            view = segment.view(off, nbytes, dtype, shape)
            views.append(view)
            refs[view.data_ptr()] = SegmentRef(
                segment.path, off, nbytes, str(dtype).removeprefix("torch."), shape
            )
        if len(refs) != len(views):  # zero-byte tensors share addresses; drop them from the map
            refs = {p: r for p, r in refs.items() if r.nbytes}
        logger.debug(
            "allocated %d bytes of staging for %d tensors at %s", offset, len(views), segment.path
        )
        buffers = _Buffers(segment, views, refs)
        with self._lock:
            self._all.append(buffers)
        return buffers

    def stage(self, state_dict: dict[str, Any], *, defer_copy: bool = False) -> Staged:
        """Copy ``state_dict`` into owned shared memory; returns once the copy is complete.

        With ``defer_copy`` the views are laid out but not filled: the returned
        :class:`Staged` carries the :class:`Copy` to run (unless a tensor has no
        version counter to guard it; then it is copied now).

        Over the budget, returns a :class:`Staged` with a wave segment instead
        and copies nothing. A wave must hold the largest tensor, so the segment
        is never smaller than that (with a warning).
        """
        structure, tensors, paths = scan(state_dict)
        cuda = any(t.device.type == "cuda" for t in tensors)
        if self._budget is not None:
            sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
            if sum(sizes) > self._budget:
                return self._wave(state_dict, structure, max(sizes), cuda)
        buffers = self._take(structure)
        if buffers is None:
            buffers = self._allocate(tensors)
        if cuda:
            buffers.segment.pin()
        versions = _versions(tensors) if defer_copy else None
        copy = None
        if versions is None:
            self._copier.copy(tensors, buffers.views, cuda)
        else:
            copy = Copy(tensors, buffers.views, paths, versions, cuda, self._copier)
        state = _rebuild(state_dict, buffers.views)
        return Staged(state, structure, buffers, cuda=cuda, copy=copy)

    def _take(self, key: tuple[Hashable, ...]) -> _Buffers | None:
        """An idle staging set for ``key``, if one is kept."""
        with self._lock:
            free = self._free.get(key)
            if not free:
                return None
            buffers = free.pop()
            self._idle = [(k, b) for k, b in self._idle if b is not buffers]
            return buffers

    def _wave(
        self, state_dict: dict[str, Any], structure: tuple[Hashable, ...], floor: int, cuda: bool
    ) -> Staged:
        assert self._budget is not None
        capacity = max(self._budget, floor)
        if capacity > self._budget:
            logger.warning(
                "staging budget %d bytes is below the largest tensor (%d bytes); "
                "staging waves use %d bytes",
                self._budget,
                floor,
                capacity,
            )
        key: tuple[Hashable, ...] = ("waves", capacity)
        buffers = self._take(key)
        if buffers is None:
            buffers = _Buffers(_Segment(capacity), [], {})
            with self._lock:
                self._all.append(buffers)
        if cuda:
            buffers.segment.pin()
        return Staged(state_dict, structure, buffers, Wave(buffers.segment), cuda)

    def release(self, staged: Staged) -> None:
        """Return a staging set for reuse once its uploads are finished.

        At most ``max_cached_sets`` idle sets are kept in all, whatever their
        structure: a job whose state dict changes shape (a new optimizer, a frozen
        layer) must not keep one full-size segment per shape it ever saved. The
        set idle the longest is freed first.
        """
        evicted: list[_Buffers] = []
        with self._lock:
            self._free.setdefault(staged.pool_key, []).append(staged.buffers)
            self._idle.append((staged.pool_key, staged.buffers))
            while len(self._idle) > self._max:
                key, oldest = self._idle.pop(0)
                self._free[key].remove(oldest)
                if not self._free[key]:
                    del self._free[key]
                self._all.remove(oldest)
                evicted.append(oldest)
        for buffers in evicted:
            buffers.segment.close()

    def close(self) -> None:
        """Unmap and delete every segment (no save may be in flight)."""
        self._copier.close()
        with self._lock:
            all_buffers, self._all, self._free, self._idle = self._all, [], {}, []
        for b in all_buffers:
            b.segment.close()
