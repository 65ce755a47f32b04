"""Copying host tensors into staging views on several threads at once.

The copy into staging is the whole stall of a default async save, and one thread
copies host memory below what the memory system takes (on the 2-core machine the
benchmarks ran on: 256 MiB in 23 ms on one thread, 12 ms on two, in one run; other
runs on other days read about the same on one and two). torch parallelises a copy
only inside one tensor and only over its intra-op threads, which training jobs often
set to one per rank, and a state dict is hundreds of tensors of every size. So the
copy is cut into pieces of about equal bytes (large tensors split along their flat
storage) and each thread copies one run of consecutive pieces.

A piece whose source and view hold the same dtype, densely in the same order, on the
CPU, is copied as bytes with the C library's ``memmove`` (``ctypes`` releases the GIL
for it), not with ``copy_``: ``copy_`` fans each copy out over torch's intra-op
threads, which from several copying threads oversubscribes the cores, and for small
tensors its fork and join cost more than the bytes. Measured on 2 cores with torch's
default two intra-op threads: 1,000 tensors of 128 KiB took 40 ms with ``copy_`` in a
loop and 9.5 ms with one intra-op thread; the benchmark's whole 256 MiB state took
44 ms (median) through ``copy_`` on two threads and 14 ms through ``memmove``.
Anything else (another dtype, a non-contiguous, conjugated or negated view, a
quantized tensor, a subclass, a tensor with no memory behind it) goes through
``copy_``, which knows its layout. Raw copies bypass torch's dispatcher, so an active
``TorchDispatchMode`` does not see them (the staging copy is not model code).

CUDA sources are not split: their device-to-host copies are queued non-blocking
on one stream and waited for once, which already overlaps them.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import threading

import torch

__all__ = ["HostCopier", "copy_tensor"]

logger = logging.getLogger(__name__)

#: Below this many bytes a copy runs on the calling thread alone: handing work to
#: another thread costs tens of microseconds, a MiB copies in about as long.
_PARALLEL_FROM = 4 * 2**20
#: Large tensors copied as bytes are cut into pieces of at most this many bytes, so
#: the threads' shares come out even whatever the tensor sizes.
_PIECE = 4 * 2**20

#: (source, destination, bytes, raw, source address, destination address): copied by
#: ``memmove`` between the addresses where raw, else by ``copy_`` whole. The source is
#: a detached alias: it holds the source's memory while another thread copies from its
#: address, even if the caller rebinds the tensor's ``.data`` meanwhile.
_Piece = tuple[torch.Tensor, torch.Tensor, int, bool, int, int]

_memmove = ctypes.memmove


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: The tensor types whose bytes may be copied raw (a subclass may store its data
#: elsewhere or mean something else by it).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _raw(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``dst`` receives exactly ``src``'s bytes in order (see the module doc)."""
    return (
        type(src) in _PLAIN
        and type(dst) is torch.Tensor
        and src.is_cpu
        and dst.is_cpu
        and src.dtype == dst.dtype
        and src.numel() == dst.numel()
        and not src.is_quantized
        and not (src.dtype.is_complex and src.is_conj())
        and not src.is_neg()
        and src.is_contiguous()
        and dst.is_contiguous()
        # A functional or zero tensor is "CPU" and dense with no memory behind it.
        and (src.data_ptr() != 0 or src.numel() == 0)
        and (dst.data_ptr() != 0 or dst.numel() == 0)
    )


def copy_tensor(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy one host tensor into its view on the calling thread (raw bytes where
    :func:`_raw` allows, else ``copy_``)."""
    if not _raw(src, dst):
        with torch.no_grad():
            dst.copy_(src.detach())
    elif nbytes := dst.numel() * dst.element_size():
        _memmove(dst.data_ptr(), src.data_ptr(), nbytes)


def _pieces(sources: list[torch.Tensor], views: list[torch.Tensor]) -> list[_Piece]:
    """Pieces covering every pair, in staging order: a raw pair as byte ranges of at
    most ``_PIECE`` (addresses, so no tensor view is made per piece), any other pair
    whole, for ``copy_``."""
    out: list[_Piece] = []
    for src, dst in zip(sources, views, strict=True):
        src = src.detach()
        nbytes = dst.numel() * dst.element_size()
        if not _raw(src, dst):
            out.append((src, dst, nbytes, False, 0, 0))
        elif nbytes:
            at, to = src.data_ptr(), dst.data_ptr()
            for start in range(0, nbytes, _PIECE):
                piece = min(_PIECE, nbytes - start)
                out.append((src, dst, piece, True, at + start, to + start))
    return out


def _shares(pieces: list[_Piece], count: int) -> list[list[_Piece]]:
    """``pieces`` cut into at most ``count`` runs of consecutive pieces, about equal in bytes
    (consecutive, so each thread writes one stretch of the segment)."""
    total = sum(p[2] for p in pieces)
    shares: list[list[_Piece]] = [[]]
    done = 0
    for piece in pieces:
        if shares[-1] and len(shares) < count and done >= total * len(shares) / count:
            shares.append([])
        shares[-1].append(piece)
        done += piece[2]
    return shares


def _copy_share(share: list[_Piece]) -> None:
    with torch.no_grad():
        for src, dst, nbytes, raw, at, to in share:
            if raw:
                _memmove(to, at, nbytes)
            else:
                dst.copy_(src)


class HostCopier:
    """Copies tensors into their staging views on up to ``threads`` threads.

    The calling thread copies one share itself; the others run on a pool started
    on first use and stopped by :meth:`close`. One copy runs at a time (the stager
    copies one save at a time anyway); a second waits for the first.

    Args:
        threads: Threads one copy may use, the caller's included; capped at the
            CPUs this process may run on.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, min(threads, usable_cpus()))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def copy(self, sources: list[torch.Tensor], views: list[torch.Tensor], cuda: bool) -> None:
        """Copy each source into its view; returns when every byte is in place."""
        if cuda:
            with torch.no_grad():
                for src, dst in zip(sources, views, strict=True):
                    dst.copy_(src.detach(), non_blocking=True)
            torch.cuda.synchronize()
            return
        pieces = _pieces(sources, views)
        total = sum(p[2] for p in pieces)
        if self.threads == 1 or total < _PARALLEL_FROM:
            _copy_share(pieces)
            return
        shares = _shares(pieces, self.threads)
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="objckpt-copy"
                )
            futures = [self._pool.submit(_copy_share, share) for share in shares[1:]]
            try:
                _copy_share(shares[0])
            finally:
                # Every share must have ended before the caller may reuse the views
                # or report an error: no copy may still be writing behind it.
                concurrent.futures.wait(futures)
            for future in futures:
                future.result()

    def close(self) -> None:
        """Stop the pool's threads (a later copy starts a new pool)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
