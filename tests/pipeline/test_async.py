"""Async saves: staging semantics, workers, handles, errors, dcp.async_save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, empty_like_state, sample_state
from helpers import carried, load, quiet

from objckpt import (
    AsyncCheckpointer,
    AsyncOptions,
    ObjectStoreReader,
    ObjectStoreWriter,
    UploadOptions,
    async_save,
)
from objckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    UploadError,
)
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget

MiB = 1024 * 1024


def _snapshot(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_snapshot(v) for v in state]
    return state


def _mutate(state) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.bitwise_not_() if v.dtype == torch.bool else v.add_(1)
        elif isinstance(v, dict):
            _mutate(v)


def test_checkpoint_holds_values_at_call_time(target: StoreTarget) -> None:
    state = sample_state(big=2 * MiB)
    with AsyncCheckpointer(storage_options=target.storage_options) as ckpt:
        for step in range(3):
            expected = _snapshot(state)
            handle = ckpt.save(state, target.url(f"step-{step}"))
            _mutate(state)  # the training loop moves on immediately
            state["step"] = -1
            manifest = handle.result(timeout=120)
            assert handle.done() and manifest is not None and manifest.world_size == 1
            got = empty_like_state(expected)
            load(got, target.url(f"step-{step}"), target)
            assert_state_equal(got, expected)
            state["step"] = expected["step"]
        # One staging segment serves every save of an unchanged structure.
        assert len(ckpt._stager._all) == 1


def test_async_save_function_and_on_commit(target: StoreTarget) -> None:
    committed = []
    state = {"w": torch.randn(100, 100)}
    handle = async_save(
        state,
        target.url("c"),
        storage_options=target.storage_options,
        on_commit=lambda url, m: committed.append((url, m.attempt)),
    )
    manifest = handle.result(timeout=120)
    assert manifest is not None and committed == [(handle.url, manifest.attempt)]
    got = {"w": torch.zeros(100, 100)}
    load(got, target.url("c"), target)
    assert torch.equal(got["w"], state["w"])


def test_errors_before_upload_are_raised_by_save(target: StoreTarget) -> None:
    with AsyncCheckpointer(storage_options=target.storage_options) as ckpt:
        ckpt.save({"w": torch.ones(3)}, target.url("c")).result(timeout=120)
        with pytest.raises(BaseException) as info:  # known committed: refused at once
            ckpt.save({"w": torch.ones(3)}, target.url("c"), exists=True)
        assert isinstance(carried(info.value), CheckpointExistsError)
        with pytest.raises(ConfigurationError, match="memory:// is private"):
            ckpt.save({"w": torch.ones(3)}, "memory://b/c")
        ckpt.check_for_errors()  # nothing failed in the background
        # Not known: asked in the background (test_stall_network.py); the handle fails.
        with pytest.raises(CheckpointExistsError, match="already holds a committed"):
            ckpt.save({"w": torch.ones(3)}, target.url("c")).result(timeout=120)


def test_options_are_validated() -> None:
    with pytest.raises(ConfigurationError, match="option workers="):
        AsyncOptions(workers=0)
    with pytest.raises(ConfigurationError, match="option max_saves_in_flight="):
        AsyncOptions(max_saves_in_flight=0)
    for bad in (0, -5, 1.5, True, "1GiB"):
        with pytest.raises(ConfigurationError, match="option staging_budget="):
            AsyncOptions(staging_budget=bad)  # type: ignore[arg-type]


def _wave_state() -> dict:
    g = torch.Generator().manual_seed(3)
    state = {f"big{i}": torch.randn(MiB // 4, generator=g) for i in range(6)}  # 6 x 1 MiB
    state["small"] = {f"p{i}": torch.randn(1000, generator=g) for i in range(50)}
    state["step"] = 5
    return state


def test_staging_budget_stages_in_waves(target: StoreTarget, caplog) -> None:
    state = _wave_state()
    budget = 2 * MiB + 4096
    opts = AsyncOptions(staging_budget=budget)
    with AsyncCheckpointer(storage_options=target.storage_options, async_options=opts) as ckpt:
        for step in range(2):  # the second save replays the plan, still in waves
            expected = _snapshot(state)
            with caplog.at_level("DEBUG", logger="objckpt.pipeline.deferred"):
                handle = ckpt.save(state, target.url(f"w{step}"))
            _mutate(state)  # every wave was copied before save returned
            handle.result(timeout=120)
            got = empty_like_state(expected)
            load(got, target.url(f"w{step}"), target)
            assert_state_equal(got, expected)
            state["step"] = 5
        waits = [r for r in caplog.records if "staging wave full" in r.getMessage()]
        assert len(waits) >= 4  # > 6 MiB through a 2 MiB segment: at least 3 waves a save
        sizes = [b.segment.size for b in ckpt._stager._all]
        assert sizes == [budget]  # one bounded segment, reused by both saves
        assert ckpt.plan_cache_stats.hits == 1


def test_a_wave_holds_a_packed_object_of_tensors_whose_views_are_padded(tmp_path) -> None:
    """Objects are packed up to ``object_size`` of their tensors' bytes, and in waves
    up to a wave's capacity; a wave aligns each view (to 64 bytes), so tensors of
    4,100 bytes take 4,160 in it. Packed by their bytes alone, 255 of them made an
    object that no empty wave could hold, and the save failed with an internal
    error; packed as the wave counts them, 252 make one."""
    g = torch.Generator().manual_seed(5)
    state = {f"p{i}": torch.randn(1025, generator=g) for i in range(300)}  # 4,100 bytes each
    url = f"file://{tmp_path}/c"
    with AsyncCheckpointer(async_options=AsyncOptions(staging_budget=MiB)) as ckpt:
        assert ckpt.save(state, url).result(timeout=120) is not None
    got = empty_like_state(state)
    load(got, url, StoreTarget(root=url, storage_options={}))
    assert_state_equal(got, state)


def test_staging_budget_below_the_largest_tensor_grows_to_fit(tmp_path, caplog) -> None:
    state = {"huge": torch.randn(MiB), "small": torch.ones(10)}  # 4 MiB tensor
    opts = AsyncOptions(staging_budget=MiB)
    url = f"file://{tmp_path}/c"
    with AsyncCheckpointer(async_options=opts) as ckpt:
        ckpt.save(state, url).result(timeout=120)
        assert [b.segment.size for b in ckpt._stager._all] == [4 * MiB]
    assert "below the largest tensor" in caplog.text
    got = {"huge": torch.zeros(MiB), "small": torch.zeros(10)}
    load(got, url, StoreTarget(root=url, storage_options={}))
    assert torch.equal(got["huge"], state["huge"]) and torch.equal(got["small"], state["small"])


@pytest.mark.timeout(180)
def test_killed_worker_fails_the_save_and_the_next_save_works(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    state = {"w": torch.randn(48 * MiB)}  # 192 MiB: uploads take seconds against moto
    with AsyncCheckpointer(
        storage_options=s3_bucket.storage_options, async_options=AsyncOptions(workers=2)
    ) as ckpt:
        ckpt.save({"warm": torch.ones(1)}, s3_bucket.url("warm")).result(timeout=60)
        handle = ckpt.save(state, s3_bucket.url("killed"))
        for pid in ckpt.worker_pids:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(UploadError, match="upload worker died"):
            handle.result(timeout=60)
        with pytest.raises(UploadError):
            ckpt.check_for_errors()  # reported once here too...
        ckpt.check_for_errors()  # ...and only once
        with pytest.raises(CheckpointNotFoundError):  # nothing visible; maybe not even payload
            ObjectStoreReader(s3_bucket.url("killed"), storage_options=s3_bucket.storage_options)
        # The pool is rebuilt: the next save commits.
        small = {"w": torch.randn(1000)}
        ckpt.save(small, s3_bucket.url("after")).result(timeout=60)
    got = {"w": torch.zeros(1000)}
    load(got, s3_bucket.url("after"), s3_bucket)
    assert torch.equal(got["w"], small["w"])


def test_max_saves_in_flight_bounds_concurrent_saves(tmp_path) -> None:
    target = StoreTarget(root=f"file://{tmp_path}", storage_options={})
    with AsyncCheckpointer(async_options=AsyncOptions(max_saves_in_flight=1)) as ckpt:
        handles = [
            ckpt.save({"w": torch.full((MiB,), float(i))}, target.url(f"s{i}")) for i in range(3)
        ]
        # Each save waited for the previous one before staging.
        assert all(h.done() for h in handles[:-1])
        ckpt.wait_until_finished()
    for i in range(3):
        got = {"w": torch.zeros(MiB)}
        load(got, target.url(f"s{i}"), target)
        assert float(got["w"][0]) == float(i)


def test_saves_one_after_another_reuse_their_commit_thread(tmp_path) -> None:
    """A thread started per save made each save's caller wait for it to run (a GIL
    switch interval); the commit threads are started once and reused."""
    target = StoreTarget(root=f"file://{tmp_path}", storage_options={})
    with AsyncCheckpointer() as ckpt:
        for i in range(5):
            ckpt.save({"w": torch.full((1024,), float(i))}, target.url(f"s{i}")).result(120)
        # A save handed over while the previous commit thread is returning may start a
        # second thread, never a third.
        assert ckpt._finalizers.threads <= 2
    threads = [t for t in threading.enumerate() if t.name.startswith("objckpt-commit-")]
    for t in threads:  # close() lets them end
        t.join(30)
        assert not t.is_alive()
    got = {"w": torch.zeros(1024)}
    load(got, target.url("s4"), target)
    assert float(got["w"][0]) == 4.0


_CLOSE_SCRIPT = """
import gc, json, os, sys, threading
import torch
from objckpt import AsyncCheckpointer, AsyncOptions

