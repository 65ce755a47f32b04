"""Bounded waits (#24 item 6, #25 item 8): a wedged upload worker fails its save by
the deadline on every rank and is replaced; close() returns with a worker or a
commit thread stuck; a failing barrier callback is logged with its request; a
save still in flight at interpreter exit is named, and waited for a bounded time.

A wedged worker is a real one stopped with SIGSTOP: it never answers, as a worker
stuck in native code or on a dead NFS mount would not.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import bounded_ranks
import pytest
import torch
from bounded_ranks import BOUND, DEADLINE, end, stop_workers
from helpers import load
from ranks import run_ranks

from objckpt import AsyncCallsQueue, AsyncCheckpointer, AsyncRequest, ObjectStoreReader
from objckpt.errors import (
    BarrierTimeoutError,
    CheckpointNotFoundError,
    RequestFailedError,
    SaveDeadlineError,
)
from objckpt.options import UploadOptions
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))}


@pytest.mark.timeout(240)
def test_a_wedged_worker_fails_the_save_by_its_deadline_and_is_replaced(tmp_path: Path) -> None:
    target = StoreTarget(root=f"file://{tmp_path}/root", storage_options={})
    with AsyncCheckpointer(upload=UploadOptions(deadline=DEADLINE)) as ckpt:
        ckpt.save(_state(), target.url("warm")).result(timeout=120)
        stopped = stop_workers(ckpt)
        try:
            handle = ckpt.save(_state(1), target.url("wedged"))
            with pytest.raises(SaveDeadlineError) as info:
                handle.result(timeout=BOUND)  # before the fix: never ends (TimeoutError)
        finally:
            end(stopped)
        message = str(info.value)
        assert "rank 0 saving" in message and target.url("wedged") in message
        assert "__0_" in message  # the object still outstanding
        assert f"deadline of {DEADLINE:g} s" in message
        after = _state(2)
        assert ckpt.save(after, target.url("after")).result(timeout=120) is not None
        assert {p.pid for p in stopped}.isdisjoint(ckpt.worker_pids)  # fresh workers
        assert all(p.returncode is not None for p in stopped)  # killed and reaped
    with pytest.raises(CheckpointNotFoundError):
        ObjectStoreReader(target.url("wedged"))
    got = {"w": torch.zeros(256, 256)}
    load(got, target.url("after"), target)
    assert torch.equal(got["w"], after["w"])


@pytest.mark.timeout(240)
def test_a_wedged_worker_cannot_hold_a_save_in_staging_waves(tmp_path: Path) -> None:
    """In waves, save() itself waits for a full wave's uploads before reusing its
    memory: that wait is bounded by the deadline too, and the workers are replaced."""
    from objckpt.options import AsyncOptions

    target = StoreTarget(root=f"file://{tmp_path}/root", storage_options={})
    MiB = 1024 * 1024
    state = {f"t{i}": torch.full((MiB // 4,), float(i)) for i in range(4)}  # 4 x 1 MiB
    opts = AsyncOptions(staging_budget=MiB + 4096)  # one tensor per wave
    with AsyncCheckpointer(
        upload=UploadOptions(deadline=DEADLINE, object_size=MiB), async_options=opts
    ) as ckpt:
        ckpt.save(state, target.url("warm")).result(timeout=120)
        stopped = stop_workers(ckpt)
        outcome: list[BaseException | None] = []

        def save() -> None:
            try:
                ckpt.save(state, target.url("wedged")).result(timeout=BOUND)
                outcome.append(None)
            except BaseException as exc:  # the outcome under test
                outcome.append(exc)

        saver = threading.Thread(target=save)
        try:
            saver.start()
            saver.join(timeout=BOUND)  # before the fix: save() waits for ever
            assert not saver.is_alive(), "save() did not return with a wedged worker"
        finally:
            end(stopped)
        from objckpt.dcp.torch_errors import unwrap

        err = unwrap(outcome[0]) if outcome[0] is not None else None
        assert isinstance(err, SaveDeadlineError), outcome
        assert "staging wave" in str(err) and f"deadline of {DEADLINE:g} s" in str(err)
        assert ckpt.save(state, target.url("after")).result(timeout=120) is not None
        assert {p.pid for p in stopped}.isdisjoint(ckpt.worker_pids)  # fresh workers


@pytest.mark.timeout(300)
def test_a_wedged_worker_on_rank_1_fails_the_save_on_both_ranks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    root = f"file://{tmp_path}/root"
    args = ("wedged_worker_on_rank_1", 2, str(tmp_path / "init"), root, str(out))
    run_ranks(bounded_ranks, *args)
    report = {
        (what, r): json.loads((out / f"{what}.rank{r}.json").read_text())
        for what in ("wedged", "after")
        for r in (0, 1)
    }
    # Rank 1 fails with its own deadline error (before the fix: TimeoutError, hung).
    assert report["wedged", 1]["type"] == "SaveDeadlineError", report["wedged", 1]
    assert "rank 1 saving" in report["wedged", 1]["error"]
    # Rank 0 fails through the commit exchange, naming rank 1 and its cause.
    assert report["wedged", 0]["outcome"] == "error"
    assert "rank 1" in report["wedged", 0]["error"], report["wedged", 0]
    assert "deadline" in report["wedged", 0]["error"], report["wedged", 0]
    assert report["after", 0]["outcome"] == report["after", 1]["outcome"] == "ok", report


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill_delay", [0.0, 5.0])
def test_close_returns_with_a_wedged_worker_and_its_save_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_delay: float
) -> None:
    """close() returns in bounded time with a wedged worker (before: never), and the
    save is failed by its own deadline error by then.

    The commit thread gives a wedged worker until the deadline plus WEDGED_AFTER,
    then kills it and fails the save; close() used to give up on the save at that
    same instant, so on a loaded host it returned with the save still pending (and
    killed the workers itself: the save then failed as "an upload worker died").
    With ``kill_delay`` the commit thread acts 5 s late, as on a loaded host: close()
    must wait for it (ACT_WITHIN)."""
    from objckpt.pipeline.workers import WorkerPool

    kill = WorkerPool.terminate

    def late_kill(self: WorkerPool, futures: Any, reason: str) -> list[int]:
        threading.Event().wait(kill_delay)  # injected slowness, not a synchronisation
        return kill(self, futures, reason)

    monkeypatch.setattr(WorkerPool, "terminate", late_kill)
    url = f"file://{tmp_path}/c"
    ckpt = AsyncCheckpointer(upload=UploadOptions(deadline=DEADLINE))
    ckpt.save(_state(), f"{url}-warm").result(timeout=120)
    stopped = stop_workers(ckpt)
    try:
        handle = ckpt.save(_state(1), url)
        closer = threading.Thread(target=ckpt.close)
        closer.start()
        closer.join(timeout=BOUND)  # before the fix: close waits for ever
        assert not closer.is_alive(), "close() did not return with a wedged worker"
        assert handle.done(), "close() returned before the save it waited for settled"
        assert isinstance(handle.exception(timeout=0), SaveDeadlineError), handle.exception(0)
        assert all(p.returncode is not None for p in stopped)  # killed and reaped
    finally:
        end(stopped)
        ckpt.close()


@pytest.mark.timeout(240)
def test_close_abandons_a_save_whose_commit_thread_is_stuck(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hooked, release = threading.Event(), threading.Event()

    def hook(url: str, manifest: Any) -> None:  # a hook that never returns
        hooked.set()
        release.wait()

    url = f"file://{tmp_path}/c"
    ckpt = AsyncCheckpointer(upload=UploadOptions(deadline=DEADLINE), on_commit=hook)
    try:
        handle = ckpt.save(_state(), url)
        assert hooked.wait(timeout=120)
        closer = threading.Thread(target=ckpt.close)
        closer.start()
        closer.join(timeout=BOUND)  # before the fix: close waits for ever
        assert not closer.is_alive(), "close() did not return with a stuck commit thread"
        assert not handle.done()
        assert f"abandons 1 save(s) still running past their deadline's bound: {url}" in (
            caplog.text
        )
    finally:
        release.set()
        ckpt.close()


class _MemoryBarrier:
    """A one-rank RankBarrier whose report can fail, as a c10d store that went away."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.arrived: dict[str, bool] = {}
        self.changed = threading.Condition()

    def arrive(self, key: str, ok: bool) -> None:
        if self.fail:
            raise ConnectionError("c10d store unreachable (injected)")
        with self.changed:
            self.arrived[key] = ok
            self.changed.notify_all()

    def all_arrived(self, key: str, timeout: float | None) -> bool:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.arrived, timeout or 0.0):
                if timeout:
                    raise BarrierTimeoutError(f"async request {key}: no report within {timeout}")
                return False
        if not self.arrived[key]:
            raise RequestFailedError(f"async request {key} failed")
        return True


