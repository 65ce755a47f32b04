"""CheckpointManager against the moto server and the local filesystem."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import fs_of

from objckpt import CheckpointManager, RetentionPolicy
from objckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    StateDictMismatchError,
    StepOrderError,
)
from objckpt.format.steps import step_name
from objckpt.testing.plugin import StoreTarget


def _state(step: int) -> dict:
    return {
        "w": torch.full((64, 64), float(step)),
        "nested": {"b": torch.arange(5) * step},
        "step": step,
    }


def _dirs(target: StoreTarget, root: str) -> list[str]:
    fs = fs_of(target)
    from objckpt import Location

    path = Location.parse(root).path
    fs.invalidate_cache(path)
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def test_steps_retention_and_resume(target: StoreTarget) -> None:
    root = target.url("run")
    with CheckpointManager(
        root, storage_options=target.storage_options, retention=RetentionPolicy(keep_last=2)
    ) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        for step in (10, 20, 30, 40):
            mgr.save(step, _state(step))
            mgr.wait_until_finished()
        assert mgr.maybe_finalize() == [10, 20, 30, 40]
        assert mgr.maybe_finalize() == []
        assert mgr.all_steps() == [30, 40] and mgr.latest_step() == 40
    # Only the kept steps remain on the store, zero-padded so a listing sorts.
    assert _dirs(target, root) == [step_name(30), step_name(40)]
    # A fresh manager (a restarted job) finds them and resumes from the latest.
    with CheckpointManager(root, storage_options=target.storage_options) as mgr:
        assert mgr.all_steps() == [30, 40]
        got = empty_like_state(_state(0))
        got["step"] = None
        assert mgr.load(got) == 40
        assert_state_equal(got, _state(40))
        assert mgr.load(got, step=30) == 30
        assert_state_equal(got, _state(30))


def test_combined_policy_and_milestones(target: StoreTarget) -> None:
    policy = RetentionPolicy(keep_last=1, keep_every=20)
    root = target.url("combo")
    with CheckpointManager(root, storage_options=target.storage_options, retention=policy) as mgr:
        for step in range(10, 70, 10):
            mgr.save(step, _state(step)).result(timeout=120)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 40, 60]


def test_uncommitted_step_is_invisible_and_errors_are_clear(target: StoreTarget) -> None:
    root = target.url("errs")
    with CheckpointManager(root, storage_options=target.storage_options) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="no committed step under"):
            mgr.load(_state(0))
        mgr.save(1, _state(1)).result(timeout=120)
        mgr.save(2, _state(2)).result(timeout=120)
        with pytest.raises(CheckpointExistsError, match="already holds a committed checkpoint"):
            mgr.save(2, _state(2))
        with pytest.raises(ConfigurationError, match="step must be an int >= 0"):
            mgr.save(-3, _state(2))
        with pytest.raises(CheckpointNotFoundError):
            mgr.load(_state(0), step=7)
    # Remove step 2's manifest: a half-deleted or never-committed step does not exist.
    fs = fs_of(target)
    from objckpt import Location

    fs.rm(Location.parse(f"{root}/{step_name(2)}/manifest.json").path)
    with CheckpointManager(root, storage_options=target.storage_options) as mgr:
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
        got = empty_like_state(_state(0))
        got["step"] = None
        assert mgr.load(got) == 1


def test_retention_options_are_validated(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="option keep_last="):
        CheckpointManager(f"file://{tmp_path}/r", retention=RetentionPolicy(keep_last=0))
    # One way to say it: the keep_* keywords are gone (retention=RetentionPolicy(...)).
    with pytest.raises(TypeError, match="keep_last"):
        CheckpointManager(f"file://{tmp_path}/r", keep_last=1)  # type: ignore[call-arg]


def test_load_into_mismatched_shapes_names_step_and_key(target: StoreTarget) -> None:
    with CheckpointManager(target.root, storage_options=target.storage_options) as mgr:
        mgr.save(1, {"w": torch.ones(4, 4), "b": torch.ones(4)}).result()
        with pytest.raises(StateDictMismatchError) as info:
            mgr.load({"w": torch.zeros(3, 4), "b": torch.zeros(4)})
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert mgr.step_url(1) in message and "for w" in message
    assert "[4, 4]" in message and "[3, 4]" in message


def _rolled_back_run(target: StoreTarget, root: str) -> CheckpointManager:
    """Steps 10, 15 and 20 of a run kept by keep_last=2, keep_every=10; then step 10
    loaded (a loss spike after it), as a job about to go on from step 10 would."""
    mgr = CheckpointManager(
        root,
        storage_options=target.storage_options,
        retention=RetentionPolicy(keep_last=2, keep_every=10),
    )
    for step in (10, 15, 20):
        mgr.save(step, _state(step)).result(timeout=120)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [10, 15, 20]
    got = empty_like_state(_state(0))
    assert mgr.load(got, step=10) == 10
    return mgr


def test_a_save_below_the_newest_step_is_refused_naming_both_steps(
    s3_bucket: StoreTarget,
) -> None:
    """Before: save(11) after loading step 10 succeeded, then retention (which ranks
    steps by number) deleted step 11 at once, and a restart resumed from step 20. Now
    the save is refused before anything is written, naming both steps and the way on."""
    root = s3_bucket.url("rollback")
    with _rolled_back_run(s3_bucket, root) as mgr:
        with pytest.raises(StepOrderError) as info:
            mgr.save(11, _state(11))
        assert mgr.all_steps() == [10, 15, 20] and mgr.latest_step() == 20
    message = str(info.value)
    assert "step 11 is below step 20" in message and root in message
    assert "discard_after(10)" in message  # the step loaded
    assert _dirs(s3_bucket, root) == [step_name(10), step_name(15), step_name(20)]


def test_discard_after_keeps_the_new_runs_steps_and_a_restart_resumes_from_them(
    s3_bucket: StoreTarget,
) -> None:
    root = s3_bucket.url("rollback-discard")
    with _rolled_back_run(s3_bucket, root) as mgr:
        assert mgr.discard_after(10) == [15, 20]
        assert mgr.all_steps() == [10] and mgr.latest_step() == 10
        for step in (11, 12, 13):
            mgr.save(step, _state(step)).result(timeout=120)
        mgr.wait_until_finished()
        # Retention ranks the new run's steps as the newest: 12 and 13 (keep_last=2)
        # and the milestone 10 stay.
        assert mgr.all_steps() == [10, 12, 13] and mgr.latest_step() == 13
        with pytest.raises(StepOrderError, match="step 12 is below step 13"):
            mgr.save(12, _state(12))
    assert _dirs(s3_bucket, root) == [step_name(10), step_name(12), step_name(13)]
    with CheckpointManager(root, storage_options=s3_bucket.storage_options) as mgr:
        got = empty_like_state(_state(0))
        got["step"] = None
        assert mgr.load(got) == 13  # the new run, not step 20 of the abandoned one
        assert_state_equal(got, _state(13))


def test_a_save_below_a_step_still_in_flight_is_refused(s3_bucket: StoreTarget) -> None:
    """The bound counts steps this manager started saving, committed yet or not: step
    20 still uploading makes a save of step 15 the same rollback (on every rank alike,
    whatever each rank's catalog has heard of the commit so far)."""
    with CheckpointManager(
        s3_bucket.url("inflight"), storage_options=s3_bucket.storage_options
    ) as mgr:
        handle = mgr.save(20, _state(20))
        with pytest.raises(StepOrderError, match="step 15 is below step 20"):
            mgr.save(15, _state(15))
        handle.result(timeout=120)
        mgr.save(21, _state(21)).result(timeout=120)
        assert mgr.all_steps() == [20, 21]
