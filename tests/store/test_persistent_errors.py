"""Transient versus persistent store failures (issue #35, item 1).

A save rides out an outage and a 503 storm, and fails in bounded time, saying what
the store answered, when the store keeps refusing the same request: the save's
deadline (600 s by default) is the outer bound, not the way a refusal ends.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import SHORT_WINDOW, carried, load, save

from objckpt import CheckpointManager, RetryPolicy, UploadOptions
from objckpt.errors import StoreRefusedError, StoreUnreachableError
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget

MiB = 1024 * 1024
PARTS = UploadOptions(part_size=5 * MiB, object_size=64 * MiB)
#: The default policy with a short window, so a test of the window costs seconds.
SHORT = SHORT_WINDOW


def _state(seed: int, mib: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "b": torch.arange(64) * seed}


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    """The test bucket, reached through the s3_proxy."""
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


def test_the_default_policy_gives_up_on_a_repeated_refusal_within_90_s() -> None:
    policy = RetryPolicy()
    assert policy.give_up_after is not None and policy.give_up_after + policy.max_delay <= 90
    assert UploadOptions().deadline is None or UploadOptions().deadline > 90  # the outer bound


def test_a_part_answered_500_on_every_attempt_fails_the_save_in_the_window(
    via: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """The row as reported: sync dcp.save, the default deadline, a 64 MiB object whose
    second part is answered 500 every time. The window is 3 s rather than the default
    60 s (the test above bounds the default), so the save ends by the window, long
    before the deadline, and says why."""
    s3_proxy.add(Rule("UploadPart", key_contains="partNumber=2", status=500))
    # Two tries: inside a save the window, not ``attempts``, ends the retries.
    two_tries = dataclasses.replace(SHORT, attempts=2)
    started = time.monotonic()
    with pytest.raises(BaseException) as info:  # torch's CheckpointException
        save(_state(1, mib=64), via.url("bad-part"), via, upload=PARTS, retry=two_tries)
    elapsed = time.monotonic() - started
    err = carried(info.value)
    assert isinstance(err, StoreRefusedError), repr(err)
    assert elapsed < 30, f"failed after {elapsed:.0f} s with a 3 s window"
    message = str(err)
    assert "HTTP 500 InternalError" in message and "give_up_after" in message, message
    assert "partNumber" not in message and "s3://objckpt-test/t/bad-part/" in message, message
    attempts = s3_proxy.count("UploadPart", faulted=True)
    assert f"on each of {attempts} attempts" in message, (attempts, message)
    assert attempts > two_tries.attempts  # retried by the window, not by attempts


def test_every_payload_write_answered_500_fails_the_save_in_the_window(
    via: StoreTarget, s3_proxy: FaultProxy
) -> None:
    s3_proxy.add(Rule(key_contains=".distcp", status=500))
    started = time.monotonic()
    with pytest.raises(BaseException) as info:
        save(_state(2, mib=2), via.url("bad-all"), via, retry=SHORT)
    elapsed = time.monotonic() - started
    err = carried(info.value)
    assert isinstance(err, StoreRefusedError), repr(err)
    assert elapsed < 30, f"failed after {elapsed:.0f} s with a 3 s window"
    assert "HTTP 500 InternalError" in str(err) and ".distcp" in str(err), err
    s3_proxy.clear()
    with pytest.raises(FileNotFoundError):  # nothing committed
        load(empty_like_state(_state(0, mib=2)), via.url("bad-all"), via)


def test_a_store_that_answers_503_to_everything_is_said_to_have_answered(
    via: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """Every request answered 503, default policy: the preflight's own bound ends it,
    and the error says the store answered 503 (it was "no answer within 30 s")."""
    s3_proxy.add(Rule(status=503))
    with pytest.raises(BaseException) as info:
        save(_state(3, mib=1), via.url("slowdown"), via, upload=UploadOptions(preflight_timeout=5))
    err = carried(info.value)
    message = str(err)
    assert isinstance(err, StoreRefusedError), repr(err)
    assert "no answer" not in message, message
    assert "HTTP 503 SlowDown" in message and "preflight_timeout" in message, message
    assert s3_proxy.count("ListObjectsV2", faulted=True) > 1  # retried, then ended


def test_throttling_is_waited_for_until_the_deadline_not_given_up(
    via: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """503 SlowDown on every payload write: the store asks for fewer requests, so the
    save waits (beyond ``give_up_after``) until its deadline, which names the answer."""
    from objckpt.errors import SaveDeadlineError

    s3_proxy.add(Rule(key_contains=".distcp", status=503))
    upload = dataclasses.replace(PARTS, deadline=8.0)
    policy = dataclasses.replace(SHORT, give_up_after=1.0)
    with pytest.raises(BaseException) as info:
        save(_state(3, mib=1), via.url("throttled"), via, retry=policy, upload=upload)
    err = carried(info.value)
    assert isinstance(err, SaveDeadlineError), repr(err)
    assert "the store answered HTTP 503 SlowDown" in str(err), err
    assert "no answer" not in str(err), err


def test_a_refused_connection_that_persists_is_unreachable_not_refused(
    via: StoreTarget, s3_proxy: FaultProxy
) -> None:
    s3_proxy.add(Rule(key_contains=".distcp", action="reset"))
    with pytest.raises(BaseException) as info:
        save(_state(4, mib=1), via.url("reset"), via, retry=SHORT)
    err = carried(info.value)
    assert isinstance(err, StoreUnreachableError), repr(err)
    assert "no answer on each of" in str(err) and "give_up_after" in str(err), err


def test_a_5_s_outage_is_ridden_out_and_the_save_commits(
    via: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """Every connection reset for 5 s, from the save's first payload request on."""
    s3_proxy.add(Rule(key_contains=".distcp", action="reset"))
    ended = threading.Event()

    def end_outage() -> None:
        s3_proxy.wait_for(None, count=1, faulted=True)  # the save is in the outage
        threading.Event().wait(5.0)  # the outage's length, not a synchronisation
        s3_proxy.clear()
        ended.set()

    ender = threading.Thread(target=end_outage, daemon=True)
    ender.start()
    save(_state(5, mib=4), via.url("outage"), via, upload=PARTS)  # default policy
    ender.join(timeout=60)
    assert ended.is_set()
    got = empty_like_state(_state(0, mib=4))
    load(got, via.url("outage"), via)
    assert_state_equal(got, _state(5, mib=4))


