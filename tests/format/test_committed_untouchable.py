"""Nothing a committed manifest names is written by another attempt (issue #25, item 1).

Each case commits a checkpoint, reads every byte of every object under its URL
straight from the moto server, lets another attempt fail or lose onto it through
the fault proxy (an overwriting save whose manifest PUT is answered 500, a second
writer that loses the create-only race, ``cp --overwrite`` whose commit fails, a
promotion onto a root step another job committed), and reads every byte again:
the same, ``objckpt verify`` passes, and a stock DCP reader loads the committed
state (its ``.metadata`` is the committed manifest's).
"""

from __future__ import annotations

import functools
import pathlib
import threading

import pytest
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, empty_like_state
from helpers import carried, quiet, save
from states import stepped_state
from store_bytes import assert_untouched, snapshot
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from objckpt import CheckpointManager, LocalTier, Location, RetryPolicy, UploadOptions
from objckpt.errors import CheckpointExistsError, StoreError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.manifest import read_manifest
from objckpt.format.steps import step_name
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.options import AsyncOptions
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

FAST = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2, timeout=30)
MANIFEST_500 = Rule("PutObject", key_contains=MANIFEST_KEY, action="status", status=500)
#: Without a deadline a save tries each request FAST.attempts times (with one it
#: would retry MANIFEST_500 until the deadline).
UNBOUNDED = UploadOptions(deadline=None)


# The commit cases write 256 KiB per step: ``stepped_state`` at that size.
_state = functools.partial(stepped_state, shape=(1 << 16,))


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    """The test bucket, reached through the s3_proxy."""
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


def _prefix(url: str) -> str:
    return Location.parse(url).path.split("/", 1)[1] + "/"


def _attempt(url: str, target: StoreTarget) -> str:
    store = open_store(Location.parse(url, target.storage_options))
    try:
        return read_manifest(store).attempt
    finally:
        store.close()


def _assert_committed_state_intact(url: str, target: StoreTarget, seed: int) -> None:
    """``objckpt verify`` passes and a stock DCP reader loads the state of ``seed``."""
    report = verify_checkpoint(Location.parse(url, target.storage_options))
    assert report.ok, report.failures
    got = empty_like_state(_state(0))
    with quiet():
        dcp.load(got, storage_reader=FsspecReader(url, **target.storage_options))
    assert_state_equal(got, _state(seed))


