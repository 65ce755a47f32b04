"""Replicated backups read each object back at most once (#25 item 10).

The "replication" is done by hand between two buckets of one moto server, as S3
Cross-Region Replication would do it (moto replicates nothing itself); the replica
is checked through the recording proxy, so its counts say what each poll cost.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from helpers import save

from objckpt import Location, UploadOptions, write_stock_metadata
from objckpt.format.layout import METADATA_KEY, is_objckpt_payload
from objckpt.format.manifest import read_manifest
from objckpt.format.steps import StepPlaces, step_name
from objckpt.ops.run.backup import BackupTarget, Replicator
from objckpt.ops.run.backup_wait import VerifiedObjects, poll_backup, replica_manifest
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

MiB = 1024 * 1024
REPLICA = "objckpt-replica"


@pytest.fixture
def replica_bucket(s3_bucket: StoreTarget, moto_server: MotoServer) -> str:
    moto_server.boto3_client().create_bucket(Bucket=REPLICA)
    return REPLICA


def _save_step(s3_bucket: StoreTarget, step: int, *, stock: bool = True) -> str:
    """A committed step with a multipart payload (16 MiB in 5 MiB parts) and small
    objects; returns the step's key prefix. Without ``stock`` the save writes no
    ``.metadata`` (as above ``stock_metadata_max_ranks``)."""
    g = torch.Generator().manual_seed(step)
    state = {"big": torch.randn(4 * MiB, generator=g), "small": torch.randn(100, generator=g)}
    save(
        state,
        s3_bucket.url(f"run/{step_name(step)}"),
        s3_bucket,
        upload=UploadOptions(
            part_size=5 * MiB, **({} if stock else {"stock_metadata_max_ranks": 0})
        ),
    )
    return f"t/run/{step_name(step)}/"


def _keys(client, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]


def _replicate(client, src: str, key: str) -> None:
    """One object as S3 replication makes it: a full-object CRC32C travels with the
    object (moto's CopyObject keeps it); a composite one, or none, does not help."""
    head = client.head_object(Bucket=src, Key=key, ChecksumMode="ENABLED")
    if head.get("ChecksumType") == "FULL_OBJECT":
        client.copy_object(Bucket=REPLICA, Key=key, CopySource={"Bucket": src, "Key": key})
    else:
        body = client.get_object(Bucket=src, Key=key)["Body"].read()
        client.put_object(Bucket=REPLICA, Key=key, Body=body)


def _replicator(s3_bucket: StoreTarget, proxy: FaultProxy) -> tuple[Replicator, StepPlaces]:
    """A replicator of the bucket's ``run`` root to one replicated target, and step 1's
    directories there."""
    target = BackupTarget(
        f"s3://{REPLICA}/t/run", proxy.storage_options(), mode="replicated", replica_timeout=60
    )
    primary = Location.parse(s3_bucket.url("run"), s3_bucket.storage_options)
    step = StepPlaces.of(1, primary, backups=[target.location])
    return Replicator(primary, [target], poll_interval=0.01), step


def _replicate_and_check(
    s3_bucket: StoreTarget, proxy: FaultProxy, client, keys: list[str]
) -> Replicator:
    """Replicate ``keys`` by hand, then back step 1 up to the replica (checked through
    ``proxy``) and wait for it; returns the closed replicator."""
    for key in keys:
        _replicate(client, s3_bucket.bucket, key)
    replicator, step_1 = _replicator(s3_bucket, proxy)
    try:
        replicator.submit(step_1)
        replicator.wait(timeout=120)
    finally:
        replicator.close()
    return replicator


def _payload_gets(proxy: FaultProxy) -> list[str]:
    return [p for p in proxy.paths("GetObject") if is_objckpt_payload(p.rsplit("/", 1)[-1])]


def test_a_replica_keeping_full_object_crc32c_is_checked_without_reading_multipart_objects(
    s3_bucket: StoreTarget, moto_server: MotoServer, replica_bucket: str, s3_proxy: FaultProxy
) -> None:
    """The multipart payload carries a full-object CRC32C, replication keeps it, and the
    check compares it from a HEAD: the 12 MiB object is never read across regions."""
    prefix = _save_step(s3_bucket, 1)
    client = moto_server.boto3_client()
    keys = _keys(client, s3_bucket.bucket, prefix)
    multipart = [
        k for k in keys if "-" in client.head_object(Bucket=s3_bucket.bucket, Key=k)["ETag"]
    ]
    assert len(multipart) == 1
    _replicate_and_check(s3_bucket, s3_proxy, client, keys)
    assert [p for p in _payload_gets(s3_proxy) if p.endswith(multipart[0])] == []
    assert s3_proxy.count("HeadObject") >= len(keys)  # each object was checked


def test_a_second_poll_reads_no_payload_object_the_first_one_verified(
    s3_bucket: StoreTarget, moto_server: MotoServer, replica_bucket: str, s3_proxy: FaultProxy
) -> None:
    """Every object but ``.metadata`` has arrived (it is written after the manifest):
    the first poll reads the payloads back (this replica keeps no checksums) and finds
    ``.metadata`` missing; the polls after it issue no GET of any payload, only HEADs,
    until ``.metadata`` arrives and the step is backed up."""
    prefix = _save_step(s3_bucket, 1)
    client = moto_server.boto3_client()
    late = prefix + METADATA_KEY
    for key in _keys(client, s3_bucket.bucket, prefix):
        if key != late:
            body = client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read()
            client.put_object(Bucket=REPLICA, Key=key, Body=body)  # no checksum kept
    # Each poll looks for .metadata once (a HEAD); the rule only counts those.
    looks = Rule(operation="HeadObject", key_contains=late, action="stall", stall=0)
    s3_proxy.add(looks)
    replicator, step_1 = _replicator(s3_bucket, s3_proxy)
    try:
        replicator.submit(step_1)
        s3_proxy.wait_for(None, faulted=True, count=2)  # poll 2 began: poll 1 is over
        assert _payload_gets(s3_proxy), "the first poll read the payloads back"
        s3_proxy.clear()
        s3_proxy.add(looks)
        s3_proxy.wait_for(None, faulted=True, count=2)  # a whole poll ran since
        assert _payload_gets(s3_proxy) == []
        assert replicator.lacking(1)  # still waiting for .metadata
        body = client.get_object(Bucket=s3_bucket.bucket, Key=late)["Body"].read()
        client.put_object(Bucket=REPLICA, Key=late, Body=body)
        replicator.wait(timeout=120)
    finally:
        replicator.close()
    assert replicator.lacking(1) == []


def test_a_verified_object_that_changes_is_checked_again(
    s3_bucket: StoreTarget, moto_server: MotoServer, replica_bucket: str
) -> None:
    """What was verified holds only while the store reports the same size and ETag:
    a replica object rewritten with other bytes is read again and fails its check."""
    prefix = _save_step(s3_bucket, 1)
    client = moto_server.boto3_client()
    for key in _keys(client, s3_bucket.bucket, prefix):
        body = client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read()
        client.put_object(Bucket=REPLICA, Key=key, Body=body)
    dest = Location.parse(f"s3://{REPLICA}/{prefix.rstrip('/')}", s3_bucket.storage_options)
    store = open_store(dest)
    verified = VerifiedObjects()
    try:
        manifest = read_manifest(store)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert poll_backup(verified, store, manifest, pool) is None
            assert len(verified) == len(manifest.objects)
            payload = next(e.key for e in manifest.objects if is_objckpt_payload(e.key))
            body = bytearray(client.get_object(Bucket=REPLICA, Key=prefix + payload)["Body"].read())
            body[len(body) // 2] ^= 0xFF  # same size, other bytes: another ETag
            client.put_object(Bucket=REPLICA, Key=prefix + payload, Body=bytes(body))
            why = poll_backup(verified, store, manifest, pool)
    finally:
        store.close()
    assert why is not None and payload in why and "CRC32C" in why


def _unnamed_metadata_step(s3_bucket: StoreTarget) -> tuple[str, Location]:
    """Step 1 whose ``.metadata`` no manifest names: the save wrote none and
    ``write_stock_metadata`` wrote it after the commit, as an async save of several
    ranks does. Returns the step's key prefix and its location."""
    prefix = _save_step(s3_bucket, 1, stock=False)
    primary = Location.parse(s3_bucket.url(f"run/{step_name(1)}"), s3_bucket.storage_options)
    write_stock_metadata(primary)
    store = open_store(primary)
    try:
        assert read_manifest(store).object(METADATA_KEY) is None and store.exists(METADATA_KEY)
    finally:
        store.close()
    return prefix, primary


def test_a_replica_is_not_backed_up_before_the_metadata_no_manifest_names_arrives(
    s3_bucket: StoreTarget, moto_server: MotoServer, replica_bucket: str, s3_proxy: FaultProxy
) -> None:
    """The manifest and every object it names have arrived, the primary's
    ``.metadata`` (written after the commit, named by no manifest) has not: stock DCP
    readers could not load the replica, so the step is not counted as backed up until
    it arrives."""
    prefix, _ = _unnamed_metadata_step(s3_bucket)
    client = moto_server.boto3_client()
    late = prefix + METADATA_KEY
    for key in _keys(client, s3_bucket.bucket, prefix):
        if key != late:
            _replicate(client, s3_bucket.bucket, key)
    looks = Rule(operation="HeadObject", key_contains=late, action="stall", stall=0)
    s3_proxy.add(looks)
    replicator, step_1 = _replicator(s3_bucket, s3_proxy)
    try:
        backed_up = replicator.submit(step_1)
        with concurrent.futures.ThreadPoolExecutor(1) as watch:
            # Poll 2 began (poll 1 is over), or the step was counted as backed up.
            looked = watch.submit(s3_proxy.wait_for, None, faulted=True, count=2)
            concurrent.futures.wait([backed_up, looked], return_when="FIRST_COMPLETED")
            assert not backed_up.done(), "backed up before the replica held .metadata"
            looked.result()
        assert replicator.lacking(1)  # every named object matched; .metadata missing
        _replicate(client, s3_bucket.bucket, late)
        replicator.wait(timeout=120)
    finally:
        replicator.close()
    assert replicator.lacking(1) == []
    assert replicator.status([])[0].error is None


def test_a_replica_holding_another_attempt_s_metadata_is_not_in_place(
    s3_bucket: StoreTarget, moto_server: MotoServer, replica_bucket: str
) -> None:
    """A ``.metadata`` left in the replica by an earlier save of the step is named:
    stock readers would load the wrong checkpoint there."""
    prefix, primary = _unnamed_metadata_step(s3_bucket)
    client = moto_server.boto3_client()
    for key in _keys(client, s3_bucket.bucket, prefix):
        _replicate(client, s3_bucket.bucket, key)
    client.put_object(Bucket=REPLICA, Key=prefix + METADATA_KEY, Body=b"an earlier attempt's")
    dest = Location.parse(f"s3://{REPLICA}/{prefix.rstrip('/')}", s3_bucket.storage_options)
    store = open_store(dest)
    verified = VerifiedObjects()
    try:
        expected = replica_manifest(primary, read_manifest(store))
        assert expected.object(METADATA_KEY) is not None
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            why = poll_backup(verified, store, expected, pool)
            assert why is not None and METADATA_KEY in why
            _replicate(client, s3_bucket.bucket, prefix + METADATA_KEY)
            assert poll_backup(verified, store, expected, pool) is None
    finally:
        store.close()


def test_a_step_whose_primary_has_no_metadata_is_backed_up_without_one(
    s3_bucket: StoreTarget, moto_server: MotoServer, replica_bucket: str, s3_proxy: FaultProxy
) -> None:
    """A save that wrote no ``.metadata`` (above ``stock_metadata_max_ranks``) leaves
    none to wait for: the replica is in place with the manifest's objects."""
    prefix = _save_step(s3_bucket, 1, stock=False)
    client = moto_server.boto3_client()
    keys = _keys(client, s3_bucket.bucket, prefix)
    assert prefix + METADATA_KEY not in keys
    replicator = _replicate_and_check(s3_bucket, s3_proxy, client, keys)
    assert replicator.lacking(1) == []


def test_a_replicated_step_listed_but_never_checked_is_lacking(
    s3_bucket: StoreTarget, moto_server: MotoServer, replica_bucket: str, s3_proxy: FaultProxy
) -> None:
    """A replica whose manifest arrived before its objects (or whose objects failed
    to replicate) lists the step: a start's listing does not count it as backed up,
    the check does, once every object is there."""
    prefix = _save_step(s3_bucket, 1)
    client = moto_server.boto3_client()
    _replicate(client, s3_bucket.bucket, prefix + "manifest.json")
    replicator, step_1 = _replicator(s3_bucket, s3_proxy)
    try:
        replicator.scan()
        assert [t.url for t in replicator.lacking(1)] == [replicator.targets[0].url]
        assert replicator.status([])[0].latest_step is None
        for key in _keys(client, s3_bucket.bucket, prefix):
            _replicate(client, s3_bucket.bucket, key)
        replicator.submit(step_1)
        replicator.wait(timeout=120)
        replicator.scan()  # listed and checked: held
        assert replicator.lacking(1) == []
    finally:
        replicator.close()
