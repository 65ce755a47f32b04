"""Staging: copy a state dict into host memory objckpt owns, reused across saves.

Staging is the only part of an async save the training loop waits for. Every
tensor is copied into one shared-memory segment (:mod:`objckpt.pipeline.segment`),
so workers read the bytes where they lie: a task names (segment, offset, length,
dtype, shape), never the tensor itself. That avoids torch's per-tensor
file-descriptor passing, which for a state dict of thousands of small tensors
runs into the open-file limit.

Segments are kept per state-dict structure (names, shapes, dtypes) and reused
while it is unchanged: allocating and faulting in a GiB of shared memory costs
far more than copying into it. A segment is leased by a save until its uploads
finish, so a second save in flight gets a second segment. For CUDA tensors the
segment is page-locked and the device-to-host copies run non-blocking, then are
waited for before ``stage`` returns, so the caller may change its tensors as
soon as it returns. A state dict over the staging budget is copied in
waves (:class:`Wave`) instead; with background staging
(``AsyncOptions(background_staging=True)``) the copy runs after ``save()`` returned
(:class:`Copy`): the training loop only promises not to change its tensors in place
until the copy ends, and each tensor's version counter checks the promise.

Staging lives in a directory that may be small: containers give ``/dev/shm``
64 MiB unless told otherwise. Segments reserve their bytes when made, so a state
dict that does not fit is known before anything is copied; idle sets are freed if
that makes the room, else the save is staged in waves of at most half the free
space (ranks of a node share the directory), and where not even the largest
tensor fits, ``stage`` raises :class:`~objckpt.errors.StagingSpaceError`: the
rank's refusal in the save's agreement, never a crash mid-copy.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
from collections.abc import Hashable
from typing import Any

import torch

from objckpt._torch import collect_traversal_cycles, version_counters
from objckpt.errors import InternalError, StagingSpaceError, StateDictError
from objckpt.pipeline.host_copy import HostCopier, copy_tensor
from objckpt.pipeline.lifeline import sweep_stale_segments
from objckpt.pipeline.segment import Buffers, Segment, aligned, default_staging_dir, no_room
from objckpt.pipeline.state_walk import rebuild, scan
from objckpt.pipeline.upload_task import SegmentRef

__all__ = ["Copy", "SegmentRef", "Staged", "Stager", "Wave"]

logger = logging.getLogger(__name__)


class Wave:
    """Copies tensors into a bounded segment, one wave at a time.

    Used when a state dict is larger than the staging budget: the writer copies
    the tensors of a few objects, hands them to the workers, and once the segment
    is full waits for those uploads before reusing it for the next wave.
    """

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.capacity = segment.size
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + aligned(nbytes) <= self.capacity

    def fits_all(self, tensors: list[torch.Tensor]) -> bool:
        need = sum(aligned(t.numel() * t.element_size()) for t in tensors)
        return self.used + need <= self.capacity

    def put(self, tensor: torch.Tensor) -> SegmentRef:
        """Copy ``tensor`` in (non-blocking from CUDA; call ``sync`` before uploading)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.fits(nbytes):
            raise InternalError(
                f"internal: a {nbytes}-byte tensor does not fit the staging wave "
                f"({self.capacity - self.used} of {self.capacity} bytes free)"
            )
        shape = tuple(tensor.shape)
        view = self._segment.view(self.used, nbytes, tensor.dtype, shape)
        if tensor.device.type == "cuda":
            with torch.no_grad():
                view.copy_(tensor.detach(), non_blocking=True)
        else:
            copy_tensor(tensor, view)
        ref = SegmentRef(
            self._segment.path, self.used, nbytes, str(tensor.dtype).removeprefix("torch."), shape
        )
        self.used += aligned(nbytes)
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
        now = version_counters(self._sources)
        if now is None:  # read at save(), so readable now; refuse rather than guess
            raise StateDictError(
                "the tensors' version counters could not be read after the background copy"
            )
        changed = [p for p, v, w in zip(self._paths, self._versions, now, strict=True) if v != w]
        if changed:
            shown = ", ".join(repr(p.lstrip(".")) for p in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise StateDictError(
                f"{len(changed)} tensor(s) changed in place before the background copy of "
                f"the save ended ({shown}{more}); nothing of this save is committed. With "
                "AsyncOptions(background_staging=True), call handle.wait_staged() before "
                "changing the state (before optimizer.step())"
            )


@dataclasses.dataclass(frozen=True)
class Staged:
    """A staged copy of a state dict. ``state`` mirrors the input with tensors in shared memory.

    When the state dict exceeds the staging budget, nothing is copied yet:
    ``state`` is the caller's own and ``wave`` is set; the writer copies wave by
    wave and returns only once every tensor has been copied.
    """

    state: dict[str, Any]
    structure: tuple[Hashable, ...]
    buffers: Buffers
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


def _sizes(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's bytes in a segment (only a budget or a wave needs them)."""
    return [aligned(t.numel() * t.element_size()) for t in tensors]


class Stager:
    """Owns the staging segments of one checkpointer (close it to free them).

    Args:
        max_cached_sets: Idle staging sets kept for reuse.
        budget: Bytes one staging set may take; a larger state dict is staged in
            waves (see :class:`Wave`). None: no bound.
        copy_threads: Threads a copy into staging may use (see :class:`HostCopier`).
        staging_dir: Where segments live (None: :func:`default_staging_dir`).
    """

    def __init__(
        self,
        max_cached_sets: int = 2,
        budget: int | None = None,
        copy_threads: int = 1,
        staging_dir: str | None = None,
    ) -> None:
        self._copier = HostCopier(copy_threads)
        self._free: dict[tuple[Hashable, ...], list[Buffers]] = {}
        self._idle: list[tuple[tuple[Hashable, ...], Buffers]] = []  # oldest first
        self._max = max_cached_sets
        self._budget = budget
        self._lock = threading.Lock()
        self._all: list[Buffers] = []
        self.directory = staging_dir or default_staging_dir()
        # Segments of processes that died without cleaning up (SIGKILL) hold host memory,
        # in the default directory or in the one this job names.
        for directory in dict.fromkeys((default_staging_dir(), self.directory)):
            sweep_stale_segments(directory)

    def _allocate(self, tensors: list[torch.Tensor]) -> Buffers:
        layout, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append((offset, nbytes, t.dtype, tuple(t.shape)))
            offset += aligned(nbytes)
        segment = self._reserve(offset)
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
        buffers = Buffers(segment, views, refs)
        with self._lock:
            self._all.append(buffers)
        return buffers

    def stage(self, state_dict: dict[str, Any], *, defer_copy: bool = False) -> Staged:
        """Copy ``state_dict`` into owned shared memory; returns once the copy is complete.

        With ``defer_copy`` the views are laid out but not filled: the returned
        :class:`Staged` carries the :class:`Copy` to run (unless a tensor has no
        version counter to guard it; then it is copied now).

        Over the budget, or where the staging directory has no room for the whole
        state dict, returns a :class:`Staged` with a wave segment instead and
        copies nothing. A wave must hold the largest tensor, so the segment is
        never smaller than that (with a warning).

        Raises:
            StagingSpaceError: Not even one wave fits in the staging directory.
        """
        structure, tensors, paths = scan(state_dict)
        if self._budget is not None and sum(sizes := _sizes(tensors)) > self._budget:
            cuda = any(t.is_cuda for t in tensors)
            if (floor := max(sizes)) > self._budget:
                logger.warning(
                    "staging budget %d bytes is below the largest tensor (%d bytes); "
                    "staging waves use %d bytes",
                    self._budget,
                    floor,
                    floor,
                )
            return self._wave(state_dict, structure, sizes, cuda, self._budget)
        buffers = self._take(structure)
        if buffers is None:
            cuda = any(t.is_cuda for t in tensors)
            try:
                buffers = self._allocate(tensors)
            except StagingSpaceError as exc:
                return self._wave(state_dict, structure, _sizes(tensors), cuda, exc.free // 2, exc)
            buffers.cuda = cuda
        cuda = buffers.cuda
        if cuda:
            buffers.segment.pin()
        versions = version_counters(tensors) if defer_copy else None
        copy = None
        if versions is None and not cuda:
            # The caller waits in this copy, so the set's kept moves may serve it.
            buffers.piece_table = self._copier.copy_reusing(
                tensors, buffers.views, buffers.piece_table
            )
        elif versions is None:
            self._copier.copy(tensors, buffers.views, cuda)
        else:
            copy = Copy(tensors, buffers.views, paths, versions, cuda, self._copier)
        state = rebuild(state_dict, buffers.views)
        return Staged(state, structure, buffers, cuda=cuda, copy=copy)

    def _take(self, key: tuple[Hashable, ...]) -> Buffers | None:
        """An idle staging set for ``key``, if one is kept."""
        with self._lock:
            free = self._free.get(key)
            if not free:
                return None
            buffers = free.pop()
            self._idle = [(k, b) for k, b in self._idle if b is not buffers]
            return buffers

    def _wave(
        self,
        state_dict: dict[str, Any],
        structure: tuple[Hashable, ...],
        sizes: list[int],
        cuda: bool,
        wanted: int,
        why: StagingSpaceError | None = None,
    ) -> Staged:
        """Stage in waves of ``wanted`` bytes (at least the largest tensor), reusing an
        idle wave set that fits; ``why``: the whole state dict had no room."""
        capacity = max(wanted, max(sizes, default=1))
        buffers = self._take_wave(max(sizes, default=1), capacity)
        if buffers is None:
            buffers = Buffers(self._wave_segment(sizes, capacity), [], {})
            with self._lock:
                self._all.append(buffers)
        if why is not None:
            logger.warning(
                "staging the state dict needs %d bytes in %s, %d bytes are free: staging in "
                "waves of %d bytes instead (the save's stall then includes uploading all "
                "but the last wave; give %s more room or set AsyncOptions.staging_dir)",
                why.needed,
                self.directory,
                why.free,
                buffers.segment.size,
                self.directory,
            )
        if cuda:
            buffers.segment.pin()
        return Staged(state_dict, structure, buffers, Wave(buffers.segment), cuda)

    def _take_wave(self, floor: int, capacity: int) -> Buffers | None:
        """The largest idle wave set holding at least ``floor`` and at most ``capacity`` bytes."""
        with self._lock:
            waves = [k[1] for k, v in self._free.items() if v and k[0] == "waves"]
        fitting = [size for size in waves if isinstance(size, int) and floor <= size <= capacity]
        return self._take(("waves", max(fitting))) if fitting else None

    def _wave_segment(self, sizes: list[int], capacity: int) -> Segment:
        """A wave segment of ``capacity`` bytes, or smaller (half the free space, never
        below the largest tensor) where that does not fit."""
        floor = max(sizes, default=1)
        try:
            return self._reserve(capacity)
        except StagingSpaceError as exc:
            failed = exc
        smaller = max(floor, failed.free // 2)
        if smaller < capacity:
            logger.warning(
                "a staging wave of %d bytes does not fit in %s (%d bytes free); using "
                "waves of %d bytes",
                capacity,
                self.directory,
                failed.free,
                smaller,
            )
            try:
                return self._reserve(smaller)
            except StagingSpaceError as exc:
                failed = exc
        raise no_room(
            f"one staging wave of a {sum(sizes)}-byte state dict (a wave must hold its "
            "largest tensor)",
            floor,
            failed.free,
            self.directory,
        ) from failed

    def _reserve(self, size: int) -> Segment:
        """A new segment of ``size`` bytes, freeing the idle sets first where their
        bytes make the room."""
        try:
            return Segment(size, self.directory)
        except StagingSpaceError as exc:
            with self._lock:
                idle = sum(b.segment.size for _, b in self._idle)
            if idle == 0 or exc.free + idle < size:
                raise
        logger.info(
            "freed %d bytes of idle staging sets to make room for %d bytes in %s",
            self.free_idle(),
            size,
            self.directory,
        )
        return Segment(size, self.directory)

    def free_idle(self) -> int:
        """Free every idle staging set (they are kept only to be reused); returns their bytes."""
        with self._lock:
            idle = [b for _, b in self._idle]
            self._idle, self._free = [], {}
            self._all = [b for b in self._all if all(b is not i for i in idle)]
        for buffers in idle:
            buffers.segment.close()
        return sum(b.segment.size for b in idle)

    def release(self, staged: Staged) -> None:
        """Return a staging set for reuse once its uploads are finished.

        At most ``max_cached_sets`` idle sets are kept in all, whatever their
        structure: a job whose state dict changes shape (a new optimizer, a frozen
        layer) must not keep one full-size segment per shape it ever saved. The
        set idle the longest is freed first.
        """
        evicted: list[Buffers] = []
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
        del all_buffers
        # torch 2.9's DCP leaves its views of the last saves in a reference cycle.
        collect_traversal_cycles()
