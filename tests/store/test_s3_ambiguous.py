"""Multipart requests whose answer was lost: settled, never guessed (#25 item 4).

The fault proxy forwards the request to moto and then resets the connection, so the
store applied it and the client saw a failure; the retry layer then sends it again.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import load, save

from objckpt import UploadOptions
from objckpt.errors import StoreError
from objckpt.ops.maintain.verify import verify_checkpoint
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store
from objckpt.writers.location import Location

MiB = 1024 * 1024
PARTS = UploadOptions(part_size=5 * MiB)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(4 * MiB, generator=g), "small": torch.randn(10, generator=g)}


def _payload_requests(proxy: FaultProxy, operation: str) -> int:
    return sum(".distcp" in p for p in proxy.paths(operation))


def _open_uploads(moto: MotoServer, bucket: str) -> list[dict]:
    return moto.boto3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.mark.parametrize(
    "full_object", [True, False], ids=["full-object-crc32c", "store-without-full-object-crc32c"]
)
def test_a_complete_whose_answer_was_lost_is_settled_by_reading_the_object_back(
    s3_bucket: StoreTarget,
    moto_server: MotoServer,
    s3_proxy: FaultProxy,
    full_object: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CompleteMultipartUpload reaches the store, its answer is lost, and the retry gets
    ``NoSuchUpload`` (S3's answer once the upload became the object; moto 5 would answer
    200 again, so the proxy answers the retry as S3 does). The object is there with the
    upload's size and CRC32C (or, on a store keeping no full-object CRC32C, the ETag its
    parts make): the save commits instead of aborting."""
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    if not full_object:  # the store refuses ChecksumType=FULL_OBJECT: today's uploads
        s3_proxy.add(
            Rule(
                operation="CreateMultipartUpload",
                key_contains=".distcp",
                status=400,
                code="InvalidArgument",
                times=1,
            )
        )
    s3_proxy.add(
        Rule(operation="CompleteMultipartUpload", action="reset", before_upstream=False, times=1)
    )
    s3_proxy.add(
        Rule(operation="CompleteMultipartUpload", status=404, code="NoSuchUpload", times=1)
    )
    state = _state()
    with caplog.at_level(logging.INFO, logger="objckpt.writers"):
        save(state, target.url("c"), target, upload=PARTS)

    assert s3_proxy.count("CompleteMultipartUpload", faulted=True) == 2  # both faults met
    completes = [dict(s.amz) for s in s3_proxy.seen if s.operation == "CompleteMultipartUpload"]
    want = "FULL_OBJECT" if full_object else None  # else settled by the parts' ETag
    assert [c.get("x-amz-checksum-type") for c in completes] == [want, want]
    assert _payload_requests(s3_proxy, "AbortMultipartUpload") == 0
    assert "settled" in caplog.text and "__0_" in caplog.text
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, target.url("c"), target)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert verify_checkpoint(Location.parse(target.url("c"), target.storage_options)).ok
    assert _open_uploads(moto_server, s3_bucket.bucket) == []


def test_a_complete_refused_for_good_is_not_mistaken_for_a_landed_object(
    s3_bucket: StoreTarget, moto_server: MotoServer, s3_proxy: FaultProxy
) -> None:
    """The read-back decides: a Complete answered ``NoSuchUpload`` with no object at
    the key (here the store never applied it) fails the upload naming the object, and
    the upload is aborted."""
    s3_proxy.add(
        Rule(operation="CompleteMultipartUpload", status=404, code="NoSuchUpload", times=1)
    )
    store = open_store(Location.parse(s3_bucket.url("c"), s3_proxy.storage_options()), PARTS)
    try:
        upload = store.begin("obj.bin", 16 * MiB)
        upload.write(bytes(16 * MiB))
        with pytest.raises(StoreError, match=r"s3://objckpt-test/t/c/obj\.bin"):
            upload.close().result(timeout=60)
        assert not store.exists("obj.bin")
    finally:
        store.close()
    assert s3_proxy.count("AbortMultipartUpload") == 1
    assert _open_uploads(moto_server, s3_bucket.bucket) == []


def test_a_create_whose_answer_was_lost_leaves_no_upload_open(
    s3_bucket: StoreTarget, moto_server: MotoServer, s3_proxy: FaultProxy
) -> None:
    """The first CreateMultipartUpload begins an upload whose id the client never
    learns; the retry begins a second, which the object is uploaded through. After the
    object is complete, one listing of the key's open uploads finds the first and aborts
    it. A save whose Create was answered lists nothing."""
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    s3_proxy.add(
        Rule(
            operation="CreateMultipartUpload",
            key_contains=".distcp",
            action="reset",
            before_upstream=False,
            times=1,
        )
    )
    state = _state()
    save(state, target.url("c"), target, upload=PARTS)

    assert _payload_requests(s3_proxy, "CreateMultipartUpload") == 2
    assert _payload_requests(s3_proxy, "AbortMultipartUpload") == 1  # the orphan
    assert s3_proxy.count("ListMultipartUploads") == 1
    assert _open_uploads(moto_server, s3_bucket.bucket) == []
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, target.url("c"), target)
    assert all(torch.equal(got[k], v) for k, v in state.items())

    s3_proxy.clear()
    save(state, target.url("d"), target, upload=PARTS)
    assert _payload_requests(s3_proxy, "CreateMultipartUpload") == 1
    assert s3_proxy.count("ListMultipartUploads") == 0  # no retried Create: no listing
