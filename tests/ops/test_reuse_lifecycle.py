"""A step stays whole on its own (#28 item 2): deletion, retention, gc and verify over
steps that reference each other's bytes, against the moto server and through the CLI.

The referencing steps are crafted from committed ones (:mod:`reuse_craft`): the
manifest, index objects and ``.metadata`` a reusing save of an unchanged state
commits, so what is tested here is the lifecycle alone.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import carried as carried_error
from helpers import quiet
from reuse_craft import craft_reference_step
from torch.distributed.checkpoint.api import CheckpointException

from objckpt import CheckpointManager, Location, ObjectStoreReader
from objckpt.errors import SizeMismatchError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import StepPlaces, step_name
from objckpt.ops.maintain.gc import collect_garbage
from objckpt.ops.maintain.retention import RetentionPolicy
from objckpt.ops.maintain.retire import retire_steps
from objckpt.ops.run.backup import BackupTarget, Replicator
from objckpt.testing import MotoServer
from objckpt.testing.plugin import StoreTarget


def _state() -> dict:
    return {"frozen": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7), "n": 3}


def _keys(moto_server: MotoServer, bucket: str, prefix: str) -> list[str]:
    client = moto_server.boto3_client()
    resp = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def _chain(s3_bucket: StoreTarget, name: str) -> str:
    """A root with step 1 saved by a manager and steps 2 and 3 referencing its payload
    (3 copies 2's references, so both name step 1's objects)."""
    root = s3_bucket.url(name)
    opts = s3_bucket.storage_options
    with CheckpointManager(root, storage_options=opts, reuse_unchanged=False) as mgr:
        mgr.save(1, _state()).result(timeout=120)
    craft_reference_step(root, 1, 2, opts)
    craft_reference_step(root, 2, 3, opts)
    return root


def _path(root: str) -> str:
    return Location.parse(root).path


@pytest.mark.timeout(240)
def test_deleting_referenced_steps_keeps_the_referencing_step_whole(
    s3_bucket: StoreTarget, moto_server: MotoServer, cli
) -> None:
    """keep_last=1 after step 3 of a chain, then gc at zero grace: step 3 verifies, and
    step 1's payload is stored still (only step 3's manifest names it)."""
    root = _chain(s3_bucket, "chain")
    opts = s3_bucket.storage_options
    bucket, prefix = _path(root).split("/", 1)
    payloads = [k for k in _keys(moto_server, bucket, f"{prefix}/{step_name(1)}/") if "__0_" in k]
    assert len(payloads) == 1
    with CheckpointManager(
        root, storage_options=opts, retention=RetentionPolicy(keep_last=1)
    ) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        mgr.delete(1)  # what retention does: the manager's own deletion
        mgr.delete(2)
        assert mgr.all_steps() == [3]
    assert cli("gc", root, "--apply", "--grace", "0").exit_code == 0
    assert payloads[0] in _keys(moto_server, bucket, prefix)
    assert not [k for k in _keys(moto_server, bucket, f"{prefix}/{step_name(2)}/")]
    result = cli("verify", f"{root}/{step_name(3)}")
    assert result.exit_code == 0, result.output
    assert "ok" in result.output
    listed = json.loads(cli("ls", root, "--json").output)["steps"]
    assert [(d["step"], d["committed"]) for d in listed] == [(1, False), (3, True)]
    # The last step referencing them goes: step 1's objects, outside the retired
    # directory, go once older than the grace period (young, they could be a save in
    # flight's: a damaged manifest must not get those deleted), as gc would.
    assert cli("rm", "-y", f"{root}/{step_name(3)}").exit_code == 0
    assert _keys(moto_server, bucket, prefix + "/") == [payloads[0]]
    assert cli("gc", root, "--apply", "--grace", "0").exit_code == 0
    assert _keys(moto_server, bucket, prefix + "/") == []


@pytest.mark.timeout(240)
def test_verify_names_both_steps_when_referenced_bytes_are_gone_or_corrupt(
    s3_bucket: StoreTarget, moto_server: MotoServer, cli
) -> None:
    root = _chain(s3_bucket, "gone")
    bucket, prefix = _path(root).split("/", 1)
    client = moto_server.boto3_client()
    (payload,) = [k for k in _keys(moto_server, bucket, f"{prefix}/{step_name(1)}/") if "__0_" in k]
    body = client.get_object(Bucket=bucket, Key=payload)["Body"].read()
    client.put_object(Bucket=bucket, Key=payload, Body=b"\x00" + body[1:])
    corrupt = cli("verify", f"{root}/{step_name(3)}")
    assert corrupt.exit_code == 1, corrupt.output
    assert "CRC32C" in corrupt.output
    assert f"stored by {root}/{step_name(1)}" in corrupt.output
    assert f"referenced by {root}/{step_name(3)}" in corrupt.output
    client.delete_object(Bucket=bucket, Key=payload)
    missing = cli("verify", f"{root}/{step_name(2)}")
    assert missing.exit_code == 1, missing.output
    line = next(ln for ln in missing.output.splitlines() if ln.startswith("FAIL"))
    assert f"FAIL s3://{bucket}/{payload}: missing" in line
    assert f"stored by {root}/{step_name(1)}" in line
    assert f"referenced by {root}/{step_name(2)}" in line


@pytest.mark.timeout(240)
def test_a_load_names_both_steps_when_referenced_bytes_are_gone(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """Step 3 references step 1's payload, deleted by hand: ``mgr.load`` and
    ``dcp.load`` fail naming the missing object, the step that stores it and the step
    being loaded, as ``verify`` does (unfixed: the object alone)."""
    root = _chain(s3_bucket, "load-gone")
    opts = s3_bucket.storage_options
    bucket, prefix = _path(root).split("/", 1)
    (payload,) = [k for k in _keys(moto_server, bucket, f"{prefix}/{step_name(1)}/") if "__0_" in k]
    moto_server.boto3_client().delete_object(Bucket=bucket, Key=payload)
    both = (
        f"s3://{bucket}/{payload}",
        f"stored by {root}/{step_name(1)}",
        f"referenced by {root}/{step_name(3)}",
    )
    state = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state().items()
    }
    with (
        CheckpointManager(root, storage_options=opts) as mgr,
        pytest.raises(SizeMismatchError) as info,
    ):
        mgr.load(state, step=3)
    assert all(part in str(info.value) for part in both), info.value
    reader = ObjectStoreReader(f"{root}/{step_name(3)}", storage_options=opts)
    with quiet(), pytest.raises(CheckpointException) as raised:
        dcp.load(state, storage_reader=reader, no_dist=True)
    carried = carried_error(raised.value)
    assert isinstance(carried, SizeMismatchError), carried
    assert all(part in str(carried) for part in both), carried


@pytest.mark.timeout(240)
def test_gc_spares_what_a_young_uncommitted_index_references(
    s3_bucket: StoreTarget, moto_server: MotoServer, cli
) -> None:
    """A reusing save of another process, in flight (its index objects written, no
    manifest yet), keeps its base's objects alive for the grace period, through the
    deletion of the base and gc; once older than the grace they are garbage."""
    root = s3_bucket.url("inflight")
    opts = s3_bucket.storage_options
    with CheckpointManager(root, storage_options=opts, reuse_unchanged=False) as mgr:
        mgr.save(1, _state()).result(timeout=120)
    craft_reference_step(root, 1, 2, opts)
    bucket, prefix = _path(root).split("/", 1)
    client = moto_server.boto3_client()
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{step_name(2)}/{MANIFEST_KEY}")
    (payload,) = [k for k in _keys(moto_server, bucket, f"{prefix}/{step_name(1)}/") if "__0_" in k]
    assert cli("rm", "-y", f"{root}/{step_name(1)}").exit_code == 0
    assert payload in _keys(moto_server, bucket, prefix)
    assert cli("gc", root, "--apply").exit_code == 0  # the default grace: an hour
    assert payload in _keys(moto_server, bucket, prefix)
    later = collect_garbage(Location.parse(root, opts), grace=3600, now=time.time() + 7200)
    assert f"{step_name(1)}/{payload.rsplit('/', 1)[1]}" in later.deleted  # a dry run
    assert cli("gc", root, "--apply", "--grace", "0").exit_code == 0
    assert _keys(moto_server, bucket, prefix + "/") == []


def _delete_prefix(moto_server: MotoServer, bucket: str, prefix: str) -> None:
    client = moto_server.boto3_client()
    for key in _keys(moto_server, bucket, prefix + "/"):
        client.delete_object(Bucket=bucket, Key=key)


@pytest.mark.timeout(240)
def test_a_backup_of_a_referencing_step_is_whole_without_the_primary(
    s3_bucket: StoreTarget, moto_server: MotoServer, cli
) -> None:
    """Only step 3 is backed up: the step 1 objects it references are copied to the
    same step directory of the backup root, and the backup verifies once the primary
    is gone."""
    root = _chain(s3_bucket, "primary")
    opts = s3_bucket.storage_options
    backup = s3_bucket.url("backup")
    primary, target = (
        Location.parse(root, opts),
        BackupTarget(backup, opts, retention=RetentionPolicy()),
    )
    replicator = Replicator(primary, [target])
    try:
        replicator.submit(StepPlaces.of(3, primary, backups=[target.location])).result(timeout=120)
        replicator.wait(timeout=120)
    finally:
        replicator.close()
    bucket, prefix = _path(root).split("/", 1)
    _delete_prefix(moto_server, bucket, prefix)
    result = cli("verify", f"{backup}/{step_name(3)}")
    assert result.exit_code == 0, result.output
    _, backup_prefix = _path(backup).split("/", 1)
    held = _keys(moto_server, bucket, f"{backup_prefix}/{step_name(1)}/")
    assert len(held) == 1 and "__0_" in held[0]  # the referenced payload, nothing else
    assert MANIFEST_KEY not in held[0]


@pytest.mark.timeout(240)
def test_cp_of_a_referencing_step_is_whole_at_the_destination(
    s3_bucket: StoreTarget, moto_server: MotoServer, cli
) -> None:
    root = _chain(s3_bucket, "src")
    other = s3_bucket.url("dst")
    refused = cli("cp", f"{root}/{step_name(3)}", f"{other}/plain")
    assert refused.exit_code != 0
    assert step_name(1) in refused.output and "not a step directory" in refused.output
    copied = cli("cp", f"{root}/{step_name(3)}", f"{other}/{step_name(3)}")
    assert copied.exit_code == 0, copied.output
    bucket, prefix = _path(root).split("/", 1)
    _delete_prefix(moto_server, bucket, prefix)
    result = cli("verify", f"{other}/{step_name(3)}")
    assert result.exit_code == 0, result.output


def test_the_local_tier_sweep_keeps_files_a_kept_step_references(tmp_path) -> None:
    """A local step directory left without a manifest (retired) whose payload a kept
    local step references is no step, but the sweep at start keeps that payload."""
    import torch.distributed.checkpoint as dcp

    from objckpt import ObjectStoreWriter
    from objckpt.dcp.collective import Collectives
    from objckpt.ops.maintain.verify import verify_checkpoint
    from objckpt.ops.tier.local_disk import sweep
    from objckpt.ops.tier.tiers import LocalTier

    local = tmp_path / "local"
    root = f"file://{local}"
    dcp.save(_state(), storage_writer=ObjectStoreWriter(f"{root}/{step_name(1)}"), no_dist=True)
    craft_reference_step(root, 1, 2)
    one = local / step_name(1)
    (payload,) = [p.name for p in one.iterdir() if p.name.startswith("__0_")]
    for p in one.iterdir():  # retired: all but the payload step 2 references
        if p.name != payload:
            p.unlink()
    (local / step_name(3)).mkdir()  # a save a crash left (nothing committed)
    (local / step_name(3) / "__0_0.00000000deadbeef.distcp").write_bytes(b"x")
    sweep(LocalTier(local), durable=set(), collectives=Collectives())
    assert sorted(p.name for p in local.iterdir()) == [step_name(1), step_name(2)]
    assert [p.name for p in one.iterdir()] == [payload]
    assert verify_checkpoint(Location.parse(f"{root}/{step_name(2)}")).ok


@pytest.mark.timeout(240)
def test_gc_collects_no_payload_while_a_manifest_is_unreadable(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """An unreadable committed manifest may reference any sibling's objects: gc then
    leaves every payload in step directories alone (the live set is partial)."""
    root = s3_bucket.url("partial")
    opts = s3_bucket.storage_options
    with CheckpointManager(root, storage_options=opts, reuse_unchanged=False) as mgr:
        mgr.save(1, _state()).result(timeout=120)
    craft_reference_step(root, 1, 2, opts)
    loc = Location.parse(root, opts)
    retire_steps(loc, [1])  # step 1's payload stays: step 2 references it
    bucket, prefix = _path(root).split("/", 1)
    (payload,) = [k for k in _keys(moto_server, bucket, f"{prefix}/{step_name(1)}/") if "__0_" in k]
    client = moto_server.boto3_client()
    client.put_object(Bucket=bucket, Key=f"{prefix}/{step_name(2)}/{MANIFEST_KEY}", Body=b"{")
    report = collect_garbage(loc, grace=0, dry_run=False)
    assert report.unreadable_steps == (2,)
    assert payload in _keys(moto_server, bucket, prefix)
    assert f"{step_name(1)}/{payload.rsplit('/', 1)[1]}" in report.spared
