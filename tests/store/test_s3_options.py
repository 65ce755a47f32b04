"""S3 options users ask for (#48 item 2), each proven on the wire.

objckpt passes ``storage_options`` to s3fs untouched, and every S3 request it makes
goes through that one s3fs client (:class:`~objckpt.writers.s3client.RetryingS3FileSystem`:
uploads, the commit, reads, listings, HEADs, deletes, gc's aborts, in the training
process and in its upload workers, which rebuild the client from the same options).
So an option works everywhere or nowhere, and each test here checks every request a
whole save, load, listing and gc made, through :class:`~objckpt.testing.FaultProxy`:

* requester-pays (``requester_pays=True``): a proxy answers 403 AccessDenied, as
  AWS does, to any request without ``x-amz-request-payer: requester``;
* addressing (``config_kwargs={"s3": {"addressing_style": ...}}``): the proxy records
  each request's ``Host`` and path. Virtual-hosted requests need ``<bucket>.<host>``
  to resolve, and no resolver here knows ``*.localhost``: the proxy is botocore's HTTP
  forward proxy instead, which resolves nothing on the client. moto and RGW (with
  ``rgw_dns_name = localhost``) both route ``<bucket>.localhost`` to the bucket;
* a custom CA bundle (``client_kwargs={"verify": path}`` or ``AWS_CA_BUNDLE``): the
  proxy serves TLS with a self-signed certificate in front of moto, RGW with its
  own;
* S3 Express One Zone, as far as it goes without AWS: listings in no order (the proxy
  reverses every listing), directory-bucket names (botocore asks ``CreateSession``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_state_equal
from helpers import carried, load, s3_client, save
from states import stepped_state

from objckpt import CheckpointManager, Location, RetentionPolicy, UploadOptions
from objckpt.errors import AccessDeniedError, ConfigurationError, StoreError
from objckpt.ops.maintain.gc import collect_garbage
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.rgw import RgwServer
from objckpt.testing.servers import MotoServer
from objckpt.testing.tls import make_certificate
from objckpt.writers import open_store

MiB = 1 << 20
PARTS = UploadOptions(part_size=5 * MiB)
PAYER = ("x-amz-request-payer", "requester")


def _requester_pays_bucket(proxy: FaultProxy) -> None:
    """The proxy answers as AWS does for a requester-pays bucket."""
    proxy.add(Rule(action="status", status=403, code="AccessDenied", unless_header=PAYER))


def _state(step: int) -> dict[str, Any]:
    """Big enough for a multipart upload (16 MiB in 5 MiB parts, grown to 6)."""
    return {**stepped_state(step), "big": torch.full((4 * MiB,), float(step))}


# -- requester pays ------------------------------------------------------------------------
def test_requester_pays_is_sent_on_every_request_of_save_load_list_and_gc(
    moto_server: MotoServer, s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """With ``requester_pays=True`` every request carries ``x-amz-request-payer``:
    the async saves (their upload workers included), the multipart uploads, the
    commits, retention's deletes, the listings, the load, and gc aborting an upload
    left open. Not one request is refused by the requester-pays proxy."""
    _requester_pays_bucket(s3_proxy)
    options = {**s3_proxy.storage_options(), "requester_pays": True}
    root = s3_bucket.root
    with CheckpointManager(
        root, storage_options=options, upload=PARTS, retention=RetentionPolicy(keep_last=1)
    ) as manager:
        manager.save(1, _state(1)).result(timeout=120)
        manager.save(2, _state(2)).result(timeout=120)
        manager.wait_until_finished()
        assert manager.all_steps() == [2]
        got = {**stepped_state(0), "big": torch.zeros(4 * MiB)}
        assert manager.load(got) == 2
        assert_state_equal(got, _state(2))
    # An upload left open by a crashed save, for gc to find and abort.
    moto_server.boto3_client().create_multipart_upload(
        Bucket=s3_bucket.bucket, Key="t/step-0000000003/__0_0.dead.distcp"
    )
    report = collect_garbage(Location.parse(root, options), grace=0, dry_run=False)
    assert report.aborted_uploads == ("step-0000000003/__0_0.dead.distcp",)

    seen = s3_proxy.seen
    refused = sorted({s.operation for s in seen if s.fault is not None})
    assert refused == [], f"sent without x-amz-request-payer: {refused}"
    assert all(dict(s.amz).get(PAYER[0]) == PAYER[1] for s in seen)
    made = {s.operation for s in seen}
    wanted = {
        "ListObjectsV2",
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
        "ListMultipartUploads",
        "PutObject",
        "GetObject",
        "DeleteObjects",
    }
    assert wanted <= made, sorted(wanted - made)


def test_without_requester_pays_the_refusal_names_the_option(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """A save to a requester-pays bucket without the option is refused by the
    preflight's listing, at once (a 403 is not retried), with AccessDeniedError naming
    ``requester_pays=True``; a load is refused the same way."""
    save(stepped_state(1), s3_bucket.url("c"), s3_bucket)  # by the owner, directly
    _requester_pays_bucket(s3_proxy)
    payer = StoreTarget(s3_bucket.root, s3_proxy.storage_options(), s3_bucket.bucket)
    with pytest.raises(BaseException) as info:
        save(stepped_state(2), payer.url("d"), payer)
    err = carried(info.value)
    assert isinstance(err, AccessDeniedError), repr(err)
    assert "requester_pays=True" in str(err) and payer.url("d") in str(err)
    assert s3_proxy.count("ListObjectsV2", faulted=True) == 1  # not retried
    with pytest.raises(BaseException) as info:
        load(stepped_state(0), payer.url("c"), payer)
    err = carried(info.value)
    assert isinstance(err, AccessDeniedError) and "requester_pays=True" in str(err), repr(err)


# -- addressing style ----------------------------------------------------------------------
def _virtual(proxy: FaultProxy, endpoint: str, style: str) -> dict[str, Any]:
    options = proxy.forward_options(endpoint)
    options["config_kwargs"]["s3"] = {"addressing_style": style}
    return options


def _round_trip(target: StoreTarget) -> None:
    """A multipart save, its commit, a listing and a load."""
    save(_state(1), target.url("c"), target, upload=PARTS)
    got = {**stepped_state(0), "big": torch.zeros(4 * MiB)}
    load(got, target.url("c"), target)
    assert_state_equal(got, _state(1))


def _assert_style(proxy: FaultProxy, bucket: str, style: str) -> None:
    seen = [s for s in proxy.seen if s.operation != "ListBuckets"]
    assert {"PutObject", "UploadPart", "ListObjectsV2", "GetObject"} <= {s.operation for s in seen}
    for s in seen:
        if style == "virtual":
            assert s.host.startswith(f"{bucket}.localhost:"), (s.operation, s.host, s.path)
            assert not s.path.startswith(f"/{bucket}"), (s.operation, s.path)
        else:
            assert s.host.startswith("localhost:"), (s.operation, s.host)
            assert s.path.startswith(f"/{bucket}"), (s.operation, s.path)


@pytest.mark.parametrize("style", ["virtual", "path"])
def test_addressing_style_on_moto_is_what_was_asked(
    moto_server: MotoServer, s3_bucket: StoreTarget, style: str
) -> None:
    """moto serves both styles; every request of a save and a load used the style
    asked for (the proxy saw ``<bucket>.localhost`` or ``/<bucket>/...``)."""
    endpoint = moto_server.endpoint_url.replace("127.0.0.1", "localhost")
    with FaultProxy(moto_server.endpoint_url, virtual_host="localhost") as proxy:
        options = _virtual(proxy, endpoint, style)
        _round_trip(StoreTarget(s3_bucket.root, options, s3_bucket.bucket))
        _assert_style(proxy, s3_bucket.bucket, style)


@pytest.mark.parametrize("style", ["virtual", "path"])
def test_addressing_style_on_rgw_is_what_was_asked(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, style: str
) -> None:
    """RGW routes ``<bucket>.localhost`` to the bucket (``rgw_dns_name = localhost``
    in its ``ceph.conf``): both styles save and load, each request in its style."""
    endpoint = rgw_server.endpoint_url.replace("127.0.0.1", "localhost")
    with FaultProxy(rgw_server.endpoint_url, virtual_host="localhost") as proxy:
        options = _virtual(proxy, endpoint, style)
        options.update(key=rgw_server.key, secret=rgw_server.secret)
        _round_trip(StoreTarget(rgw_bucket.root, options, rgw_bucket.bucket))
        _assert_style(proxy, rgw_bucket.bucket, style)


def test_virtual_addressing_towards_an_ip_address_is_refused(s3_bucket: StoreTarget) -> None:
    """botocore sends path-style requests to an IP endpoint whatever the style says;
    objckpt refuses the combination, naming the option, before any request. An
    unknown style is refused the same way."""
    options = {**s3_bucket.storage_options, "config_kwargs": {"s3": {"addressing_style": "x"}}}
    with pytest.raises(ConfigurationError, match=r"addressing_style.*auto, path, virtual"):
        CheckpointManager(s3_bucket.root, storage_options=options)
    options["config_kwargs"]["s3"]["addressing_style"] = "virtual"
    with pytest.raises(ConfigurationError, match=r"addressing_style.*IP address"):
        CheckpointManager(s3_bucket.root, storage_options=options)


# -- custom CA bundle ----------------------------------------------------------------------
@pytest.fixture
def tls_proxy(
    moto_server: MotoServer, s3_bucket: StoreTarget, tmp_path: Path
) -> Iterator[FaultProxy]:
    """moto behind a TLS proxy whose self-signed certificate no system store trusts
    (its CA file is ``tls_proxy.ca_file``)."""
    cert = make_certificate(tmp_path / "proxy.pem", tmp_path / "ca.pem")
    with FaultProxy(moto_server.endpoint_url, tls=cert) as proxy:
        proxy.ca_file = cert.ca_file  # type: ignore[attr-defined]
        yield proxy


def test_without_the_ca_bundle_tls_fails_at_once_naming_the_certificate_and_option(
    s3_bucket: StoreTarget, tls_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """An untrusted certificate is refused by the first request (the manager's
    preflight), once: not retried, a StoreError that says the certificate was not
    trusted and names ``client_kwargs={'verify': ...}`` and ``AWS_CA_BUNDLE``."""
    caplog.set_level(logging.INFO, logger="objckpt")
    with pytest.raises(StoreError) as info:
        CheckpointManager(s3_bucket.root, storage_options=tls_proxy.storage_options())
    text = str(info.value)
    assert "certificate was not trusted" in text and "CERTIFICATE_VERIFY_FAILED" in text
    assert "client_kwargs={'verify'" in text and "AWS_CA_BUNDLE" in text
    assert s3_bucket.root in text
    tls_proxy.wait_failed_handshakes(1)
    assert tls_proxy.seen == []  # no request got through
    assert not [r for r in caplog.records if r.getMessage().startswith("retrying")]


@pytest.mark.parametrize("given", ["client_kwargs", "AWS_CA_BUNDLE"])
def test_with_the_ca_bundle_async_saves_and_loads_over_tls(
    s3_bucket: StoreTarget,
    tls_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    given: str,
) -> None:
    """The CA bundle in ``client_kwargs["verify"]``, or in ``AWS_CA_BUNDLE``, reaches
    every client objckpt builds: the manager's, its upload workers' (their own
    interpreters), the commit's and the load's. Every request went over TLS."""
    options = tls_proxy.storage_options()
    ca = str(tls_proxy.ca_file)  # type: ignore[attr-defined]
    if given == "client_kwargs":
        options["client_kwargs"]["verify"] = ca
    else:
        monkeypatch.setenv("AWS_CA_BUNDLE", ca)
    with CheckpointManager(s3_bucket.root, storage_options=options, upload=PARTS) as manager:
        manager.save(1, _state(1)).result(timeout=120)
        got = {**stepped_state(0), "big": torch.zeros(4 * MiB)}
        assert manager.load(got) == 1
    assert_state_equal(got, _state(1))
    assert {"UploadPart", "PutObject", "GetObject"} <= tls_proxy.operations()
    assert tls_proxy.failed_handshakes == 0


def test_rgw_over_tls_needs_its_ca_and_takes_it_from_aws_ca_bundle(
    rgw_server: RgwServer, rgw_bucket: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RGW's beast frontend with its own self-signed certificate: refused, naming the
    option, without the CA; a save and a load pass with ``AWS_CA_BUNDLE`` (the test
    beside it in ``test_rgw.py`` gives ``client_kwargs["verify"]``)."""
    if rgw_server.https_endpoint_url is None or rgw_server.ca_file is None:
        pytest.skip("this RGW has no https endpoint (set OBJCKPT_RGW_HTTPS_ENDPOINT)")
    options = rgw_server.storage_options(https=True)
    del options["client_kwargs"]["verify"]
    target = StoreTarget(rgw_bucket.root, options, rgw_bucket.bucket)
    with pytest.raises(BaseException) as info:
        save(stepped_state(1), target.url("c"), target)
    err = carried(info.value)
    assert isinstance(err, StoreError) and "certificate was not trusted" in str(err), repr(err)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(rgw_server.ca_file))
    _round_trip(target)


