"""Opt-in compression (#28 item 4): zstd, byte grouping, bounded decoding, stock readers."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import carried
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.api import CheckpointException

import objckpt
from objckpt import AsyncCheckpointer, ObjectStoreReader, ObjectStoreWriter, UploadOptions
from objckpt.dcp.serialize import Framer, serialized_tensor
from objckpt.dcp.transforms import ByteGrouping
from objckpt.errors import ConfigurationError, ManifestError, SizeMismatchError
from objckpt.format.compress import BYTEGROUP, ZSTD, Codec, group_bytes, ungroup_bytes
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.checksum import Crc32c

zstandard = pytest.importorskip("zstandard")


def _state(seed: int = 0) -> dict[str, Any]:
    """Trained-like bf16 weights, fp32 Adam-like moments, integers and a plain value."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(512, 256, generator=g) * 0.02).to(torch.bfloat16),
        "exp_avg": torch.randn(512, 256, generator=g) * 1e-3,
        "exp_avg_sq": torch.rand(4096, generator=g) * 1e-6,
        "ids": torch.arange(1000),
        "step": 12,
    }


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()
    }


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _index_doc(path: str) -> dict[str, Any]:
    (index,) = glob.glob(f"{path}/__index_0.*.json")
    return json.loads(Path(index).read_bytes())


def _file_save(tmp_path: Path, name: str, state: dict[str, Any], **upload: Any) -> str:
    path = str(tmp_path / name)
    dcp.save(state, storage_writer=ObjectStoreWriter(path, upload=UploadOptions(**upload)))
    return path


def test_byte_grouping_is_planes_and_undoes_itself() -> None:
    data = bytes(range(12))
    assert group_bytes(data, 4) == bytes([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])
    assert bytes(ungroup_bytes(group_bytes(data, 4), 4)) == data


@pytest.mark.parametrize("value", ["gzip", "zstd:0", "zstd:23", "bytegroup", "ZSTD", 3])
def test_a_bad_compression_value_names_the_option(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"option compression=.*'bytegroup\+zstd'"):
        UploadOptions(compression=value)


