"""Garbage collection and deletion, including after a save killed mid-upload."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from killed_save import state

from objckpt import CheckpointManager, Location
from objckpt.errors import CheckpointNotFoundError, ConfigurationError
from objckpt.format.steps import step_name
from objckpt.ops.maintain.gc import GcReport, collect_garbage, delete_step
from objckpt.testing import FaultProxy, MotoServer, Rule, offline_env
from objckpt.testing.plugin import StoreTarget

HERE = os.path.dirname(__file__)


def _open_uploads(moto_server: MotoServer, bucket: str) -> list[dict]:
    return moto_server.boto3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _upload_parts(moto_server: MotoServer, bucket: str) -> dict[str, int]:
    """Parts of each upload still open. An upload listed open may complete before its
    ListParts (the save runs on while the test looks): it is open no more, and left out."""
    client = moto_server.boto3_client()
    parts = {}
    for u in _open_uploads(moto_server, bucket):
        try:
            listed = client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
        except client.exceptions.NoSuchUpload:
            continue
        parts[u["Key"]] = len(listed.get("Parts", []))
    return parts


def _open_uploads_all_have_parts(moto_server: MotoServer, bucket: str) -> bool:
    """Some upload is open and each has a part. moto reports a fixed 2010 ``Initiated``
    for every upload, so only its parts' times show an upload is young: one killed
    before its first part landed would look abandoned to gc (on S3 it would not)."""
    parts = _upload_parts(moto_server, bucket)
    return bool(parts) and all(parts.values())


def _keys(moto_server: MotoServer, bucket: str, prefix: str) -> list[str]:
    resp = moto_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for o in resp.get("Contents", [])]


@pytest.mark.timeout(240)
def test_gc_after_a_save_killed_mid_upload(
    moto_server: MotoServer, s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    root = s3_bucket.url("killed")
    opts = s3_bucket.storage_options
    # The child saves through the proxy: once one of step 2's objects is complete, the
    # proxy holds every further CompleteMultipartUpload (and CreateMultipartUpload), so
    # an upload is certainly still open, with parts, when the child is killed.
    child = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "..", "support", "killed_save.py"),
            root,
            json.dumps(s3_proxy.storage_options()),
            "6",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **offline_env()},
        start_new_session=True,  # its upload workers share its process group
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "committed"
        assert child.stdout.readline().strip() == "uploading"
        deadline = time.monotonic() + 60
        killed = f"{Location.parse(root).path.split('/', 1)[1]}/{step_name(2)}/"
        # Kill mid-upload: some of step 2's objects complete, another one's parts in
        # flight. Once an object is complete, completions are held; once an upload is
        # open with parts, new uploads are held too, so that none opened just before
        # the kill lacks a part (see _open_uploads_all_have_parts).
        held = frozen = False
        while not (frozen and _open_uploads_all_have_parts(moto_server, s3_bucket.bucket)):
            assert time.monotonic() < deadline, (
                f"never caught the save mid-upload: held={held}, frozen={frozen}, "
                f"open uploads: {_upload_parts(moto_server, s3_bucket.bucket)}"
            )
            if not held and _keys(moto_server, s3_bucket.bucket, killed):
                s3_proxy.add(Rule("CompleteMultipartUpload", action="stall", stall=300))
                held = True
            elif held and not frozen and any(_upload_parts(moto_server, s3_bucket.bucket).values()):
                s3_proxy.add(Rule("CreateMultipartUpload", action="stall", stall=300))
                frozen = True
            time.sleep(0.01)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert child.stdout is not None
        child.stdout.close()
    s3_proxy.wait_idle(timeout=30)  # requests the dead workers had sent have landed

    # The killed step is invisible; the previous step loads bit-exact.
    with CheckpointManager(root, storage_options=opts) as mgr:
        assert mgr.all_steps() == [1]
        got = {k: torch.zeros_like(v) for k, v in state(1, 1).items()}
        assert mgr.load(got) == 1
        for k, v in state(1, 1).items():
            assert torch.equal(got[k], v), k
        # A young save might still be running: the default grace spares it.
        spared = mgr.gc(dry_run=False)
        assert spared.deleted == () and spared.aborted_uploads == ()
        assert spared.spared and all(k.startswith(step_name(2)) for k in spared.spared)
        assert spared.spared_uploads
        # Once the grace period has passed, gc removes the objects and the open uploads.
        dry = collect_garbage(mgr.root, grace=0, dry_run=True)
        assert dry.aborted_uploads and _open_uploads(moto_server, s3_bucket.bucket)
        report = mgr.gc(grace=0, dry_run=False)
        assert report.deleted == dry.deleted and report.bytes_reclaimed == dry.bytes_reclaimed
        assert report.deleted and all(k.startswith(step_name(2) + "/") for k in report.deleted)
        assert report.aborted_uploads
    assert _open_uploads(moto_server, s3_bucket.bucket) == []
    assert _keys(moto_server, s3_bucket.bucket, killed) == []
    with CheckpointManager(root, storage_options=opts) as mgr:  # step 1 untouched
        got = {k: torch.zeros_like(v) for k, v in state(1, 1).items()}
        assert mgr.load(got) == 1 and all(torch.equal(got[k], v) for k, v in state(1, 1).items())


def test_gc_keeps_committed_objects_and_removes_zombie_payloads(s3_bucket: StoreTarget) -> None:
    root = s3_bucket.url("zombie")
    with CheckpointManager(root, storage_options=s3_bucket.storage_options) as mgr:
        mgr.save(1, {"w": torch.ones(10)}).result(timeout=120)
        fs = mgr.root.open_fs(fresh=True)
        step = mgr.root.child(step_name(1)).path
        # A zombie writer of a lost attempt left a payload beside the committed step,
        # and something not objckpt's lives beside the steps.
        fs.pipe_file(f"{step}/__0_0.0123456789abcdef.distcp", b"x" * 100)
        fs.pipe_file(f"{mgr.root.path}/notes.txt", b"keep me")
        report = mgr.gc(grace=0, dry_run=False)
        assert report.deleted == (f"{step_name(1)}/__0_0.0123456789abcdef.distcp",)
        assert report.bytes_reclaimed == 100
        fs.invalidate_cache()
        assert fs.exists(f"{mgr.root.path}/notes.txt")
        got = {"w": torch.zeros(10)}
        assert mgr.load(got) == 1 and torch.equal(got["w"], torch.ones(10))


def test_delete_refuses_what_is_not_one_checkpoint(tmp_path) -> None:
    root = Location.parse(f"file://{tmp_path}/root")
    with CheckpointManager(root.url) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).result(timeout=120)
    with pytest.raises(ConfigurationError, match="is not one checkpoint"):
        delete_step(root)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.bin").write_bytes(b"1")
    with pytest.raises(ConfigurationError, match="does not look like an objckpt checkpoint"):
        delete_step(Location.parse(f"file://{tmp_path}/other"))
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        delete_step(root.child("step-0000000099"))
    # manifest, .metadata, the payload and rank 0's index object
    assert delete_step(root.child(step_name(1))) == 4
    assert not (tmp_path / "root" / step_name(1)).exists()


def test_gc_on_a_single_checkpoint_url(s3_bucket: StoreTarget) -> None:
    """``gc URL`` where URL is one checkpoint saved directly (no manager): a failed
    attempt's payload and index at its top go; what its manifest names, a stock DCP
    checkpoint's files and objects that are not objckpt's stay."""
    import torch.distributed.checkpoint as dcp
    from helpers import quiet, save

    from objckpt import ObjectStoreReader

    url = s3_bucket.url("single")
    save({"w": torch.ones(10)}, url, s3_bucket)
    loc = Location.parse(url, s3_bucket.storage_options)
    fs = loc.open_fs(fresh=True)
    zombie = ["__0_0.0123456789abcdef.distcp", "__index_0.0123456789abcdef.json"]
    for name in zombie:
        fs.pipe_file(f"{loc.path}/{name}", b"x" * 50)
    fs.pipe_file(f"{loc.path}/notes.txt", b"keep me")
    named = set(fs.ls(loc.path, detail=False)) - {f"{loc.path}/{n}" for n in zombie}

    dry = collect_garbage(loc, grace=0)
    assert sorted(dry.deleted) == sorted(zombie) and dry.dry_run
    report = collect_garbage(loc, grace=0, dry_run=False)
    assert sorted(report.deleted) == sorted(zombie) and report.bytes_reclaimed == 100
    fs.invalidate_cache()
    assert set(fs.ls(loc.path, detail=False)) == named  # manifest, its objects, notes.txt
    got = {"w": torch.zeros(10)}
    with quiet():
        reader = ObjectStoreReader(url, storage_options=s3_bucket.storage_options)
        dcp.load(got, storage_reader=reader)
    assert torch.equal(got["w"], torch.ones(10))

    # A stock DCP checkpoint (no manifest): its names are not objckpt's; nothing goes.
    stock = Location.parse(s3_bucket.url("stock"), s3_bucket.storage_options)
    fs.pipe_file(f"{stock.path}/.metadata", b"m")
    fs.pipe_file(f"{stock.path}/__0_0.distcp", b"p")
    assert collect_garbage(stock, grace=0, dry_run=False).deleted == ()

    # A save that never committed at a URL of its own: its objckpt objects go.
    failed = Location.parse(s3_bucket.url("failed"), s3_bucket.storage_options)
    fs.pipe_file(f"{failed.path}/{zombie[0]}", b"x")
    assert collect_garbage(failed, grace=0, dry_run=False).deleted == (zombie[0],)


def _hold_index_put(proxy: FaultProxy, where: str) -> None:
    """Hold the index object PUTs under ``where``: the payload is up, the commit waits."""
    proxy.add(Rule("PutObject", key_contains=f"{where}/__index_", action="hold", stall=120))


def _payloads_collected(report: GcReport, prefix: str) -> list[str]:
    """The payload keys gc deleted (some, all starting with ``prefix``), without it."""
    from objckpt.format.layout import is_objckpt_payload

    early = [k for k in report.deleted if is_objckpt_payload(k)]
    assert early and all(k.startswith(prefix) for k in early), report
    return [k[len(prefix) :] for k in early]


def test_a_save_whose_payload_gc_collected_fails_at_its_commit(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """gc (grace 0) deletes a save's payload between its upload and its commit: the
    commit's listing finds it gone, the save fails naming it, nothing is committed,
    and the next save to the URL commits."""
    import threading

    from helpers import carried, load, save

    from objckpt.errors import CheckpointNotCommittedError, UploadError

    via = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    url = via.url("slow")
    _hold_index_put(s3_proxy, "slow")
    outcome: dict[str, BaseException | None] = {}

    def slow_save() -> None:
        try:
            save({"w": torch.ones(1000)}, url, via)
            outcome["save"] = None
        except BaseException as exc:
            outcome["save"] = carried(exc)

    saver = threading.Thread(target=slow_save)
    saver.start()
    try:
        s3_proxy.wait_for("PutObject", faulted=True, timeout=60)
        report = collect_garbage(
            Location.parse(url, s3_bucket.storage_options), grace=0, dry_run=False
        )
    finally:
        s3_proxy.release()
        saver.join(timeout=120)
    early = _payloads_collected(report, "")
    err = outcome.get("save")
    assert isinstance(err, UploadError), outcome
    assert all(k in str(err) for k in early), (str(err), early)
    assert "nothing was committed" in str(err) and url in str(err)
    s3_proxy.clear()
    with pytest.raises(CheckpointNotCommittedError):
        load({"w": torch.zeros(1000)}, url, via)
    save({"w": torch.full((1000,), 2.0)}, url, via)
    got = {"w": torch.zeros(1000)}
    load(got, url, via)
    assert torch.equal(got["w"], torch.full((1000,), 2.0))


def test_gc_racing_a_slow_promotion_fails_it_and_the_local_copy_stays(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: pathlib.Path
) -> None:
    """The promotion of step 2 is held at its commit (the proxy holds its index PUT)
    while gc with grace 0 deletes the payload it already copied: the promotion's
    commit refuses, naming the payload; the root keeps step 1 as its newest step, the
    local tier keeps step 2 (its only full copy), and step 3 is promoted."""
    from objckpt import LocalTier
    from objckpt.errors import UploadError
    from objckpt.format.layout import MANIFEST_KEY
    from objckpt.options import AsyncOptions

    via = StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())
    local = str(tmp_path / "nvme")
    two = os.path.join(local, step_name(2), MANIFEST_KEY)
    with CheckpointManager(
        via.url("run"),
        storage_options=via.storage_options,
        async_options=AsyncOptions(workers=1),
        local=LocalTier(local),
    ) as mgr:
        assert mgr.save(1, {"w": torch.ones(1000)}).wait_durable(60)
        _hold_index_put(s3_proxy, step_name(2))
        handle = mgr.save(2, {"w": torch.full((1000,), 2.0)})
        try:
            s3_proxy.wait_for("PutObject", faulted=True, timeout=60)
            report = collect_garbage(
                Location.parse(s3_bucket.url("run"), s3_bucket.storage_options),
                grace=0,
                dry_run=False,
            )
        finally:
            s3_proxy.release()
        early = _payloads_collected(report, step_name(2) + "/")
        with pytest.raises(UploadError, match="refusing to commit") as info:
            handle.wait_durable(60)
        assert all(k in str(info.value) for k in early), str(info.value)
        with pytest.raises(UploadError):
            mgr.check_for_errors()
        assert mgr.all_steps() == [1] and os.path.exists(two)
        s3_proxy.clear()
        assert mgr.save(3, {"w": torch.full((1000,), 3.0)}).wait_durable(60)
        assert mgr.all_steps() == [1, 3] and mgr.local_steps() == [2, 3]
        got = {"w": torch.zeros(1000)}
        assert mgr.load(got, step=2) == 2 and torch.equal(got["w"], torch.full((1000,), 2.0))
    assert os.path.exists(two)
