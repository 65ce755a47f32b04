"""What keeps referenced bytes alive besides retention and gc (#28 review): an overwrite
of a referenced step, gc run on one step directory, a deletion racing a commit, copies
onto a root whose steps reference what is there, and references that are honoured only
between the steps of one root."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import load, save
from reuse_craft import craft_reference_step

from objckpt import CheckpointManager, Location, ObjectStoreWriter
from objckpt.errors import ConfigurationError, IntegrityError, ManifestError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import read_manifest
from objckpt.format.refs import is_reference
from objckpt.format.steps import step_name
from objckpt.ops.maintain.gc import collect_garbage
from objckpt.ops.maintain.retire import RetireReport, retire_steps
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store


def _state(n: int = 3) -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32) * n, "b": torch.ones(7), "n": n}


def _keys(moto_server: MotoServer, bucket: str, prefix: str) -> list[str]:
    client = moto_server.boto3_client()
    resp = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def _objects(target: StoreTarget, url: str) -> set[str]:
    return {
        o.key
        for o in read_manifest(open_store(Location.parse(url, target.storage_options))).objects
    }


def test_overwriting_a_step_keeps_what_later_steps_reference(s3_bucket: StoreTarget) -> None:
    """Step 2 reuses step 1's payload; step 1 is then saved again with overwrite: the
    payload step 2 references stays (step 2 verifies and loads), what only the replaced
    step 1 named (its index object) goes."""
    one, two = s3_bucket.url(f"run/{step_name(1)}"), s3_bucket.url(f"run/{step_name(2)}")
    state = _state()
    save(state, one, s3_bucket)
    replaced = _objects(s3_bucket, one)
    save(state, two, s3_bucket, reuse_from=one)
    referenced = {k.rsplit("/", 1)[1] for k in _objects(s3_bucket, two) if is_reference(k)}
    assert referenced and referenced < replaced
    save(_state(5), one, s3_bucket, overwrite=True)
    assert verify_checkpoint(Location.parse(two, s3_bucket.storage_options)).ok
    got = empty_like_state(state)
    load(got, two, s3_bucket)
    assert_state_equal(got, state)
    store = open_store(Location.parse(one, s3_bucket.storage_options))
    index = [k for k in replaced if k.startswith("__index_")]
    assert index and not any(store.exists(k) for k in index)  # only step 1 named it


def test_reuse_from_needs_the_checkpoint_to_be_a_step_directory(s3_bucket: StoreTarget) -> None:
    base = s3_bucket.url(f"run/{step_name(1)}")
    with pytest.raises(ConfigurationError, match=r"reuse_from=.*run/best.*step directory"):
        ObjectStoreWriter(
            s3_bucket.url("run/best"), storage_options=s3_bucket.storage_options, reuse_from=base
        )


def test_references_in_a_checkpoint_that_is_no_step_directory_are_refused(tmp_path: Path) -> None:
    """A referencing step copied by hand to ``<root>/best``: its ``../step-<N>/`` keys would
    read whatever lies beside ``best``; load and verify refuse them."""
    import torch.distributed.checkpoint as dcp

    from objckpt import ObjectStoreReader

    root = f"file://{tmp_path}"
    dcp.save(_state(), storage_writer=ObjectStoreWriter(f"{root}/{step_name(1)}"), no_dist=True)
    craft_reference_step(root, 1, 2)
    shutil.copytree(tmp_path / step_name(2), tmp_path / "best")
    assert verify_checkpoint(Location.parse(f"{root}/{step_name(2)}")).ok
    with pytest.raises(ManifestError, match="best, which is not a step directory"):
        verify_checkpoint(Location.parse(f"{root}/best"))
    with pytest.raises(ManifestError, match="not a step directory"):
        dcp.load(
            empty_like_state(_state()),
            storage_reader=ObjectStoreReader(f"{root}/best"),
            no_dist=True,
        )


def test_gc_on_one_step_directory_keeps_what_later_steps_reference(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """Step 1 retired while step 2 references its payload: gc of step 1's directory at
    zero grace keeps the payload; once step 2 goes too, the same gc collects it."""
    root = s3_bucket.url("gcdir")
    opts = s3_bucket.storage_options
    with CheckpointManager(root, storage_options=opts, reuse_unchanged=False) as mgr:
        mgr.save(1, _state()).result(timeout=120)
    craft_reference_step(root, 1, 2, opts)
    loc = Location.parse(root, opts)
    retire_steps(loc, [1])
    bucket, prefix = loc.path.split("/", 1)
    (payload,) = _keys(moto_server, bucket, f"{prefix}/{step_name(1)}/")
    step_one = loc.child(step_name(1))
    report = collect_garbage(step_one, grace=0, dry_run=False)
    assert report.deleted == ()
    assert payload in _keys(moto_server, bucket, prefix)
    assert verify_checkpoint(loc.child(step_name(2))).ok
    client = moto_server.boto3_client()
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{step_name(2)}/{MANIFEST_KEY}")
    later = collect_garbage(step_one, grace=0, dry_run=False)
    assert later.deleted == (payload.rsplit("/", 1)[1],)


@pytest.mark.timeout(240)
def test_a_step_committed_while_its_base_is_retired_keeps_the_base_bytes(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    """Retiring step 1 (through the proxy) holds at its first deletion, step 1's
    manifest; meanwhile step 2, referencing step 1's payload, commits. What retire
    keeps is decided from a listing taken after the manifests went, which shows step
    2: the payload stays and step 2 verifies."""
    root = s3_bucket.url("fresh")
    opts = s3_bucket.storage_options
    with CheckpointManager(root, storage_options=opts, reuse_unchanged=False) as mgr:
        mgr.save(1, _state()).result(timeout=120)
    loc = Location.parse(root, opts)
    bucket, prefix = loc.path.split("/", 1)
    (payload,) = [k for k in _keys(moto_server, bucket, f"{prefix}/{step_name(1)}/") if "__0_" in k]
    s3_proxy.add(Rule("DeleteObjects", action="hold", nth=1, stall=120))
    outcome: list[RetireReport | BaseException] = []

    def retire() -> None:
        try:
            outcome.append(retire_steps(Location.parse(root, s3_proxy.storage_options()), [1]))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=retire)
    worker.start()
    try:
        s3_proxy.wait_for("DeleteObjects", faulted=True, timeout=60)
        craft_reference_step(root, 1, 2, opts)  # not through the proxy
    finally:
        s3_proxy.release()
        worker.join(timeout=120)
    (report,) = outcome
    assert not isinstance(report, BaseException), report
    assert payload in _keys(moto_server, bucket, prefix)
    assert f"{step_name(1)}/{payload.rsplit('/', 1)[1]}" in report.kept
    assert verify_checkpoint(loc.child(step_name(2))).ok


def test_retiring_a_step_spares_young_objects_it_references_elsewhere(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """Step 6 references step 5's payload, and step 5 has no manifest (a save in
    flight looks like that): retiring step 6 leaves that young payload to gc's grace."""
    root = s3_bucket.url("young")
    opts = s3_bucket.storage_options
    with CheckpointManager(root, storage_options=opts, reuse_unchanged=False) as mgr:
        mgr.save(5, _state()).result(timeout=120)
    craft_reference_step(root, 5, 6, opts)
    loc = Location.parse(root, opts)
    bucket, prefix = loc.path.split("/", 1)
    client = moto_server.boto3_client()
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{step_name(5)}/{MANIFEST_KEY}")
    before = _keys(moto_server, bucket, f"{prefix}/{step_name(5)}/")
    report = retire_steps(loc, [6])
    assert not any(k.startswith(step_name(5)) for k in report.deleted), report
    assert _keys(moto_server, bucket, f"{prefix}/{step_name(5)}/") == before


