"""Backups and promotions commit through the save's one create-then-settle (#45, item 3).

The save's manifest, ``copy_checkpoint``'s and an export's index have their own
lost-answer and second-create tests (``tests/format/test_commit_settle.py``,
``tests/dcp/test_roundtrip.py``, ``tests/ops/test_export.py``). Here the two
artefacts a ``CheckpointManager`` writes besides its saves, through the fault proxy:
a backup's manifest and a promoted step's manifest, each PUT landing with its answer
lost (settled by reading it back: done, no error, the copy loads), and each meeting
another writer's manifest at its place (refused, that manifest untouched).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import carried, load, save

from objckpt import CheckpointManager, LocalTier, Location, RetryPolicy
from objckpt.errors import BackupError, CheckpointExistsError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import step_name
from objckpt.ops.maintain.verify import verify_checkpoint
from objckpt.ops.run.backup import BackupTarget
from objckpt.options import AsyncOptions
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget

FAST = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2, timeout=30)
OPTS = AsyncOptions(workers=1)
BACKUP_BUCKET = "objckpt-artefacts"


def _lost(step: int) -> Rule:
    """Step ``step``'s manifest PUT reaches the store, then its answer is lost, once."""
    return Rule(
        "PutObject",
        key_contains=f"{step_name(step)}/{MANIFEST_KEY}",
        action="reset",
        before_upstream=False,
        times=1,
    )


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 16,), float(step)), "b": torch.arange(7) * step}


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


@pytest.fixture
def backup(s3_proxy: FaultProxy, moto_server: MotoServer) -> StoreTarget:
    """A second bucket, reached through the proxy (the primary is reached directly)."""
    moto_server.boto3_client().create_bucket(Bucket=BACKUP_BUCKET)
    return StoreTarget(
        root=f"s3://{BACKUP_BUCKET}/t",
        storage_options=s3_proxy.storage_options(),
        bucket=BACKUP_BUCKET,
    )


def _loads(url: str, target: StoreTarget, step: int) -> None:
    got = empty_like_state(_state(0))
    load(got, url, target)
    assert_state_equal(got, _state(step))
    assert verify_checkpoint(Location.parse(url, target.storage_options)).ok


def _backed_up(s3_bucket: StoreTarget, backup: StoreTarget) -> CheckpointManager:
    """A manager saving to ``s3_bucket`` directly, backing up to ``backup``."""
    return CheckpointManager(
        s3_bucket.url("run"),
        storage_options=s3_bucket.storage_options,
        async_options=OPTS,
        retry=FAST,
        backups=[BackupTarget(backup.url("run"), backup.storage_options)],
    )


def test_a_backup_whose_manifest_answer_is_lost_is_settled_as_backed_up(
    s3_bucket: StoreTarget, backup: StoreTarget, s3_proxy: FaultProxy
) -> None:
    s3_proxy.add(_lost(1))
    with _backed_up(s3_bucket, backup) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.wait_for_backups(timeout=60)
        (status,) = mgr.backup_status()
        assert (status.latest_step, status.error) == (1, None)
    assert s3_proxy.count("PutObject", faulted=True) == 1
    _loads(f"{backup.url('run')}/{step_name(1)}", backup, 1)


def test_a_backup_meeting_another_writers_manifest_is_refused_and_leaves_it(
    s3_bucket: StoreTarget, backup: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """Another writer commits the backup's step while the backup's manifest PUT is
    held (after the copy checked the place was free): the create-only PUT is
    refused, the read-back finds the other manifest, and the backup fails naming it."""
    other = f"{backup.url('run')}/{step_name(1)}"
    where = f"{step_name(1)}/{MANIFEST_KEY}"
    s3_proxy.add(Rule("PutObject", key_contains=where, action="hold", stall=30, times=1))
    with _backed_up(s3_bucket, backup) as mgr:
        mgr.save(1, _state(1)).result()
        s3_proxy.wait_for("PutObject", faulted=True)
        save(_state(9), other, backup)  # the hold rule is spent: this one goes through
        s3_proxy.release()
        with pytest.raises(BackupError, match=f"{step_name(1)}.*committed") as info:
            mgr.wait_for_backups(timeout=60)
        assert "attempt" in str(info.value), str(info.value)  # names the other writer
    _loads(other, backup, 9)


def _tiered(via: StoreTarget, local: str) -> CheckpointManager:
    return CheckpointManager(
        via.url("run"),
        storage_options=via.storage_options,
        retry=FAST,
        async_options=OPTS,
        local=LocalTier(local, promote_every=1),
    )


def test_a_promotion_whose_manifest_answer_is_lost_is_settled_as_durable(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    with _tiered(via, str(tmp_path / "nvme")) as mgr:
        s3_proxy.add(_lost(1))
        handle = mgr.save(1, _state(1))
        assert handle.wait_durable(60)
        assert mgr.all_steps() == [1] and mgr.tier_status().error is None
    assert s3_proxy.count("PutObject", faulted=True) == 1
    _loads(f"{s3_bucket.url('run')}/{step_name(1)}", s3_bucket, 1)


def test_a_promotion_meeting_another_writers_manifest_is_refused_and_leaves_it(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    other = f"{s3_bucket.url('run')}/{step_name(2)}"
    with _tiered(via, str(tmp_path / "nvme")) as mgr:
        assert mgr.save(1, _state(1)).wait_durable(60)
        # Another writer commits step 2 at the root while this job's step 2 is
        # held at its promotion's manifest PUT.
        where = f"{step_name(2)}/{MANIFEST_KEY}"
        s3_proxy.add(Rule("PutObject", key_contains=where, action="hold", stall=30, times=1))
        handle = mgr.save(2, _state(2))
        s3_proxy.wait_for("PutObject", faulted=True)
        save(_state(9), other, s3_bucket)
        s3_proxy.release()
        with pytest.raises(BaseException) as info:
            handle.wait_durable(60)
        assert isinstance(carried(info.value), CheckpointExistsError), repr(info.value)
        assert step_name(2) in str(info.value)
    _loads(other, s3_bucket, 9)