def test_an_overwriting_save_whose_manifest_put_fails_changes_no_committed_byte(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    url = via.url("ckpt")
    save(_state(1), url, via)
    before = snapshot(moto_server, via.bucket, _prefix(url))
    s3_proxy.add(MANIFEST_500)
    with pytest.raises(BaseException) as info:  # torch's CheckpointException
        save(_state(2), url, via, overwrite=True, retry=FAST, upload=UNBOUNDED)
    assert isinstance(carried(info.value), StoreError), repr(carried(info.value))
    assert s3_proxy.count("PutObject", faulted=True) == FAST.attempts
    s3_proxy.clear()
    assert_untouched(before, snapshot(moto_server, via.bucket, _prefix(url)), _attempt(url, via))
    _assert_committed_state_intact(url, s3_bucket, 1)


def test_a_second_writer_that_loses_the_race_changes_no_committed_byte(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    """Writer B (through the proxy) is held mid-upload while writer A commits the
    URL; B then finishes its uploads and loses at the create-only manifest."""
    url = via.url("race")
    s3_proxy.add(Rule("PutObject", key_contains=".distcp", action="hold", stall=120))
    outcome: dict[str, BaseException | None] = {}

    def writer_b() -> None:
        try:
            save(_state(2), url, via)
            outcome["b"] = None
        except BaseException as exc:
            outcome["b"] = carried(exc)

    b = threading.Thread(target=writer_b)
    b.start()
    try:
        s3_proxy.wait_for("PutObject", faulted=True, timeout=60)  # B is past its checks
        save(_state(1), url, s3_bucket)  # writer A, straight to the server
        before = snapshot(moto_server, via.bucket, _prefix(url))
    finally:
        s3_proxy.release()
        b.join(timeout=120)
    assert isinstance(outcome.get("b"), CheckpointExistsError), outcome
    assert_untouched(before, snapshot(moto_server, via.bucket, _prefix(url)), _attempt(url, via))
    _assert_committed_state_intact(url, s3_bucket, 1)


def test_cp_overwrite_whose_commit_fails_changes_no_committed_byte(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    src, dst = s3_bucket.url("src"), via.url("dst")
    save(_state(2), src, s3_bucket)
    save(_state(1), dst, via)
    before = snapshot(moto_server, via.bucket, _prefix(dst))
    s3_proxy.add(MANIFEST_500)
    with pytest.raises(StoreError, match=r"dst/manifest\.json"):
        copy_checkpoint(
            Location.parse(src, s3_bucket.storage_options),
            Location.parse(dst, via.storage_options, FAST),
            overwrite=True,
        )
    s3_proxy.clear()
    assert_untouched(before, snapshot(moto_server, via.bucket, _prefix(dst)), _attempt(dst, via))
    _assert_committed_state_intact(dst, s3_bucket, 1)
    # The same copy without the fault replaces it, whole.
    copy_checkpoint(
        Location.parse(src, s3_bucket.storage_options),
        Location.parse(dst, via.storage_options),
        overwrite=True,
    )
    _assert_committed_state_intact(dst, s3_bucket, 2)


def test_cp_overwrite_leaves_no_object_only_the_replaced_checkpoint_named(
    s3_bucket: StoreTarget,
) -> None:
    """A copy with ``overwrite=True`` onto a committed checkpoint deletes, after its
    commit, the objects only the replaced manifest named, as an overwriting save does
    (before, they stayed: garbage no manifest names)."""
    src, dst = s3_bucket.url("src-sup"), s3_bucket.url("dst-sup")
    save(_state(2), src, s3_bucket)
    save(_state(1), dst, s3_bucket)
    store = open_store(Location.parse(dst, s3_bucket.storage_options))
    try:
        replaced = {o.key for o in read_manifest(store).objects}
        copy_checkpoint(
            Location.parse(src, s3_bucket.storage_options),
            Location.parse(dst, s3_bucket.storage_options),
            overwrite=True,
        )
        named = {o.key for o in read_manifest(store).objects}
        only_replaced = replaced - named
        assert only_replaced, "the two saves name the same objects: nothing to check"
        there = {o.key for o in store.inventory()}
    finally:
        store.close()
    assert not only_replaced & there, sorted(only_replaced & there)
    _assert_committed_state_intact(dst, s3_bucket, 2)


def test_a_promotion_onto_a_root_step_another_job_committed_changes_none_of_its_bytes(
    via: StoreTarget, s3_bucket: StoreTarget, moto_server: MotoServer, tmp_path: pathlib.Path
) -> None:
    local = str(tmp_path / "nvme")
    step_url = f"{s3_bucket.url('run')}/{step_name(1)}"
    with CheckpointManager(
        via.url("run"),
        storage_options=via.storage_options,
        async_options=AsyncOptions(workers=1),
        local=LocalTier(local),
    ) as mgr:
        save(_state(9), step_url, s3_bucket)  # another job commits step 1 on the root
        before = snapshot(moto_server, via.bucket, _prefix(step_url))
        handle = mgr.save(1, _state(1))
        assert handle.result(60) is not None  # committed locally
        with pytest.raises(CheckpointExistsError, match=step_name(1)):
            handle.wait_durable(60)
        with pytest.raises(CheckpointExistsError):
            mgr.check_for_errors()
    after = snapshot(moto_server, via.bucket, _prefix(step_url))
    assert_untouched(before, after, _attempt(step_url, s3_bucket))
    _assert_committed_state_intact(step_url, s3_bucket, 9)
