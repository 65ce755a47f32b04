"""Shared-memory segments: the host memory staging copies into and workers read from.

A segment is one file in ``/dev/shm`` (:data:`SHM_DIR`), mapped by this process
and by the upload workers, so a worker reads a tensor's bytes where they lie from
(segment, offset, length). Its name carries this process's lifeline prefix
(:mod:`objckpt.pipeline.lifeline`) so a later process can sweep the segments of
one that died without unlinking them. For CUDA sources a segment is page-locked
(``cudaHostRegister``) so device-to-host copies can run non-blocking.
:class:`Buffers` is one staging set: a segment and the tensor views laid out in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import tempfile

import torch

from objckpt.pipeline.lifeline import segment_prefix
from objckpt.pipeline.upload_task import SegmentRef

__all__ = ["SHM_DIR", "Buffers", "Segment", "aligned"]

logger = logging.getLogger(__name__)
_ALIGN = 64  # bytes; every view starts on a cache line

#: Where staging segments live: shared memory where the system has it.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


class Segment:
    """A shared-memory file mapped into this process."""

    def __init__(self, size: int) -> None:
        fd, self.path = tempfile.mkstemp(prefix=segment_prefix(), dir=SHM_DIR)
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
class Buffers:
    """One staging set: a segment and the views laid out in it, by structure."""

    segment: Segment
    views: list[torch.Tensor]
    refs: dict[int, SegmentRef]  # data_ptr of a view -> where it lives

    @functools.cached_property
    def starts(self) -> list[int]:
        """The views' data pointers, sorted (to find the view a slice lies in)."""
        return sorted(self.refs)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the alignment of each tensor's start in a segment."""
    return -(-nbytes // _ALIGN) * _ALIGN
