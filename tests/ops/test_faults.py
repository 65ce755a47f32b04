"""The fault matrix, through a FaultProxy in front of the moto server.

Each case checks the promise: the previous committed step loads bit-exact, no
partial step is visible, the save either succeeds through retries or fails
with a clear error, and gc leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import carried, load, save

from objckpt import CheckpointManager, Location, RetryPolicy, UploadOptions
from objckpt.errors import (
    CheckpointExistsError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    StoreError,
)
from objckpt.format.layout import MANIFEST_KEY, is_objckpt_payload
from objckpt.ops.maintain.gc import collect_garbage
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store

FAST = RetryPolicy(attempts=4, base_delay=0.05, max_delay=0.5, timeout=5)
MiB = 1024 * 1024
PARTS = UploadOptions(part_size=5 * MiB, object_size=64 * MiB)
#: A save without a deadline tries each request ``attempts`` times; one with a
#: deadline retries until it (so a permanent fault would take the whole deadline).
UNBOUNDED = dataclasses.replace(PARTS, deadline=None)


def _state(seed: int, mib: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(mib * MiB // 4, generator=g),
        "b": torch.arange(100) * seed,
        "step": seed,
    }


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    """The test bucket, reached through the s3_proxy."""
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


def _open_uploads(moto_server: MotoServer, bucket: str) -> list:
    return moto_server.boto3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _keys(moto_server: MotoServer, bucket: str, prefix: str) -> list[str]:
    page = moto_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in page.get("Contents", []))


def _assert_clean(target: StoreTarget, moto_server: MotoServer) -> None:
    """gc with no grace finds nothing more to do, and no upload is open."""
    report = collect_garbage(
        Location.parse(target.root, target.storage_options), grace=0, dry_run=False
    )
    assert report.deleted == () and report.aborted_uploads == (), report
    assert _open_uploads(moto_server, target.bucket) == []


def test_random_503s_and_resets_are_retried_and_the_save_succeeds(
    via: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    root = via.url("run")
    with CheckpointManager(
        root, storage_options=via.storage_options, upload=PARTS, retry=FAST
    ) as mgr:
        mgr.save(1, _state(1, mib=32)).result()
        s3_proxy.add(Rule(probability=0.05, action="status", status=503))
        s3_proxy.add(Rule(probability=0.05, action="reset"))
        mgr.save(2, _state(2, mib=32)).result()
        for step in (1, 2):  # reads go through the same faults
            got = empty_like_state(_state(0, mib=32))
            assert mgr.load(got, step=step) == step
            assert_state_equal(got, _state(step, mib=32))
    faulted = [s for s in s3_proxy.seen if s.fault]
    assert len(faulted) >= 2, (
        f"the run should have met injected faults: {len(s3_proxy.seen)} requests"
    )
    assert {s.fault for s in faulted} <= {"status", "reset"}
    s3_proxy.clear()
    _assert_clean(via, moto_server)


def test_a_part_that_always_fails_aborts_the_upload_and_commits_nothing(
    via: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    save(_state(1), via.url("ok"), via, upload=PARTS, retry=FAST)
    s3_proxy.add(Rule("UploadPart", key_contains="partNumber=2", action="status", status=500))
    with pytest.raises(BaseException) as info:  # torch's CheckpointException
        save(_state(2), via.url("bad"), via, upload=UNBOUNDED, retry=FAST)
    err = carried(info.value)
    assert isinstance(err, StoreError) and "s3://objckpt-test/t/bad/" in str(err), err
    assert s3_proxy.count("UploadPart", faulted=True) == FAST.attempts  # retried, then given up
    assert _open_uploads(moto_server, via.bucket) == []  # aborted
    assert not [k for k in _keys(moto_server, via.bucket, "t/bad/") if k.endswith(MANIFEST_KEY)]
    s3_proxy.clear()
    with pytest.raises(CheckpointNotFoundError):
        load(empty_like_state(_state(0)), via.url("bad"), via)
    got = empty_like_state(_state(0))
    load(got, via.url("ok"), via)
    assert_state_equal(got, _state(1))


def test_failing_manifest_put_leaves_no_visible_step(
    via: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    root = via.url("run")
    with CheckpointManager(
        root, storage_options=via.storage_options, upload=UNBOUNDED, retry=FAST
    ) as mgr:
        mgr.save(1, _state(1)).result()
        s3_proxy.add(Rule("PutObject", key_contains=MANIFEST_KEY, action="status", status=500))
        with pytest.raises(StoreError, match=r"step-0000000002/manifest\.json"):
            mgr.save(2, _state(2)).result()
        assert mgr.all_steps() == [1]
        s3_proxy.clear()
        with pytest.raises(CheckpointNotCommittedError):
            load(empty_like_state(_state(0)), f"{root}/step-0000000002", via)
        mgr.reload()
        assert mgr.latest_step() == 1
        got = empty_like_state(_state(0))
        assert mgr.load(got) == 1
        assert_state_equal(got, _state(1))
    report = collect_garbage(Location.parse(root, via.storage_options), grace=0, dry_run=False)
    assert report.deleted  # the failed step's payload and index object
    _assert_clean(via, moto_server)


def test_manifest_put_whose_answer_is_lost_is_settled(
    via: StoreTarget, s3_proxy: FaultProxy, caplog
) -> None:
    """The PUT reached S3 but the answer never came: the retry meets 412 and the
    commit reads the manifest back, finds its own attempt, and succeeds."""
    caplog.set_level(logging.INFO, logger="objckpt")
    s3_proxy.add(
        Rule("PutObject", key_contains=MANIFEST_KEY, nth=1, action="reset", before_upstream=False)
    )
    save(_state(3), via.url("lost"), via, upload=PARTS, retry=FAST)
    assert s3_proxy.count("PutObject", faulted=True) == 1
    assert any("already written by this attempt" in r.getMessage() for r in caplog.records)
    got = empty_like_state(_state(0))
    load(got, via.url("lost"), via)
    assert_state_equal(got, _state(3))


def test_a_stalled_request_times_out_and_is_retried(via: StoreTarget, s3_proxy: FaultProxy) -> None:
    policy = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2, timeout=1)
    s3_proxy.add(Rule("PutObject", key_contains=".metadata", nth=1, action="stall", stall=3))
    started = time.monotonic()
    save(_state(4, mib=1), via.url("stall"), via, retry=policy)
    assert time.monotonic() - started < 30
    assert s3_proxy.count("PutObject") >= 3  # payload, the stalled .metadata and its retry, ...
    got = empty_like_state(_state(0, mib=1))
    load(got, via.url("stall"), via)
    assert_state_equal(got, _state(4, mib=1))


@pytest.mark.parametrize("what", ["distcp", MANIFEST_KEY])
def test_a_truncated_response_is_retried_on_load(
    via: StoreTarget, s3_proxy: FaultProxy, what: str
) -> None:
    save(_state(5), via.url("cut"), via, upload=PARTS, retry=FAST)
    s3_proxy.add(Rule("GetObject", key_contains=what, nth=1, action="truncate"))
    got = empty_like_state(_state(0))
    load(got, via.url("cut"), via, retry=FAST)
    assert_state_equal(got, _state(5))
    assert s3_proxy.count("GetObject", faulted=True) == 1


def test_upload_concurrency_backs_off_under_throttling_and_recovers(
    via: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    loc = Location.parse(via.url("aimd"), via.storage_options, FAST)
    store = open_store(loc, UploadOptions(part_size=5 * MiB, max_parts_in_flight=8))
    data = torch.randint(0, 255, (60 * MiB,), dtype=torch.uint8).numpy().tobytes()
    try:
        s3_proxy.add(Rule("UploadPart", nth=2, action="status", status=503))
        up = store.begin("big.bin", len(data))
        up.write(data)
        up.close().result()
        backoff, where = store.backoff, f"{via.bucket}/t/aimd"
        assert backoff is not None
        cut = backoff.stats()
        assert cut.directory_cuts == 1 and cut.lowest is not None, cut  # halved once
        s3_proxy.clear()
        up = store.begin("big2.bin", len(data))
        up.write(data)
        up.close().result()
        # Grown back (the parts after the cut, then big2's 12), or lifted where it was cut.
        assert dict(backoff.stats().limited).get(where, math.inf) > cut.lowest, backoff.stats()
    finally:
        store.close()
    body = moto_server.boto3_client().get_object(Bucket=via.bucket, Key="t/aimd/big.bin")
    assert body["Body"].read() == data


def test_zombie_writer_of_an_old_attempt_never_reaches_the_committed_step(
    via: StoreTarget, s3_bucket: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    """Job A stalls mid-save; job B (a restart) commits the step; A wakes, finishes
    its uploads, and is refused at the commit. B's checkpoint is what loads."""
    url = via.url("run/step-0000000001")
    s3_proxy.add(Rule("PutObject", key_contains=".distcp", nth=1, action="stall", stall=4))
    result: dict[str, BaseException] = {}

    def job_a() -> None:
        try:
            save(_state(6, mib=1), url, via, retry=RetryPolicy(timeout=30))
        except BaseException as exc:
            result["a"] = carried(exc)

    a = threading.Thread(target=job_a)
    a.start()
    s3_proxy.wait_for("PutObject", faulted=True, timeout=30)  # A is stalled mid-save
    # While A is writing: nothing is visible at the URL.
    with pytest.raises(CheckpointNotFoundError):
        load(empty_like_state(_state(0, mib=1)), url, s3_bucket)
    save(_state(7, mib=1), url, s3_bucket)  # job B, straight to the server
    a.join(timeout=60)
    assert isinstance(result.get("a"), CheckpointExistsError), result
    got = empty_like_state(_state(0, mib=1))
    load(got, url, s3_bucket)
    assert_state_equal(got, _state(7, mib=1))
    names = [k.rsplit("/", 1)[-1] for k in _keys(moto_server, s3_bucket.bucket, "t/run/step-")]
    assert sum(is_objckpt_payload(n) for n in names) == 2  # A's bytes sit beside B's...
    report = collect_garbage(
        Location.parse(s3_bucket.url("run"), s3_bucket.storage_options), grace=0, dry_run=False
    )
    # ...until gc removes them: A's payload and the index object A wrote before its
    # manifest was refused, nothing of B's.
    b_attempt = load(got, url, s3_bucket).manifest.attempt
    assert len(report.deleted) == 2 and not any(b_attempt in k for k in report.deleted)
    load(got, url, s3_bucket)
    assert_state_equal(got, _state(7, mib=1))


