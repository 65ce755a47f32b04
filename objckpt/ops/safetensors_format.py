"""What a safetensors export is on the store: shard names, headers and the index.

A safetensors file is an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, then the raw bytes. A sharded export is
several such files plus ``model.safetensors.index.json`` (Hugging Face's layout),
whose ``weight_map`` names the file that holds each tensor.

Why shard names carry the export's attempt id (``model-00001-of-00003.<attempt>
.safetensors``): two exports racing to one destination, or a zombie export still
running after another committed, must never write bytes under a name a committed
index points at. Hugging Face tools read shard names from ``weight_map`` and accept
any name there; only the index's name is fixed, and it is the export's commit
(create-only, written last). Exports made before attempt ids (``model-00001-of-00003
.safetensors``) read the same way.

This module holds the naming and the header encoding; writing and committing are
:mod:`objckpt.ops.export`'s, and reading a source to import, which trusts
nothing in it, is :mod:`objckpt.ops.safetensors_read`'s.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import torch

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "Entry",
    "encode_header",
    "index_attempt",
    "index_document",
    "shard_name",
]

INDEX_NAME = "model.safetensors.index.json"

#: torch dtype -> safetensors dtype name (the format's own spelling).
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of an export: its key, shape, dtype as exported and as stored."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as exported (after any conversion)
    source_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def shard_name(n: int, total: int, attempt: str) -> str:
    """Shard ``n`` of ``total`` of export ``attempt``, named as ``save_pretrained``
    names shards plus the attempt id (see the module docstring for why)."""
    return f"model-{n:05d}-of-{total:05d}.{attempt}.safetensors"


def encode_header(entries: list[Entry]) -> bytes:
    """The shard's length-prefixed JSON header, padded so tensor data is 8-byte aligned."""
    fields: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for e in entries:
        fields[e.key] = {
            "dtype": DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [at, at + e.nbytes],
        }
        at += e.nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index_document(
    *,
    total_size: int,
    weight_map: dict[str, str],
    source: str,
    attempt: str,
    crc32c: dict[str, str],
) -> dict[str, Any]:
    """The index Hugging Face reads (``metadata.total_size``, ``weight_map``), plus
    ``metadata.objckpt``: the source, the attempt that wrote it (how a retried commit
    recognises its own index) and each shard's CRC32C (a copy can be checked without
    re-reading the source)."""
    return {
        "metadata": {
            "total_size": total_size,
            "format": "pt",
            "objckpt": {"source": source, "attempt": attempt, "crc32c": crc32c},
        },
        "weight_map": dict(sorted(weight_map.items())),
    }


def index_attempt(raw: bytes) -> str:
    """The attempt id an index records; ``"unknown"`` for one without (written by
    another tool, or by objckpt before attempt ids)."""
    try:
        doc = json.loads(raw)
        return str(doc["metadata"]["objckpt"]["attempt"])
    except (ValueError, KeyError, TypeError):
        return "unknown"
