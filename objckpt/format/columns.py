"""Integer columns in JSON, with arithmetic runs folded.

The metadata of a sharded checkpoint is mostly integer columns with a regular
shape: chunk offsets along the sharded dimension step by the shard size, chunk
sizes repeat, the writing rank counts up. Written one record per chunk they grow
as tensors x world size and dominate the manifest (303 MB at 1,024 ranks for a
1,200-tensor model). Folded into runs ``(start, step, count)`` the regular ones
take a few numbers per tensor whatever the world size; an irregular column stays
a plain list, so the encoding is never more than a few bytes larger than a list.

Encoded form: a plain JSON list of ints, or ``{"runs": [start, step, count, ...]}``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any, overload

from objckpt.errors import ManifestError

__all__ = ["Column", "column", "pack", "unpack"]


def pack(values: Sequence[int]) -> Any:
    """``values`` as the shorter of a plain list and its run encoding.

    Each run's end is found by comparing slices with ``range`` (C loops, a
    logarithmic number of them per run), not element by element in Python: a
    column of a tensor sharded over 4,096 ranks is 4,096 values, and the first
    commit of a plan packs a few of them per tensor."""
    values = list(values)
    n = len(values)
    if n < 4:
        return values
    runs: list[int] = []
    i = 0
    while i < n:
        start = values[i]
        if i + 1 == n:
            runs += [start, 0, 1]
            break
        step = values[i + 1] - start
        count = _run_length(values, i, step)
        runs += [start, step, count]
        i += count
        if len(runs) >= n:  # irregular: a list is shorter
            return values
    return {"runs": runs}


def _continues(values: list[int], i: int, m: int, step: int) -> bool:
    """Whether the ``m`` values from ``i`` on are ``values[i] + k * step``."""
    start = values[i]
    if step == 0:
        return values[i : i + m].count(start) == m
    return values[i : i + m] == list(range(start, start + step * m, step))


def _run_length(values: list[int], i: int, step: int) -> int:
    """How many values from ``i`` on (at least 2) continue the run ``values[i] + k * step``."""
    left = len(values) - i
    good, m = 2, 4
    while m < left and _continues(values, i, m, step):  # doubling: a bound
        good, m = m, 2 * m
    if m >= left:  # the doubling reached the end untested
        if _continues(values, i, left, step):
            return left
        m = left
    bad = m  # a prefix this long does not continue the run
    while bad - good > 1:  # bisection: the longest prefix that continues the run
        mid = (good + bad) // 2
        if _continues(values, i, mid, step):
            good = mid
        else:
            bad = mid
    return good


def unpack(doc: Any, length: int, what: str) -> list[int]:
    """Decode a column of exactly ``length`` ints; ManifestError naming ``what`` otherwise."""
    if isinstance(doc, list):
        out = doc
    elif isinstance(doc, dict) and isinstance(doc.get("runs"), list) and len(doc) == 1:
        runs = doc["runs"]
        if len(runs) % 3:
            raise ManifestError(f"{what}: runs must come in (start, step, count) triples")
        out = []
        for k in range(0, len(runs), 3):
            start, step, count = runs[k : k + 3]
            if not all(type(v) is int for v in (start, step, count)) or count < 1:
                raise ManifestError(f"{what}: run {runs[k : k + 3]!r} is not (int, int, int>=1)")
            if len(out) + count > length:
                raise ManifestError(f"{what}: runs hold more than {length} values")
            out.extend(range(start, start + step * count, step) if step else [start] * count)
    else:
        raise ManifestError(f"{what}: expected a list of ints or {{'runs': [...]}}")
    if len(out) != length:
        raise ManifestError(f"{what}: {len(out)} values, expected {length}")
    if doc is out and not all(type(v) is int for v in out):
        raise ManifestError(f"{what}: values must be integers")
    return out


class Column(Sequence[int]):
    """A decoded column that keeps its runs: values computed on demand, never stored.

    A load at scale reads a chunk column of W values per tensor but needs a handful
    of them (the chunks its shard overlaps); expanding every column costs every rank
    tensors x W integers. A ``Column`` answers ``len``, indexing (a binary search
    over its runs) and iteration, and hands its runs to whoever can work on them
    directly (:mod:`objckpt.format.chunk_runs`).

    Attributes:
        firsts: Index of each run's first value (ascending, starting at 0).
        starts: Each run's first value.
        steps: Each run's step.
    """

    __slots__ = ("_length", "firsts", "starts", "steps")

    def __init__(self, firsts: list[int], starts: list[int], steps: list[int], length: int) -> None:
        self.firsts, self.starts, self.steps, self._length = firsts, starts, steps, length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._length))]
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"column index {i} out of range for {self._length} values")
        k = bisect.bisect_right(self.firsts, i) - 1
        return self.starts[k] + self.steps[k] * (i - self.firsts[k])

    def __iter__(self) -> Iterator[int]:
        ends = [*self.firsts[1:], self._length]
        for start, step, first, end in zip(self.starts, self.steps, self.firsts, ends, strict=True):
            count = end - first
            yield from (range(start, start + step * count, step) if step else [start] * count)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other, strict=False))

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))  # pickles as the plain list it stands for

    def __repr__(self) -> str:
        return f"Column({self._length} values in {len(self.starts)} runs)"


def column(doc: Any, length: int, what: str) -> Column:
    """Decode a column of exactly ``length`` ints without expanding its runs (a plain
    list is folded into runs); ManifestError naming ``what`` otherwise.

    Same checks as :func:`unpack`, at a cost of its runs, not its values.
    """
    firsts: list[int] = []
    starts: list[int] = []
    steps: list[int] = []
    if isinstance(doc, list):
        if not all(type(v) is int for v in doc):
            raise ManifestError(f"{what}: values must be integers")
        i, n = 0, len(doc)
        while i < n:
            step = doc[i + 1] - doc[i] if i + 1 < n else 0
            j = i + 1
            while j < n and doc[j] - doc[j - 1] == step:
                j += 1
            firsts.append(i)
            starts.append(doc[i])
            steps.append(step)
            i = j
        total = n
    elif isinstance(doc, dict) and isinstance(doc.get("runs"), list) and len(doc) == 1:
        runs = doc["runs"]
        if len(runs) % 3:
            raise ManifestError(f"{what}: runs must come in (start, step, count) triples")
        total = 0
        for k in range(0, len(runs), 3):
            start, step, count = runs[k : k + 3]
            if not all(type(v) is int for v in (start, step, count)) or count < 1:
                raise ManifestError(f"{what}: run {runs[k : k + 3]!r} is not (int, int, int>=1)")
            if total + count > length:
                raise ManifestError(f"{what}: runs hold more than {length} values")
            firsts.append(total)
            starts.append(start)
            steps.append(step)
            total += count
    else:
        raise ManifestError(f"{what}: expected a list of ints or {{'runs': [...]}}")
    if total != length:
        raise ManifestError(f"{what}: {total} values, expected {length}")
    return Column(firsts, starts, steps, length)
