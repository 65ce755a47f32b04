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
)
from objckpt.format.steps import step_name
from objckpt.testing.plugin import StoreTarget


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path) -> StoreTarget:
    if request.param == "file":
        return StoreTarget(root=f"file://{tmp_path}/root", storage_options={})
    return request.getfixturevalue("s3_bucket")


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
    with CheckpointManager(root, storage_options=target.storage_options, keep_last=2) as mgr:
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
        CheckpointManager(f"file://{tmp_path}/r", keep_last=0)
    with pytest.raises(ConfigurationError, match="either retention="):
        CheckpointManager(f"file://{tmp_path}/r", keep_last=1, retention=RetentionPolicy())


def test_load_into_mismatched_shapes_names_step_and_key(target: StoreTarget) -> None:
    with CheckpointManager(target.root, storage_options=target.storage_options) as mgr:
        mgr.save(1, {"w": torch.ones(4, 4), "b": torch.ones(4)}).result()
        with pytest.raises(StateDictMismatchError) as info:
            mgr.load({"w": torch.zeros(3, 4), "b": torch.zeros(4)})
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert mgr.step_url(1) in message and "for w" in message
    assert "[4, 4]" in message and "[3, 4]" in message
