"""objckpt on Ceph RGW, a real S3 server, beside the moto suite (#36 item 1).

The conformance suite runs on RGW in ``test_store_conformance.py``; here are the rest:
what RGW does differently from moto, each beside what objckpt does about it;
multipart with parts in flight; answers lost on the way back (settled by what RGW
itself answers, no reset API needed); crafted checkpoints; a manager run with
retention, reuse, backups to a second bucket and a local tier; the CLI; TLS, where
the SDK's default request shape is refused by RGW; and the launcher's pid safety.
Where moto and RGW answer differently, a test runs on both (``s3_target``).

Every test gets a fresh bucket (``rgw_bucket``): RGW has no reset.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.exceptions
import pytest
import torch
from botocore.config import Config
from click.testing import CliRunner, Result
from conftest import assert_state_equal, empty_like_state
from crafted import _CHILD, CRAFTED, N, _Ckpt, _outside, _saved
from helpers import carried, cli_env, load, s3_client, save
from reuse_helpers import lora_state, train_step
from states import stepped_state

from objckpt import (
    AsyncOptions,
    CheckpointManager,
    LocalTier,
    Location,
    RetentionPolicy,
    RetryPolicy,
    UploadOptions,
)
from objckpt.cli import main
from objckpt.errors import CheckpointExistsError, StoreError, UploadError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import read_manifest
from objckpt.format.steps import step_name
from objckpt.ops.maintain.verify import verify_checkpoint
from objckpt.ops.run.backup import BackupTarget, committed_steps
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.rgw import RgwServer, stop_rgw
from objckpt.testing.servers import offline_env
from objckpt.writers import open_store
from objckpt.writers import s3 as s3_store_module
from objckpt.writers import s3_upload as s3_writers
from objckpt.writers.checksum import crc32c_of
from objckpt.writers.s3 import S3Store
from objckpt.writers.s3_settle import landed

MiB = 1 << 20
PARTS = UploadOptions(part_size=5 * MiB, max_parts_in_flight=8)


@pytest.fixture
def proxy(rgw_server: RgwServer, rgw_bucket: StoreTarget) -> Iterator[FaultProxy]:
    """The recording, fault-injecting proxy in front of RGW (the test credentials it
    signs with are the RGW user's)."""
    with FaultProxy(rgw_server.endpoint_url, seed=7) as p:
        yield p


def _via(proxy: FaultProxy, bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(
        root=bucket.root, storage_options=proxy.storage_options(), bucket=bucket.bucket
    )


def _open_uploads(rgw: RgwServer, bucket: str) -> list[dict[str, Any]]:
    return list(rgw.boto3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def _manual_multipart(client: Any, bucket: str, key: str, parts: list[bytes]) -> tuple[str, list]:
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)
    done = []
    for n, body in enumerate(parts, 1):
        out = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=n, Body=body
        )
        done.append({"PartNumber": n, "ETag": out["ETag"]})
    return upload["UploadId"], done


# -- what RGW does differently, and what objckpt does about it ----------------------------
def test_rgw_ignores_if_none_match_on_complete_so_the_commit_is_one_conditional_put(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, proxy: FaultProxy
) -> None:
    """RGW completes a multipart upload over an existing object despite
    ``If-None-Match: *`` (moto answers 412). objckpt's create-only commit is one
    conditional PutObject whatever its size, never a multipart upload."""
    client = rgw_server.boto3_client()
    bucket = rgw_bucket.bucket
    client.put_object(Bucket=bucket, Key="there", Body=b"first")
    upload_id, parts = _manual_multipart(client, bucket, "there", [b"second"])
    client.complete_multipart_upload(
        Bucket=bucket,
        Key="there",
        UploadId=upload_id,
        MultipartUpload={"Parts": parts},
        IfNoneMatch="*",
    )
    assert client.get_object(Bucket=bucket, Key="there")["Body"].read() == b"second"

    store = open_store(
        Location.parse(_via(proxy, rgw_bucket).url("c"), proxy.storage_options()), PARTS
    )
    try:
        big = os.urandom(3 * PARTS.part_size)
        store.create(MANIFEST_KEY, big)
        with pytest.raises(FileExistsError):
            store.create(MANIFEST_KEY, b"{}")
        assert store.read(MANIFEST_KEY) == big
    finally:
        store.close()
    puts = [s for s in proxy.seen if s.operation == "PutObject"]
    assert len(puts) == 2 and proxy.count("CreateMultipartUpload") == 0, proxy.operations()


def test_rgw_answers_the_first_complete_with_an_empty_etag_and_uploads_do_not_need_it(
    rgw_server: RgwServer, rgw_bucket: StoreTarget
) -> None:
    """RGW's first CompleteMultipartUpload answers ``<ETag></ETag>`` (a repeat answers
    the real one); HEAD tells the object's ETag. objckpt reads no ETag from Complete:
    an upload recognises its object by HEAD, the size and (RGW keeping no CRC32C)
    the ETag its parts make, and a same-size object of other bytes is not it."""
    client = rgw_server.boto3_client()
    bucket = rgw_bucket.bucket
    chunks = [os.urandom(5 * MiB), os.urandom(MiB)]
    upload_id, parts = _manual_multipart(client, bucket, "t/obj.bin", chunks)
    out = client.complete_multipart_upload(
        Bucket=bucket, Key="t/obj.bin", UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    assert out.get("ETag", "") == ""
    data = b"".join(chunks)
    store = open_store(Location.parse(rgw_bucket.root, rgw_bucket.storage_options), PARTS)
    try:
        assert isinstance(store, S3Store)
        assert store.run_coro(landed(store, "obj.bin", len(data), crc32c_of(data), parts))
        client.put_object(Bucket=bucket, Key="t/other.bin", Body=os.urandom(len(data)))
        assert not store.run_coro(landed(store, "other.bin", len(data), crc32c_of(data), parts))
    finally:
        store.close()


def test_rgw_keeps_no_checksum_and_objckpt_reports_none(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, caplog: pytest.LogCaptureFixture
) -> None:
    """RGW stores no ``x-amz-checksum-crc32c`` and accepts a wrong one (it does check
    ``Content-MD5``, which objckpt does not send). ``digest`` then reports no CRC32C, a
    multipart upload's ``ChecksumType=FULL_OBJECT`` is found ignored (logged once), and
    copies and backups read objects back (the conformance suite's altered-bytes case
    shows the load checking its own CRC32C)."""
    client = rgw_server.boto3_client()
    bucket = rgw_bucket.bucket
    client.put_object(Bucket=bucket, Key="t/wrong", Body=b"abc", ChecksumCRC32C="AAAAAA==")
    head = client.head_object(Bucket=bucket, Key="t/wrong", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C") is None
    once = rgw_server.boto3_client(retries={"max_attempts": 1})  # botocore retries BadDigest
    with pytest.raises(botocore.exceptions.ClientError, match="BadDigest"):
        once.put_object(
            Bucket=bucket, Key="t/md5", Body=b"abc", ContentMD5=base64.b64encode(bytes(16)).decode()
        )
    store = open_store(Location.parse(rgw_bucket.root, rgw_bucket.storage_options), PARTS)
    try:
        data = os.urandom(16 * MiB)
        with caplog.at_level(logging.WARNING, logger="objckpt.writers"):
            upload = store.begin("multi.bin", len(data))
            upload.write(data)
            upload.close().result(timeout=120)
        assert upload.crc32c == f"{crc32c_of(data):08x}"
        assert store.digest("multi.bin") == (len(data), None)
        assert "ignored ChecksumType" in caplog.text
    finally:
        store.close()


def test_rgw_refuses_a_range_of_an_empty_object_and_objckpt_reads_it_as_empty(
    rgw_server: RgwServer, rgw_bucket: StoreTarget
) -> None:
    """416 InvalidRange for ``Range: bytes=0-1000`` of an empty object (as AWS; moto
    answers an empty body). objckpt's bounded reads answer ``b""``."""
    from objckpt.writers.reads import read_bounded

    client = rgw_server.boto3_client()
    client.put_object(Bucket=rgw_bucket.bucket, Key="t/empty", Body=b"")
    with pytest.raises(botocore.exceptions.ClientError, match="InvalidRange"):
        client.get_object(Bucket=rgw_bucket.bucket, Key="t/empty", Range="bytes=0-1000")
    store = open_store(Location.parse(rgw_bucket.root, rgw_bucket.storage_options))
    try:
        assert read_bounded(store._fs, store.path("empty"), 1000) == b""
    finally:
        store.close()


def test_over_tls_objckpt_sends_what_rgw_accepts_where_the_sdk_default_is_refused(
    rgw_server: RgwServer, rgw_bucket: StoreTarget
) -> None:
    """Over https botocore's default streams bodies aws-chunked with a trailing
    checksum, which RGW 16.2 refuses (411 MissingContentLength), so plain s3fs cannot
    write there. objckpt sends its CRC32C as a header and turns the SDK's own off:
    a multipart save, its commit and a load all pass over TLS."""
    if rgw_server.https_endpoint_url is None:
        pytest.skip("this RGW has no https endpoint (set OBJCKPT_RGW_HTTPS_ENDPOINT)")
    default = boto3.client(
        "s3",
        endpoint_url=rgw_server.https_endpoint_url,
        aws_access_key_id=rgw_server.key,
        aws_secret_access_key=rgw_server.secret,
        region_name="us-east-1",
        verify=str(rgw_server.ca_file),
        config=Config(retries={"max_attempts": 1}),
    )
    with pytest.raises(botocore.exceptions.ClientError, match="MissingContentLength"):
        default.put_object(Bucket=rgw_bucket.bucket, Key="t/sdk-default", Body=b"abc")
    target = StoreTarget(
        root=rgw_bucket.root,
        storage_options=rgw_server.storage_options(https=True),
        bucket=rgw_bucket.bucket,
    )
    state: dict[str, Any] = {"w": torch.randn(4 * MiB), "step": 1}  # 16 MiB: three parts
    save(state, target.url("tls"), target, upload=PARTS)
    got: dict[str, Any] = {"w": torch.zeros(4 * MiB), "step": 0}
    load(got, target.url("tls"), target)
    assert_state_equal(got, state)


# -- uploads and lost answers -------------------------------------------------------------
def test_a_save_keeps_parts_in_flight_and_loads_back(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, proxy: FaultProxy
) -> None:
    """A 40 MiB tensor in 5 MiB parts: the proxy holds UploadPart requests until four
    are open at once (so they were in flight together), then lets them all go. The
    checkpoint loads bit-exact and verifies; no upload is left open."""
    target = _via(proxy, rgw_bucket)
    proxy.add(Rule(operation="UploadPart", action="hold", stall=120))
    state = {"big": torch.randn(10 * MiB), "small": torch.arange(5)}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        saving = pool.submit(save, state, target.url("c"), target, upload=PARTS)
        try:
            proxy.wait_for("UploadPart", count=4, timeout=120)
        finally:
            proxy.release()
        saving.result(timeout=300)
    assert proxy.peak_open("UploadPart") >= 4
    # 40 MiB and a frame: seven parts of 6 MiB, grown from 5 so the frame is no part
    assert proxy.count("UploadPart") >= 7
    got = {"big": torch.zeros(10 * MiB), "small": torch.zeros(5, dtype=torch.int64)}
    load(got, rgw_bucket.url("c"), rgw_bucket)
    assert torch.equal(got["big"], state["big"]) and torch.equal(got["small"], state["small"])
    assert verify_checkpoint(Location.parse(rgw_bucket.url("c"), rgw_bucket.storage_options)).ok
    assert _open_uploads(rgw_server, rgw_bucket.bucket) == []


def test_a_second_save_to_a_committed_checkpoint_is_refused(rgw_bucket: StoreTarget) -> None:
    save(stepped_state(1), rgw_bucket.url("c"), rgw_bucket)
    with pytest.raises(BaseException) as info:
        save(stepped_state(2), rgw_bucket.url("c"), rgw_bucket)
    assert isinstance(carried(info.value), CheckpointExistsError), repr(info.value)
    got = empty_like_state(stepped_state(0))
    load(got, rgw_bucket.url("c"), rgw_bucket)
    assert_state_equal(got, stepped_state(1))


def test_a_commit_whose_answer_was_lost_is_settled_by_reading_the_manifest_back(
    rgw_bucket: StoreTarget, proxy: FaultProxy
) -> None:
    """The manifest PUT lands on RGW and its answer is lost; the retry meets RGW's own
    412, and reading the manifest back (our bytes) settles it as committed."""
    target = _via(proxy, rgw_bucket)
    proxy.add(
        Rule(
            operation="PutObject",
            key_contains=MANIFEST_KEY,
            action="reset",
            before_upstream=False,
            times=1,
        )
    )
    save(stepped_state(3), target.url("c"), target)
    assert len([p for p in proxy.paths("PutObject") if p.endswith(MANIFEST_KEY)]) == 2
    got = empty_like_state(stepped_state(0))
    load(got, rgw_bucket.url("c"), rgw_bucket)
    assert_state_equal(got, stepped_state(3))


def test_a_complete_whose_answer_was_lost_is_answered_again_by_rgw(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, proxy: FaultProxy
) -> None:
    """RGW answers a repeated CompleteMultipartUpload of a finished upload with 200
    (AWS and moto: NoSuchUpload, settled by a read-back): the retry after a lost
    answer completes the save, nothing is aborted, nothing is left open."""
    target = _via(proxy, rgw_bucket)
    proxy.add(
        Rule(operation="CompleteMultipartUpload", action="reset", before_upstream=False, times=1)
    )
    state = {"big": torch.randn(4 * MiB)}
    save(state, target.url("c"), target, upload=PARTS)
    assert proxy.count("CompleteMultipartUpload") == 2
    assert not [p for p in proxy.paths("AbortMultipartUpload") if ".distcp" in p]
    got = {"big": torch.zeros(4 * MiB)}
    load(got, rgw_bucket.url("c"), rgw_bucket)
    assert torch.equal(got["big"], state["big"])
    assert _open_uploads(rgw_server, rgw_bucket.bucket) == []


def test_a_create_multipart_whose_answer_was_lost_leaves_no_upload_open(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, proxy: FaultProxy
) -> None:
    """The first CreateMultipartUpload begins an upload whose id never arrives; after
    the object is finished, one listing finds that upload on RGW and aborts it."""
    target = _via(proxy, rgw_bucket)
    proxy.add(
        Rule(
            operation="CreateMultipartUpload",
            key_contains=".distcp",
            action="reset",
            before_upstream=False,
            times=1,
        )
    )
    state = {"big": torch.randn(4 * MiB)}
    save(state, target.url("c"), target, upload=PARTS)
    assert len([p for p in proxy.paths("CreateMultipartUpload") if ".distcp" in p]) == 2
    assert len([p for p in proxy.paths("AbortMultipartUpload") if ".distcp" in p]) == 1
    assert _open_uploads(rgw_server, rgw_bucket.bucket) == []


@pytest.fixture(params=["moto", "rgw"])
def s3_target(request: pytest.FixtureRequest) -> StoreTarget:
    """A fresh bucket on moto, then on RGW: where the two answer differently."""
    return request.getfixturevalue("s3_bucket" if request.param == "moto" else "rgw_bucket")


@pytest.mark.parametrize(
    ("full", "tail", "hint", "parts"),
    [
        (3, 4_731, "exact", 3),  # three 16 MiB tensors' frames past a packed object's size
        (3, 5 * MiB, "exact", 4),  # a tail S3 takes as a part of its own stays one
        (3, 4_731, "unknown", 4),  # torch_checkpointing's streams: no size known up front
        (2, 1_577, "exact", 1),  # a 32 MiB tensor's frame: two parts grown, so one PUT
    ],
    ids=["short-tail", "long-tail", "short-tail-no-hint", "two-parts-short-tail"],
)
def test_a_short_tail_is_no_part_of_its_own_where_the_size_is_known(
    s3_target: StoreTarget, full: int, tail: int, hint: str, parts: int
) -> None:
    """A payload object a few KiB past a multiple of the part size used to end in a
    part of those few KiB: one more request per object (#47). Where the upload knows
    the object's size, its parts grow a little so as many parts cover it. Every part
    but the last stays the same size and the last no larger: some S3-compatible
    stores (Cloudflare R2) refuse any other layout. Two parts grown are an object
    of up to two parts, which goes up in one PUT (a tensor of exactly twice the part
    size took a Create, three parts and a Complete). Without a size there is no
    knowing where the object ends, and the tail is a part."""
    store = open_store(Location.parse(s3_target.url("tail"), s3_target.storage_options), PARTS)
    data = os.urandom(full * 5 * MiB + tail)
    size_hint = len(data) if hint == "exact" else 0
    try:
        upload = store.begin("obj.bin", size_hint)
        for at in range(0, len(data), 3 * MiB):  # writes that do not line up with parts
            upload.write(data[at : at + 3 * MiB])
        upload.close().result(timeout=120)
    finally:
        store.close()
    client = s3_client(s3_target.storage_options)
    key = s3_target.url("tail").removeprefix(f"s3://{s3_target.bucket}/") + "/obj.bin"
    # A multipart ETag is the MD5 of the parts' MD5s, "-" and the count (RGW 16.2
    # ignores HeadObject's PartNumber, so the parts' sizes are read from this).
    head = client.head_object(Bucket=s3_target.bucket, Key=key)
    if parts == 1:  # one PutObject: the ETag is the body's MD5
        assert head["ETag"].strip('"') == hashlib.md5(data).hexdigest()
    else:
        part = PARTS.part_size_for(size_hint)
        cuts = [*range(0, len(data), part), len(data)]
        assert len(cuts) - 1 == parts
        assert cuts[-1] - cuts[-2] <= part  # the last part is no larger than the others
        md5s = b"".join(hashlib.md5(data[a:b]).digest() for a, b in itertools.pairwise(cuts))
        assert head["ETag"].strip('"') == f"{hashlib.md5(md5s).hexdigest()}-{parts}"
    body = client.get_object(Bucket=s3_target.bucket, Key=key)["Body"].read()
    assert body == data


def _uploads_open(target: StoreTarget) -> list[dict[str, Any]]:
    client = s3_client(target.storage_options)
    return list(client.list_multipart_uploads(Bucket=target.bucket).get("Uploads", []))


def test_a_close_refused_at_its_last_part_leaves_no_upload_open(
    s3_target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` sends the last part before it completes the upload. Where that
    last part is refused before it is sent (here: one part past the limit on parts,
    which a stream of unknown size can reach), the caller's ``abort()`` must still
    abort the upload: it used to do nothing, as ``close()`` had marked the upload
    finished first, and the upload's parts stayed billed until ``objckpt gc``."""
    monkeypatch.setattr(s3_writers, "MAX_PARTS", 3)
    store = open_store(Location.parse(s3_target.url("last"), s3_target.storage_options), PARTS)
    try:
        upload = store.begin("obj.bin", 0)  # no size known: parts of part_size
        upload.write(os.urandom(3 * 5 * MiB + 1000))  # three parts sent, a fourth to come
        assert len(_uploads_open(s3_target)) == 1
        with pytest.raises(UploadError, match="more than 3 parts"):
            upload.close()
        upload.abort()
        assert not store.exists("obj.bin")
    finally:
        store.close()
    assert _uploads_open(s3_target) == []


def test_two_parts_past_s3s_single_put_limit_go_multipart(
    s3_target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object of up to two parts goes up in one PutObject, but S3 takes at most
    5 GiB in one PUT: at a ``part_size`` above 2.5 GiB two parts can pass it. Such an
    object goes multipart (the limit is lowered here so that a test can reach it)."""
    monkeypatch.setattr(s3_writers, "S3_MAX_PUT", 8 * MiB)
    store = open_store(Location.parse(s3_target.url("big"), s3_target.storage_options), PARTS)
    data = {"under": os.urandom(7 * MiB), "over": os.urandom(9 * MiB)}
    try:
        for name, body in data.items():
            upload = store.begin(name, len(body))
            upload.write(body)
            upload.close().result(timeout=120)
    finally:
        store.close()
    client = s3_client(s3_target.storage_options)
    prefix = s3_target.url("big").removeprefix(f"s3://{s3_target.bucket}/")
    etags = {
        name: client.head_object(Bucket=s3_target.bucket, Key=f"{prefix}/{name}")["ETag"]
        for name in data
    }
    assert etags["under"].strip('"') == hashlib.md5(data["under"]).hexdigest()  # one PUT
    md5s = (
        hashlib.md5(data["over"][: 5 * MiB]).digest()
        + hashlib.md5(data["over"][5 * MiB :]).digest()
    )
    assert etags["over"].strip('"') == f"{hashlib.md5(md5s).hexdigest()}-2"
    for name, body in data.items():
        got = client.get_object(Bucket=s3_target.bucket, Key=f"{prefix}/{name}")["Body"].read()
        assert got == body
    assert _uploads_open(s3_target) == []


def test_a_copy_past_s3s_single_copy_limit_goes_in_part_copies(
    s3_target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy inside S3 is one CopyObject up to two parts, but CopyObject, like a PUT,
    stops at 5 GiB: past it the copy goes in UploadPartCopy ranges (the limit is
    lowered here so that a test can reach it)."""
    monkeypatch.setattr(s3_store_module, "S3_MAX_PUT", 8 * MiB)
    data = os.urandom(9 * MiB)
    src = open_store(Location.parse(s3_target.url("src"), s3_target.storage_options), PARTS)
    dst = open_store(Location.parse(s3_target.url("dst"), s3_target.storage_options), PARTS)
    try:
        upload = src.begin("obj.bin", len(data))
        upload.write(data)
        upload.close().result(timeout=120)
        assert dst.copy_from(src, "obj.bin", len(data))
        assert dst.read("obj.bin") == data
    finally:
        src.close()
        dst.close()
    client = s3_client(s3_target.storage_options)
    prefix = s3_target.url("dst").removeprefix(f"s3://{s3_target.bucket}/")
    etag = client.head_object(Bucket=s3_target.bucket, Key=f"{prefix}/obj.bin")["ETag"]
    assert etag.strip('"').endswith("-2")  # two part copies, not one CopyObject
    assert _uploads_open(s3_target) == []


def test_an_upload_ended_behind_objckpts_back_fails_naming_it_without_a_gc_warning(
    s3_target: StoreTarget, caplog: pytest.LogCaptureFixture
) -> None:
    """An upload whose parts are all sent is aborted by someone else (``gc`` past its
    grace, a lifecycle rule). Its Complete is refused (moto and AWS: NoSuchUpload,
    and the read-back finds no object; RGW: 500 "This multipart completion is already
    in progress", retried as transient until the policy gives up), so the upload
    fails naming the object. The abort that follows meets NoSuchUpload: nothing is
    left, so no warning that ``objckpt gc`` will clean up."""
    opts = s3_target.storage_options
    client = s3_client(opts)
    with FaultProxy(opts["endpoint_url"]) as proxy:
        location = Location.parse(
            s3_target.url("c"), proxy.storage_options(), RetryPolicy(attempts=2)
        )
        store = open_store(location, PARTS)
        try:
            upload = store.begin("obj.bin", 2 * PARTS.part_size)
            upload.write(os.urandom(2 * PARTS.part_size))  # both parts go out now
            proxy.wait_for("UploadPart", count=2)
            proxy.wait_idle()  # and have landed
            (open_upload,) = client.list_multipart_uploads(Bucket=s3_target.bucket)["Uploads"]
            client.abort_multipart_upload(
                Bucket=s3_target.bucket, Key=open_upload["Key"], UploadId=open_upload["UploadId"]
            )
            with (
                caplog.at_level(logging.INFO, logger="objckpt.writers"),
                pytest.raises(StoreError, match=re.escape(location.url_of("obj.bin"))),
            ):
                upload.close().result(timeout=120)
            assert not store.exists("obj.bin")
        finally:
            store.close()
    assert "nothing to abort" in caplog.text
    assert "could not abort" not in caplog.text, caplog.text


# -- untrusted contents -------------------------------------------------------------------
# The loads run in one child process for all cases (a torch import each would cost
# more than the rest of this module), each under the same limits as in
# test_untrusted_input.py.
_MANY = textwrap.dedent(
    """
    import json, sys
    child, specs = sys.argv[1], json.loads(sys.argv[2])
    for spec in specs:
        sys.argv = ["-c", json.dumps(spec)]
        try:
            exec(compile(child, "<crafted load>", "exec"), {"__name__": "__main__"})
        except SystemExit:
            pass
    """
)


def test_crafted_checkpoints_are_refused_naming_the_object_after_a_few_requests(
    rgw_bucket: StoreTarget, proxy: FaultProxy
) -> None:
    """The crafted-input cases of ``test_untrusted_input.py`` against RGW: each load
    ends in a ManifestError naming the crafted object, after at most three requests,
    none for a payload, none outside its checkpoint."""
    target = _via(proxy, rgw_bucket)
    cases = []
    for n, craft in enumerate(CRAFTED):
        ck: _Ckpt = _saved(target, f"run/ck-{n:02d}")
        cases.append((craft.__name__, ck.url, craft(ck), f"/{rgw_bucket.bucket}/t/run/ck-{n:02d}/"))
    proxy.clear()
    specs = [
        {"url": url, "options": target.storage_options, "read": None, "backups": None, "n": N}
        for _, url, _, _ in cases
    ]
    out = subprocess.run(
        [sys.executable, "-c", _MANY, _CHILD, json.dumps(specs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **offline_env()},
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), out.stdout[-4000:]
    for (name, _, culprit, prefix), got in zip(cases, results, strict=True):
        assert got.get("error") == "objckpt.errors.ManifestError", (name, got)
        assert culprit in got["message"], (name, got)
        mine = [s for s in proxy.seen if s.path.startswith(prefix)]
        assert len(mine) <= 3, (name, [(s.operation, s.path) for s in mine])
    assert not [p for p in proxy.paths("GetObject") if p.endswith(".distcp")]
    assert _outside(proxy, f"/{rgw_bucket.bucket}/t/run/ck-") == []


# -- the manager and the CLI --------------------------------------------------------------
def test_a_manager_run_keeps_its_steps_reuses_bytes_backs_up_and_resumes(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, caplog: pytest.LogCaptureFixture
) -> None:
    """Async saves of a LoRA-shaped state with ``keep_last=2``, a backup to a second
    bucket on RGW (server-side copies) with ``keep_last=3``: later steps reference
    the frozen base where step 1 stored it, retention keeps what they reference,
    both roots verify, and a new manager resumes from the newest step."""
    caplog.set_level(logging.INFO, logger="objckpt")
    backup_bucket = f"{rgw_bucket.bucket}-backup"
    rgw_server.create_bucket(backup_bucket)
    backup = BackupTarget(
        f"s3://{backup_bucket}/t/run",
        rgw_server.storage_options(),
        retention=RetentionPolicy(keep_last=3),
    )
    root = rgw_bucket.url("run")
    opts = rgw_bucket.storage_options
    state = lora_state(layers=4, width=512)  # a 4 MiB frozen base
    with CheckpointManager(
        root,
        storage_options=opts,
        retention=RetentionPolicy(keep_last=2),
        backups=[backup],
        async_options=AsyncOptions(workers=1),
    ) as mgr:
        for step in range(1, 5):
            if step > 1:
                train_step(state, step)
            mgr.save(step, state)
            mgr.maybe_finalize()
        mgr.wait_until_finished()
        mgr.check_for_errors()
        mgr.wait_for_backups(timeout=120)
        assert mgr.all_steps() == [3, 4]
        assert [(s.latest_step, s.error) for s in mgr.backup_status()] == [(4, None)]
    step4 = Location.parse(root, opts).child(step_name(4))
    store = open_store(step4)
    try:
        manifest = read_manifest(store)
    finally:
        store.close()
    assert manifest.reused_bytes >= 4 * MiB, manifest.reused_bytes
    backed = [s.step for s in committed_steps(Location.parse(backup.url, backup.storage_options))]
    assert backed == [2, 3, 4]
    assert verify_checkpoint(step4).ok
    assert verify_checkpoint(
        Location.parse(backup.url, backup.storage_options).child(step_name(4))
    ).ok
    # Each backup copies server-side on RGW (an object already at the backup counts
    # as "streamed" in the message, though nothing was sent).
    copies = [r.getMessage() for r in caplog.records if "backed up to" in r.getMessage()]
    found = [re.search(r"\((\d+) server-side", m) for m in copies]
    assert len(copies) == 4 and all(f and int(f[1]) >= 3 for f in found), copies
    with CheckpointManager(root, storage_options=opts) as mgr:
        got = empty_like_state(state)
        assert mgr.load(got) == 4
    assert_state_equal(got, state)


def test_a_local_tier_promotes_every_second_step_to_rgw(
    rgw_bucket: StoreTarget, tmp_path: Any
) -> None:
    root = rgw_bucket.url("run")
    opts = rgw_bucket.storage_options
    tier = LocalTier(
        str(tmp_path / "nvme"), retention=RetentionPolicy(keep_last=2), promote_every=2
    )
    with CheckpointManager(
        root, storage_options=opts, local=tier, async_options=AsyncOptions(workers=1)
    ) as mgr:
        handles = [mgr.save(step, stepped_state(step)) for step in (1, 2, 3, 4)]
        mgr.wait_until_finished()
        assert [h.wait_durable(60) for h in handles] == [False, True, False, True]
        assert mgr.all_steps() == [2, 4] and mgr.local_steps() == [3, 4]
    with CheckpointManager(root, storage_options=opts) as mgr:  # another node: the root only
        got = empty_like_state(stepped_state(0))
        assert mgr.load(got) == 4
    assert_state_equal(got, stepped_state(4))


@pytest.fixture
def cli(rgw_server: RgwServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    for k, v in cli_env(rgw_server).items():
        monkeypatch.setenv(k, v)

    def run(*args: str) -> Result:
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    return run


def test_cli_lists_describes_and_verifies_checkpoints_on_rgw(
    cli: Any, rgw_server: RgwServer, rgw_bucket: StoreTarget
) -> None:
    root = rgw_bucket.url("run")
    with CheckpointManager(root, storage_options=rgw_bucket.storage_options) as mgr:
        for step in (1, 2):
            mgr.save(step, stepped_state(step)).result(timeout=120)
    listed = json.loads(cli("ls", root, "--json").stdout)
    assert [(s["step"], s["committed"]) for s in listed["steps"]] == [(1, True), (2, True)]
    info = json.loads(cli("info", f"{root}/{step_name(2)}", "--json").stdout)
    assert {e["name"] for e in info["entries"]} >= {"w", "b", "step"}
    assert cli("verify", f"{root}/{step_name(1)}").exit_code == 0
    client = rgw_server.boto3_client()
    prefix = f"t/run/{step_name(1)}/"
    listing = client.list_objects_v2(Bucket=rgw_bucket.bucket, Prefix=prefix)["Contents"]
    key = next(o["Key"] for o in listing if o["Key"].endswith(".distcp"))
    body = bytearray(client.get_object(Bucket=rgw_bucket.bucket, Key=key)["Body"].read())
    body[-10] ^= 0xFF
    client.put_object(Bucket=rgw_bucket.bucket, Key=key, Body=bytes(body))
    out = cli("verify", f"{root}/{step_name(1)}", "--json")
    assert out.exit_code == 1
    failures = json.loads(out.stdout)["failures"]
    assert [f["key"] for f in failures] == [key.rsplit("/", 1)[-1]]
    assert "CRC32C" in failures[0]["problem"]


# -- the launcher -------------------------------------------------------------------------
def test_stop_ends_the_directorys_daemons_and_nothing_a_stale_pid_file_names(
    tmp_path: Any,
) -> None:
    """``stop_rgw`` signals a pid only while its command line names this directory's
    ``ceph.conf``: a stale pid file (the pid reused by another process) is left alone."""
    (tmp_path / "run").mkdir()
    conf = str(tmp_path / "ceph.conf")
    # Each child says it runs before the pid files name it: the parent's Popen returns
    # when the child's exec has begun, before the kernel has set the new command line
    # that ``stop_rgw`` reads (an empty one under load).
    sleeper = "import time; print('up', flush=True); time.sleep(120)"
    ours = subprocess.Popen([sys.executable, "-c", sleeper, "--conf", conf], stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.PIPE)
    try:
        for proc in (ours, other):
            assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        (tmp_path / "run" / "client.rgw.pid").write_text(f"{ours.pid}\n")
        (tmp_path / "run" / "osd.0.pid").write_text(f"{other.pid}\n")
        stop_rgw(tmp_path)
        assert ours.wait(timeout=30) == -signal.SIGTERM
        assert other.poll() is None
        assert list((tmp_path / "run").iterdir()) == []
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