def test_a_failing_barrier_report_is_logged_with_its_request_and_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[int] = []
    queue = AsyncCallsQueue(barrier=_MemoryBarrier(fail=True), finalize_timeout=5.0)
    queue.schedule_async_request(AsyncRequest(lambda: None, (), [lambda: ran.append(0)]))
    # Before the fix: the callback's error went to concurrent.futures' log without
    # the request, and finalize waited for the barrier's timeout.
    with (
        caplog.at_level(logging.ERROR, logger="objckpt.pipeline.queue"),
        pytest.raises(RequestFailedError, match="async request 0: this rank could not"),
    ):
        queue.maybe_finalize_async_calls(blocking=True)
    assert "async request 0: reporting its end to the other ranks failed" in caplog.text
    assert "c10d store unreachable (injected)" in caplog.text
    assert ran == []  # never finalized as a success


def test_a_raising_finalize_function_is_logged_with_its_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def boom() -> None:
        raise RuntimeError("finalize (injected)")

    queue = AsyncCallsQueue(barrier=_MemoryBarrier(fail=False))
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: None]))
    queue.schedule_async_request(AsyncRequest(None, (), [boom, lambda: None]))
    with (
        caplog.at_level(logging.ERROR, logger="objckpt.pipeline.queue"),
        pytest.raises(RuntimeError, match="finalize \\(injected\\)"),
    ):
        queue.maybe_finalize_async_calls(blocking=True)
    assert "async request 1: finalize function 1 of 2" in caplog.text
    assert "finalize (injected)" in caplog.text
    queue.close()


