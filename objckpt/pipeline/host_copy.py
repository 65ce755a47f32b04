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

Building the pieces checks a dozen properties of every tensor and makes a detached
alias of each: at 10,000 small tensors that took longer than the copy itself. A
reused staging set copies the same sources into the same views save after save, so
the foreground copy keeps its table of byte moves (:class:`PieceTable`) with the
set and revalidates it per save with three reads per tensor: the same address and
still dense with no conjugate or negative bit (dtype, shape, device and type are
the staging set's key, already checked by the scan). Anything else rebuilds it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["HostCopier", "PieceTable", "copy_tensor"]

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


#: (destination address, source address, bytes): one ``memmove`` of a piece table.
_Move = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class PieceTable:
    """The byte moves of one all-raw copy, kept with its staging set for the next save.

    Holds addresses, never the tensors: a table kept between saves must not keep the
    caller's memory alive. So it is only used while the caller's thread waits in the
    copy (the foreground copy), and only once :meth:`fits` has read every source's
    address again this save.
    """

    #: Each source's ``data_ptr()`` when the table was built, in staging order.
    addresses: list[int]
    #: The moves of each thread's share (the first is the caller's).
    shares: list[list[_Move]]
    threads: int

    def fits(self, sources: list[torch.Tensor], threads: int) -> bool:
        """Whether these sources are still copied by exactly these moves.

        The caller's staging set was chosen by the scan's layout, so every source has
        the type, dtype, shape and device it had; what the layout does not see is
        where its bytes are (a rebound ``.data``, a new optimizer state) and whether
        they are still dense and plain (a transposed square matrix keeps its shape
        and address, a conjugate view its dtype).
        """
        return (
            threads == self.threads
            and len(sources) == len(self.addresses)
            and all(
                t.data_ptr() == at
                and type(t) in _PLAIN
                and t.is_contiguous()
                and not t.is_conj()
                and not t.is_neg()
                for t, at in zip(sources, self.addresses, strict=True)  # lengths checked
            )
        )


def _table(pieces: list[_Piece], sources: list[torch.Tensor], threads: int) -> PieceTable | None:
    """The table of ``pieces`` (all raw), or None where one is not raw."""
    if not all(p[3] for p in pieces):
        return None
    total = sum(p[2] for p in pieces)
    shares = [pieces] if threads == 1 or total < _PARALLEL_FROM else _shares(pieces, threads)
    return PieceTable(
        [t.data_ptr() for t in sources],
        [[(p[5], p[4], p[2]) for p in share] for share in shares],
        threads,
    )


def _move_share(share: list[_Move]) -> None:
    for to, at, nbytes in share:
        _memmove(to, at, nbytes)


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
        self._copy_pieces(_pieces(sources, views))

    def _copy_pieces(self, pieces: list[_Piece]) -> None:
        total = sum(p[2] for p in pieces)
        if self.threads == 1 or total < _PARALLEL_FROM:
            _copy_share(pieces)
            return
        self._in_parallel(_copy_share, _shares(pieces, self.threads))

    def _in_parallel(self, work: Callable[[Any], None], shares: Sequence[Any]) -> None:
        """``work`` on each share, the first on this thread and the rest on the pool."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="objckpt-copy"
                )
            futures = [self._pool.submit(work, share) for share in shares[1:]]
            try:
                work(shares[0])
            finally:
                # Every share must have ended before the caller may reuse the views
                # or report an error: no copy may still be writing behind it.
                concurrent.futures.wait(futures)
            for future in futures:
                future.result()

    def copy_reusing(
        self, sources: list[torch.Tensor], views: list[torch.Tensor], table: PieceTable | None
    ) -> PieceTable | None:
        """Copy host ``sources`` into ``views`` as :meth:`copy` does, by ``table``'s
        moves where it still :meth:`~PieceTable.fits`; returns the table for the next
        copy into these views (None where a pair is not raw).

        Only for a copy the caller waits in: the table holds addresses, and the
        caller's references to ``sources`` keep them valid for the copy's length.
        """
        if table is None or not table.fits(sources, self.threads):
            pieces = _pieces(sources, views)
            table = _table(pieces, sources, self.threads)
            if table is None:
                self._copy_pieces(pieces)
                return None
        self._run_shares(table.shares)
        return table

    def _run_shares(self, shares: list[list[_Move]]) -> None:
        if len(shares) == 1:
            _move_share(shares[0])
            return
        self._in_parallel(_move_share, shares)

    def close(self) -> None:
        """Stop the pool's threads (a later copy starts a new pool)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
