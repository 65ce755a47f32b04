"""Manifest format 2: integer columns, compact metadata, per-rank index objects; format 1 loads."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import carried, quiet
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import objckpt
from objckpt.errors import ChecksumMismatchError, ManifestError, SizeMismatchError
from objckpt.format import columns
from objckpt.format.dcp_json import StoredItem
from objckpt.format.index import decode_index, decode_metadata, encode_metadata
from objckpt.format.manifest import ObjectEntry

ATTEMPT = "6b0000000000cafe"
DATA = Path(__file__).parent / "data"


# -- columns -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values",
    [
        [],
        [5],
        [0, 4, 8, 12, 16, 20],
        [7] * 100,
        [0, 3, 6, 9, 10, 11, 12, 13, 50],
        list(range(1000, 0, -3)),
    ],
)
def test_columns_round_trip(values: list[int]) -> None:
    assert columns.unpack(columns.pack(values), len(values), "c") == values


def test_regular_columns_fold_into_a_few_numbers_irregular_ones_stay_lists() -> None:
    assert columns.pack(list(range(0, 4096 * 4, 4))) == {"runs": [0, 4, 4096]}
    assert columns.pack([3] * 1023 + [1]) == {"runs": [3, 0, 1023, 1, 0, 1]}
    rng = random.Random(0)
    noise = [rng.randrange(10**6) for _ in range(200)]
    assert columns.pack(noise) == noise


def _greedy_runs(values: list[int]) -> object:
    """The encoding by definition, one element at a time: at each position the run
    starts with the step to the next value and takes every value that continues it."""
    if len(values) < 4:
        return list(values)
    runs: list[int] = []
    i = 0
    while i < len(values):
        if i + 1 == len(values):
            runs += [values[i], 0, 1]
            break
        step, j = values[i + 1] - values[i], i + 1
        while j + 1 < len(values) and values[j + 1] - values[j] == step:
            j += 1
        runs += [values[i], step, j - i + 1]
        i = j + 1
        if len(runs) >= len(values):
            return list(values)
    return {"runs": runs}


def test_pack_equals_the_element_by_element_encoding() -> None:
    """pack finds each run's end by comparing slices; the result must be the one the
    element-by-element definition gives (runs of every length, at every position,
    ending at or one short of the column's end, and irregular columns)."""
    rng = random.Random(3)
    for _ in range(5000):
        n = rng.randint(0, 70)
        values: list[int] = []
        x = rng.randint(-5, 5)
        while len(values) < n:
            step, count = rng.choice([0, 1, -2, 5, 7]), rng.randint(1, 20)
            for _ in range(count):
                values.append(x)
                x += step
            if rng.random() < 0.3:
                x = rng.randint(-50, 50)
        values = values[:n] if rng.random() < 0.7 else [rng.randint(-3, 3) for _ in range(n)]
        assert columns.pack(values) == _greedy_runs(values), values
        assert columns.unpack(columns.pack(values), n, "c") == values


@pytest.mark.parametrize(
    ("doc", "length", "needle"),
    [
        ([1, 2, 3], 4, "3 values, expected 4"),
        ([1, "2"], 2, "integers"),
        ([1, True], 2, "integers"),
        ({"runs": [0, 1]}, 2, "triples"),
        ({"runs": [0, 1, 0]}, 0, "int>=1"),
        ({"runs": [0, 1, 10**12]}, 5, "more than 5"),
        ({"rows": [0, 1, 2]}, 2, "expected a list"),
        ("0,1,2", 3, "expected a list"),
    ],
)
def test_bad_columns_are_refused_by_name(doc, length: int, needle: str) -> None:
    with pytest.raises(ManifestError, match="offsets") as info:
        columns.unpack(doc, length, "offsets")
    assert needle in str(info.value)


# -- compact metadata ------------------------------------------------------------------------
def _simulated(world: int, tensors: int = 6, rows: int = 48):
    """DCP metadata and per-rank items of a row-sharded save over ``world`` ranks."""
    sd: dict = {}
    items: list[dict[MetadataIndex, StoredItem]] = [{} for _ in range(world)]
    per = -(-rows // world)
    for t in range(tensors):
        fqn = f"layers.{t}.w"
        chunks = []
        for r in range(world):
            n = max(0, min(per, rows - r * per))
            chunk = ChunkStorageMetadata(torch.Size([r * per, 0]), torch.Size([n, 8]))
            chunks.append(chunk)
            items[r][MetadataIndex(fqn, chunk.offsets)] = StoredItem(
                f"__{r}_0.{ATTEMPT}.distcp", 100 * t, 90 + t, f"{r * 16 + t:08x}"
            )
        sd[fqn] = TensorStorageMetadata(
            TensorProperties(torch.bfloat16), torch.Size([rows, 8]), chunks
        )
    sd["step"] = BytesStorageMetadata()
    items[0][MetadataIndex("step")] = StoredItem(f"__0_0.{ATTEMPT}.distcp", 900, 12, None)
    return Metadata(sd, planner_data={k: tuple(k.split(".")) for k in sd}), items


@pytest.mark.parametrize("world", [1, 3, 8])
def test_metadata_and_index_round_trip(world: int) -> None:
    meta, items = _simulated(world)
    doc, shards = encode_metadata(meta, items, ATTEMPT)
    doc = json.loads(json.dumps(doc))  # what the manifest really carries
    decoded, locator = decode_metadata(doc, url="s3://b/c")
    assert decoded.state_dict_metadata == meta.state_dict_metadata
    assert decoded.planner_data == meta.planner_data
    assert [s.rank for s in shards] == list(range(world))
    for shard in shards:
        found = decode_index(
            shard.data, rank=shard.rank, attempt=ATTEMPT, metadata=decoded, url=shard.key
        )
        assert found == items[shard.rank]
        for index in found:
            assert locator.shard_of(index, decoded) == shard.rank
    assert locator.shard_of(MetadataIndex("missing"), decoded) is None


def test_compact_metadata_is_smaller_than_dcps_pickle_and_flat_per_rank() -> None:
    sizes = {}
    for world in (8, 64):
        meta, items = _simulated(world, tensors=60, rows=4096)
        doc, shards = encode_metadata(meta, items, ATTEMPT)
        ours = len(json.dumps(doc, separators=(",", ":"))) + sum(len(s.data) for s in shards)
        stock = Metadata(
            meta.state_dict_metadata,
            storage_data={
                i: _StorageInfo(it.relative_path, it.offset, it.length)
                for rank_items in items
                for i, it in rank_items.items()
            },
        )
        assert ours < len(pickle.dumps(stock)), world
        sizes[world] = len(json.dumps(doc)) + len(shards[-1].data)  # what rank W-1 reads
    assert sizes[64] < 1.2 * sizes[8], sizes  # per-rank metadata does not grow with W


def test_an_index_is_refused_for_another_rank_or_attempt_or_damage() -> None:
    meta, items = _simulated(2)
    doc, shards = encode_metadata(meta, items, ATTEMPT)
    decoded, _ = decode_metadata(json.loads(json.dumps(doc)), url="u")
    with pytest.raises(ManifestError, match="belongs to rank 1"):
        decode_index(shards[1].data, rank=0, attempt=ATTEMPT, metadata=decoded, url="idx")
    with pytest.raises(ManifestError, match="idx"):
        decode_index(
            shards[0].data, rank=0, attempt="6b0000000000dead", metadata=decoded, url="idx"
        )
    bad = json.loads(shards[0].data)
    bad["crc32c"] = bad["crc32c"][:-1]
    with pytest.raises(ManifestError, match="8 hex digits"):
        decode_index(json.dumps(bad).encode(), rank=0, attempt=ATTEMPT, metadata=decoded, url="i")
    bad = json.loads(shards[0].data)
    bad["keys"] = ["../../elsewhere"]
    with pytest.raises(ManifestError, match="escapes"):
        decode_index(json.dumps(bad).encode(), rank=0, attempt=ATTEMPT, metadata=decoded, url="i")


def test_a_manifest_whose_writer_column_names_no_rank_is_refused() -> None:
    meta, items = _simulated(2)
    doc, _ = encode_metadata(meta, items, ATTEMPT)
    doc["state_dict"]["layers.0.w"]["writer"] = [0, 5]
    with pytest.raises(ManifestError, match=r"s3://b/c.*not a rank of the index"):
        decode_metadata(doc, url="s3://b/c")


def _objects(shards, payload: int) -> dict[str, ObjectEntry]:
    """A manifest's objects for ``shards``: their index objects and one payload."""
    out = {s.key: ObjectEntry(s.key, len(s.data), "00000000") for s in shards}
    out["p"] = ObjectEntry("p", payload, "00000000")
    return out


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        # A few bytes that would expand into 300M chunks (gigabytes) before any check.
        (
            lambda d: d["state_dict"]["layers.0.w"].update(
                chunks=300_000_000,
                offsets=[{"runs": [0, 0, 300_000_000]}] * 2,
                sizes=[{"runs": [1, 0, 300_000_000]}] * 2,
                writer={"runs": [0, 0, 300_000_000]},
            ),
            "chunk count of 'layers.0.w' is 300000000, more than 387",
        ),
        (
            lambda d: d["state_dict"]["layers.0.w"].update(size=[2**40, 8]),
            "needs more bytes than the checkpoint's",
        ),
        (
            lambda d: d["state_dict"]["layers.0.w"].update(size=[48.0, 8]),
            "expected an integer",
        ),
        (
            lambda d: d["state_dict"]["layers.0.w"]["sizes"].__setitem__(0, [7, 7, 99]),
            "sizes[0] reach 7..99, outside its dimension of 48",
        ),
        (lambda d: d.update(index=["sub/__index_0.json", None]), "directly in the checkpoint"),
    ],
)
def test_counts_and_extents_are_bounded_before_anything_is_expanded(edit, needle: str) -> None:
    meta, items = _simulated(3)
    doc, shards = encode_metadata(meta, items, ATTEMPT)
    doc = json.loads(json.dumps(doc))
    decode_metadata(doc, url="s3://b/c", objects=_objects(shards, 10_000))
    edit(doc)
    with pytest.raises(ManifestError, match="s3://b/c") as info:
        decode_metadata(doc, url="s3://b/c", objects=_objects(shards, 10_000))
    assert needle in str(info.value)