_EXIT_SCRIPT = """
import json, sys
import torch
from objckpt import AsyncCheckpointer, AsyncOptions
options, url, exit_timeout = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
opts = AsyncOptions(exit_timeout=exit_timeout)
ckpt = AsyncCheckpointer(storage_options=options, async_options=opts)
ckpt.save({"w": torch.ones(1024)}, url)
print("staged", flush=True)
"""  # ends with the save in flight: no result(), no wait_until_finished(), no with


def _exiting(
    tmp_path: Path, proxy: FaultProxy, url: str, exit_timeout: float
) -> subprocess.Popen[str]:
    script = tmp_path / "exits.py"
    script.write_text(_EXIT_SCRIPT)
    options = json.dumps(proxy.storage_options())
    return subprocess.Popen(
        [sys.executable, str(script), options, url, str(exit_timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(180)
def test_a_save_in_flight_at_exit_is_named_and_dropped_with_exit_timeout_0(
    tmp_path: Path, s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """The warning is one line on stderr: said once (not by the log and again by
    ``warnings``), with no source line after it that reads like a traceback."""
    s3_proxy.add(Rule(operation="PutObject", key_contains=".distcp", action="hold", stall=120))
    url = s3_bucket.url("step-0000000007")
    try:
        proc = _exiting(tmp_path, s3_proxy, url, 0.0)
        _, stderr = proc.communicate(timeout=150)
    finally:
        s3_proxy.release()
    assert proc.returncode == 0, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    (line,) = lines
    assert line.startswith("objckpt: the interpreter is exiting with 1 async save(s)"), line
    assert f"in flight: {url}" in line, line
    assert "dropped, not committed (AsyncOptions.exit_timeout=0)" in line
    assert "handle.result(), wait_until_finished()" in line
    with pytest.raises(CheckpointNotFoundError):
        ObjectStoreReader(url, storage_options=s3_bucket.storage_options)


@pytest.mark.timeout(180)
def test_a_save_in_flight_at_exit_is_waited_for_and_commits(
    tmp_path: Path, s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    s3_proxy.add(Rule(operation="PutObject", key_contains=".distcp", action="hold", stall=120))
    url = s3_bucket.url("step-0000000008")
    try:
        proc = _exiting(tmp_path, s3_proxy, url, 120.0)
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the warning comes while the upload is still held
            seen.append(line)
            if "waiting up to 120 s" in line:
                assert url in line
                break
        else:
            pytest.fail(f"no warning at exit: {''.join(seen)}")
    finally:
        s3_proxy.release()  # the upload goes on: the exit wait sees it commit
    _, rest = proc.communicate(timeout=150)
    assert proc.returncode == 0, rest
    assert "dropped at exit" not in rest
    got = {"w": torch.zeros(1024)}
    load(got, url, s3_bucket)
    assert torch.equal(got["w"], torch.ones(1024))