_DISK_FULL_CHILD = textwrap.dedent(
    """
    import resource, signal, sys, torch, torch.distributed.checkpoint as dcp, warnings
    import objckpt
    warnings.filterwarnings("ignore")
    url = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # write() fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    try:
        dcp.save({"w": torch.ones(4 << 20)}, storage_writer=objckpt.ObjectStoreWriter(url))
    except BaseException as exc:  # torch's CheckpointException carries ours
        failure = next(iter(getattr(exc, "failures", {0: exc}).values()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        print("ERROR", type(inner).__name__, inner)
        sys.exit(3)
    print("SAVED")
    """
)


def test_a_full_disk_fails_the_save_and_keeps_the_previous_step(tmp_path) -> None:
    """The file:// target cannot grow (RLIMIT_FSIZE in a child process: each write
    past 2 MiB fails as it does on a full disk)."""
    target = StoreTarget(root=f"file://{tmp_path}", storage_options={})
    save(_state(8, mib=1), target.url("ok"), target)
    out = subprocess.run(
        [sys.executable, "-c", _DISK_FULL_CHILD, target.url("full")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 3, out.stdout + out.stderr
    # The write error itself (EFBIG, as ENOSPC would be), named for the payload object.
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("ERROR StoreError "), out.stdout
    assert "File too large" in line and f"{target.url('full')}/__0_0." in line, line
    assert not (tmp_path / "full" / MANIFEST_KEY).exists()
    with pytest.raises(CheckpointNotFoundError):
        load(empty_like_state({"w": torch.ones(4 << 20)}), target.url("full"), target)
    got = empty_like_state(_state(0, mib=1))
    load(got, target.url("ok"), target)
    assert_state_equal(got, _state(8, mib=1))


# A frozen endpoint: payload requests are accepted and never answered (the proxy
# holds each far longer than the test), while the retry policy alone would wait
# 6 attempts x 60 s per request.
FROZEN = Rule(key_contains=".distcp", action="stall", stall=120)
DEADLINE = 4.0


def _fails_within_deadline(elapsed: float, message: str, url: str) -> None:
    assert elapsed <= DEADLINE * 1.1, f"failed after {elapsed:.2f} s, deadline {DEADLINE} s"
    assert "rank 0" in message and url in message, message
    assert ".distcp" in message, message  # the object that got no answer
    assert "UploadOptions.deadline" in message, message


def test_a_sync_save_to_a_frozen_endpoint_fails_within_its_deadline_naming_rank_and_object(
    via: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    import torch.distributed.checkpoint as dcp
    from helpers import quiet
    from torch.distributed.checkpoint.api import CheckpointException

    from objckpt import ObjectStoreWriter
    from objckpt.errors import SaveDeadlineError

    url = via.url("frozen")
    s3_proxy.add(FROZEN)
    writer = ObjectStoreWriter(
        url,
        storage_options=via.storage_options,
        upload=dataclasses.replace(PARTS, deadline=DEADLINE),
        retry=RetryPolicy(),  # the defaults: 6 attempts, 60 s per request
    )
    started = time.monotonic()
    with quiet(), pytest.raises(CheckpointException) as info:
        dcp.save(_state(6, mib=1), storage_writer=writer)
    elapsed = time.monotonic() - started
    error = carried(info.value)
    assert isinstance(error, SaveDeadlineError), repr(error)
    _fails_within_deadline(elapsed, str(error), url)
    assert s3_proxy.count("PutObject", faulted=True) >= 1  # the stall was really hit
    prefix = url.removeprefix("s3://objckpt-test/") + "/"
    assert MANIFEST_KEY not in [
        k.rsplit("/", 1)[-1] for k in _keys(moto_server, "objckpt-test", prefix)
    ]


def test_an_async_save_to_a_frozen_endpoint_fails_within_its_deadline(
    via: StoreTarget, s3_proxy: FaultProxy, moto_server: MotoServer
) -> None:
    from objckpt import AsyncCheckpointer
    from objckpt.errors import SaveDeadlineError

    url = via.url("frozen-async")
    with AsyncCheckpointer(
        storage_options=via.storage_options, upload=dataclasses.replace(PARTS, deadline=DEADLINE)
    ) as ckpt:
        ckpt.save(_state(7, mib=1), via.url("warm")).result(timeout=60)  # workers up and warm
        s3_proxy.add(FROZEN)
        started = time.monotonic()
        handle = ckpt.save(_state(7, mib=1), url)
        with pytest.raises(SaveDeadlineError) as info:
            handle.result(timeout=60)
        elapsed = time.monotonic() - started
        _fails_within_deadline(elapsed, str(info.value), url)
        s3_proxy.clear()
    prefix = url.removeprefix("s3://objckpt-test/") + "/"
    keys = [k.rsplit("/", 1)[-1] for k in _keys(moto_server, "objckpt-test", prefix)]
    assert MANIFEST_KEY not in keys
