"""DCP's stream-transform extensions (``_extensions`` / ``_extension_registry``) on objckpt.

The same checks torch's own extension tests make of its FileSystemWriter/Reader
(a Rot13-style transform and ZStandard, round trip and unknown descriptors), run
against objckpt's writer and reader, and across them and torch's stock ones.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import IO, Any, cast

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import carried
from reuse_helpers import stored_items
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.api import CheckpointException

from objckpt import Location, ObjectStoreReader, ObjectStoreWriter, UploadOptions
from objckpt.errors import ConfigurationError, ManifestError
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store


class Rot13(StreamTransformExtension):
    """Adds 13 to every byte on write, subtracts on read: not its own inverse, so a
    reader that skipped it, or applied it the wrong way, would not load."""

    @staticmethod
    def registry_name() -> str:
        return "stream.rot13"

    @staticmethod
    def from_descriptor(version: str) -> Rot13:
        if version != "1":
            raise ValueError(f"unknown rot13 version {version!r}")
        return Rot13()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], _Shift(output, 13))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(bytes((b - 13) % 256 for b in input.read()))


class _Shift(io.RawIOBase):
    def __init__(self, output: IO[bytes], by: int) -> None:
        super().__init__()
        self.output, self.by = output, by

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b).cast("B"))
        self.output.write(bytes((x + self.by) % 256 for x in data))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.output.close()
        super().close()


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "step": 3,
        "meta": {"name": "run"},
    }


def _blank() -> dict[str, Any]:
    return {
        "w": torch.zeros(64, 32),
        "b": torch.zeros(32, dtype=torch.bfloat16),
        "step": 0,
        "meta": {"name": ""},
    }


def _check(got: dict[str, Any]) -> None:
    want = _state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert got["step"] == 3 and got["meta"] == {"name": "run"}


def _registry() -> ExtensionRegistry:
    registry = ExtensionRegistry()
    registry.register(Rot13)
    return registry


@pytest.mark.parametrize("make", [Rot13, ZStandard], ids=["rot13", "zstd"])
def test_extensions_round_trip_through_objckpt_on_s3(
    s3_bucket: StoreTarget, make: type[StreamTransformExtension]
) -> None:
    url, opts = s3_bucket.url(make.__name__), s3_bucket.storage_options
    writer = ObjectStoreWriter(url, storage_options=opts, _extensions=[make()])
    dcp.save(_state(), storage_writer=writer)
    _assert_stored_transformed(url, s3_bucket, make)
    got = _blank()
    reader = ObjectStoreReader(url, storage_options=opts, _extension_registry=_registry())
    dcp.load(got, storage_reader=reader)
    _check(got)


#: What a stored item begins with once transformed: torch.save's zip header shifted by
#: Rot13, or a zstd frame's magic number. Untransformed, it would begin b"PK\x03\x04".
_STORED_HEAD = {
    "Rot13": bytes((b + 13) % 256 for b in b"PK\x03\x04"),
    "ZStandard": b"\x28\xb5\x2f\xfd",
}


def _assert_stored_transformed(
    url: str, target: StoreTarget, make: type[StreamTransformExtension]
) -> None:
    """Every tensor item is stored transformed (a writer that ignored ``_extensions``
    would round-trip too): its descriptors recorded, its stored bytes transformed."""
    store = open_store(Location.parse(url, target.storage_options))
    tensors = {i: item for i, item in stored_items(url, target).items() if i.fqn in ("w", "b")}
    assert len(tensors) == 2, tensors
    for index, item in tensors.items():
        assert item.transform_descriptors == (make().get_descriptor(),), (index, item)
        head = store.read(item.relative_path)[item.offset : item.offset + 4]
        assert head == _STORED_HEAD[make.__name__], (index.fqn, head)


def test_an_unknown_descriptor_is_refused_naming_it(s3_bucket: StoreTarget) -> None:
    url, opts = s3_bucket.url("rot13"), s3_bucket.storage_options
    dcp.save(
        _state(), storage_writer=ObjectStoreWriter(url, storage_options=opts, _extensions=[Rot13()])
    )
    with pytest.raises(CheckpointException) as info:
        dcp.load(_blank(), storage_reader=ObjectStoreReader(url, storage_options=opts))
    err = carried(info.value)
    assert isinstance(err, ManifestError)
    assert "'stream.rot13/1'" in str(err) and "_extension_registry" in str(err)


@pytest.mark.parametrize("make", [Rot13, ZStandard], ids=["rot13", "zstd"])
def test_objckpt_written_extensions_load_with_torchs_reader(
    tmp_path: Path, make: type[StreamTransformExtension]
) -> None:
    path = str(tmp_path / "ckpt")
    dcp.save(_state(), storage_writer=ObjectStoreWriter(path, _extensions=[make()]))
    got = _blank()
    dcp.load(got, storage_reader=FileSystemReader(path, _extension_registry=_registry()))
    _check(got)


@pytest.mark.parametrize("make", [Rot13, ZStandard], ids=["rot13", "zstd"])
def test_torch_written_extensions_load_with_objckpts_reader(
    tmp_path: Path, make: type[StreamTransformExtension]
) -> None:
    path = str(tmp_path / "stock")
    dcp.save(_state(), storage_writer=FileSystemWriter(path, _extensions=[make()]))
    got = _blank()
    dcp.load(got, storage_reader=ObjectStoreReader(path, _extension_registry=_registry()))
    _check(got)


def test_compression_and_extensions_are_one_or_the_other(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="compression='zstd' and _extensions"):
        ObjectStoreWriter(
            str(tmp_path), upload=UploadOptions(compression="zstd"), _extensions=[Rot13()]
        )
    with pytest.raises(ConfigurationError, match="_extensions holds str"):
        ObjectStoreWriter(str(tmp_path), _extensions=cast(Any, ["zstd"]))