def test_more_chunks_than_the_index_objects_can_place_are_refused() -> None:
    meta, items = _simulated(3)
    doc, shards = encode_metadata(meta, items, ATTEMPT)
    tiny = {s.key: ObjectEntry(s.key, 16, "00000000") for s in shards}  # 2 items each
    tiny["p"] = ObjectEntry("p", 10_000, "00000000")
    with pytest.raises(ManifestError, match="more than the 0 items the index objects"):
        decode_metadata(json.loads(json.dumps(doc)), url="u", objects=tiny)


@pytest.mark.parametrize(
    ("column", "values", "needle"),
    [
        ("fqn", -1, "column 'fqn' reaches -1"),  # would count from the end of the table
        ("key", 5, "column 'key' reaches"),
        ("chunk", 99, "has 3 chunks, not a chunk 99"),
        ("length", -4, "column 'length' reaches -4"),
    ],
)
def test_index_columns_stay_inside_the_tables_they_point_into(
    column: str, values: int, needle: str
) -> None:
    meta, items = _simulated(3)
    doc, shards = encode_metadata(meta, items, ATTEMPT)
    decoded, _ = decode_metadata(json.loads(json.dumps(doc)), url="u")
    bad = json.loads(shards[0].data)
    bad[column] = [values] * (len(bad["crc32c"]) // 8)
    with pytest.raises(ManifestError, match="idx") as info:
        decode_index(json.dumps(bad).encode(), rank=0, attempt=ATTEMPT, metadata=decoded, url="idx")
    assert needle in str(info.value)


# -- on disk ---------------------------------------------------------------------------------
def _sample() -> dict:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1, 2, 3]),
        "scale": torch.tensor(2.5),
        "step": 7,
        "nested": {"lr": 0.5},
    }


