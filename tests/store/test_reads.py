"""Reads past an object's end, as S3-compatible stores answer them (issue #36).

The conformance suite checks the rule on every family
(``StoreConformance.test_a_range_past_the_end_of_an_object_reads_as_empty``); here,
through the fault proxy in front of moto, the answers moto does not give: Ceph RGW's
416 ``InvalidRange`` without a ``Message`` (s3fs then says ``[Errno 22] None``), and
the request s3fs would send for an empty range.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import carried, load, save

from objckpt import Location
from objckpt.errors import ManifestError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store
from objckpt.writers.reads import (
    SpanSink,
    read_bounded,
    read_range,
    read_ranges,
    receive_into,
)

#: 416 InvalidRange with a message that does not say "range" (RGW sends none at all).
TERSE_416 = Rule("GetObject", action="status", status=416, code="InvalidRange")


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


def test_a_416_is_judged_by_its_code_not_its_text(via: StoreTarget, s3_proxy: FaultProxy) -> None:
    """A bounded read of an empty object answered as RGW answers it (416
    ``InvalidRange``, no message that says "range") reads as empty."""
    store = open_store(Location.parse(via.url("x"), via.storage_options))
    try:
        store.put("empty.json", b"")
        s3_proxy.add(TERSE_416)
        assert read_bounded(store._fs, store.path("empty.json"), 1000) == b""
        assert read_ranges(store._fs, [store.path("empty.json")], [0], [10]) == [b""]
    finally:
        store.close()
    assert s3_proxy.count("GetObject", faulted=True) == 2


def test_a_manifest_read_answered_416_without_a_message_is_an_empty_manifest(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """A committed step whose manifest reads as RGW answers an empty object's range:
    the load refuses it as a manifest (naming it), not as a store failure."""
    url = via.url("ck")
    save({"w": torch.arange(8.0)}, url, via)
    s3_proxy.add(Rule("GetObject", key_contains=MANIFEST_KEY, status=416, code="InvalidRange"))
    with pytest.raises(BaseException) as info:
        load({"w": torch.zeros(8)}, url, via)
    err = carried(info.value)
    assert isinstance(err, ManifestError), repr(err)
    assert f"{url}/{MANIFEST_KEY}" in str(err), str(err)
    s3_proxy.clear()
    got = empty_like_state({"w": torch.arange(8.0)})
    load(got, url, s3_bucket)
    assert_state_equal(got, {"w": torch.arange(8.0)})


def test_an_empty_range_sends_no_request(via: StoreTarget, s3_proxy: FaultProxy) -> None:
    """s3fs would send ``bytes=2-1`` for an empty range, which S3 ignores as
    malformed and answers with the whole object."""
    store = open_store(Location.parse(via.url("x"), via.storage_options))
    try:
        store.put("five.bin", b"01234")
        s3_proxy.clear()
        assert read_range(store._fs, store.path("five.bin"), 2, 2) == b""
        assert read_ranges(store._fs, [store.path("five.bin")] * 2, [2, 0], [2, 5]) == [
            b"",
            b"01234",
        ]
    finally:
        store.close()
    assert s3_proxy.count("GetObject") == 1


def test_ranges_read_into_sinks_count_what_each_answer_had(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    """``read_ranges_into`` on S3 (streamed) and on a file:// store (read whole, then
    copied): bytes land in the sink's buffers across their edges, a range past the
    end counts as empty, a missing object is its error, an empty range sends no
    request, and an answer longer than its sink is counted, not written past it."""
    for url, options in ((via.url("into"), via.storage_options), (f"file://{tmp_path}/into", {})):
        store = open_store(Location.parse(url, options))
        try:
            store.put("ten.bin", b"0123456789")
            s3_proxy.clear()
            a, b, short = bytearray(3), bytearray(4), bytearray(2)
            got = store.read_ranges_into(
                ["ten.bin", "ten.bin", "ten.bin", "gone.bin", "ten.bin"],
                [2, 12, 4, 0, 0],
                [9, 14, 4, 4, 4],
                [
                    SpanSink([memoryview(a), memoryview(b)]),
                    SpanSink([memoryview(bytearray(2))]),
                    SpanSink([]),
                    SpanSink([memoryview(bytearray(4))]),
                    SpanSink([memoryview(short)]),
                ],
            )
            assert got[:3] == [7, 0, 0], got
            assert isinstance(got[3], FileNotFoundError), got
            assert got[4] == 4 and bytes(short) == b"01", got
            assert bytes(a + b) == b"2345678"
            if url.startswith("s3://"):
                assert s3_proxy.count("GetObject") == 4  # the empty range asked nothing
        finally:
            store.close()


@pytest.mark.parametrize(
    ("mib", "gets"),
    [(16, 1), (40, 3)],
    ids=["a-frames-tail-rides-along", "a-long-tail-is-its-own-get"],
)
def test_a_tensor_is_read_in_range_size_gets_without_a_tail_of_a_few_kib(
    via: StoreTarget, s3_proxy: FaultProxy, mib: int, gets: int
) -> None:
    """A 16 MiB tensor is stored with its frame, 16 MiB and ~1.5 KiB, and was read
    as a 16 MiB GET and a GET of the frame's few KiB (#47): now a tail under a
    quarter of ``range_size`` is read with the piece before it. At 40 MiB the
    pieces are 16, 16 and 8 MiB and a bit: a tail that big is still its own GET."""
    state = {"w": torch.randn(mib * 1024 * 1024 // 4)}
    url = via.url(f"t{mib}")
    save(state, url, via)
    before = len(_payload_gets(s3_proxy))
    got = empty_like_state(state)
    load(got, url, via)
    assert_state_equal(got, state)
    assert len(_payload_gets(s3_proxy)) - before == gets


def _payload_gets(proxy: FaultProxy) -> list[str]:
    return [p for p in proxy.paths("GetObject") if p.endswith(".distcp")]


def test_a_closed_sink_file_counts_what_it_is_given_and_writes_none_of_it() -> None:
    """What azure-storage-blob's ``readinto`` writes to (``SinkFile``): written front
    to back across the sink's buffers, bytes past its end counted, not written; and
    once closed (the download failed or was cancelled, a chunk task of the SDK may
    still run) nothing more reaches the caller's memory."""
    first, second, guard = bytearray(3), bytearray(4), bytearray(2)
    sink = SpanSink([memoryview(first), memoryview(second), memoryview(guard)]).window(0, 7)
    into = sink.file()
    assert into.write(b"abcde") == 5 and into.write(memoryview(b"fghij")) == 5
    assert (bytes(first), bytes(second), bytes(guard)) == (b"abc", b"defg", b"\0\0")
    assert into.received == 10
    first[:], second[:] = b"\0" * 3, b"\0" * 4
    late = sink.file()
    assert late.write(b"ab") == 2
    late.close()
    assert late.write(b"cdefg") == 5 and late.received == 7
    assert (bytes(first), bytes(second)) == (b"ab\0", b"\0" * 4)


