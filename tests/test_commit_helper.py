"""Rank 0's commit helper process (pipeline/coordinator.py, pipeline/stock_task.py):
its failures, each a real process or a real store, and what the training side makes
of them."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import StorageMeta

from objckpt.errors import UploadError
from objckpt.format.manifest import ObjectEntry
from objckpt.options import UploadOptions
from objckpt.pipeline import stock_task
from objckpt.pipeline.coordinator import CommitHelper
from objckpt.writers.checksum import Crc32c
from objckpt.writers.location import Location

ATTEMPT = "0123456789abcdef"


@pytest.fixture
def helper() -> Iterator[CommitHelper]:
    made = CommitHelper()
    yield made
    made.close(timeout=30)


def _entry(key: str, data: bytes) -> ObjectEntry:
    crc = Crc32c()
    crc.update(data)
    return ObjectEntry(key, len(data), crc.hexdigest())


def _prepare(tmp_path: Path, indexes: list[tuple[int, ObjectEntry]]) -> None:
    """The helper's step 1 on a file:// store; it reads the index objects first, so
    an empty layout is enough for what these tests check."""
    layout = stock_task.StockLayout({}, {}, None, StorageMeta())
    location = Location.parse(f"file://{tmp_path}")
    stock_task.prepare_stock(location, UploadOptions(), None, ATTEMPT, layout, indexes, False)


def test_an_index_that_differs_from_its_rank_s_report_fails_the_commit(tmp_path: Path) -> None:
    """A stored index object whose bytes are not what its rank reported (size or
    CRC32C) is refused, naming the object and both sizes and CRCs."""
    (tmp_path / "__index_1.x.json").write_bytes(b'{"changed":1}')
    reported = _entry("__index_1.x.json", b'{"original":1}')
    with pytest.raises(UploadError, match=r"__index_1\.x\.json holds 13 bytes .*not the 14 bytes"):
        _prepare(tmp_path, [(1, reported)])
    same_size = _entry("__index_1.x.json", b'{"changed":2}')
    with pytest.raises(UploadError, match=rf"CRC32C {same_size.crc32c}\) its rank wrote"):
        _prepare(tmp_path, [(1, same_size)])


def test_a_missing_index_fails_the_commit_naming_it(tmp_path: Path) -> None:
    (tmp_path / "__index_0.x.json").write_bytes(b"{}")
    indexes = [(0, _entry("__index_0.x.json", b"{}")), (1, _entry("__index_1.x.json", b"{}"))]
    with pytest.raises(UploadError, match=r"__index_1\.x\.json is gone before the commit"):
        _prepare(tmp_path, indexes)


def test_a_commit_helper_that_dies_fails_the_save_with_an_objckpt_error(
    helper: CommitHelper,
) -> None:
    """The helper is a real process; killed (as the OOM killer does) while it holds a
    task, the save gets :class:`UploadError` naming what it was doing, not the pool's
    own exception; the next task gets a fresh helper."""
    pid = helper._submit(os.getpid).result(timeout=120)
    doomed = helper._submit(os.kill, pid, signal.SIGKILL)
    with pytest.raises(UploadError, match=r"preparing s3://b/x: the commit helper process died"):
        helper.bounded(doomed, None, None, "preparing s3://b/x")
    assert helper._submit(os.getpid).result(timeout=120) != pid


def test_a_wedged_commit_helper_is_stopped_at_its_bound(helper: CommitHelper) -> None:
    """A helper that never answers (SIGSTOP, as a process stuck in native code) fails
    the wait at its bound with an error naming what it was doing; it is killed (a
    stopped process cannot be asked to exit) and the next task gets a fresh one."""
    pid = helper._submit(os.getpid).result(timeout=120)
    os.kill(pid, signal.SIGSTOP)
    try:
        stuck = helper._submit(os.getpid)
        with pytest.raises(
            UploadError, match=r"preparing s3://b/x: the commit helper process had no answer"
        ):
            helper.bounded(stuck, time.monotonic() + 1.0, None, "preparing s3://b/x", ATTEMPT)
        # Stopped by the pool: the task it held failed, the next gets a fresh process.
        assert isinstance(stuck.exception(timeout=60), BrokenProcessPool)
        assert helper._submit(os.getpid).result(timeout=120) != pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_closed_helper_starts_no_process(helper: CommitHelper) -> None:
    """A save still running when the checkpointer closed cannot start a helper that
    nobody would stop: it fails instead."""
    helper.close()
    with pytest.raises(UploadError, match="the commit helper is closed"):
        helper.start()
    assert helper.pids() == []


def test_a_metadata_the_helper_did_not_write_is_logged_by_the_training_process(
    helper: CommitHelper, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The helper has no logging of its own: when it writes no ``.metadata`` (here it
    holds none for the attempt, as after a restart), the training process logs it,
    naming the checkpoint."""
    location = Location.parse(f"file://{tmp_path}")
    with caplog.at_level(logging.ERROR, logger="objckpt.pipeline.coordinator"):
        written = helper.publish(location, UploadOptions(), ATTEMPT, frozenset())
    assert written is False
    assert not (tmp_path / ".metadata").exists()
    assert f"{location.url} committed, but its commit helper did not write .metadata" in (
        caplog.text
    )