def _zeros() -> dict:
    return {
        "w": torch.zeros(3, 4),
        "b": torch.zeros(3, dtype=torch.int64),
        "scale": torch.tensor(0.0),
        "step": 0,
        "nested": {"lr": 0.0},
    }


def _equal(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["w"], b["w"])
        and torch.equal(a["b"], b["b"])
        and ("scale" not in b or torch.equal(a["scale"], b["scale"]))
        and a["step"] == b["step"]
        and a["nested"] == b["nested"]
    )


def test_a_format_1_checkpoint_still_loads(tmp_path) -> None:
    """Written by objckpt before format 2 (tests/format/data/v1, kept byte for byte)."""
    ckpt = tmp_path / "step-0000000001"
    shutil.copytree(DATA / "v1" / "step-0000000001", ckpt)
    reader = objckpt.ObjectStoreReader(f"file://{ckpt}")
    assert reader.manifest is not None and reader.manifest.version == 1
    got = _zeros()
    del got["scale"]  # the format-1 sample predates it
    with quiet():
        dcp.load(got, storage_reader=reader)
    expected = _sample()
    del expected["scale"]
    assert _equal(got, expected)
    with objckpt.CheckpointManager(f"file://{tmp_path}") as mgr:
        got = _zeros()
        del got["scale"]
        assert mgr.load(got) == 1 and _equal(got, expected)


