"""Lifecycle of steps that real reusing saves wrote (#28): a LoRA-shaped run whose
frozen base is stored once, kept whole by retention and gc, the race between a
reusing save and a deletion of its base by another process, through the proxy, and
a base whose referenced bytes were damaged by hand before the save (#35)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from reuse_helpers import stored_items

from objckpt import CheckpointManager, Location, RetentionPolicy
from objckpt.errors import UploadError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import read_manifest
from objckpt.format.refs import is_reference
from objckpt.format.steps import step_name
from objckpt.ops.maintain.gc import collect_garbage
from objckpt.ops.maintain.retire import retire_steps
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store


def _lora(step: int) -> dict:
    """A frozen base (the same every step) and a small adapter that trains."""
    g = torch.Generator().manual_seed(0)
    return {
        "base": torch.randn(256, 1024, generator=g),  # 1 MiB, frozen
        "adapter": torch.full((16, 64), float(step)),
        "step": step,
    }


def _blank() -> dict:
    return {"base": torch.zeros(256, 1024), "adapter": torch.zeros(16, 64), "step": 0}


@pytest.mark.timeout(300)
def test_keep_last_one_and_gc_at_zero_grace_keep_the_newest_step_whole(
    s3_bucket: StoreTarget, moto_server: MotoServer, cli
) -> None:
    root = s3_bucket.url("lora")
    opts = s3_bucket.storage_options
    with CheckpointManager(
        root, storage_options=opts, retention=RetentionPolicy(keep_last=1)
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _lora(step)).result(timeout=120)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
    assert cli("gc", root, "--apply", "--grace", "0").exit_code == 0
    verified = cli("verify", f"{root}/{step_name(3)}")
    assert verified.exit_code == 0, verified.output
    info = json.loads(cli("info", f"{root}/{step_name(3)}", "--json").output)
    assert info["reused_from"] == [step_name(1)]  # the base, stored by step 1 only
    assert info["reused_bytes"] > 1024 * 1024 > info["stored_bytes"]
    got = _blank()
    with CheckpointManager(root, storage_options=opts) as mgr:
        assert mgr.load(got) == 3
    want = _lora(3)
    assert torch.equal(got["base"], want["base"]) and torch.equal(got["adapter"], want["adapter"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("then_gc", [False, True], ids=["rm", "rm-and-gc-at-zero-grace"])
def test_a_reusing_save_whose_base_was_deleted_meanwhile_never_commits(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer, then_gc: bool
) -> None:
    """Another process deletes step 1 (and collects garbage at zero grace) while step
    2, which reuses step 1's frozen base, waits before its commit (its index PUT held
    by the proxy): step 2 fails, and nothing of it is committed. Deleted alone, the
    base is what the commit finds gone and names (gc at zero grace also takes step
    2's own young payload, which the commit's listing of its own directory finds
    first)."""
    root = s3_bucket.url("race")
    via = s3_proxy.storage_options()
    with CheckpointManager(root, storage_options=via) as mgr:
        mgr.save(1, _lora(1)).result(timeout=120)
        s3_proxy.add(
            Rule(
                "PutObject",
                key_contains=f"{step_name(2)}/__index_",
                action="hold",
                stall=120,
            )
        )
        handle = mgr.save(2, _lora(2))
        try:
            s3_proxy.wait_for("PutObject", faulted=True, timeout=60)
            other = Location.parse(root, s3_bucket.storage_options)  # not through the proxy
            retired = retire_steps(other, [1])
            if then_gc:
                collect_garbage(other, grace=0, dry_run=False)
        finally:
            s3_proxy.release()
        # Each variant fails for its own reason, named: the base gone (the reference
        # check), or, after gc at zero grace, step 2's own young payload missing.
        why = (
            rf"commit \S+/{step_name(2)}: .* missing \(__0_" if then_gc else f"{step_name(1)}.*gone"
        )
        with pytest.raises(UploadError, match=why):
            handle.result(timeout=120)
        with pytest.raises(UploadError):
            mgr.check_for_errors()
    # Nothing protected the base: the save's index objects were not written yet.
    assert any(k.startswith(f"{step_name(1)}/__0_") for k in retired.deleted), retired
    bucket, prefix = Location.parse(root).path.split("/", 1)
    client = moto_server.boto3_client()
    keys = [
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    ]
    assert f"{prefix}/{step_name(2)}/{MANIFEST_KEY}" not in keys


def _damage_payload(target: StoreTarget, step_url: str, how: str) -> str:
    """Damage the one payload object of the committed step ``step_url`` by hand:
    ``deleted``, or ``replaced`` by as many other bytes; its URL."""
    loc = Location.parse(step_url, target.storage_options)
    store = open_store(loc)
    try:
        (key,) = [o.key for o in read_manifest(store).objects if o.key.endswith(".distcp")]
    finally:
        store.close()
    fs, path = loc.open_fs(fresh=True), loc.key_path(key)
    if how == "deleted":
        fs.rm_file(path)
    else:
        body = bytearray(fs.cat_file(path))
        body[len(body) // 2] ^= 0xFF
        fs.pipe_file(path, bytes(body))
    return loc.url_of(key)


def _base_of(target: StoreTarget, step_url: str) -> str:
    """Where step ``step_url`` stores its frozen ``base``: a reference, or its own key."""
    (item,) = [i for index, i in stored_items(step_url, target).items() if index.fqn == "base"]
    return item.relative_path


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("store", "how", "fresh"),
    [("s3", "deleted", True), ("s3", "deleted", False), ("gcs", "replaced", True)],
    ids=["deleted-fresh-managers", "deleted-one-manager", "replaced-gcs-crc32c"],
)
def test_a_damaged_base_costs_its_items_their_reuse_not_every_later_save(
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
    store: str,
    how: str,
    fresh: bool,
) -> None:
    """Step 2 references step 1's frozen base; then step 1's payload is deleted by
    hand (or, on GCS, which keeps a CRC32C of every object, replaced by as many other
    bytes). Steps 3, 4 and 5 (each by a fresh manager, or all by the one that saved
    steps 1 and 2 and remembers what it wrote) all commit: step 3 uploads the base
    again, with exactly one warning naming its base (step 2) and the damaged object,
    and later steps reference step 3's copy. Unfixed, step 3 referenced the gone
    bytes again and its commit failed ("the step was deleted since this save looked
    it up"), and so did every later save."""
    target: StoreTarget = request.getfixturevalue(f"{store}_bucket")
    root = target.url("damaged")
    opts = target.storage_options
    with CheckpointManager(root, storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, _lora(step)).result(timeout=120)
        assert _base_of(target, f"{root}/{step_name(2)}").startswith(f"../{step_name(1)}/")
        culprit = _damage_payload(target, f"{root}/{step_name(1)}", how)
        with caplog.at_level(logging.WARNING, logger="objckpt.dcp.reuse_base"):
            for step in (3, 4, 5):
                if fresh:
                    with CheckpointManager(root, storage_options=opts) as other:
                        other.save(step, _lora(step)).result(timeout=120)
                else:
                    mgr.save(step, _lora(step)).result(timeout=120)
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "objckpt.dcp.reuse_base" and r.levelno >= logging.WARNING
    ]
    assert len(warned) == 1, warned
    assert f"{root}/{step_name(2)} " in warned[0] and culprit in warned[0], warned
    assert not is_reference(_base_of(target, f"{root}/{step_name(3)}"))  # uploaded again
    for step in (4, 5):
        assert _base_of(target, f"{root}/{step_name(step)}").startswith(f"../{step_name(3)}/")
    got = _blank()
    with CheckpointManager(root, storage_options=opts) as mgr:
        assert mgr.all_steps() == [1, 2, 3, 4, 5]
        assert mgr.load(got) == 5
    want = _lora(5)
    assert torch.equal(got["base"], want["base"]) and torch.equal(got["adapter"], want["adapter"])


