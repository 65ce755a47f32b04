"""``.metadata`` written a batch at a time (format/metadata_stream.py): the same
``Metadata`` a plain pickle gives, through C's and Python's unpicklers, with the
pickler's memory bounded by a batch."""

from __future__ import annotations

import pickle
import pickletools

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from objckpt._torch import storage_info
from objckpt.format.metadata_stream import BATCH, MetadataStream


def _metadata(ranks: int, tensors: int) -> tuple[Metadata, list[dict[MetadataIndex, object]]]:
    """A row-sharded save: every tensor chunked over ``ranks``, one item per chunk,
    each rank's items in objects whose names (one string object per object) many
    items share, each item's key sharing its chunk's offsets, plus a bytes value and
    a compressed item (transform descriptors)."""
    sd_md: dict[str, object] = {}
    by_rank: list[dict[MetadataIndex, object]] = [{} for _ in range(ranks)]
    paths = [[f"__{r}_{o}.cafe.distcp" for o in range(3)] for r in range(ranks)]
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunks = [
            ChunkStorageMetadata(torch.Size([r * 4, 0]), torch.Size([4, 16])) for r in range(ranks)
        ]
        sd_md[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([4 * ranks, 16]), chunks
        )
        for r, chunk in enumerate(chunks):
            descriptors = ["zstd"] if (t + r) % 7 == 0 else None
            by_rank[r][MetadataIndex(fqn, chunk.offsets, r)] = storage_info(
                paths[r][t % 3], t * 1000, 128 + r, descriptors
            )
    sd_md["step"] = BytesStorageMetadata()
    by_rank[0][MetadataIndex("step")] = storage_info(paths[0][0], 9, 5)
    storage = {i: s for items in by_rank for i, s in items.items()}
    meta = Metadata(
        sd_md,
        planner_data={fqn: tuple(fqn.split(".")) for fqn in sd_md},
        storage_data=storage,
        storage_meta=StorageMeta("s3://b/run/step", "0123456789abcdef"),
        version="1.0.0",
    )
    return meta, by_rank


def _stream(meta: Metadata, by_rank: list[dict[MetadataIndex, object]]) -> bytes:
    stream = MetadataStream()
    stream.begin(meta.state_dict_metadata, meta.planner_data)
    for items in by_rank:
        stream.add(items.items())
    return stream.end(meta.storage_meta, meta.version)


@pytest.mark.parametrize(("ranks", "tensors"), [(1, 1), (2, 3), (5, 70), (64, 40)])
def test_the_stream_unpickles_to_the_same_metadata(ranks: int, tensors: int) -> None:
    """Batches of ``BATCH`` items and a memo reset between them; strings shared across
    batches (the object names) come back right: a GET naming a previous batch's
    entry would give another object's name, offsets or class."""
    meta, by_rank = _metadata(ranks, tensors)
    blob = _stream(meta, by_rank)
    assert pickle.loads(blob) == meta
    assert pickle._loads(blob) == meta  # type: ignore[attr-defined]  # Python's own unpickler
    assert pickle.loads(pickle.dumps(pickle.loads(blob))) == meta
    if ranks * tensors > 2 * BATCH:
        gets = [
            op for op, arg, _ in pickletools.genops(blob) if op.name in ("BINGET", "LONG_BINGET")
        ]
        assert gets  # shared strings and classes are referenced, not written again


def test_the_pickler_memo_is_bounded_by_a_batch() -> None:
    """What bounds the helper's memory: after each batch the pickler remembers only
    DCP's classes, whatever the number of items streamed."""
    meta, by_rank = _metadata(64, 40)
    stream = MetadataStream()
    shared = len(stream._pickler.memo.copy())
    stream.begin(meta.state_dict_metadata, meta.planner_data)
    for items in by_rank:
        stream.add(items.items())
        assert len(stream._pickler.memo.copy()) == shared
    assert pickle.loads(stream.end(meta.storage_meta, meta.version)) == meta


def test_every_memo_number_in_a_batch_fits_one_byte() -> None:
    """The batch size keeps memo numbers below 256 (BINPUT, not the 5-byte LONG_BINPUT)
    for ``storage_data`` entries, whatever the item count."""
    meta, by_rank = _metadata(64, 40)
    stream = MetadataStream()
    stream.begin(meta.state_dict_metadata, meta.planner_data)
    head = len(stream._out.getvalue())
    for items in by_rank:
        stream.add(items.items())
    blob = stream.end(meta.storage_meta, meta.version)
    ops = [op.name for op, _, pos in pickletools.genops(blob) if pos is not None and pos >= head]
    assert "BINPUT" in ops and "LONG_BINPUT" not in ops


def test_the_stream_is_written_in_order() -> None:
    stream = MetadataStream()
    with pytest.raises(RuntimeError, match=r"internal: MetadataStream\.add when it is new"):
        stream.add([])
    stream.begin({}, None)
    with pytest.raises(RuntimeError, match=r"internal: MetadataStream\.begin when it is open"):
        stream.begin({}, None)
    stream.add([])
    assert pickle.loads(stream.end(None, None)) == Metadata({}, None, {}, None, None)
    with pytest.raises(RuntimeError, match=r"internal: MetadataStream\.end when it is ended"):
        stream.end(None, None)
