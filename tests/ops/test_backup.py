"""Backups: copies to a second moto bucket and to file://, fallback on load, lag,
server-side copy checks, the replicated mode, and restore with the CLI."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_state_equal, empty_like_state
from helpers import fs_of
from states import stepped_state

from objckpt import CheckpointManager, Location, RetentionPolicy, UploadOptions
from objckpt.cli import main
from objckpt.errors import BackupError, ChecksumMismatchError, ConfigurationError
from objckpt.format.layout import MANIFEST_KEY, is_objckpt_payload
from objckpt.format.steps import StepInfo, step_name
from objckpt.ops.maintain.gc import delete_step
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.ops.run.backup import BackupTarget, lag_of
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget

BACKUP_BUCKET = "objckpt-backup"


@pytest.fixture
def backup_bucket(s3_bucket: StoreTarget, moto_server: MotoServer) -> StoreTarget:
    """A second bucket on the same server (standing in for another region)."""
    moto_server.boto3_client().create_bucket(Bucket=BACKUP_BUCKET)
    return StoreTarget(
        root=f"s3://{BACKUP_BUCKET}/t",
        storage_options=moto_server.storage_options(),
        bucket=BACKUP_BUCKET,
    )


def _steps(root: str, options: dict) -> list[int]:
    from objckpt.ops.run.backup import committed_steps

    return [s.step for s in committed_steps(Location.parse(root, options))]


def _payloads(root: str, step: int, options: dict) -> list[str]:
    loc = Location.parse(root, options).child(step_name(step))
    fs = loc.open_fs(fresh=True)
    return sorted(p for p in fs.ls(loc.path, detail=False) if is_objckpt_payload(p.rsplit("/")[-1]))


def _flip_byte(root: str, step: int, options: dict) -> str:
    """Corrupt one payload object of a step in place (same size); returns its path."""
    loc = Location.parse(root, options)
    fs = loc.open_fs(fresh=True)
    path = _payloads(root, step, options)[0]
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    return path


def test_backups_to_a_second_bucket_and_to_file_with_their_own_retention(
    s3_bucket: StoreTarget, backup_bucket: StoreTarget, tmp_path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="objckpt")
    root = s3_bucket.url("run")
    s3_backup = BackupTarget(
        backup_bucket.url("run"),
        backup_bucket.storage_options,
        retention=RetentionPolicy(keep_last=4),
    )
    file_backup = f"file://{tmp_path}/backup"
    with CheckpointManager(
        root,
        storage_options=s3_bucket.storage_options,
        retention=RetentionPolicy(keep_last=2),
        backups=[s3_backup, file_backup],
    ) as mgr:
        for step in range(1, 6):
            mgr.save(step, stepped_state(step))
            mgr.wait_until_finished()
        mgr.wait_for_backups(timeout=120)
        status = mgr.backup_status()
        assert [(s.latest_step, s.steps_behind, s.seconds_behind, s.error) for s in status] == [
            (5, 0, 0.0, None),
            (5, 0, 0.0, None),
        ]
        assert mgr.all_steps() == [4, 5]
    assert _steps(root, s3_bucket.storage_options) == [4, 5]
    assert _steps(s3_backup.url, backup_bucket.storage_options) == [2, 3, 4, 5]
    assert _steps(file_backup, {}) == [4, 5]  # no policy of its own: the primary's
    # The same step on every root: identical manifest bytes, every object checks out.
    primary_fs = fs_of(s3_bucket)
    for url, opts in ((s3_backup.url, backup_bucket.storage_options), (file_backup, {})):
        loc = Location.parse(url, opts).child(step_name(5))
        assert loc.open_fs(fresh=True).cat_file(loc.key_path(MANIFEST_KEY)) == primary_fs.cat_file(
            Location.parse(root).child(step_name(5)).key_path(MANIFEST_KEY)
        )
        assert verify_checkpoint(loc).ok
    copies = [r.getMessage() for r in caplog.records if "backed up to" in r.getMessage()]
    # The bucket on the same service is copied server-side; file:// streams.
    assert any("s3://objckpt-backup" in m and "0 streamed" in m for m in copies), copies
    assert any("file://" in m and "0 server-side" in m for m in copies), copies

    # A restarted job with one more, empty backup: the newest step is backed up at start.
    late = f"file://{tmp_path}/late"
    with CheckpointManager(root, storage_options=s3_bucket.storage_options, backups=[late]) as mgr:
        mgr.wait_for_backups(timeout=60)
    assert _steps(late, {}) == [5]


def test_load_falls_back_to_a_backup_and_says_so(
    s3_bucket: StoreTarget, moto_server: MotoServer, tmp_path, caplog
) -> None:
    root = s3_bucket.url("run")
    backup = f"file://{tmp_path}/backup"
    opts = s3_bucket.storage_options
    with CheckpointManager(root, storage_options=opts, backups=[backup]) as mgr:
        for step in (1, 2):
            mgr.save(step, stepped_state(step))
            mgr.wait_until_finished()
        mgr.wait_for_backups(timeout=60)

        # A corrupted primary object: the CRC check fails, the backup loads.
        _flip_byte(root, 2, opts)
        caplog.clear()
        got = empty_like_state(stepped_state(0))
        assert mgr.load(got, step=2) == 2
        assert_state_equal(got, stepped_state(2))
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("loaded step 2 from backup file://" in m for m in warned), warned
        assert any("CRC32C" in m for m in warned), warned

        # A deleted primary step: same.
        delete_step(Location.parse(root, opts).child(step_name(1)))
        got = empty_like_state(stepped_state(0))
        assert mgr.load(got, step=1) == 1
        assert_state_equal(got, stepped_state(1))

    # Without a backup, the corruption is the error.
    with CheckpointManager(root, storage_options=opts) as mgr, pytest.raises(ChecksumMismatchError):
        mgr.load(empty_like_state(stepped_state(0)), step=2)

    # The primary bucket is gone: a restarted job still resumes, from the backup.
    client = moto_server.boto3_client()
    for obj in client.list_objects_v2(Bucket=s3_bucket.bucket).get("Contents", []):
        client.delete_object(Bucket=s3_bucket.bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=s3_bucket.bucket)
    caplog.clear()
    with CheckpointManager(root, storage_options=opts, backups=[backup]) as mgr:
        assert mgr.latest_step() is None
        got = empty_like_state(stepped_state(0))
        assert mgr.load(got) == 2
        assert_state_equal(got, stepped_state(2))
    assert any("loaded step 2 from backup" in r.getMessage() for r in caplog.records)


def test_server_side_copy_uses_part_copies_and_refuses_a_corrupt_source(
    s3_bucket: StoreTarget, backup_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    opts = s3_bucket.storage_options
    root = s3_bucket.url("run")
    big = {"w": torch.arange(4 * 1024 * 1024, dtype=torch.float32)}  # 16 MiB: 3 parts of 6
    with CheckpointManager(root, storage_options=opts) as mgr:
        mgr.save(1, big)
        mgr.wait_until_finished()
    src = Location.parse(root, opts).child(step_name(1))
    dst = Location.parse(backup_bucket.url("copy"), opts)
    small_parts = UploadOptions(part_size=5 * 1024 * 1024)
    report = copy_checkpoint(src, dst, upload=small_parts)
    assert report.copied and report.streamed == 0 and report.server_side == 3  # + index
    client = moto_server.boto3_client()
    for key in _payloads(root, 1, opts):
        name = key.rsplit("/", 1)[-1]
        head = client.head_object(
            Bucket=BACKUP_BUCKET, Key=f"t/copy/{name}", ChecksumMode="ENABLED"
        )
        assert head.get("ChecksumType") == "FULL_OBJECT"  # assembled by UploadPartCopy
    got = {"w": torch.zeros_like(big["w"])}
    from helpers import load

    load(got, dst.url, backup_bucket)
    assert torch.equal(got["w"], big["w"])

    # A flipped byte at rest on the source: S3's CRC32C of the copy disagrees with
    # the manifest, nothing is committed, and the bad copy is removed.
    _flip_byte(root, 1, opts)
    bad = Location.parse(backup_bucket.url("bad"), opts)
    with pytest.raises(ChecksumMismatchError, match="server-side copy of s3://objckpt-test"):
        copy_checkpoint(src, bad, upload=small_parts)
    left = client.list_objects_v2(Bucket=BACKUP_BUCKET, Prefix="t/bad/").get("Contents", [])
    assert not [o for o in left if o["Key"].endswith(MANIFEST_KEY)]
    assert not [o for o in left if is_objckpt_payload(o["Key"].rsplit("/", 1)[-1])]
    assert client.list_multipart_uploads(Bucket=BACKUP_BUCKET).get("Uploads", []) == []


def test_gcs_rewrite_is_server_side_and_checked(gcs_bucket: StoreTarget, gcs_emulator) -> None:
    gcs_emulator.create_bucket(BACKUP_BUCKET)
    opts = gcs_bucket.storage_options
    from helpers import save

    save(stepped_state(3), gcs_bucket.url("ck"), gcs_bucket)
    src = Location.parse(gcs_bucket.url("ck"), opts)
    dst = Location.parse(f"gs://{BACKUP_BUCKET}/ck", opts)
    report = copy_checkpoint(src, dst)
    assert report.server_side >= 1 and verify_checkpoint(dst).ok


def _replicate(client, src_bucket: str, dst_bucket: str, prefix: str, corrupt: bool) -> None:
    """What S3 CRR does, by hand: objects appear on the replica, the manifest among them."""
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=src_bucket, Prefix=prefix)["Contents"]]
    for key in sorted(keys, key=lambda k: k.endswith(MANIFEST_KEY)):
        body = client.get_object(Bucket=src_bucket, Key=key)["Body"].read()
        if corrupt and is_objckpt_payload(key.rsplit("/", 1)[-1]):
            body = body[:-1] + bytes([body[-1] ^ 1])
            corrupt = False
        client.put_object(Bucket=dst_bucket, Key=key, Body=body)


def test_replicated_mode_waits_for_a_matching_replica(
    s3_bucket: StoreTarget, backup_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    opts = s3_bucket.storage_options
    client = moto_server.boto3_client()
    replica = BackupTarget(
        f"s3://{BACKUP_BUCKET}/t/run", opts, mode="replicated", replica_timeout=8
    )
    with CheckpointManager(s3_bucket.url("run"), storage_options=opts, backups=[replica]) as mgr:
        mgr.save(1, stepped_state(1)).result(timeout=120)  # committed; its backup still waits
        status = mgr.backup_status()[0]
        assert status.latest_step is None and status.steps_behind == 1
        later = threading.Timer(
            1.5,
            _replicate,
            (client, s3_bucket.bucket, BACKUP_BUCKET, "t/run/step-0000000001/", False),
        )
        later.start()
        mgr.wait_for_backups(timeout=60)
        later.join()
        status = mgr.backup_status()[0]
        assert (status.latest_step, status.steps_behind, status.error) == (1, 0, None)
        # Nothing was copied by objckpt before the "replication" ran: the check waited.
        mgr.save(2, stepped_state(2)).result(timeout=120)
        _replicate(client, s3_bucket.bucket, BACKUP_BUCKET, "t/run/step-0000000002/", True)
        with pytest.raises(BackupError, match=r"replica not in place after 8 s: .*CRC32C"):
            mgr.wait_for_backups(timeout=60)
        status = mgr.backup_status()[0]
        assert status.latest_step == 1 and status.steps_behind == 1 and status.seconds_behind > 0


def test_failing_target_is_reported_with_lag_and_never_fails_the_save(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    opts = s3_bucket.storage_options
    missing = BackupTarget("s3://no-such-backup-bucket/run", opts)
    with CheckpointManager(
        s3_bucket.url("run"),
        storage_options=opts,
        backups=[missing],
        retention=RetentionPolicy(keep_last=1),
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, stepped_state(step)).result()
        with pytest.raises(BackupError, match="no-such-backup-bucket"):
            mgr.wait_for_backups(timeout=60)
        mgr.check_for_errors()  # the saves themselves succeeded
        assert mgr.all_steps() == [2]
        status = mgr.backup_status()[0]
        assert status.latest_step is None and status.steps_behind == 1
        assert status.error and "no-such-backup-bucket" in status.error


def test_lag_arithmetic() -> None:
    steps = [StepInfo(s, f"u/{s}", True, 1, 1, 100.0 + s) for s in range(1, 6)]
    steps.append(StepInfo(6, "u/6", False, 1, 1, 200.0))  # uncommitted: never counted
    assert lag_of(steps, [5], now=300.0) == (0, 0.0)
    assert lag_of(steps, [1, 2], now=300.0) == (3, 300.0 - 103.0)
    assert lag_of(steps, [], now=300.0) == (5, 300.0 - 101.0)


def test_backup_target_validation(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="mode='mirror' is invalid"):
        BackupTarget("s3://b/r", mode="mirror")
    with pytest.raises(ConfigurationError, match="replica_timeout"):
        BackupTarget("s3://b/r", mode="replicated", replica_timeout=0)
    with pytest.raises(ConfigurationError, match="must differ"):
        CheckpointManager(f"file://{tmp_path}/r", backups=[f"file://{tmp_path}/r"])


def test_cli_ls_shows_lag_and_cp_restores_from_a_backup(
    s3_bucket: StoreTarget, tmp_path, monkeypatch
) -> None:
    opts = s3_bucket.storage_options
    root = s3_bucket.url("run")
    backup = f"file://{tmp_path}/backup"
    with CheckpointManager(root, storage_options=opts, backups=[backup]) as mgr:
        mgr.save(1, stepped_state(1))
        mgr.wait_until_finished()
        mgr.wait_for_backups(timeout=60)
        mgr.save(2, stepped_state(2))
        mgr.wait_until_finished()
        mgr.wait_for_backups(timeout=60)
    delete_step(Location.parse(f"{backup}/{step_name(2)}"))  # the backup trails by one
    for name, value in {
        "OBJCKPT_TEST_KEY": opts["key"],
        "OBJCKPT_TEST_SECRET": opts["secret"],
    }.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "objckpt.toml"
    config.write_text(
        f'root = "{root}"\n'
        f"[storage]\n"
        f'options = {{ endpoint_url = "{opts["endpoint_url"]}" }}\n'
        f'env = {{ key = "OBJCKPT_TEST_KEY", secret = "OBJCKPT_TEST_SECRET" }}\n'
        f'[[backups]]\nurl = "{backup}"\nretention = {{ keep_last = 5 }}\n'
    )
    runner = CliRunner()
    out = runner.invoke(main, ["--config", str(config), "ls", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    (lag,) = doc["backups"]
    assert lag["latest_step"] == 1 and lag["steps_behind"] == 1 and lag["seconds_behind"] >= 0
    text = runner.invoke(main, ["--config", str(config), "ls"]).output
    assert "latest step 1, 1 step(s)" in text

    # Restore: the primary loses step 1, `objckpt cp` brings it back from the backup.
    delete_step(Location.parse(root, opts).child(step_name(1)))
    out = runner.invoke(
        main, ["--config", str(config), "cp", f"{backup}/{step_name(1)}", f"{root}/{step_name(1)}"]
    )
    assert out.exit_code == 0, out.output
    assert _steps(root, opts) == [1, 2]
    with CheckpointManager(root, storage_options=opts) as mgr:
        got = empty_like_state(stepped_state(0))
        assert mgr.load(got, step=1) == 1
        assert_state_equal(got, stepped_state(1))


def test_primary_retention_spares_a_step_still_being_backed_up(
    s3_bucket: StoreTarget, backup_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """keep_last=1 while step 1's backup is held mid-copy (the proxy holds every
    request for it): steps 2 and 3 commit, retention runs, and step 1 is still on the
    primary; once the copy is let go, retention catches up."""
    opts = s3_bucket.storage_options
    root = s3_bucket.url("run")
    target = BackupTarget(backup_bucket.url("b"), storage_options=s3_proxy.storage_options())
    s3_proxy.add(Rule(key_contains=step_name(1), action="hold", stall=120))
    with CheckpointManager(
        root, storage_options=opts, retention=RetentionPolicy(keep_last=1), backups=[target]
    ) as mgr:
        mgr.save(1, stepped_state(1)).result(timeout=60)
        s3_proxy.wait_for(None, faulted=True, timeout=60)  # step 1's copy is under way, held
        for step in (2, 3):
            mgr.save(step, stepped_state(step)).result(timeout=60)  # retention runs at each commit
        assert 1 in _steps(root, opts), "a step was deleted while its backup was copying it"
        assert mgr.backup_status()[0].latest_step is None  # step 1 not there yet
        s3_proxy.release()
        mgr.wait_until_finished()
        deadline = time.monotonic() + 30
        while mgr.all_steps() != [3] and time.monotonic() < deadline:
            time.sleep(0.1)  # retention of the primary runs after the backup thread's copy
        assert mgr.all_steps() == [3]
    assert _steps(backup_bucket.url("b"), backup_bucket.storage_options) == [3]
    assert _steps(root, opts) == [3]


def test_wait_until_finished_also_waits_for_the_backups(
    s3_bucket: StoreTarget, backup_bucket: StoreTarget
) -> None:
    """A job that ends with wait_until_finished() (no close) has its steps backed up."""
    opts = s3_bucket.storage_options
    mgr = CheckpointManager(
        s3_bucket.url("run"), storage_options=opts, backups=[backup_bucket.url("bk")]
    )
    try:
        mgr.save(1, stepped_state(1))
        mgr.wait_until_finished()
        # Checked before close(), which would also wait: the backup is already there.
        backup = Location.parse(backup_bucket.url("bk"), opts).child(step_name(1))
        assert verify_checkpoint(backup).ok
    finally:
        mgr.close()


def test_wait_until_finished_raises_a_failing_backup_naming_it(s3_bucket: StoreTarget) -> None:
    opts = s3_bucket.storage_options
    missing = BackupTarget("s3://no-such-backup-bucket/run", opts)
    with CheckpointManager(s3_bucket.url("run"), storage_options=opts, backups=[missing]) as mgr:
        mgr.save(1, stepped_state(1))
        started = time.monotonic()
        with pytest.raises(BackupError, match="no-such-backup-bucket"):
            mgr.wait_until_finished()
        assert time.monotonic() - started < 120
        assert mgr.all_steps() == [1]  # the primary commit stands
