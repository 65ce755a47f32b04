"""Shared-memory segments: the host memory staging copies into and workers read from.

A segment is one file in the staging directory (``/dev/shm``, :data:`SHM_DIR`, unless
``AsyncOptions.staging_dir`` names another), mapped by this process and by the
upload workers, so a worker reads a tensor's bytes where they lie from
(segment, offset, length). Its name carries this process's lifeline prefix
(:mod:`objckpt.pipeline.lifeline`) so a later process can sweep the segments of
one that died without unlinking them. For CUDA sources a segment is page-locked
(``cudaHostRegister``) so device-to-host copies can run non-blocking.
:class:`Buffers` is one staging set: a segment and the tensor views laid out in it.

A segment's bytes are reserved when it is made (``posix_fallocate``), not left
sparse: a sparse file in a full tmpfs (containers give ``/dev/shm`` 64 MiB) takes a
page at the first write to it, and a write with no page to take is a SIGBUS that
kills the training process in the middle of the copy. Reserved up front, "no room"
is a :class:`~objckpt.errors.StagingSpaceError` raised before anything is copied,
which the save turns into this rank's refusal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import mmap
import os
import tempfile

import torch

from objckpt.errors import StagingSpaceError
from objckpt.pipeline.host_copy import PieceTable
from objckpt.pipeline.lifeline import segment_prefix
from objckpt.pipeline.upload_task import SegmentRef

__all__ = [
    "SHM_DIR",
    "Buffers",
    "Segment",
    "aligned",
    "default_staging_dir",
    "free_bytes",
    "no_room",
]

logger = logging.getLogger(__name__)
_ALIGN = 64  # bytes; every view starts on a cache line

#: Where staging segments live: shared memory where the system has it.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


#: errnos of a filesystem that cannot reserve bytes (check the free space instead).
_CANNOT_RESERVE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
#: errnos of a reservation refused for want of room (a full tmpfs, a quota).
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def default_staging_dir() -> str:
    """Where staging lives unless ``AsyncOptions.staging_dir`` says otherwise."""
    return SHM_DIR if SHM_DIR is not None else tempfile.gettempdir()


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def no_room(what: str, needed: int, free: int, directory: str) -> StagingSpaceError:
    """The error for ``needed`` bytes of ``what`` that do not fit in ``directory``."""
    return StagingSpaceError(
        f"no room for {what} in {directory}: {needed} bytes needed, {free} bytes free. "
        f"Give {directory} more room (docker run --shm-size=...; on Kubernetes mount an "
        "emptyDir with medium: Memory at /dev/shm) or set AsyncOptions.staging_dir to a "
        "directory that has it",
        needed,
        free,
        directory,
    )


def _reserve(fd: int, size: int, directory: str) -> None:
    """Give the file ``fd`` ``size`` bytes that are really allocated, or raise.

    The free space is checked first: it is cheap, and a reservation that fails
    part-way on tmpfs zeroes and then returns every page it took.
    """
    free = free_bytes(directory)
    if size > free:
        raise no_room("staging memory", size, free, directory)
    fallocate = getattr(os, "posix_fallocate", None)
    try:
        if fallocate is None:
            raise OSError(errno.ENOSYS, "posix_fallocate is not available")
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise no_room("staging memory", size, free_bytes(directory), directory) from exc
        if exc.errno not in _CANNOT_RESERVE:
            raise
        logger.debug(
            "%s cannot reserve staging bytes (%s); relying on its free space (%d bytes, "
            "%d needed) instead",
            directory,
            exc,
            free,
            size,
        )
        os.ftruncate(fd, size)


class Segment:
    """A shared-memory file mapped into this process, its bytes reserved.

    Args:
        size: Bytes the segment holds.
        directory: Where the file goes (None: :func:`default_staging_dir`).

    Raises:
        StagingSpaceError: ``directory`` has no room for ``size`` bytes (the file
            is removed again).
    """

    def __init__(self, size: int, directory: str | None = None) -> None:
        self.directory = directory or default_staging_dir()
        try:
            fd, self.path = tempfile.mkstemp(prefix=segment_prefix(), dir=self.directory)
        except OSError as exc:  # a tmpfs out of inodes, or of room for the entry
            if exc.errno not in _NO_ROOM:
                raise
            raise no_room(
                "staging memory", size, free_bytes(self.directory), self.directory
            ) from exc
        try:
            try:
                _reserve(fd, max(size, 1), self.directory)
                self.map = mmap.mmap(fd, max(size, 1))
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
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
class Buffers:
    """One staging set: a segment and the views laid out in it, by structure."""

    segment: Segment
    views: list[torch.Tensor]
    refs: dict[int, SegmentRef]  # data_ptr of a view -> where it lives
    #: The last foreground copy's moves into ``views``, revalidated by the next one.
    piece_table: PieceTable | None = None
    #: Whether its sources are on a CUDA device: the same for every state dict of its
    #: structure (the scan's layout names each tensor's device), so not asked again.
    cuda: bool = False

    @functools.cached_property
    def starts(self) -> list[int]:
        """The views' data pointers, sorted (to find the view a slice lies in)."""
        return sorted(self.refs)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the alignment of each tensor's start in a segment."""
    return -(-nbytes // _ALIGN) * _ALIGN