def _saved(tmp_path) -> tuple[str, Path]:
    url = f"file://{tmp_path}/c"
    with quiet():
        dcp.save(_sample(), storage_writer=objckpt.ObjectStoreWriter(url))
    index = next((tmp_path / "c").glob("__index_*.json"))
    return url, index


def test_a_corrupt_index_object_is_refused_naming_it(tmp_path) -> None:
    url, index = _saved(tmp_path)
    data = bytearray(index.read_bytes())
    data[-3] ^= 0x01
    index.write_bytes(bytes(data))
    with pytest.raises(BaseException) as info, quiet():
        dcp.load(_zeros(), storage_reader=objckpt.ObjectStoreReader(url))
    err = carried(info.value)
    assert isinstance(err, ChecksumMismatchError) and index.name in str(err), err


def test_a_truncated_index_object_is_refused_naming_it(tmp_path) -> None:
    url, index = _saved(tmp_path)
    index.write_bytes(index.read_bytes()[:-10])
    with pytest.raises(BaseException) as info, quiet():
        dcp.load(_zeros(), storage_reader=objckpt.ObjectStoreReader(url))
    err = carried(info.value)
    assert isinstance(err, SizeMismatchError) and index.name in str(err), err


def test_a_manifest_naming_an_unlisted_index_object_is_refused(tmp_path) -> None:
    url, index = _saved(tmp_path)
    manifest = tmp_path / "c" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["objects"] = [o for o in doc["objects"] if o["key"] != index.name]
    doc["total_bytes"] = sum(o["size"] for o in doc["objects"])
    manifest.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=f"names index object '{index.name}'"):
        objckpt.ObjectStoreReader(url)


@pytest.mark.parametrize(
    "world, index",
    [
        (3, MetadataIndex("layers.0.w", torch.Size([1, 0]))),  # saved in pieces
        (1, MetadataIndex("layers.0.w", torch.Size([8, 0]))),  # saved whole
        (1, MetadataIndex("layers.9.w", torch.Size([0, 0]))),  # no such tensor
        (1, MetadataIndex("step", torch.Size([0]))),  # bytes, named as a tensor chunk
        (1, MetadataIndex("layers.0.w", torch.Size([0]))),  # too few dimensions
        (1, MetadataIndex("layers.0.w", torch.Size([]))),
        (1, MetadataIndex("layers.0.w", torch.Size([0, 0, 0]))),  # too many
        (1, MetadataIndex("layers.0.w")),  # a tensor, named as a non-tensor value
        (1, MetadataIndex("nothing")),  # no such value
    ],
)
def test_an_item_at_a_chunk_the_metadata_does_not_list_is_refused(
    world: int, index: MetadataIndex
) -> None:
    meta, items = _simulated(world)
    items[0][index] = StoredItem(f"__0_0.{ATTEMPT}.distcp", 0, 4, "00000000")
    with pytest.raises(ManifestError, match=f"rank 0 wrote {index.fqn!r} at .* does not list"):
        encode_metadata(meta, items, ATTEMPT)