@pytest.mark.parametrize("probability", [0.3, 0.5])
def test_a_503_storm_is_ridden_out_and_the_save_commits(
    via: StoreTarget, s3_proxy: FaultProxy, probability: float
) -> None:
    """The default policy, a 30% and a 50% 503 storm on every request of an async save."""
    with CheckpointManager(
        via.url("storm"), storage_options=via.storage_options, upload=PARTS
    ) as mgr:
        s3_proxy.add(Rule(probability=probability, status=503))
        mgr.save(1, _state(6, mib=11)).result(timeout=300)
        faulted = len([s for s in s3_proxy.seen if s.fault])
        s3_proxy.clear()  # reads outside a save make `attempts` tries, not the window's
        got = empty_like_state(_state(0, mib=11))
        assert mgr.load(got, step=1) == 1
    assert_state_equal(got, _state(6, mib=11))
    assert faulted >= 2, "the storm should have hit the save"


def test_an_upload_aborted_after_meeting_an_existing_file_leaves_that_file(tmp_path) -> None:
    """A file:// upload whose create-only open meets a file already there fails, and
    its abort removes nothing: the file is not the upload's."""
    from objckpt import Location
    from objckpt.errors import StoreError
    from objckpt.writers import open_store

    store = open_store(Location.parse(f"file://{tmp_path}/root"))
    try:
        store.put("taken.bin", b"someone else's")
        upload = store.begin("taken.bin", 4)
        with pytest.raises(StoreError):
            upload.write(b"mine")
        upload.abort()
        assert (tmp_path / "root" / "taken.bin").read_bytes() == b"someone else's"
    finally:
        store.close()