def test_a_remembered_base_heads_only_the_older_steps_it_references(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    """One manager: step 2's base is step 1, which this process wrote and saw commit,
    so no HEAD asks for step 1's own objects; step 3's base is step 2, whose frozen
    items lie in step 1, so those objects are asked for (a hand deletion there costs
    their reuse, not the save). At 1,024 ranks the first would be a burst of HEADs on
    one prefix on every save, for nothing."""
    target = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    root = target.url("heads")

    def heads_of(step: int) -> list[str]:
        return [p for p in s3_proxy.paths("HeadObject") if f"/{step_name(step)}/" in p]

    with CheckpointManager(root, storage_options=target.storage_options) as mgr:
        mgr.save(1, _lora(1)).result(timeout=120)
        s3_proxy.clear()
        mgr.save(2, _lora(2)).result(timeout=120)
        assert _base_of(target, f"{root}/{step_name(2)}").startswith(f"../{step_name(1)}/")
        assert heads_of(1) == [], heads_of(1)  # its own previous save's objects
        s3_proxy.clear()
        mgr.save(3, _lora(3)).result(timeout=120)
        assert _base_of(target, f"{root}/{step_name(3)}").startswith(f"../{step_name(1)}/")
        assert any(".distcp" in p for p in heads_of(1)), s3_proxy.paths("HeadObject")
