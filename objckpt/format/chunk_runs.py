"""A tensor's stored chunks as runs, for loads that need only the chunks they overlap.

A tensor sharded over W ranks is stored as W chunks, and the manifest keeps their
offsets and sizes as run-folded columns (:mod:`objckpt.format.columns`): a few
numbers per tensor whatever W is. Expanded into DCP ``ChunkStorageMetadata`` on
every rank, they are tensors x W objects (5 million at 4,096 ranks for a
1,200-tensor model), built by every rank and then walked again by DCP's load
planner, when each rank reads a handful of them.

:class:`ChunkRuns` is the ``TensorStorageMetadata.chunks`` objckpt's reader hands
out for a format-2 checkpoint: a read-only sequence that builds a chunk when it is
indexed or iterated, so stock DCP planners and any other consumer work unchanged
(at the old cost), and that answers "which chunks overlap this box" from the runs
(:meth:`ChunkRuns.overlapping`) for :class:`objckpt.LoadPlanner`. Iterating builds
every chunk once and keeps them, so a stock planner pays what a plain list costs. Within a segment
where every column is one arithmetic run, each overlap condition is linear in the
chunk's position, so the matching positions are an interval found by division.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from objckpt.format.columns import Column

__all__ = ["ChunkRuns", "chunk_of"]

#: One segment: its first position, its length, and per dimension the chunk's
#: (offset, offset step, end, end step) at the segment's first position.
_Segment = tuple[int, int, tuple[tuple[int, int, int, int], ...]]


class ChunkRuns(Sequence[ChunkStorageMetadata]):
    """The chunks of one stored tensor, kept as columns of runs.

    Args:
        offsets: One column per dimension: each chunk's offset along it.
        sizes: One column per dimension: each chunk's size along it.
        count: Number of chunks (a 0-d tensor has no columns to tell it).
    """

    __slots__ = ("_built", "_count", "_offsets", "_segments", "_sizes")

    def __init__(self, offsets: Sequence[Column], sizes: Sequence[Column], count: int) -> None:
        if len(offsets) != len(sizes) or any(len(c) != count for c in (*offsets, *sizes)):
            raise ValueError("every chunk column must hold one value per chunk")
        self._offsets, self._sizes, self._count = tuple(offsets), tuple(sizes), count
        self._segments: list[_Segment] | None = None
        #: Every chunk, once something iterated them (a stock planner walks them all,
        #: then indexes them again): built once, as a plain list would hold them.
        self._built: list[ChunkStorageMetadata] | None = None

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> ChunkStorageMetadata: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChunkStorageMetadata]: ...
    def __getitem__(self, i: int | slice) -> ChunkStorageMetadata | list[ChunkStorageMetadata]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"chunk {i} out of range for {self._count} chunks")
        if self._built is not None:
            return self._built[i]
        return ChunkStorageMetadata(
            torch.Size([c[i] for c in self._offsets]), torch.Size([c[i] for c in self._sizes])
        )

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        if self._built is None:
            self._built = list(self._build())
        return iter(self._built)

    def _build(self) -> Iterator[ChunkStorageMetadata]:
        if not self._offsets:
            for _ in range(self._count):
                yield ChunkStorageMetadata(torch.Size(()), torch.Size(()))
            return
        shapes: dict[tuple[int, ...], torch.Size] = {}  # one torch.Size per distinct shape
        offsets = zip(*self._offsets, strict=True)
        for offset, shape in zip(offsets, zip(*self._sizes, strict=True), strict=True):
            size = shapes.get(shape)
            if size is None:
                size = shapes[shape] = torch.Size(shape)
            yield ChunkStorageMetadata(torch.Size(offset), size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == self._count and all(a == b for a, b in zip(self, other, strict=False))

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))  # pickles as the list DCP's own metadata holds

    def __repr__(self) -> str:
        runs = max((len(c.starts) for c in (*self._offsets, *self._sizes)), default=0)
        return f"ChunkRuns({self._count} chunks, at most {runs} runs per column)"

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Positions, ascending, of the chunks overlapping the box at ``offsets`` of
        ``sizes``, by DCP's own rule: along every dimension each starts before the
        other ends (so an empty box or chunk overlaps only what strictly contains it).

        Costs O(segments x dimensions) plus the positions returned, where a segment
        is a stretch of positions over which every column is one run.
        """
        ndim = len(self._offsets)
        if len(offsets) != ndim or len(sizes) != ndim:
            raise ValueError(f"a box of {len(offsets)} dimensions against {ndim}")
        if not ndim:
            return list(range(self._count))
        bounds = [(lo, lo + size) for lo, size in zip(offsets, sizes, strict=True)]
        out: list[int] = []
        for first, length, dims in self._segmented():
            low, high = 0, length
            for (off, off_step, end, end_step), (box_lo, box_hi) in zip(dims, bounds, strict=True):
                # chunk offset < box end, and box offset < chunk end (as -end < -box_lo)
                a, b = _below(off, off_step, box_hi, length)
                c, d = _below(-end, -end_step, -box_lo, length)
                low, high = max(low, a, c), min(high, b, d)
                if low >= high:
                    break
            else:
                out.extend(range(first + low, first + high))
        return out

    def _segmented(self) -> list[_Segment]:
        """Stretches of positions over which every column is one run (cached)."""
        if self._segments is not None:
            return self._segments
        cols = [*self._offsets, *self._sizes]
        cuts = sorted({f for c in cols for f in c.firsts} | {self._count})
        at = [0] * len(cols)  # each column's current run
        segments: list[_Segment] = []
        ndim = len(self._offsets)
        for first, nxt in itertools.pairwise(cuts):
            heads = []
            for n, col in enumerate(cols):
                k = at[n]
                while k + 1 < len(col.firsts) and col.firsts[k + 1] <= first:
                    k += 1
                at[n] = k
                heads.append((col.starts[k] + col.steps[k] * (first - col.firsts[k]), col.steps[k]))
            dims = tuple(
                (o, so, o + s, so + ss)
                for (o, so), (s, ss) in zip(heads[:ndim], heads[ndim:], strict=True)
            )
            segments.append((first, nxt - first, dims))
        self._segments = segments
        return segments


def _below(a: int, b: int, c: int, n: int) -> tuple[int, int]:
    """The positions ``k`` in ``[0, n)`` with ``a + b * k < c``, as ``[low, high)``."""
    if b == 0:
        return (0, n) if a < c else (0, 0)
    if b > 0:  # k < (c - a) / b
        return 0, min(n, -((a - c) // b))
    return max(0, (a - c) // -b + 1), n  # k > (a - c) / -b


def chunk_of(md: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata | None:
    """The stored chunk ``index`` names: by its position when that chunk has its
    offsets (what DCP's planners produce: one chunk built), else by a scan."""
    chunks = md.chunks
    pos = index.index
    if pos is not None and 0 <= pos < len(chunks):
        chunk = chunks[pos]
        if tuple(chunk.offsets) == tuple(index.offset or ()):
            return chunk
    offset = tuple(index.offset or ())
    return next((c for c in chunks if tuple(c.offsets) == offset), None)
