"""S3 uploads: multipart for large objects, one PUT for small ones, abort on failure."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
import torch
from helpers import carried, load, save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from objckpt import ObjectStoreReader, UploadOptions
from objckpt.format.layout import is_objckpt_payload
from objckpt.testing import MotoServer
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store
from objckpt.writers import s3_upload as s3_writers
from objckpt.writers.body import StreamedBody
from objckpt.writers.location import Location

MiB = 1024 * 1024


def _objects(moto: MotoServer, prefix: str) -> dict[str, dict]:
    client = moto.boto3_client()
    out = client.list_objects_v2(Bucket="objckpt-test", Prefix=prefix).get("Contents", [])
    return {o["Key"].rsplit("/", 1)[-1]: o for o in out}


def test_large_objects_go_multipart_small_ones_single(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    state = {"big": torch.randn(4 * MiB), "small": torch.randn(100)}  # 16 MiB + tiny
    opts = UploadOptions(part_size=5 * MiB, object_size=8 * MiB)
    save(state, s3_bucket.url("c"), s3_bucket, upload=opts)
    reader = ObjectStoreReader(s3_bucket.url("c"), storage_options=s3_bucket.storage_options)
    assert reader.manifest is not None
    objs = _objects(moto_server, "t/c/")
    payload = {k: v for k, v in objs.items() if is_objckpt_payload(k)}
    multipart = [k for k, v in payload.items() if "-" in v["ETag"]]
    single = [k for k, v in payload.items() if "-" not in v["ETag"]]
    assert len(multipart) == 1 and payload[multipart[0]]["Size"] > 16 * MiB
    # 16 MiB and a frame: three 6 MiB parts, not three of 5 MiB and a fourth of 1 MiB
    assert payload[multipart[0]]["ETag"].strip('"').endswith("-3")
    assert len(single) == 1
    client = moto_server.boto3_client()
    assert not client.list_multipart_uploads(Bucket="objckpt-test").get("Uploads")


def test_tensors_fill_object_size_without_counting_their_frames(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """Tensors are packed up to ``object_size`` of their own bytes: four tensors of a
    quarter of it make one object. Counting each tensor's frame (a KiB or so) against
    it left the fourth for the next object, one object (a Create and a Complete) more
    per three tensors (#47)."""
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(5 * MiB // 4, generator=gen) for i in range(8)}  # 5 MiB each
    url = s3_bucket.url("fill")
    save(state, url, s3_bucket, upload=UploadOptions(part_size=5 * MiB, object_size=20 * MiB))
    payload = {k: v for k, v in _objects(moto_server, "t/fill/").items() if is_objckpt_payload(k)}
    assert len(payload) == 2
    assert all(20 * MiB < v["Size"] < 20 * MiB + 16 * 1024 for v in payload.values())
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, url, s3_bucket)
    assert all(torch.equal(got[k], v) for k, v in state.items())


class _FailOn(DefaultSavePlanner):
    """Fails while serializing one tensor, after earlier parts are in flight."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def resolve_data(self, write_item: WriteItem):  # type: ignore[override]
        if write_item.index.fqn == self.fqn:
            raise RuntimeError(f"injected failure on {self.fqn}")
        return super().resolve_data(write_item)


def test_failure_mid_object_aborts_the_upload(
    s3_bucket: StoreTarget, moto_server: MotoServer, s3_proxy
) -> None:
    state = {"a": torch.randn(4 * MiB), "b": torch.randn(4 * MiB)}
    opts = UploadOptions(part_size=5 * MiB, object_size=64 * MiB)  # both tensors in one object
    import torch.distributed.checkpoint as dcp
    from helpers import quiet

    from objckpt import ObjectStoreWriter

    writer = ObjectStoreWriter(
        s3_bucket.url("c"), storage_options=s3_proxy.storage_options(), upload=opts
    )
    with quiet(), pytest.raises(BaseException) as info:
        dcp.save(state, storage_writer=writer, planner=_FailOn("b"))
    assert "injected failure" in str(carried(info.value))

    # "a" (16 MiB) had gone out as parts of a multipart upload, which was then aborted
    # (the preflight's probe upload, begun and aborted at another key, aside).
    def payload_requests(operation: str) -> int:
        return sum(".distcp" in p for p in s3_proxy.paths(operation))

    assert payload_requests("CreateMultipartUpload") == 1
    assert payload_requests("UploadPart") >= 2
    assert payload_requests("AbortMultipartUpload") == 1
    client = moto_server.boto3_client()
    assert not client.list_multipart_uploads(Bucket="objckpt-test").get("Uploads"), (
        "upload left open"
    )
    assert "manifest.json" not in _objects(moto_server, "t/c/")


def test_every_upload_carries_its_crc32c_and_the_sdk_hashes_nothing_more(
    s3_bucket: StoreTarget, s3_proxy
) -> None:
    """objckpt checksums each PUT and part once and sends it (S3 verifies it in
    transit); botocore's own CRC and the SigV4 payload SHA256 are off."""
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    state = {"big": torch.randn(4 * MiB), "small": torch.ones(3)}  # 16 MiB in 5 MiB parts
    save(state, target.url("c"), target, upload=UploadOptions(part_size=5 * MiB))
    uploads = [s for s in s3_proxy.seen if s.operation in ("PutObject", "UploadPart")]
    assert {s.operation for s in uploads} == {"PutObject", "UploadPart"}
    for seen in uploads:
        headers = dict(seen.amz)
        assert seen.crc32c_ok is True, (seen.path, headers)
        assert headers.get("x-amz-content-sha256") == "UNSIGNED-PAYLOAD", seen.path
        others = [
            h for h in headers if h.startswith("x-amz-checksum-") and h != "x-amz-checksum-crc32c"
        ]
        assert others == [], (seen.path, others)
    got = {"big": torch.zeros(4 * MiB), "small": torch.zeros(3)}
    load(got, target.url("c"), target)
    assert torch.equal(got["big"], state["big"]) and torch.equal(got["small"], state["small"])


@pytest.mark.parametrize("kept", [False, True], ids=["copied", "copied-and-kept"])
@pytest.mark.parametrize(
    "sizes", [[3, 70_000, 5 * MiB + 17, 9], [6 * MiB, 4 * MiB + 1, 6 * MiB + 100]]
)
def test_upload_returns_each_writes_crc32c_and_hashes_parts_from_the_same_pieces(
    s3_bucket: StoreTarget, s3_proxy, sizes: list[int], kept: bool
) -> None:
    """Writes that straddle part boundaries, short and long: the CRC32C returned for
    each write, the part checksums S3 verified and the object's CRC32C all match an
    independent hash of the same bytes (each byte is hashed once inside the upload).
    ``kept``: every other write is sent from the caller's buffer (``write_kept``)."""
    import os

    import crc32c

    from objckpt.options import UploadOptions as Opts
    from objckpt.writers import open_store
    from objckpt.writers.location import Location

    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    store = open_store(
        Location.parse(target.url("crc"), storage_options=target.storage_options),
        Opts(part_size=5 * MiB),
    )
    try:
        chunks = [os.urandom(n) for n in sizes]
        upload = store.begin("obj", sum(sizes))
        returned = [
            upload.write_kept(c) if kept and n % 2 else upload.write(c)
            for n, c in enumerate(chunks)
        ]
        upload.close().result()
        assert returned == [crc32c.crc32c(c) for c in chunks]
        assert upload.crc32c == f"{crc32c.crc32c(b''.join(chunks)):08x}"
        parts = [s for s in s3_proxy.seen if s.operation in ("PutObject", "UploadPart")]
        part = Opts(part_size=5 * MiB).part_size_for(sum(sizes))  # grown past a short tail
        # up to two parts: one PUT
        assert len(parts) == (1 if sum(sizes) <= 2 * part else -(-sum(sizes) // part))
        assert all(p.crc32c_ok is True for p in parts)
        assert store.read("obj") == b"".join(chunks)
    finally:
        store.close()


def test_streamed_body_sends_views_and_rewinds_like_a_file() -> None:
    data = bytearray(range(256)) * 9  # 2,304 bytes
    body = StreamedBody(data, chunk=1000)

    async def collect() -> list[memoryview]:
        return [chunk async for chunk in body]

    chunks = asyncio.run(collect())
    assert [len(c) for c in chunks] == [1000, 1000, 304]
    assert all(c.obj is chunks[0].obj for c in chunks)  # views of one buffer: no copies
    assert b"".join(chunks) == bytes(data)
    assert len(body) == 2304
    assert body.read(10) == bytes(data[:10]) and body.tell() == 10
    assert body.read() == bytes(data[10:]) and body.read() == b""
    assert body.seek(0) == 0 and body.read(3) == bytes(data[:3])  # botocore's rewind
    assert body.seek(-4, 2) == 2300 and body.read() == bytes(data[-4:])
    # Each send streams the whole body again, wherever a read left the position.
    assert b"".join(asyncio.run(collect())) == bytes(data)


def test_streamed_body_of_several_pieces_reads_seeks_and_streams_them_in_order() -> None:
    pieces = [b"head", bytearray(range(256)) * 5, memoryview(b"")[:0], b"tail!"]
    whole = b"".join(bytes(p) for p in pieces)
    body = StreamedBody(pieces, chunk=100)

    async def collect() -> list[memoryview]:
        return [chunk async for chunk in body]

    chunks = asyncio.run(collect())
    assert b"".join(chunks) == whole and len(body) == len(whole) == 1289
    assert max(len(c) for c in chunks) == 100
    assert body.read(6) == whole[:6]  # across the first boundary
    assert body.read(1280) == whole[6:1286] and body.tell() == 1286
    assert body.read() == whole[1286:] and body.read() == b""
    assert body.seek(2) == 2 and body.read(3) == whole[2:5]
    assert body.seek(-7, 2) == 1282 and body.read() == whole[-7:]
    # Read in small steps (as an SDK hashing the body reads it), across every piece.
    body.seek(0)
    steps = list(iter(lambda: body.read(7), b""))
    assert b"".join(steps) == whole and {len(r) for r in steps[:-1]} == {7}


@pytest.mark.parametrize("parts", [1, 3], ids=["one-put", "multipart"])
def test_write_kept_sends_the_callers_bytes_and_write_copies_them(
    s3_bucket: StoreTarget, monkeypatch: pytest.MonkeyPatch, parts: int
) -> None:
    """The request bodies are views of what ``write_kept`` got (no copy), never of
    what ``write`` got (copied), and the object holds both in order."""
    sources: list[object] = []

    class Recording(StreamedBody):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            sources.extend(v.obj for v in self._views)

    monkeypatch.setattr(s3_writers, "StreamedBody", Recording)
    store = open_store(
        Location.parse(s3_bucket.url("kept"), s3_bucket.storage_options),
        UploadOptions(part_size=5 * MiB),
    )
    try:
        half = {1: 2 * MiB, 3: 8 * MiB}[parts]  # 16 MiB in 5 MiB parts: three parts of 6
        kept, copied = bytearray(b"k" * half), bytearray(b"c" * half)
        upload = store.begin("obj", len(kept) + len(copied))
        upload.write(copied)
        upload.write_kept(kept)
        upload.close().result(timeout=60)
        assert store.read("obj") == bytes(copied) + bytes(kept)
    finally:
        store.close()
    assert any(o is kept for o in sources)
    assert not any(o is copied for o in sources)


def test_sync_save_sends_tensors_from_their_own_memory(
    s3_bucket: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous save copies no tensor into part buffers: each tensor's bytes go
    to S3 as a view of the tensor's memory (frame head and tail are the only copies),
    in single PUTs and multipart parts alike."""
    owners: list[torch.Tensor] = []

    class Recording(StreamedBody):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            owners.extend(v.obj.owner for v in self._views if hasattr(v.obj, "owner"))

    monkeypatch.setattr(s3_writers, "StreamedBody", Recording)
    state = {"big": torch.randn(4 * MiB), "small": torch.randn(1000)}  # 16 MiB: multipart
    url = s3_bucket.url("sync-views")
    save(state, url, s3_bucket, upload=UploadOptions(part_size=5 * MiB))
    sent_from = {t.data_ptr() for t in owners}
    assert {state["big"].data_ptr(), state["small"].data_ptr()} <= sent_from
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, url, s3_bucket)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_finished_parts_are_freed_without_waiting_for_a_garbage_collection(
    s3_bucket: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part's buffer goes when its request ends. Held by a reference cycle instead
    (tenacity's retry state closing over the request's arguments), every part of a save
    stayed in memory until the next collection: ~10 parts per upload worker."""
    alive: weakref.WeakSet[StreamedBody] = weakref.WeakSet()

    class Tracked(StreamedBody):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            alive.add(self)

    monkeypatch.setattr(s3_writers, "StreamedBody", Tracked)
    store = open_store(
        Location.parse(s3_bucket.url("freed"), s3_bucket.storage_options),
        UploadOptions(part_size=5 * MiB),
    )
    gc.collect()
    gc.disable()  # as between two of a long-lived worker's rare collections
    try:
        upload = store.begin("big.bin", 15 * MiB)
        upload.write(bytes(15 * MiB))
        upload.close().result(timeout=60)
        store.put("small.bin", b"x" * 100)
        sent = len(alive)
        del upload
        assert sent == 0, f"{sent} request bodies still referenced after their requests"
    finally:
        gc.enable()
        store.close()


def test_multipart_uploads_keep_a_full_object_crc32c_that_digest_reports(
    s3_bucket: StoreTarget, s3_proxy
) -> None:
    """CreateMultipartUpload asks for ChecksumType=FULL_OBJECT and the Complete sends
    the CRC32C combined from the parts', so the store keeps the object's CRC32C and
    ``digest()`` answers from a HEAD: copies and backups need not read the object."""
    import crc32c

    from objckpt.writers.checksum import to_base64

    store = open_store(
        Location.parse(s3_bucket.url("full"), s3_proxy.storage_options()),
        UploadOptions(part_size=5 * MiB),
    )
    try:
        data = bytes(range(256)) * (16 * MiB // 256) + b"tail"
        upload = store.begin("obj.bin", len(data))
        upload.write(data)
        upload.close().result(timeout=60)
        want = f"{crc32c.crc32c(data):08x}"
        assert upload.crc32c == want
        assert store.digest("obj.bin") == (len(data), want)
    finally:
        store.close()
    (create,) = [s for s in s3_proxy.seen if s.operation == "CreateMultipartUpload"]
    assert dict(create.amz).get("x-amz-checksum-type") == "FULL_OBJECT"
    (complete,) = [s for s in s3_proxy.seen if s.operation == "CompleteMultipartUpload"]
    sent = dict(complete.amz)
    assert sent.get("x-amz-checksum-crc32c") == to_base64(crc32c.crc32c(data))
    assert sent.get("x-amz-checksum-type") == "FULL_OBJECT"


def test_a_store_refusing_full_object_crc32c_gets_todays_uploads_and_is_asked_once(
    s3_bucket: StoreTarget, s3_proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """An S3-compatible store that answers 400 to ChecksumType=FULL_OBJECT: the upload
    goes on with per-part checksums, a warning names the store once, and later uploads
    through the same client (a later save's store included) do not ask again."""
    import logging

    from objckpt.testing import Rule

    s3_proxy.add(
        Rule(operation="CreateMultipartUpload", status=400, code="InvalidArgument", times=1)
    )
    loc = Location.parse(s3_bucket.url("plain"), s3_proxy.storage_options())
    data = b"x" * (16 * MiB)
    first = open_store(loc, UploadOptions(part_size=5 * MiB))
    second = first.child("later")
    try:
        with caplog.at_level(logging.WARNING, logger="objckpt.writers"):
            for store, key in ((first, "a.bin"), (first, "b.bin"), (second, "c.bin")):
                upload = store.begin(key, len(data))
                upload.write(data)
                upload.close().result(timeout=60)
                assert store.read(key) == data
                assert store.digest(key) == (len(data), None)  # read back when checked
    finally:
        second.close()
        first.close()
    creates = [dict(s.amz) for s in s3_proxy.seen if s.operation == "CreateMultipartUpload"]
    asked = [c.get("x-amz-checksum-type") for c in creates]
    assert asked == ["FULL_OBJECT", None, None, None]  # refused, then a.bin again, b, c
    warnings = [r for r in caplog.records if "full-object CRC32C" in r.getMessage()]
    assert len(warnings) == 1 and s3_bucket.url("plain") in warnings[0].getMessage()