@pytest.mark.timeout(240)
def test_discard_after_keeps_the_steps_below_whole(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """Steps 2 and 3 reference step 1's payload: discarding everything after step 1
    deletes their own objects only; step 1 verifies and loads."""
    root = s3_bucket.url("discard")
    opts = s3_bucket.storage_options
    state = _state()
    with CheckpointManager(root, storage_options=opts, reuse_unchanged=False) as mgr:
        mgr.save(1, state).result(timeout=120)
    craft_reference_step(root, 1, 2, opts)
    craft_reference_step(root, 2, 3, opts)
    with CheckpointManager(root, storage_options=opts) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        assert mgr.discard_after(1) == [2, 3]
        assert mgr.all_steps() == [1]
        got = empty_like_state(state)
        assert mgr.load(got) == 1
    assert_state_equal(got, state)
    loc = Location.parse(root, opts)
    assert verify_checkpoint(loc.child(step_name(1))).ok
    bucket, prefix = loc.path.split("/", 1)
    assert _keys(moto_server, bucket, f"{prefix}/{step_name(2)}/") == []
    assert _keys(moto_server, bucket, f"{prefix}/{step_name(3)}/") == []


def test_a_copy_never_overwrites_an_object_already_at_the_destination(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """The destination already holds other bytes under the key of the copied step's
    payload (a committed step there may reference them): the copy is refused, commits
    nothing, and the bytes there are unchanged."""
    src = s3_bucket.url(f"a/{step_name(1)}")
    dst = s3_bucket.url(f"b/{step_name(1)}")
    save(_state(), src, s3_bucket)
    payload = next(k for k in _objects(s3_bucket, src) if k.endswith(".distcp"))
    bucket, prefix = Location.parse(dst).path.split("/", 1)
    client = moto_server.boto3_client()
    client.put_object(Bucket=bucket, Key=f"{prefix}/{payload}", Body=b"theirs")
    opts = s3_bucket.storage_options
    with pytest.raises(IntegrityError, match="never overwritten"):
        copy_checkpoint(Location.parse(src, opts), Location.parse(dst, opts))
    body = client.get_object(Bucket=bucket, Key=f"{prefix}/{payload}")["Body"].read()
    assert body == b"theirs"
    assert _keys(moto_server, bucket, f"{prefix}/{MANIFEST_KEY}") == []