def test_compression_without_zstandard_says_what_to_install(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    with pytest.raises(ConfigurationError, match=r"compression='zstd'.*objckpt\[compress\]"):
        UploadOptions(compression="zstd")
    UploadOptions()  # off needs nothing


def test_off_by_default_stores_what_dcp_stores(tmp_path: Path) -> None:
    """Without the option, each item's stored bytes are the torch.save file DCP's
    writers store, and neither the index nor .metadata mentions a transform."""
    assert UploadOptions().compression is None
    state = _state()
    path = _file_save(tmp_path, "plain", state)
    doc = _index_doc(path)
    assert not {"transforms", "transform", "raw_length"} & set(doc)
    assert json.loads(Path(path, "manifest.json").read_bytes())["version"] == 2
    reader = FileSystemReader(path)
    md = reader.read_metadata()
    framer = Framer()
    for index, info in md.storage_data.items():
        assert info.transform_descriptors is None
        if index.fqn in ("w", "exp_avg"):
            stored = Path(path, info.relative_path).read_bytes()[
                info.offset : info.offset + info.length
            ]
            assert stored == serialized_tensor(state[index.fqn], framer), index.fqn


@pytest.mark.parametrize("compression", ["zstd", "bytegroup+zstd", "bytegroup+zstd:1"])
def test_sync_round_trip_on_s3_is_bit_exact(s3_bucket: StoreTarget, compression: str) -> None:
    state = _state()
    url = s3_bucket.url(compression.replace("+", "-").replace(":", "-"))
    opts = s3_bucket.storage_options
    writer = ObjectStoreWriter(
        url, storage_options=opts, upload=UploadOptions(compression=compression)
    )
    dcp.save(state, storage_writer=writer)
    manifest = writer.last_manifest
    assert manifest is not None
    raw = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    payload = sum(o.size for o in manifest.objects if o.key.endswith(".distcp"))
    assert payload < 0.9 * raw  # stored compressed (bf16 weights and fp32 moments shrink)
    # Readers before format 3 cannot decode transformed items: they must refuse the
    # manifest by its version rather than misread it.
    assert json.loads(manifest.to_json_bytes())["version"] == 3
    got = _blank(state)
    dcp.load(got, storage_reader=ObjectStoreReader(url, storage_options=opts))
    _assert_equal(got, state)


def test_async_round_trip_on_s3_compresses_in_the_workers(s3_bucket: StoreTarget) -> None:
    state = {**_state(1), "zeros": torch.zeros(512, 1024)}  # ~1000x: raw_bytes counts
    url = s3_bucket.url("async")
    opts = s3_bucket.storage_options
    with AsyncCheckpointer(
        storage_options=opts, upload=UploadOptions(compression="bytegroup+zstd")
    ) as ckpt:
        ckpt.save(state, url).result(timeout=120)
    reader = ObjectStoreReader(url, storage_options=opts)
    got = _blank(state)
    dcp.load(got, storage_reader=reader)
    _assert_equal(got, state)
    # The workers recorded what they applied: floats grouped then zstd, the rest zstd.
    (index,) = [k for k in reader.store.listing() if k.startswith("__index_0.")]
    doc = json.loads(reader.store.read(index))
    assert sorted(doc["transforms"]) == [[ZSTD], [ZSTD, BYTEGROUP]]
    assert reader.manifest is not None
    raw = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    payload = sum(o.size for o in reader.manifest.objects if o.key.endswith(".distcp"))
    assert payload < 0.9 * raw


def test_stock_reader_loads_zstd_with_its_default_registry(tmp_path: Path) -> None:
    state = _state(2)
    path = _file_save(tmp_path, "zstd", state, compression="zstd")
    got = _blank(state)
    dcp.load(got, storage_reader=FileSystemReader(path))  # torch's default registry
    _assert_equal(got, state)


def test_stock_reader_loads_byte_grouping_once_registered(tmp_path: Path) -> None:
    state = _state(3)
    path = _file_save(tmp_path, "grouped", state, compression="bytegroup+zstd")
    with pytest.raises(CheckpointException, match="Unknown extension"):
        dcp.load(_blank(state), storage_reader=FileSystemReader(path))
    registry = ExtensionRegistry()
    registry.register(objckpt.ByteGrouping)
    got = _blank(state)
    dcp.load(got, storage_reader=FileSystemReader(path, _extension_registry=registry))
    _assert_equal(got, state)
    assert objckpt.ByteGrouping is ByteGrouping


def _reseal(path: str, key: str, new_payload: bytes, item_row: int, raw_length: int) -> None:
    """Replace payload object ``key`` and make every checksum the reader checks agree
    with it again: the item's CRC32C and raw length in the index, the index's and the
    payload's entries in the manifest (what an attacker who controls the bucket does)."""
    Path(path, key).write_bytes(new_payload)
    (index_path,) = glob.glob(f"{path}/__index_0.*.json")
    doc = json.loads(Path(index_path).read_bytes())
    lengths = doc["length"]
    offsets = doc["offset"]
    assert isinstance(lengths, list) and isinstance(offsets, list)
    lengths[item_row] = len(new_payload) - offsets[item_row]  # the object's last item
    crc = Crc32c()
    crc.update(new_payload[offsets[item_row] :])
    crcs = doc["crc32c"]
    doc["crc32c"] = crcs[: 8 * item_row] + crc.hexdigest() + crcs[8 * item_row + 8 :]
    raws = doc["raw_length"]
    assert isinstance(raws, list)
    raws[item_row] = raw_length
    index_blob = json.dumps(doc, separators=(",", ":")).encode()
    Path(index_path).write_bytes(index_blob)
    manifest = json.loads(Path(path, "manifest.json").read_bytes())
    for entry in manifest["objects"]:
        blob = index_blob if entry["key"] == os.path.basename(index_path) else None
        blob = new_payload if entry["key"] == key else blob
        if blob is not None:
            whole = Crc32c()
            whole.update(blob)
            entry["size"], entry["crc32c"] = len(blob), whole.hexdigest()
    manifest["total_bytes"] = sum(e["size"] for e in manifest["objects"])
    Path(path, "manifest.json").write_bytes(json.dumps(manifest).encode())


def test_a_crafted_oversize_frame_is_refused_naming_the_object(tmp_path: Path) -> None:
    """A zstd frame that would inflate far past the item's declared size is stopped
    at that size, even though every checksum agrees with it."""
    state = {"w": torch.randn(256, 256)}  # one framed item of 262,144 bytes + frame
    path = _file_save(tmp_path, "bomb", state, compression="zstd")
    doc = _index_doc(path)
    declared = doc["raw_length"][0]
    key = doc["keys"][0]
    bomb = zstandard.ZstdCompressor().compress(bytes(64 * 1024 * 1024))  # 64 MiB of zeros
    _reseal(path, key, bomb, 0, declared)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(256, 256)}, storage_reader=ObjectStoreReader(path))
    err = carried(info.value)
    assert isinstance(err, SizeMismatchError)
    assert key in str(err) and "'w'" in str(err)
    assert f"decompresses to more than the {declared} bytes declared" in str(err)


def test_a_declared_size_the_shape_cannot_have_is_refused_before_reading(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 256)}
    path = _file_save(tmp_path, "liar", state, compression="zstd")
    doc = _index_doc(path)
    key = doc["keys"][0]
    payload = Path(path, key).read_bytes()
    _reseal(path, key, payload, 0, 1 << 40)  # claims a terabyte before compression
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(256, 256)}, storage_reader=ObjectStoreReader(path))
    err = carried(info.value)
    assert isinstance(err, ManifestError) and "'w'" in str(err) and str(1 << 40) in str(err)


def test_codec_descriptors_follow_dcp_order() -> None:
    """The first descriptor is undone first, on the stored bytes (how DCP's readers
    walk them): zstd, then the grouping under it."""
    assert Codec(byte_grouping=True).descriptors("bfloat16") == (ZSTD, BYTEGROUP)
    assert Codec(byte_grouping=True).descriptors("int64") == (ZSTD,)
    assert Codec(byte_grouping=False).descriptors("float32") == (ZSTD,)


def test_a_highly_compressible_state_loads(tmp_path: Path) -> None:
    """Zeros shrink ~1000x: the reader's budget for what tensors may claim counts the
    bytes items decode to (manifest raw_bytes), not only the stored ones."""
    state = {"zeros": torch.zeros(1024, 1024), "ones": torch.ones(4096, dtype=torch.bfloat16)}
    path = _file_save(tmp_path, "zeros", state, compression="bytegroup+zstd")
    manifest = json.loads(Path(path, "manifest.json").read_bytes())
    assert manifest["total_bytes"] < 4 * 1024 * 1024 // 100
    got = _blank(state)
    dcp.load(got, storage_reader=ObjectStoreReader(path))
    _assert_equal(got, state)