def held():
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, already closed
            pass
    return {"fds": fds, "threads": sorted(t.name for t in threading.enumerate())}

options, url = json.loads(sys.argv[1]), sys.argv[2]
gc.disable()  # what only a reference cycle still holds counts as left behind
before = held()
with AsyncCheckpointer(storage_options=options, async_options=AsyncOptions(workers=1)) as c:
    c.save({"w": torch.ones(4096), "b": torch.arange(8)}, url).result(120)
print(json.dumps({"before": before, "after": held(), "threads": threading.active_count()}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("store", ["file", "s3", "gs"])
def test_close_leaves_the_descriptors_and_threads_it_found(
    store: str, request: pytest.FixtureRequest, tmp_path
) -> None:
    """A fresh process (so no other test's threads come and go): after a save and
    close(), exactly the descriptors and threads there were before the checkpointer
    was built. No warm-up: objckpt's imports open nothing that lasts; what did (the
    process-wide fsspec loop thread, its epoll descriptor and self-pipe, its DNS
    thread, a kept-alive connection, the staging file held by a reference cycle) is
    closed or gone now. S3 goes through the proxy, which keeps connections alive as
    a real store does (moto's server closes each one itself)."""
    if store == "file":
        url, options = f"file://{tmp_path}/root/closed", {}
    elif store == "s3":
        url = request.getfixturevalue("s3_bucket").url("closed")
        options = request.getfixturevalue("s3_proxy").storage_options()
    else:
        target = request.getfixturevalue("gcs_bucket")
        url, options = target.url("closed"), target.storage_options
    script = tmp_path / "close.py"
    script.write_text(_CLOSE_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(options), url],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = seen["before"], seen["after"]
    assert after["threads"] == before["threads"], after["threads"]
    assert seen["threads"] == len(before["threads"])
    left = {fd: to for fd, to in after["fds"].items() if before["fds"].get(fd) != to}
    assert after["fds"] == before["fds"], f"left open: {left}"


def test_torch_async_save_with_objckpt_writer(target: StoreTarget) -> None:
    state = {"w": torch.randn(200, 200), "step": 9}
    writer = ObjectStoreWriter(target.url("dcp-async"), storage_options=target.storage_options)
    with quiet():
        future = dcp.async_save(state, storage_writer=writer)
        deadline = time.monotonic() + 120
        future.result(timeout=max(1.0, deadline - time.monotonic()))
    got = {"w": torch.zeros(200, 200), "step": 0}
    load(got, target.url("dcp-async"), target)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 9


def test_workers_start_when_the_checkpointer_is_built_not_in_the_first_save() -> None:
    with AsyncCheckpointer(async_options=AsyncOptions(workers=2)) as ckpt:
        ckpt._pool.wait_ready(timeout=120)  # no save has been asked for
        assert len(ckpt.worker_pids) == 2


def test_two_threads_saving_at_once_both_commit_their_own_values(target: StoreTarget) -> None:
    import threading

    states = [sample_state(seed=s) for s in (1, 2)]
    start = threading.Barrier(2)
    handles: dict[int, object] = {}
    opts = AsyncOptions(max_saves_in_flight=2)
    with AsyncCheckpointer(storage_options=target.storage_options, async_options=opts) as ckpt:

        def run(n: int) -> None:
            start.wait()
            handles[n] = ckpt.save(states[n], target.url(f"thread{n}"))

        threads = [threading.Thread(target=run, args=(n,)) for n in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for n in (0, 1):
            handles[n].result(timeout=120)  # type: ignore[attr-defined]
        stats = ckpt.plan_cache_stats
        assert stats.hits + stats.misses == 2
    for n in (0, 1):
        got = empty_like_state(states[n])
        load(got, target.url(f"thread{n}"), target)
        assert_state_equal(got, states[n])


def test_a_save_that_waited_for_the_previous_one_says_how_long(
    s3_bucket: StoreTarget, s3_proxy
) -> None:
    from objckpt.testing import Rule

    s3_proxy.add(Rule("PutObject", key_contains=".distcp", nth=1, action="stall", stall=2.0))
    opts = AsyncOptions(max_saves_in_flight=1)
    with AsyncCheckpointer(storage_options=s3_proxy.storage_options(), async_options=opts) as ckpt:
        first = ckpt.save({"w": torch.ones(8)}, s3_bucket.url("first"))
        second = ckpt.save({"w": torch.ones(8)}, s3_bucket.url("second"))
        assert first.waited_for_earlier < 0.05  # nothing was in flight
        assert second.waited_for_earlier > 0.5  # the first save's upload was stalled 2 s
        second.result(timeout=120)


@pytest.mark.timeout(180)
def test_upload_workers_share_the_ranks_request_budget(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """UploadOptions.max_parts_in_flight bounds a rank's parts in flight (and so its part
    buffers) across all its workers: 2 workers with max_parts_in_flight=2 have at most two
    UploadParts open at the server, not two each."""
    upload = UploadOptions(part_size=5 * MiB, object_size=8 * MiB, max_parts_in_flight=2)
    # Four 20 MiB tensors: four objects of four parts (the frame's few KiB ride with
    # the last), two workers busy at once.
    state = {f"t{i}": torch.randn(5 * MiB) for i in range(4)}
    s3_proxy.add(Rule(operation="UploadPart", action="stall", stall=0.3))
    with AsyncCheckpointer(
        storage_options=s3_proxy.storage_options(),
        upload=upload,
        async_options=AsyncOptions(workers=2),
    ) as ckpt:
        ckpt.save(state, s3_bucket.url("budget")).result(timeout=120)
    # Four objects of four parts went up (a part retried on a loaded machine is
    # seen twice: a floor, not an exact count). The proxy counts a request answered
    # before its answer goes out, so the client's next part never overlaps it.
    assert s3_proxy.count("UploadPart") >= 16
    assert s3_proxy.peak_open("UploadPart") <= 2
