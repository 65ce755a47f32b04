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

from collections.abc import Sequence
from typing import Any

from objckpt.errors import ManifestError

__all__ = ["pack", "unpack"]


def pack(values: Sequence[int]) -> Any:
    """``values`` as the shorter of a plain list and its run encoding."""
    n = len(values)
    if n < 4:
        return list(values)
    runs: list[int] = []
    i = 0
    while i < n:
        start = values[i]
        if i + 1 == n:
            runs += [start, 0, 1]
            break
        step = values[i + 1] - start
        j = i + 1
        while j + 1 < n and values[j + 1] - values[j] == step:
            j += 1
        runs += [start, step, j - i + 1]
        i = j + 1
        if len(runs) >= n:  # irregular: a list is shorter
            return list(values)
    return {"runs": runs}


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
