"""Rolling a run back (``CheckpointManager.discard_after``) on every tier, and the
refusal of a save below the newest step on every rank of a gloo job.

The single-tier scenario (refusal naming both steps, discard, restart) is in
``test_manager.py``.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import rollback_ranks
import torch
from conftest import assert_state_equal, empty_like_state
from ranks import run_ranks

from objckpt import CheckpointManager, LocalTier, RetentionPolicy
from objckpt.errors import StepOrderError
from objckpt.format.steps import step_name
from objckpt.ops.run.backup import committed_steps
from objckpt.options import AsyncOptions
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.location import Location


def _state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "step": step}


def _backed_up(target: StoreTarget, url: str) -> list[int]:
    return sorted(s.step for s in committed_steps(Location.parse(url, target.storage_options)))


def test_discard_after_on_the_local_tier_and_a_copy_backup(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    """Steps 10, 15 and 20 on the local tier, the root and a copy backup (each with
    retention by number). After loading step 10, discard_after(10) removes 15 and 20
    from all three; the new run's steps are then kept everywhere, and a restart
    resumes from them."""
    root, backup = s3_bucket.url("tiers"), s3_bucket.url("tiers-backup")
    local = str(tmp_path / "nvme")

    def manager() -> CheckpointManager:
        return CheckpointManager(
            root,
            storage_options=s3_bucket.storage_options,
            retention=RetentionPolicy(keep_last=2, keep_every=10),
            backups=[backup],
            async_options=AsyncOptions(workers=1),
            local=LocalTier(local, retention=RetentionPolicy(keep_last=3)),
        )

    with manager() as mgr:
        for step in (10, 15, 20):
            mgr.save(step, _state(step)).wait_durable(120)
        mgr.wait_until_finished()
        assert mgr.local_steps() == mgr.all_steps() == [10, 15, 20]
        assert _backed_up(s3_bucket, backup) == [10, 15, 20]
        assert mgr.load(empty_like_state(_state(0)), step=10) == 10
        with pytest.raises(StepOrderError, match="step 11 is below step 20"):
            mgr.save(11, _state(11))

        assert mgr.discard_after(10) == [15, 20]
        assert mgr.local_steps() == mgr.all_steps() == [10]
        assert sorted(os.listdir(local)) == [step_name(10)]
        assert _backed_up(s3_bucket, backup) == [10]

        for step in (11, 12):
            mgr.save(step, _state(step)).wait_durable(120)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [10, 11, 12] and mgr.local_steps() == [10, 11, 12]
        assert _backed_up(s3_bucket, backup) == [10, 11, 12]
    with manager() as mgr:
        got = empty_like_state(_state(0))
        got["step"] = None
        assert mgr.latest_step() == 12 and mgr.load(got) == 12
        assert_state_equal(got, _state(12))


def test_a_save_below_the_newest_step_is_refused_on_both_ranks(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    url = s3_bucket.url("rollback-2")
    body = rollback_ranks.refuse_then_discard.__name__
    args = (body, 2, str(tmp_path / "init"), url, s3_bucket.storage_options)
    run_ranks(rollback_ranks, *args)
    steps = sorted(s.step for s in committed_steps(Location.parse(url, s3_bucket.storage_options)))
    assert steps == [10, 11]


def test_a_rollback_record_names_the_discarded_copies_by_attempt_digest_and_time(
    tmp_path,
) -> None:
    """What a restart checks a node's manifest against: written create-only under
    ``<root>/rollbacks/`` (outside step directories), read back whole; a copy of a
    step above the record's step is discarded by its attempt id, its digest, or a
    commit time before the rollback; a step at or below it, or committed after it
    under another attempt, is not; an unreadable record is skipped."""
    from types import SimpleNamespace
    from typing import Any, cast

    from objckpt.ops.run.rollback import ROLLBACKS_DIR, Rollback, _record, read_rollbacks

    root = Location.parse(str(tmp_path / "root"))
    os.makedirs(root.path)
    old: Any = SimpleNamespace(attempt="aaaa", created="2026-01-01T00:00:00+00:00")
    _record(root, 1, {2: {b'{"old": 2}'}})
    (tmp_path / "root" / ROLLBACKS_DIR / "garbage.json").write_bytes(b"[not a record")
    [record] = read_rollbacks(root)
    assert record.after == 1 and set(record.discarded) == {2}
    assert record.discards(2, b'{"old": 2}', old)  # digest (and time)
    later = cast(Any, SimpleNamespace(attempt="aaaa", created="2999-01-01T00:00:00+00:00"))
    assert not record.discards(2, b"{}", later)  # another digest, committed after
    [(attempt, _)] = record.discarded[2]
    assert attempt == ""  # not a manifest: matched by its digest only
    assert not record.discards(
        2, b"{}", cast(Any, SimpleNamespace(attempt="", created=later.created))
    )
    by_attempt = Rollback(1, record.at, {2: frozenset({("bbbb", "0" * 64)})})
    same_attempt = cast(Any, SimpleNamespace(attempt="bbbb", created=later.created))
    assert by_attempt.discards(2, b"{}", same_attempt)
    assert not record.discards(1, b'{"old": 2}', old)  # the step rolled back to stays
    assert record.discards(3, b"{}", old)  # unknown copy, committed before the rollback
    assert step_name(2) not in os.listdir(root.path)


def _tier_manager(target: StoreTarget, root: str, local) -> CheckpointManager:
    """A manager of ``root`` with the default local tier (no replicas) at ``local``."""
    return CheckpointManager(
        target.url(root),
        storage_options=target.storage_options,
        async_options=AsyncOptions(workers=1),
        local=LocalTier(str(local)),
    )


def _durable_5_local_7(mgr: CheckpointManager) -> None:
    """Step 5 on the root and the local tier, step 7 on the local tier only."""
    mgr.save(5, _state(5)).wait_durable(120)
    mgr.save(7, _state(7), promote=False).result()
    mgr.wait_until_finished()
    assert mgr.local_steps() == [5, 7] and mgr.all_steps() == [5]


def _load_newest(mgr: CheckpointManager, expected: int) -> None:
    got = empty_like_state(_state(0))
    got["step"] = None
    assert mgr.load(got) == expected
    assert_state_equal(got, _state(expected))


def test_a_discarded_copy_a_node_kept_is_not_loaded_without_replicas(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    """The default tier (no replicas, so no peers' survey): step 7 was saved on the
    local tier only, the node was away when the run went back to step 5 (its copy
    survived the discard), and a restart on it loads step 5, not the discarded copy
    the rollback record names."""
    local = tmp_path / "nvme"
    with _tier_manager(s3_bucket, "away", local) as mgr:
        _durable_5_local_7(mgr)
        shutil.copytree(local / step_name(7), tmp_path / "away")
        assert mgr.discard_after(5) == [7]
    shutil.copytree(tmp_path / "away", local / step_name(7))  # the node is back
    with _tier_manager(s3_bucket, "away", local) as mgr:
        # The start-up sweep deleted the copy the record names: the run goes on at 5.
        assert mgr.latest_step() == 5 and not (local / step_name(7)).exists()
        _load_newest(mgr, 5)
        mgr.save(6, _state(6)).wait_durable(120)
        assert mgr.latest_step() == 6


def test_a_restart_loads_no_discarded_copy_the_sweep_kept(s3_bucket: StoreTarget, tmp_path) -> None:
    """The restore's own check, where the start-up sweep did not delete the copy (it
    came back after the manager started, as a node's disk remounted late): the load
    still takes step 5, not the discarded step 7 the record names, and the run's
    steps stay its own at a later listing."""
    local = tmp_path / "nvme"
    with _tier_manager(s3_bucket, "late", local) as mgr:
        _durable_5_local_7(mgr)
        shutil.copytree(local / step_name(7), tmp_path / "away")
        assert mgr.discard_after(5) == [7]
    with _tier_manager(s3_bucket, "late", local) as mgr:
        shutil.copytree(tmp_path / "away", local / step_name(7))  # back after the sweep
        _load_newest(mgr, 5)
        mgr.reload()  # lists rank 0's tier again: the refused copy stays refused
        assert mgr.latest_step() == 5
        mgr.save(6, _state(6)).wait_durable(120)


def test_a_discarded_copy_no_record_names_is_set_aside_and_its_step_saved_again(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    """The node holding step 7 (local only: no other node had its manifest) was away
    during discard_after(5), so the record cannot name its copy: committed before the
    rollback, it is moved out of the step's name at the next start (kept, never
    loaded), and the run saves steps 6 and 7 again."""
    local = tmp_path / "nvme"
    with _tier_manager(s3_bucket, "unnamed", local) as mgr:
        _durable_5_local_7(mgr)
        shutil.move(local / step_name(7), tmp_path / "away")  # the node goes away
        # Committed well before the rollback (the record's time has whole seconds: a
        # copy of the same second is not taken for an older one).
        manifest = tmp_path / "away" / "manifest.json"
        doc = json.loads(manifest.read_bytes())
        doc["created"] = "2026-01-01T00:00:00+00:00"
        manifest.write_text(json.dumps(doc))
        assert mgr.discard_after(5) == []  # no node holds step 7: nothing named
    shutil.move(tmp_path / "away", local / step_name(7))  # the node is back
    with _tier_manager(s3_bucket, "unnamed", local) as mgr:
        assert mgr.latest_step() == 5 and not (local / step_name(7)).exists()
        [aside] = os.listdir(local / "set-aside")
        assert aside.startswith(step_name(7) + ".")
        _load_newest(mgr, 5)
        for step in (6, 7):
            mgr.save(step, _state(step), promote=False).result()
        mgr.wait_until_finished()
        assert mgr.latest_step() == 7
    with _tier_manager(s3_bucket, "unnamed", local) as mgr:  # the new step 7 is the run's
        _load_newest(mgr, 7)


def test_a_copy_a_rank_sharing_the_directory_set_aside_is_not_counted(tmp_path) -> None:
    """Ranks of a node share its tier directory: one lists step 7 as committed, another
    moves it aside before the first reads its manifest. The first counts it as
    discarded, neither committed nor present (nothing of it left to delete), never as
    the run's step."""
    from objckpt.ops.tier.local_disk import _judged, list_tier

    tier = tmp_path / "nvme"
    (tier / step_name(7)).mkdir(parents=True)
    (tier / step_name(7) / "manifest.json").write_text("{}")
    listed = list_tier(str(tier))
    assert listed.committed == {7}
    shutil.move(tier / step_name(7), tmp_path / "moved")  # the other rank's move

    def never(step: int, data: bytes, url: str) -> None:
        raise AssertionError("judged a copy it could not read")

    mine = _judged(listed, never, durable=5)
    assert mine.committed == frozenset() and 7 not in mine.present
    assert mine.discarded == {7}
