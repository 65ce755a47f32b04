"""What the local tier finds on its own disk, and never trusts: a link at a step's name
(a user's directory, or a step moved to another disk), files objckpt did not write in
a step directory, a directory it may not write to. Nothing outside the tier may be
touched, no file objckpt did not write may be deleted, and no training step may fail
for the local tier."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from conftest import assert_state_equal, empty_like_state
from test_local_tier import _manager, _state, _step_dir

from objckpt import RetentionPolicy
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import StoreTarget


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


def _tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (links not followed) with its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_a_user_directory_linked_in_as_a_step_survives_saves_retention_and_sweeps(
    via: StoreTarget, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stale link ``step-0000000003 -> <the user's directory>`` under the tier: the
    sweep leaves it, step 3 is not written through it (it goes to the root, with a
    warning naming the link), retention past step 3 deletes nothing there, and neither
    does the next start's sweep."""
    local = str(tmp_path / "nvme")
    mine = tmp_path / "users-own"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_bytes(b"the user's notes")
    (mine / "sub" / "data.bin").write_bytes(b"\x00\x01" * 100)
    before = _tree(str(mine))
    os.makedirs(local)
    os.symlink(mine, _step_dir(local, 3))
    with (
        _manager(via, local, retention=RetentionPolicy(keep_last=1)) as mgr,
        caplog.at_level(logging.WARNING),
    ):
        handles = {step: mgr.save(step, _state(step)) for step in (1, 2, 3, 4, 5)}
        mgr.wait_until_finished()
        assert handles[3].tier == "primary" and handles[3].wait_durable(60)
        assert [handles[s].tier for s in (1, 2, 4, 5)] == ["local"] * 4
        assert mgr.all_steps() == [1, 2, 3, 4, 5] and mgr.local_steps() == [5]
    assert f"{_step_dir(local, 3)} is a symbolic link" in caplog.text
    with _manager(
        via, local, retention=RetentionPolicy(keep_last=1)
    ) as mgr:  # the next start's sweep
        got = empty_like_state(_state(0))
        assert mgr.load(got, step=3) == 3
        assert_state_equal(got, _state(3))
    assert _tree(str(mine)) == before
    assert os.path.islink(_step_dir(local, 3))


def test_a_committed_step_moved_away_and_linked_back_is_left_alone_and_named(
    via: StoreTarget, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1 (local only) moved to another disk and linked back: the tier neither
    lists it nor deletes a byte of it through the link, and the start says so."""
    local = str(tmp_path / "nvme")
    with _manager(via, local, retention=RetentionPolicy(keep_last=3), promote_every=2) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
        mgr.wait_until_finished()
    moved = str(tmp_path / "other-disk" / step_name(1))
    os.makedirs(os.path.dirname(moved))
    os.rename(_step_dir(local, 1), moved)
    os.symlink(moved, _step_dir(local, 1))
    before = _tree(moved)
    with (
        _manager(via, local, retention=RetentionPolicy(keep_last=1)) as mgr,
        caplog.at_level(logging.WARNING),
    ):
        assert mgr.local_steps() == [2]
        mgr.save(3, _state(3)).wait_durable(60)
        mgr.wait_until_finished()
        assert mgr.local_steps() == [3]
    assert f"{_step_dir(local, 1)} is a symbolic link to {moved}" in caplog.text
    assert _tree(moved) == before and MANIFEST_KEY in before


def test_the_sweep_and_retention_delete_only_objckpt_files(via: StoreTarget, tmp_path) -> None:
    """A file objckpt never writes, left in an uncommitted step directory and in a
    committed one, survives the sweep and retention; objckpt's own files go."""
    local = str(tmp_path / "nvme")
    with _manager(via, local, retention=RetentionPolicy(keep_last=1)) as mgr:
        mgr.save(1, _state(1)).wait_durable(60)
        mgr.wait_until_finished()
    stray = os.path.join(_step_dir(local, 7), "__0_0.0123456789abcdef.distcp")
    os.makedirs(os.path.dirname(stray))
    for path in (stray, os.path.join(_step_dir(local, 7), "keep.txt")):
        with open(path, "wb") as f:
            f.write(b"x" * 10)
    with open(os.path.join(_step_dir(local, 1), "keep.txt"), "wb") as f:
        f.write(b"y" * 10)
    with _manager(via, local, retention=RetentionPolicy(keep_last=1)) as mgr:
        assert os.listdir(_step_dir(local, 7)) == ["keep.txt"]  # the sweep
        mgr.save(2, _state(2)).wait_durable(60)
        mgr.wait_until_finished()
        assert mgr.local_steps() == [2]
    assert os.listdir(_step_dir(local, 1)) == ["keep.txt"]  # retention


@contextlib.contextmanager
def _read_only(path: str) -> Iterator[None]:
    """``path`` refuses new files for real: mode 0o555, or for root (which ignores
    modes) the immutable attribute; where neither is possible the test is skipped."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, 0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: no way to make a directory read-only")
    made = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"running as root and chattr +i {path} failed: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=True)


def test_a_read_only_local_tier_sends_every_save_to_the_root_with_one_warning(
    via: StoreTarget, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    local = str(tmp_path / "nvme")
    os.makedirs(local)
    with _read_only(local):
        probe = os.path.join(local, "probe")
        with pytest.raises(PermissionError):
            open(probe, "xb").close()  # the kernel refuses, as a save would meet
        with _manager(via, local) as mgr, caplog.at_level(logging.WARNING):
            handles = [mgr.save(step, _state(step)) for step in (1, 2, 3)]
            assert [h.wait_durable(60) for h in handles] == [True] * 3
            mgr.wait_until_finished()
            mgr.check_for_errors()
            assert [h.tier for h in handles] == ["primary"] * 3
            assert mgr.all_steps() == [1, 2, 3] and mgr.local_steps() == []
            assert "not writable" in (mgr.tier_status().degraded or "")
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and local in r.getMessage()]
    assert len(warned) == 1 and "not writable" in warned[0].getMessage(), caplog.text
    assert os.listdir(local) == []
