"""The worker pool: fresh interpreters that never import torch, and how they fail."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
import torch
import worker_tasks
from helpers import load

from objckpt import AsyncCheckpointer, Location, UploadOptions
from objckpt.pipeline.upload_task import worker_store
from objckpt.pipeline.workers import RemoteTraceback, WorkerPool
from objckpt.testing.plugin import StoreTarget

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _reaped(pid: int) -> bool:
    """Gone from the process table (exited and waited for: no zombie left)."""
    return not os.path.exists(f"/proc/{pid}")


def test_upload_workers_never_import_torch(s3_bucket: StoreTarget) -> None:
    state = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    state["bf16"] = torch.randn(5, 3).to(torch.bfloat16)
    url = s3_bucket.url("no-torch")
    with AsyncCheckpointer(storage_options=s3_bucket.storage_options) as ckpt:
        ckpt.save(state, url).result(timeout=120)
        pids = ckpt.worker_pids
        assert len(pids) == ckpt.options.workers
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtorch" not in maps, f"worker {pid} mapped torch"
        modules = ckpt.run_in_worker(worker_tasks.loaded_modules).result(timeout=60)
        assert "torch" not in modules
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    load(got, url, s3_bucket)
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_task_error_arrives_with_the_workers_traceback() -> None:
    pool = WorkerPool(1, name="test")
    try:
        with pytest.raises(ValueError, match="boom") as info:
            pool.submit(worker_tasks.fail, "boom").result(timeout=60)
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "worker_tasks.py" in str(cause) and "in fail" in str(cause)
    finally:
        pool.close()


def test_unpicklable_argument_fails_that_task_only() -> None:
    pool = WorkerPool(1, name="test")
    try:
        assert pool.submit(worker_tasks.echo, 1).result(timeout=60) == 1
        before = pool.pids()
        with pytest.raises((AttributeError, TypeError, ValueError)):
            pool.submit(worker_tasks.echo, lambda: 1).result(timeout=60)
        assert pool.submit(worker_tasks.echo, "still up").result(timeout=60) == "still up"
        assert pool.pids() == before  # no worker was lost over it
    finally:
        pool.close()


@pytest.mark.parametrize(("workers", "slots"), [(2, 1), (1, 2)])
def test_killed_worker_fails_running_and_queued_tasks_then_a_fresh_pool_runs(
    tmp_path: Path, workers: int, slots: int
) -> None:
    pool = WorkerPool(workers, slots=slots, name="test")
    release = tmp_path / "release"
    try:
        started = [tmp_path / f"started-{n}" for n in range(3)]
        running = [pool.submit(worker_tasks.hold, str(s), str(release)) for s in started[:2]]
        for s in started[:2]:
            _wait_for(s)  # both workers (or both slots of one) are busy now
        queued = pool.submit(worker_tasks.hold, str(started[2]), str(release))
        first = pool.pids()
        victim = int(started[0].read_text())
        os.kill(victim, signal.SIGKILL)
        for fut in [*running, queued]:
            with pytest.raises(BrokenProcessPool):
                fut.result(timeout=60)
        assert not started[2].exists()  # the queued task never ran
        assert pool.submit(worker_tasks.echo, 7).result(timeout=60) == 7
        assert set(pool.pids()).isdisjoint(first)
        for pid in first:  # the survivor was stopped; both were waited for
            deadline = time.monotonic() + 30
            while not _reaped(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _reaped(pid), f"worker {pid} left behind"
    finally:
        release.touch()
        pool.close()


def test_close_waits_for_queued_tasks_and_reaps_the_workers(tmp_path: Path) -> None:
    pool = WorkerPool(2, name="test")
    futures = [pool.submit(worker_tasks.echo, n) for n in range(6)]
    pool.wait_ready(timeout=60)
    pids = pool.pids()
    pool.close()
    assert [f.result(timeout=0) for f in futures] == list(range(6))
    assert all(_reaped(pid) for pid in pids)
    assert pool.pids() == []


def test_started_workers_serve_tasks_on_every_worker(tmp_path: Path) -> None:
    pool = WorkerPool(2, name="test")
    release = tmp_path / "release"
    try:
        pool.start()
        pool.wait_ready(timeout=60)
        assert len(pool.pids()) == 2
        started = [tmp_path / f"started-{n}" for n in range(2)]
        futures = [pool.submit(worker_tasks.hold, str(s), str(release)) for s in started]
        for s in started:
            _wait_for(s)  # two tasks at once: one per worker
        release.touch()
        ran_on = {f.result(timeout=60) for f in concurrent.futures.as_completed(futures)}
        assert ran_on == set(pool.pids())
    finally:
        release.touch()
        pool.close()


def test_one_worker_runs_a_task_per_slot_at_once(tmp_path: Path) -> None:
    pool = WorkerPool(1, slots=2, name="test")
    release = tmp_path / "release"
    try:
        started = [tmp_path / f"started-{n}" for n in range(3)]
        futures = [pool.submit(worker_tasks.hold, str(s), str(release)) for s in started]
        for s in started[:2]:
            _wait_for(s)  # two tasks running at once, in one process
        assert not started[2].exists()  # the third waits for a free slot
        assert len(pool.pids()) == 1
        release.touch()
        assert {f.result(timeout=60) for f in futures} == set(pool.pids())
        assert started[2].exists()
    finally:
        release.touch()
        pool.close()


def test_close_lets_a_busy_slot_finish_after_the_idle_one_said_goodbye(
    tmp_path: Path,
) -> None:
    pool = WorkerPool(1, slots=2, name="slots")
    release = tmp_path / "release"
    try:
        started = tmp_path / "started"
        busy = pool.submit(worker_tasks.hold, str(started), str(release))
        _wait_for(started)
        closer = threading.Thread(target=pool.close)
        closer.start()
        # The idle slot's thread ends once it has sent its worker the goodbye.
        deadline = time.monotonic() + 60
        while sum(t.name.startswith("objckpt-slots-") for t in threading.enumerate()) > 1:
            assert time.monotonic() < deadline, "the idle slot never said goodbye"
            time.sleep(0.01)
        release.touch()
        closer.join(timeout=60)
        assert not closer.is_alive()
        assert busy.result(timeout=0) == int(started.read_text())  # not a broken pool
    finally:
        release.touch()
        pool.close()


def test_a_worker_keeps_one_store_per_location_over_one_filesystem(
    s3_bucket: StoreTarget,
) -> None:
    # A worker's upload threads may write to two checkpoints at once (saves in
    # flight, a promotion's source and destination): each needs its own location.
    opts = UploadOptions()
    here = Location.parse(s3_bucket.url("a"), s3_bucket.storage_options)
    there = Location.parse(s3_bucket.url("b"), s3_bucket.storage_options)
    first, second = worker_store(here, opts), worker_store(there, opts)
    assert (first.location.url, second.location.url) == (here.url, there.url)
    assert first._fs is second._fs  # one client, one connection pool
    assert worker_store(here, opts) is first
    other = worker_store(here, UploadOptions(max_parts_in_flight=3))
    assert other._fs is not first._fs  # other options: a filesystem of their own


def test_promotion_workers_never_import_torch(s3_bucket: StoreTarget, tmp_path: Path) -> None:
    """A promotion worker unpickles ``promote_object`` and so imports its module:
    that module must not import torch (before, it lived beside the rank exchange,
    and every rank's promotion worker loaded torch: seconds of CPU and ~190 MiB)."""
    from objckpt.format.manifest import ObjectEntry
    from objckpt.ops.maintain.object_check import promote_object
    from objckpt.ops.tier import promote
    from objckpt.writers.checksum import crc32c_of, format_crc

    assert promote.promote_object is promote_object  # what the Promoter submits

    data = os.urandom(4096)
    src = Location.parse(f"file://{tmp_path}/local/step-0000000001")
    worker_store(src, UploadOptions()).put("0.distcp", data)
    dst = Location.parse(s3_bucket.url("promoted"), s3_bucket.storage_options)
    entry = ObjectEntry("0.distcp", len(data), format_crc(crc32c_of(data)))
    pool = WorkerPool(1, name="promotion")
    try:
        stats = pool.submit(promote_object, src, dst, UploadOptions(), entry).result(timeout=60)
        assert stats.bytes_sent == len(data), stats
        modules = pool.submit(worker_tasks.loaded_modules).result(timeout=60)
        assert "torch" not in modules, [m for m in modules if m.startswith("torch")][:5]
    finally:
        pool.close()
    assert worker_store(dst, UploadOptions()).read("0.distcp") == data
