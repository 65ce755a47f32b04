"""The local tier (``CheckpointManager(local=LocalTier(...))``) in one process, against
the moto server through the recording proxy: what is committed where, what a load
reads from the store, and the faults (corrupt local copy, full local disk, a
promotion that fails)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_state_equal, empty_like_state

from objckpt import CheckpointManager, LocalTier, Location, RetentionPolicy
from objckpt.errors import ConfigurationError, StoreError
from objckpt.format.layout import MANIFEST_KEY, is_objckpt_payload
from objckpt.format.steps import step_name
from objckpt.options import AsyncOptions
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget

OPTS = AsyncOptions(workers=1)


@pytest.fixture
def via(s3_proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(root=s3_bucket.root, storage_options=s3_proxy.storage_options())


def _state(step: int, mib: int = 1) -> dict:
    return {
        "w": torch.full((mib << 18,), float(step)),
        "b": torch.arange(7) * step,
        "step": step,
    }


def _manager(via: StoreTarget, local: str, **tier: object) -> CheckpointManager:
    return CheckpointManager(
        via.url("run"),
        storage_options=via.storage_options,
        async_options=OPTS,
        local=LocalTier(local, **tier),  # type: ignore[arg-type]
    )


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_name(step))


def _gets(proxy: FaultProxy, step: int) -> list[str]:
    return [p for p in proxy.paths("GetObject") if f"/{step_name(step)}/" in p]


def test_option_errors_name_the_option(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="promote_every=0"):
        LocalTier(tmp_path, promote_every=0)
    with pytest.raises(ConfigurationError, match=r"retention=3 is invalid: expected objckpt\.Ret"):
        LocalTier(tmp_path, retention=3)  # type: ignore[arg-type]
    # The tier's own bound, not borrowed from AsyncOptions.barrier_timeout (#45).
    assert LocalTier(tmp_path).replication_timeout == 600.0
    with pytest.raises(ConfigurationError, match="replication_timeout=None is invalid"):
        LocalTier(tmp_path, replication_timeout=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="s3://b/x is not a local directory"):
        LocalTier("s3://b/x")
    with pytest.raises(ConfigurationError, match="local="):
        CheckpointManager(f"file://{tmp_path}/root", local=str(tmp_path))  # type: ignore[arg-type]


def test_local_retention_is_the_whole_retention_policy(tmp_path) -> None:
    """``LocalTier(retention=)`` takes the root's value, every rule of it: with
    ``keep_last=1, keep_every=2`` the local disk keeps the milestones 2 and 4 and the
    newest, 5 (a local ``keep_last`` alone could only keep the newest)."""
    local = str(tmp_path / "nvme")
    tier = LocalTier(local, retention=RetentionPolicy(keep_last=1, keep_every=2), promote_every=100)
    with CheckpointManager(f"file://{tmp_path}/root", async_options=OPTS, local=tier) as mgr:
        for step in (1, 2, 3, 4, 5):
            mgr.save(step, _state(step)).result(60)
        mgr.wait_until_finished()
    assert sorted(os.listdir(local)) == [step_name(s) for s in (2, 4, 5)]


def test_every_kth_save_is_promoted_and_durable_means_on_the_root(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    local = str(tmp_path / "nvme")
    with _manager(via, local, retention=RetentionPolicy(keep_last=3), promote_every=2) as mgr:
        handles = [mgr.save(step, _state(step)) for step in (1, 2, 3, 4)]
        mgr.wait_until_finished()
        assert [h.tier for h in handles] == ["local"] * 4
        assert [h.will_be_durable for h in handles] == [False, True, False, True]
        assert [h.wait_durable(60) for h in handles] == [False, True, False, True]
        assert handles[1].seconds_to_durable is not None
        assert handles[1].seconds_to_durable >= (handles[1].seconds_to_commit or 0)
        assert mgr.all_steps() == [2, 4]  # durable
        assert mgr.local_steps() == [2, 3, 4]  # keep_last=3 dropped step 1
        assert mgr.latest_step() == 4 and mgr.latest_step(durable=True) == 4
        status = mgr.tier_status()
        assert (status.local_latest, status.durable_latest, status.steps_behind) == (4, 4, 0)
        assert status.last_time_to_durable is not None and status.error is None
    # Steps 1 and 3 never reached the store: no PUT under their names at all.
    puts = s3_proxy.paths("PutObject") + s3_proxy.paths("CreateMultipartUpload")
    for step in (1, 3):
        assert not [p for p in puts if f"/{step_name(step)}/" in p], step
    assert os.path.exists(os.path.join(_step_dir(local, 4), MANIFEST_KEY))
    assert not os.path.exists(_step_dir(local, 1))
    # The root's manifest is the very one the local tier committed, and names the
    # root's step (where the bytes end up) as DCP's checkpoint id.
    manifest_puts = [p for p in s3_proxy.paths("PutObject") if p.endswith(MANIFEST_KEY)]
    assert len(manifest_puts) == 2
    root = Location.parse(via.url("run"), via.storage_options)
    remote = root.open_fs(fresh=True).cat_file(root.child(step_name(4)).key_path(MANIFEST_KEY))
    with open(os.path.join(_step_dir(local, 4), MANIFEST_KEY), "rb") as f:
        assert f.read() == remote
    assert root.child(step_name(4)).url in remote.decode()


def test_load_reads_the_local_copy_and_nothing_of_the_step_from_the_store(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    local = str(tmp_path / "nvme")
    with _manager(via, local) as mgr:
        mgr.save(5, _state(5, mib=6)).wait_durable(60)
    s3_proxy.clear()
    with _manager(via, local) as mgr:
        got = empty_like_state(_state(0, mib=6))
        assert mgr.load(got) == 5
    assert_state_equal(got, _state(5, mib=6))
    assert _gets(s3_proxy, 5) == []  # manifest, index and payload all came from disk


def test_a_corrupt_local_object_falls_back_to_the_store_and_is_named(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    local = str(tmp_path / "nvme")
    with _manager(via, local) as mgr:
        mgr.save(5, _state(5, mib=2)).wait_durable(60)
    payload = next(n for n in os.listdir(_step_dir(local, 5)) if is_objckpt_payload(n))
    path = os.path.join(_step_dir(local, 5), payload)
    with open(path, "r+b") as f:  # same size, one byte flipped
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    s3_proxy.clear()
    with _manager(via, local) as mgr, caplog.at_level(logging.WARNING):
        got = empty_like_state(_state(0, mib=2))
        assert mgr.load(got) == 5
    assert_state_equal(got, _state(5, mib=2))
    assert any(f"{payload} is corrupt" in r.getMessage() for r in caplog.records), caplog.text
    # Only the damaged object was read from the store.
    assert {p.rsplit("/", 1)[-1] for p in _gets(s3_proxy, 5)} == {payload}


def test_a_step_gone_from_the_root_still_loads_from_a_complete_local_copy(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    local = str(tmp_path / "nvme")
    with _manager(via, local, promote_every=2) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))  # local only
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3 and mgr.latest_step(durable=True) == 2
    s3_proxy.clear()
    with _manager(via, local, promote_every=2) as mgr:
        got = empty_like_state(_state(0))
        assert mgr.load(got) == 3
        assert_state_equal(got, _state(3))
        assert mgr.load(got, step=2) == 2  # durable, and on disk too
        assert_state_equal(got, _state(2))
    assert s3_proxy.count("GetObject") == 0


def test_an_incomplete_local_step_falls_back_to_the_newest_durable_step(
    via: StoreTarget, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 3 is local only and its payload is lost from disk: the newest durable step
    loads instead, and the log says why."""
    local = str(tmp_path / "nvme")
    with _manager(via, local, promote_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait_until_finished()
    for name in os.listdir(_step_dir(local, 3)):
        if is_objckpt_payload(name):
            os.unlink(os.path.join(_step_dir(local, 3), name))
    with _manager(via, local, promote_every=2) as mgr, caplog.at_level(logging.WARNING):
        got = empty_like_state(_state(0))
        assert mgr.load(got) == 2
    assert_state_equal(got, _state(2))
    assert "step 3 (local tier) cannot be loaded" in caplog.text


def test_a_failed_promotion_keeps_the_previous_durable_step_and_the_local_one(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    local = str(tmp_path / "nvme")
    with _manager(via, local) as mgr:
        mgr.save(1, _state(1)).wait_durable(60)
        s3_proxy.add(Rule(key_contains=f"{step_name(2)}/{MANIFEST_KEY}", status=403))
        handle = mgr.save(2, _state(2))
        where = f"{step_name(2)}/{MANIFEST_KEY}"
        with pytest.raises(StoreError, match=where):
            handle.wait_durable(60)
        with pytest.raises(StoreError, match=where):
            mgr.wait_until_finished()
        assert s3_proxy.count("PutObject", faulted=True) >= 1
        assert mgr.latest_step(durable=True) == 1 and mgr.latest_step() == 2
        assert mgr.tier_status().error is not None
        s3_proxy.clear()
        # the next promotion works
        assert mgr.save(3, _state(3)).wait_durable(60)
        assert mgr.all_steps() == [1, 3]
    assert os.path.exists(os.path.join(_step_dir(local, 2), MANIFEST_KEY))


def test_a_full_local_disk_degrades_to_object_store_saves(
    s3_bucket: StoreTarget, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """RLIMIT_FSIZE in the upload worker, which writes the local payload: every
    write past 1 MiB fails there as on a full disk. The failed save is logged, the
    next one goes to S3, and no error reaches the training loop."""
    local = str(tmp_path / "nvme")
    with (
        CheckpointManager(
            s3_bucket.url("run"),
            storage_options=s3_bucket.storage_options,
            async_options=OPTS,  # one worker: the limit below reaches it
            local=LocalTier(local),
        ) as mgr,
        caplog.at_level(logging.WARNING),
    ):
        run = mgr._checkpointer.run_in_worker
        # Python ignores SIGXFSZ from startup, so a write past the limit fails with
        # EFBIG rather than killing the worker (a task may run off the main thread,
        # where signal.signal is refused).
        assert run(signal.getsignal, signal.SIGXFSZ).result(60) == signal.SIG_IGN
        run(resource.setrlimit, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)).result(60)
        first = mgr.save(1, {"w": torch.ones(1 << 20)})  # 4 MiB: the local write fails
        assert first.tier == "local" and first.exception(60) is not None
        second = mgr.save(2, {"w": torch.full((1 << 20,), 2.0)})
        assert second.tier == "primary" and second.wait_durable(60)
        mgr.wait_until_finished()  # the local failure is not raised
        mgr.check_for_errors()
        assert mgr.all_steps() == [2] and mgr.local_steps() == []
        assert "ran out of space" in (mgr.tier_status().degraded or "")
    assert "File too large" in caplog.text and "ran out of space" in caplog.text
    assert not os.path.exists(os.path.join(_step_dir(local, 1), MANIFEST_KEY))


def test_a_save_that_would_not_fit_goes_to_the_store_directly(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The room check before a save: ``min_free_bytes`` larger than the disk."""
    local = str(tmp_path / "nvme")
    huge = 1 << 62
    with _manager(via, local, min_free_bytes=huge) as mgr, caplog.at_level(logging.WARNING):
        handle = mgr.save(1, _state(1))
        assert handle.tier == "primary" and handle.wait_durable(60)
        assert mgr.all_steps() == [1] and mgr.local_steps() == []
        assert "min_free_bytes" in (mgr.tier_status().degraded or "")
    assert "goes to" in caplog.text and "not the local tier" in caplog.text
    assert not os.path.exists(_step_dir(local, 1))


def test_a_refused_payload_upload_fails_that_promotion_naming_the_object(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    """A payload PUT refused during promotion fails that promotion only, on the
    handle and once through check_for_errors; the local step stays."""
    local = str(tmp_path / "nvme")
    s3_proxy.add(Rule(operation="PutObject", key_contains=".distcp", status=403))
    with _manager(via, local) as mgr:
        handle = mgr.save(1, _state(1))
        assert handle.result(60) is not None  # committed locally
        with pytest.raises(StoreError, match=rf"{step_name(1)}/__0_0\.\w+\.distcp"):
            handle.wait_durable(60)
        with pytest.raises(StoreError, match="distcp"):
            mgr.check_for_errors()
        mgr.check_for_errors()  # reported once
        assert mgr.all_steps() == [] and mgr.local_steps() == [1]
        assert s3_proxy.count("PutObject", faulted=True) >= 1


_PROMOTING_CHILD = textwrap.dedent(
    """
    import sys, torch
    import objckpt
    root, local, options = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    mgr = objckpt.CheckpointManager(
        root, storage_options=options, async_options=objckpt.AsyncOptions(workers=1),
        local=objckpt.LocalTier(local),
    )
    assert mgr.save(1, {"w": torch.full((1 << 18,), 1.0), "step": 1}).wait_durable(60)
    handle = mgr.save(2, {"w": torch.full((1 << 18,), 2.0), "step": 2})
    handle.result(60)
    print("LOCAL", flush=True)
    handle.wait_durable(600)   # the proxy holds the promotion; the test kills us here
    print("DURABLE", flush=True)
    """
)


def test_kill_9_during_promotion_leaves_nothing_half_visible(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path
) -> None:
    """The training process dies (SIGKILL) while step 2's payload is being promoted:
    the root keeps step 1 as its newest durable step and shows no step 2, the local
    tier still holds step 2, a restart loads it from disk alone, and gc finds the
    promotion's leftovers on the root."""
    local = str(tmp_path / "nvme")
    s3_proxy.add(
        Rule(operation="PutObject", key_contains=f"{step_name(2)}/__0_", action="hold", stall=120)
    )
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PROMOTING_CHILD,
            via.url("run"),
            local,
            repr(dict(via.storage_options)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        s3_proxy.wait_for("PutObject", faulted=True, timeout=120)  # the promotion, held
        child.kill()
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL, out + err
    assert "LOCAL" in out and "DURABLE" not in out, out + err
    s3_proxy.release()
    s3_proxy.wait_idle()
    assert os.path.exists(os.path.join(_step_dir(local, 2), MANIFEST_KEY))
    s3_proxy.clear()
    with _manager(via, local) as mgr:
        assert mgr.latest_step(durable=True) == 1 and mgr.all_steps() == [1]
        assert mgr.latest_step() == 2
        got = {"w": torch.zeros(1 << 18), "step": 0}
        assert mgr.load(got) == 2
        assert torch.equal(got["w"], torch.full((1 << 18,), 2.0)) and got["step"] == 2
        assert _gets(s3_proxy, 2) == []
        leftovers = mgr.gc(grace=0).deleted
    assert leftovers and all(step_name(2) in k for k in leftovers), leftovers


def test_local_retention_spares_a_step_until_its_promotion_ends(
    via: StoreTarget, s3_proxy: FaultProxy, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """keep_last=1, and step 1's promotion is held at the proxy while steps 2 and 3
    commit locally: step 1 stays on disk (its only copy) until it is durable. Step 2,
    which promote=False leaves local-only, is deleted with a log saying it was never
    durable."""
    local = str(tmp_path / "nvme")
    s3_proxy.add(Rule(key_contains=f"{step_name(1)}/__0_", action="hold", stall=50))
    with (
        _manager(via, local, retention=RetentionPolicy(keep_last=1)) as mgr,
        caplog.at_level(logging.INFO),
    ):
        try:
            first = mgr.save(1, _state(1))
            first.result(60)
            s3_proxy.wait_for("PutObject", faulted=True)  # step 1's payload, held
            mgr.save(2, _state(2), promote=False).result(60)
            third = mgr.save(3, _state(3))
            third.result(60)
            assert first.seconds_to_durable is None
            assert os.path.exists(os.path.join(_step_dir(local, 1), MANIFEST_KEY))
            assert not os.path.exists(_step_dir(local, 2))
            assert mgr.tier_status().promoting == (1, 3)  # 3 queued behind 1
        finally:
            s3_proxy.release()
        mgr.wait_until_finished()
        assert first.wait_durable(60) and third.wait_durable(60)
        assert mgr.all_steps() == [1, 3] and mgr.local_steps() == [3]
    assert not os.path.exists(_step_dir(local, 1))
    assert "deletes step 2, which was never durable" in caplog.text
    assert "deletes step 1, which was never durable" not in caplog.text


def test_a_restart_deletes_local_saves_that_never_committed(
    via: StoreTarget, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a save killed before its local commit left (payload, no manifest) can never
    load: the next manager deletes it from the local disk; committed steps stay."""
    local = str(tmp_path / "nvme")
    with _manager(via, local, promote_every=2) as mgr:
        mgr.save(1, _state(1))  # local only
        mgr.save(2, _state(2))  # durable
        mgr.wait_until_finished()
    stray = os.path.join(_step_dir(local, 3), "__0_0.0123456789abcdef.distcp")
    os.makedirs(os.path.dirname(stray))
    with open(stray, "wb") as f:
        f.write(b"x" * 100)
    with _manager(via, local, promote_every=2) as mgr, caplog.at_level(logging.INFO):
        assert mgr.local_steps() == [1, 2]
    assert sorted(os.listdir(local)) == [step_name(1), step_name(2)]
    assert "never committed" in caplog.text