# -- S3 Express One Zone -------------------------------------------------------------------
DIRECTORY_BUCKET = "objckpt--use1-az4--x-s3"


def test_directory_bucket_listed_out_of_order_with_session_auth(s3_proxy: FaultProxy) -> None:
    """A directory-bucket name (``name--azid--x-s3``) makes botocore authenticate with
    ``CreateSession`` (answered by the proxy: moto has no S3 Express) and send the
    session token on every request, in the training process and its upload workers.
    Every listing comes back in reverse order, as directory buckets list keys in no
    order: steps, retention, the newest step, the load and gc are still right."""
    s3_proxy.add(Rule(operation="CreateSession", action="session"))
    for listing in ("ListObjectsV2", "ListMultipartUploads"):
        s3_proxy.add(Rule(operation=listing, action="reorder"))
    options = s3_proxy.storage_options()
    setup = s3_client(options)  # through the proxy: botocore asks CreateSession first
    setup.create_bucket(Bucket=DIRECTORY_BUCKET)
    root = f"s3://{DIRECTORY_BUCKET}/t"
    with CheckpointManager(
        root, storage_options=options, upload=PARTS, retention=RetentionPolicy(keep_last=2)
    ) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step)).result(timeout=120)
        manager.wait_until_finished()
        assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
        got = {**stepped_state(0), "big": torch.zeros(4 * MiB)}
        assert manager.load(got) == 3
        assert_state_equal(got, _state(3))
    for key in ("t/step-0000000004/__0_0.a.distcp", "t/step-0000000004/__0_0.b.distcp"):
        setup.create_multipart_upload(Bucket=DIRECTORY_BUCKET, Key=key)
    report = collect_garbage(Location.parse(root, options), grace=0, dry_run=False)
    assert sorted(report.aborted_uploads) == [
        "step-0000000004/__0_0.a.distcp",
        "step-0000000004/__0_0.b.distcp",
    ]
    # The store's answers were out of order (s3fs sorts what it lists, and objckpt
    # orders steps and keys itself again: neither depends on the store's order).
    listed = setup.list_objects_v2(Bucket=DIRECTORY_BUCKET, Prefix="t/")["Contents"]
    keys = [o["Key"] for o in listed]
    assert len(keys) > 2 and keys == sorted(keys, reverse=True), keys
    seen = [s for s in s3_proxy.seen if s.operation != "CreateSession"]
    assert {"UploadPart", "PutObject", "GetObject", "ListObjectsV2"} <= {s.operation for s in seen}
    assert all(dict(s.amz).get("x-amz-s3session-token") for s in seen), [
        s.operation for s in seen if not dict(s.amz).get("x-amz-s3session-token")
    ]


def test_a_botocore_without_if_none_match_is_refused_before_the_commit_is_sent(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore releases before S3's conditional writes (August 2024) have no
    ``IfNoneMatch`` on PutObject, and s3fs drops parameters its botocore does not
    know: the create-only commit would be a plain PUT over a committed manifest.
    Simulated on the real server by taking the member out of this client's model
    (and s3fs's cache of it, as in a fresh process): objckpt refuses, naming
    botocore and the parameter, and sends no PutObject; the manifest is intact."""
    from s3fs.utils import ParamKwargsHelper

    store = open_store(Location.parse(s3_bucket.url("c"), s3_proxy.storage_options()))
    try:
        store.create("manifest.json", b"first")
        members = store._fs._s3.meta.service_model.operation_model("PutObject").input_shape.members
        monkeypatch.delitem(members, "IfNoneMatch")
        monkeypatch.setattr(ParamKwargsHelper, "_kwarg_cache", {})
        puts = s3_proxy.count("PutObject")
        with pytest.raises(ConfigurationError, match=r"botocore .*PutObject's IfNoneMatch"):
            store.create("manifest.json", b"second")
        assert s3_proxy.count("PutObject") == puts
        assert store.read("manifest.json") == b"first"
    finally:
        store.close()
