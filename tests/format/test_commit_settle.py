"""Ambiguous commits are settled by reading the manifest back (issue #25, item 4).

A manifest PUT can land while its caller sees an error. Through the fault proxy:
every answer to the manifest PUT lost after the store applied it, the answer held
past the save's deadline, a 412 that names no condition (as some S3-compatible
stores answer), and ``copy_checkpoint`` meeting its own earlier write. Each is
settled by the read-back: our bytes there means committed, another writer's means
``CheckpointExistsError``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
from commit_strategies import STRATEGIES, commit_via
from conftest import assert_state_equal, empty_like_state
from helpers import load, save
from states import stepped_state
from store_bytes import assert_untouched, snapshot
from torch.distributed.checkpoint.metadata import Metadata

from objckpt import Location, RetryPolicy, UploadOptions
from objckpt.errors import CheckpointExistsError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

FAST = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2, timeout=30)
#: The manifest PUT reaches the store, then its answer is lost (a reset).
LOST_ANSWER = Rule("PutObject", key_contains=MANIFEST_KEY, action="reset", before_upstream=False)
#: 412 PreconditionFailed without the <Condition> element s3fs looks for.
BARE_412 = Rule(
    "PutObject", key_contains=MANIFEST_KEY, action="status", status=412, code="PreconditionFailed"
)


# The commit cases write 256 KiB per step: ``stepped_state`` at that size.
_state = functools.partial(stepped_state, shape=(1 << 16,))


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    """The test bucket, reached through the s3_proxy."""
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


def _loads_and_verifies(url: str, target: StoreTarget, seed: int) -> None:
    got = empty_like_state(_state(0))
    load(got, url, target)
    assert_state_equal(got, _state(seed))
    report = verify_checkpoint(Location.parse(url, target.storage_options))
    assert report.ok, report.failures


def test_a_manifest_put_whose_every_answer_is_lost_commits(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Every try of the manifest PUT reaches the store and loses its answer (the
    retries meet 412, whose answers are lost too): the read-back finds the bytes
    this save sent, so the save reports success."""
    caplog.set_level(logging.WARNING, logger="objckpt")
    s3_proxy.add(LOST_ANSWER)
    url = via.url("lost")
    # A reset is transient: a save with a deadline retries it until the deadline.
    save(_state(1), url, via, retry=FAST, upload=UploadOptions(deadline=10.0))
    # Each try at least once (the HTTP client may resend a reset request itself).
    assert s3_proxy.count("PutObject", faulted=True) >= FAST.attempts
    assert any("yet the manifest holds what it sent" in r.getMessage() for r in caplog.records)
    s3_proxy.clear()
    _loads_and_verifies(url, s3_bucket, 1)


def test_a_manifest_put_that_lands_after_the_deadline_cancelled_it_commits(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The store applies the manifest PUT but its answer is held until the save's
    deadline cancels the request: the save is committed, and says so."""
    caplog.set_level(logging.WARNING, logger="objckpt")
    s3_proxy.add(
        Rule(
            "PutObject",
            key_contains=MANIFEST_KEY,
            action="hold",
            before_upstream=False,
            stall=300,
        )
    )
    url = via.url("late")
    try:
        save(_state(2), url, via, upload=dataclasses.replace(UploadOptions(), deadline=10.0))
    finally:
        s3_proxy.release()
    settled = [r.getMessage() for r in caplog.records if "yet the manifest holds" in r.getMessage()]
    assert settled and "SaveDeadlineError" in settled[0], settled
    s3_proxy.clear()
    _loads_and_verifies(url, s3_bucket, 2)


def test_a_retry_answered_412_without_a_condition_is_settled_as_ours(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """The first manifest PUT lands and its answer is lost; the store answers the
    retry with a 412 that names no condition: read back, the manifest is ours."""
    s3_proxy.add(dataclasses.replace(LOST_ANSWER, times=1))
    s3_proxy.add(dataclasses.replace(BARE_412, times=1))
    url = via.url("bare")
    save(_state(3), url, via, retry=FAST)
    assert s3_proxy.count("PutObject", faulted=True) == 2
    s3_proxy.clear()
    _loads_and_verifies(url, s3_bucket, 3)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_412_without_a_condition_on_a_committed_url_is_checkpoint_exists(
    via: StoreTarget,
    s3_bucket: StoreTarget,
    s3_proxy: FaultProxy,
    moto_server: MotoServer,
    strategy: str,
) -> None:
    """Another attempt committed the URL; this commit's create-only PUT gets a 412
    naming no condition: ``CheckpointExistsError`` naming the winner, nothing of the
    winner's changed."""
    url = via.url("taken")
    empty = Metadata(state_dict_metadata={})
    winner = open_store(Location.parse(url, s3_bucket.storage_options), UploadOptions())
    loser = open_store(Location.parse(url, via.storage_options, FAST), UploadOptions())
    try:
        commit_via(strategy, winner, empty, [], attempt="a" * 16, world_size=1, overwrite=False)
        before = snapshot(moto_server, via.bucket, "t/taken/")
        s3_proxy.add(BARE_412)
        with pytest.raises(CheckpointExistsError, match=f"by attempt {'a' * 16}"):
            commit_via(strategy, loser, empty, [], attempt="b" * 16, world_size=1, overwrite=False)
    finally:
        winner.close()
        loser.close()
    assert s3_proxy.count("PutObject", faulted=True) == 1  # a 412 is never retried
    assert_untouched(before, snapshot(moto_server, via.bucket, "t/taken/"), "a" * 16)


def test_a_copy_whose_manifest_answer_is_lost_is_settled_by_reading_it_back(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """``copy_checkpoint``'s manifest PUT lands and its answer is lost; the retry
    meets 412 (``FileExistsError``): the copy reads the manifest back, finds its
    own bytes, and reports the copy done."""
    src, dst = s3_bucket.url("src"), via.url("dst")
    save(_state(4), src, s3_bucket)
    s3_proxy.add(dataclasses.replace(LOST_ANSWER, times=1))
    report = copy_checkpoint(
        Location.parse(src, s3_bucket.storage_options),
        Location.parse(dst, via.storage_options, FAST),
    )
    assert report.copied and s3_proxy.count("PutObject", faulted=True) == 1
    s3_proxy.clear()
    _loads_and_verifies(dst, s3_bucket, 4)


def test_a_create_only_put_answered_412_without_a_condition_raises_file_exists(
    via: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """The store contract: a create-only PUT refused with 412 is ``FileExistsError``
    (the caller's cue to read back), whether or not the answer names a condition."""
    s3_proxy.add(BARE_412)
    store = open_store(Location.parse(via.url("k"), via.storage_options, FAST), UploadOptions())
    try:
        with pytest.raises(FileExistsError, match=r"t/k/manifest\.json"):
            store.create(MANIFEST_KEY, b"{}")
    finally:
        store.close()
