"""GCS parallel composite uploads against two independent GCS implementations:
fake-gcs-server (Go) and gcp-storage-emulator (Python)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from objckpt import Location, RetryPolicy, UploadOptions
from objckpt.errors import ChecksumMismatchError
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.rules import Seen
from objckpt.testing.servers import FakeGcsServer
from objckpt.writers import open_store
from objckpt.writers.checksum import Crc32c
from objckpt.writers.gcs_compose import CompositeUpload, MediaUpload
from objckpt.writers.generic import GcsStore

MiB = 1 << 20
PART = 5 * MiB


@pytest.fixture(params=["fake-gcs-server", "gcp-storage-emulator"])
def gcs(request: pytest.FixtureRequest) -> StoreTarget:
    name = "fake_gcs_bucket" if request.param == "fake-gcs-server" else "gcs_bucket"
    return request.getfixturevalue(name)


def _store(target: StoreTarget, name: str) -> GcsStore:
    store = open_store(
        Location.parse(target.url(name), target.storage_options),
        UploadOptions(part_size=PART, max_parts_in_flight=4),
    )
    assert isinstance(store, GcsStore)
    return store


def _upload(store: GcsStore, key: str, data: bytes, chunk: int = 3 * MiB + 7) -> CompositeUpload:
    upload = store.begin(key, len(data))
    assert isinstance(upload, CompositeUpload)
    for i in range(0, len(data), chunk):  # writes that straddle piece boundaries
        upload.write(data[i : i + chunk])
    upload.close().result(120)
    return upload


def _names(store: GcsStore) -> list[str]:
    store.forget_listings()
    return sorted(p.rsplit("/", 1)[-1] for p in store._fs.find(store.location.path))


def test_a_large_object_is_composed_from_pieces_and_checked(gcs: StoreTarget) -> None:
    data = os.urandom(3 * PART + 123_456)  # 3 pieces, the last with the tail
    store = _store(gcs, "composite")
    upload = _upload(store, "big.distcp", data)
    crc = Crc32c()
    crc.update(data)
    assert upload.crc32c == crc.hexdigest()
    assert store.read("big.distcp") == data
    assert store.digest("big.distcp") == (len(data), crc.hexdigest())  # GCS's own CRC32C
    assert _names(store) == ["big.distcp"]  # the pieces are gone


@pytest.mark.parametrize(("tail", "pieces"), [(4_731, 3), (PART, 4)], ids=["short", "long"])
def test_a_short_tail_is_no_piece_of_its_own(gcs: StoreTarget, tail: int, pieces: int) -> None:
    """A payload object a few KiB past a multiple of the part size (its tensors'
    frames) made a piece of those few KiB: one more upload, compose source and
    delete (#47). Its pieces now grow a little so as many cover it; a tail of 5 MiB
    or more is still a piece."""
    data = os.urandom(3 * PART + tail)
    store = _store(gcs, "tail")
    upload = _upload(store, "t.distcp", data)
    assert len(upload._pieces) == pieces
    assert store.read("t.distcp") == data
    assert _names(store) == ["t.distcp"]


def test_objects_up_to_two_parts_go_up_in_one_request(gcs: StoreTarget) -> None:
    store = _store(gcs, "small")
    assert not isinstance(store.begin("x", 2 * PART), CompositeUpload)


def test_more_than_32_pieces_compose_through_intermediates(fake_gcs_bucket: StoreTarget) -> None:
    data = os.urandom(34 * PART)  # 34 pieces: two intermediate composites, then one
    store = _store(fake_gcs_bucket, "tree")
    _upload(store, "huge.distcp", data, chunk=8 * MiB)
    assert store.read("huge.distcp") == data
    assert _names(store) == ["huge.distcp"]


@pytest.mark.parametrize(("parts", "composed"), [(2, False), (5, True)], ids=["two", "five"])
def test_an_object_of_unknown_size_goes_in_one_request_up_to_two_parts_then_composed(
    gcs: StoreTarget, parts: int, composed: bool
) -> None:
    """A writer that cannot know an object's size begins it with a hint of 0 (a
    torch_checkpointing file): up to two parts it is one request; a third part hands
    it to a composite upload (never one request of any size, held whole in memory)."""
    store = _store(gcs, f"unknown-{parts}")
    data = os.urandom(parts * PART - 17)
    try:
        upload = store.begin("u.bin", 0)
        assert isinstance(upload, MediaUpload)
        for i in range(0, len(data), 3 * MiB + 7):
            upload.write(data[i : i + 3 * MiB + 7])
        upload.close().result(120)
        assert (upload._composite is not None) is composed
        crc = Crc32c()
        crc.update(data)
        assert upload.crc32c == crc.hexdigest()
        assert store.read("u.bin") == data
        assert store.digest("u.bin") == (len(data), crc.hexdigest())
        assert _names(store) == ["u.bin"]  # no piece left behind
    finally:
        store.close()


@pytest.fixture
def via(fake_gcs_server: FakeGcsServer, fake_gcs_bucket: StoreTarget) -> Iterator[FaultProxy]:
    """A fault proxy in front of fake-gcs-server (pieces go up through it)."""
    with FaultProxy(fake_gcs_server.endpoint_url) as proxy:
        yield proxy


def _proxied(target: StoreTarget, proxy: FaultProxy, name: str) -> GcsStore:
    options = {**target.storage_options, "endpoint_url": proxy.endpoint_url}
    policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=30)
    store = open_store(
        Location.parse(target.url(name), options, policy),
        UploadOptions(part_size=PART, max_parts_in_flight=4),
    )
    assert isinstance(store, GcsStore)
    return store


def _uploads(proxy: FaultProxy) -> list[Seen]:
    """The uploads the proxy saw (POSTs to the upload endpoint; the object's name is
    in the query, which the proxy does not record)."""
    return [s for s in proxy.seen if s.method == "POST" and s.path.startswith("/upload/")]


def test_a_piece_damaged_on_the_way_fails_the_object_and_leaves_nothing(
    fake_gcs_bucket: StoreTarget, via: FaultProxy
) -> None:
    """A piece whose bytes change on the way (one byte flipped in the request the
    proxy forwards): the composite's CRC32C, computed by the server, differs from the
    one objckpt computed while writing; the upload fails naming the object and
    deletes what it made."""
    via.add(Rule(key_contains="piece-0-00001", action="corrupt", nth=1))
    store = _proxied(fake_gcs_bucket, via, "damaged")
    data = os.urandom(3 * PART)
    try:
        upload = store.begin("bad.distcp", len(data))
        upload.write(data)
        with pytest.raises(ChecksumMismatchError, match=r"bad\.distcp: the composed object"):
            upload.close().result(120)
        assert [s.fault for s in _uploads(via) if s.fault] == ["corrupt"]
        assert _names(store) == []
    finally:
        store.close()


def test_a_piece_whose_request_failed_is_sent_again_whole(
    fake_gcs_bucket: StoreTarget, via: FaultProxy
) -> None:
    """A piece goes up streamed from where its bytes lie; a try cut off (a reset
    before the server saw it) is sent again from the piece's first byte, and the
    object is what was written."""
    via.add(Rule(key_contains="piece-0-00001", action="reset", nth=1))
    store = _proxied(fake_gcs_bucket, via, "resent")
    data = os.urandom(3 * PART + 99)
    try:
        upload = store.begin("again.distcp", len(data))
        upload.write_kept(data)
        upload.close().result(120)
        assert store.read("again.distcp") == data
        faults = [s.fault for s in _uploads(via)]
        # Three pieces (the short tail rides with the last), one of them sent twice.
        assert faults.count("reset") == 1 and faults.count(None) == 3, faults
    finally:
        store.close()


def test_a_small_object_damaged_on_the_way_fails_and_is_deleted(
    fake_gcs_bucket: StoreTarget, via: FaultProxy
) -> None:
    """An object of up to two parts goes up in one streamed request; GCS answers with
    the object it made, whose CRC32C is checked against the one computed while the
    bytes were written: a byte flipped on the way fails the upload, naming the
    object, and the damaged object is deleted (gcsfs's upload kept it, unchecked)."""
    via.add(Rule(key_contains="small.distcp", action="corrupt", nth=1))
    store = _proxied(fake_gcs_bucket, via, "small")
    data = os.urandom(PART + 5)
    try:
        upload = store.begin("small.distcp", len(data))
        assert isinstance(upload, MediaUpload)
        upload.write_kept(data)
        with pytest.raises(ChecksumMismatchError, match=r"small\.distcp: GCS made an object"):
            upload.close().result(120)
        assert _names(store) == []  # deleted by the upload itself (no abort called)
        upload = store.begin("small.distcp", len(data))  # the next try is not damaged
        upload.write(data)
        upload.close().result(120)
        assert store.read("small.distcp") == data
        assert [s.fault for s in _uploads(via)] == ["corrupt", None]  # one request a try
    finally:
        store.close()


def test_gc_removes_pieces_a_crash_left_in_a_single_checkpoint(
    fake_gcs_bucket: StoreTarget,
) -> None:
    """A save killed between uploading pieces and composing leaves pieces behind; they
    are objckpt-named, so gc on the checkpoint URL itself (not a manager root) removes
    them, and nothing the manifest names."""
    import torch
    import torch.distributed.checkpoint as dcp

    from objckpt import ObjectStoreWriter
    from objckpt.ops.maintain.gc import collect_garbage

    url = fake_gcs_bucket.url("one")
    dcp.save(
        {"w": torch.ones(8)},
        storage_writer=ObjectStoreWriter(url, storage_options=fake_gcs_bucket.storage_options),
    )
    store = _store(fake_gcs_bucket, "one")
    leftover = "__0_0.0123456789abcdef.distcp.objckpt-piece-0-00002"
    store.put(leftover, b"x" * 10)
    before = _names(store)
    report = collect_garbage(store.location, grace=0, dry_run=False)
    assert report.deleted == (leftover,)
    assert _names(store) == [n for n in before if n != leftover]