class _Body:
    """An aiohttp body's reading surface (``readchunk``) over fixed chunks, recording
    how many were taken; ``None`` stands for the end of an HTTP chunk (``(b"", True)``)."""

    def __init__(self, chunks: list[bytes | None]) -> None:
        self._chunks = list(chunks)
        self.taken = 0

    async def readchunk(self) -> tuple[bytes, bool]:
        if not self._chunks:
            return b"", False
        self.taken += 1
        chunk = self._chunks.pop(0)
        return (b"", True) if chunk is None else (chunk, False)


@pytest.mark.parametrize(
    ("chunks", "length", "count", "taken"),
    [
        ([b"ab", None, b"cde", b"fg"], 7, 7, 3),
        ([b"ab", b"cde", b"fg"], None, 5, 2),
        ([b"abcdef", b"g"], 7, 7, 1),
    ],
    ids=["content-length", "no-length", "the-first-chunk-overflows"],
)
def test_a_body_longer_than_its_sink_is_written_to_its_end_and_not_read_on(
    chunks: list[bytes | None], length: int | None, count: int, taken: int
) -> None:
    """``receive_into`` (S3's and GCS's streamed ranges): chunks land across the
    sink's buffers; the one that overflows the sink is written up to its end only, and
    the body is not read on: counted by its Content-Length, or where none was sent by
    what came so far, either way more than the sink (a store that ignored the Range
    reads as longer than asked)."""
    a, b, guard = bytearray(2), bytearray(2), bytearray(3)
    sink = SpanSink([memoryview(a), memoryview(b), memoryview(guard)]).window(0, 4)
    body = _Body(chunks)
    assert asyncio.run(receive_into(body, sink, length)) == count
    assert (bytes(a), bytes(b), bytes(guard)) == (b"ab", b"cd", b"\0\0\0")
    assert body.taken == taken


@pytest.mark.parametrize("chunks", [[b"ab", None, b"cde"], []], ids=["whole", "empty"])
def test_a_body_that_fits_its_sink_is_written_whole(chunks: list[bytes | None]) -> None:
    into = bytearray(5)
    size = sum(len(c) for c in chunks if c)
    body = _Body(chunks)
    assert asyncio.run(receive_into(body, SpanSink([memoryview(into)]), size)) == size
    assert bytes(into) == b"abcde"[:size] + b"\0" * (5 - size)
