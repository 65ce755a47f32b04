"""Staging in a directory without room: waves, or a clean error on every rank, never SIGBUS.

Containers give ``/dev/shm`` 64 MiB. A staging segment that is a sparse file takes
its pages during the copy, and a page that tmpfs cannot give is a SIGBUS that kills
the training process. Segments now reserve their bytes first: the state dict is
staged whole where it fits, in waves where one does, and otherwise the save fails
with ``StagingSpaceError`` naming the bytes needed, the bytes free and the directory.

A real small tmpfs where the machine lets the test mount one (root); everywhere, a
directory whose room is simulated (``simulated_room``: ``statvfs`` and
``posix_fallocate`` answer as a filesystem of that size would).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import simulated_room as room_ranks
import torch
import torch.distributed.checkpoint as dcp
from ranks import run_ranks
from simulated_room import simulated_room

import objckpt
from objckpt.errors import ConfigurationError, StagingSpaceError
from objckpt.pipeline import lifeline
from objckpt.pipeline.segment import Segment
from objckpt.pipeline.stage import Stager
from objckpt.testing.plugin import StoreTarget

MiB = 1 << 20


def _tensors(count: int, nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(nbytes // 4, generator=g) for i in range(count)}


def _load(url: str, like: dict[str, torch.Tensor], target: StoreTarget) -> dict[str, torch.Tensor]:
    got = {k: torch.zeros_like(v) for k, v in like.items()}
    reader = objckpt.ObjectStoreReader(url, storage_options=target.storage_options)
    dcp.load(got, storage_reader=reader, no_dist=True)
    return got


def _segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("objckpt-"))


# -- a real tmpfs -------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, as a container's small /dev/shm (skips where it cannot be mounted)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the simulated-room tests cover this here")
    where = tmp_path / "shm"
    where.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


CHILD = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    import objckpt

    staging, root, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("objckpt").addHandler(handler)
    g = torch.Generator().manual_seed(0)
    twelve = {f"w{i}": torch.randn(MiB // 4, generator=g) for i in range(12)}
    report = {}
    opts = objckpt.AsyncOptions(workers=1, staging_dir=staging)
    with objckpt.AsyncCheckpointer(storage_options=options, async_options=opts) as ckpt:
        ckpt.save(twelve, f"{root}/twelve").result(timeout=120)
        report["twelve"] = warnings[:]
        try:
            ckpt.save({"big": torch.ones(10 * MiB // 4)}, f"{root}/big").result(timeout=120)
        except objckpt.errors.StagingSpaceError as exc:
            report["big"] = [str(exc), exc.needed, exc.free, exc.directory]
        ckpt.save({"small": torch.ones(MiB // 4)}, f"{root}/small").result(timeout=120)
        report["small"] = "committed"
    print(json.dumps(report))
    """
).replace("MiB", str(MiB))


def test_in_a_small_tmpfs_a_save_goes_in_waves_and_one_that_cannot_fits_fails_cleanly(
    small_tmpfs: Path, s3_bucket: StoreTarget
) -> None:
    """12 MiB of tensors into an 8 MiB tmpfs: staged in waves and committed; a 10 MiB
    tensor cannot be staged at all: StagingSpaceError with the numbers; the process
    goes on to the next save. In a child process: the failure this prevents is the
    SIGBUS of a sparse segment, which would end the test run."""
    args = [str(small_tmpfs), s3_bucket.root, json.dumps(s3_bucket.storage_options)]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, f"child ended with {child.returncode}: {child.stderr[-3000:]}"
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert any(
        "12582912 bytes" in w and str(small_tmpfs) in w and "waves" in w for w in report["twelve"]
    ), report["twelve"]
    g = torch.Generator().manual_seed(0)
    twelve = {f"w{i}": torch.randn(MiB // 4, generator=g) for i in range(12)}
    got = _load(s3_bucket.url("twelve"), twelve, s3_bucket)
    assert all(torch.equal(got[k], v) for k, v in twelve.items())
    text, needed, free, directory = report["big"]
    assert (needed, directory) == (10 * MiB, str(small_tmpfs)) and free < needed, report
    assert f"{needed} bytes needed, {free} bytes free" in text and directory in text, text
    assert "AsyncOptions.staging_dir" in text and "--shm-size" in text, text
    assert report["small"] == "committed"
    assert _segments(small_tmpfs) == []  # closed: nothing left in the tmpfs


# -- a simulated small directory ------------------------------------------------------------


def test_a_state_dict_without_room_is_staged_in_waves_says_so_and_commits(
    s3_bucket: StoreTarget, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    state = _tensors(4, MiB)
    opts = objckpt.AsyncOptions(workers=1, staging_dir=str(staging))
    with (
        simulated_room(str(staging), 3 * MiB),
        caplog.at_level(logging.WARNING, logger="objckpt"),
        objckpt.AsyncCheckpointer(
            storage_options=s3_bucket.storage_options, async_options=opts
        ) as ckpt,
    ):
        ckpt.save(state, s3_bucket.url("c")).result(timeout=120)
        # One wave segment of half the free space, not the 4 MiB the whole would take.
        assert [p.stat().st_size for p in staging.iterdir()] == [3 * MiB // 2]
    warned = [r.getMessage() for r in caplog.records if "waves" in r.getMessage()]
    assert any(
        f"needs {4 * MiB} bytes in {staging}, {3 * MiB} bytes are free" in m
        and f"waves of {3 * MiB // 2} bytes" in m
        for m in warned
    ), warned
    got = _load(s3_bucket.url("c"), state, s3_bucket)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_no_room_for_even_one_wave_fails_the_save_with_the_numbers_and_the_next_commits(
    s3_bucket: StoreTarget, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    opts = objckpt.AsyncOptions(workers=1, staging_dir=str(staging))
    small = _tensors(1, MiB // 4, seed=1)
    with (
        simulated_room(str(staging), MiB // 2),
        objckpt.AsyncCheckpointer(
            storage_options=s3_bucket.storage_options, async_options=opts
        ) as ckpt,
    ):
        with pytest.raises(StagingSpaceError) as caught:
            ckpt.save(_tensors(1, MiB), s3_bucket.url("big"))
        text = str(caught.value)
        assert f"{MiB} bytes needed, {MiB // 2} bytes free" in text, text
        assert str(staging) in text and "AsyncOptions.staging_dir" in text, text
        assert caught.value.errno == errno.ENOSPC
        assert _segments(staging) == []  # the failed reservation left no file
        ckpt.save(small, s3_bucket.url("small")).result(timeout=120)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3_bucket.storage_options)
    assert not fs.exists(s3_bucket.url("big").split("://", 1)[1])  # nothing uploaded
    got = _load(s3_bucket.url("small"), small, s3_bucket)
    assert all(torch.equal(got[k], v) for k, v in small.items())


def test_a_filesystem_that_cannot_reserve_is_checked_for_free_space_instead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        simulated_room(str(tmp_path), MiB, can_reserve=False),
        caplog.at_level(logging.DEBUG, logger="objckpt.pipeline.segment"),
    ):
        kept = Segment(MiB // 2, str(tmp_path))
        assert any("cannot reserve" in r.getMessage() for r in caplog.records)
        with pytest.raises(StagingSpaceError) as caught:
            Segment(MiB, str(tmp_path))
    assert (caught.value.needed, caught.value.free) == (MiB, MiB // 2)
    assert _segments(tmp_path) == [Path(kept.path).name]
    kept.close()


def test_a_reservation_refused_with_free_space_left_removes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quota or a racing process: statvfs shows room, the reservation still fails."""
    real = os.posix_fallocate

    def quota(fd: int, offset: int, length: int) -> None:
        if length > MiB:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", quota)
    with pytest.raises(StagingSpaceError) as caught:
        Segment(2 * MiB, str(tmp_path))
    assert caught.value.needed == 2 * MiB and str(tmp_path) in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)
    assert _segments(tmp_path) == []


def test_a_directory_without_room_for_the_file_itself_is_no_room_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tmpfs out of inodes refuses the segment's file before any reservation."""

    def no_inodes(*args: Any, **kwargs: Any) -> tuple[int, str]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("tempfile.mkstemp", no_inodes)
    with pytest.raises(StagingSpaceError) as caught:
        Segment(MiB, str(tmp_path))
    assert caught.value.needed == MiB and str(tmp_path) in str(caught.value)


def test_idle_staging_sets_are_freed_when_their_room_is_needed(tmp_path: Path) -> None:
    stager = Stager(max_cached_sets=2, staging_dir=str(tmp_path))
    with simulated_room(str(tmp_path), 3 * MiB):
        first = stager.stage({"a": torch.ones(2 * MiB // 4)})
        stager.release(first)  # idle, kept for reuse: 2 of the 3 MiB
        second = stager.stage({"b": torch.ones(2 * MiB // 4)})  # another structure
        assert second.wave is None  # staged whole, in the idle set's room
        assert _segments(tmp_path) == [Path(second.buffers.segment.path).name]
        stager.release(second)
    stager.close()


def test_a_budget_wave_without_room_shrinks_to_half_the_free_space(tmp_path: Path) -> None:
    stager = Stager(budget=4 * MiB, staging_dir=str(tmp_path))
    with simulated_room(str(tmp_path), 3 * MiB):
        staged = stager.stage(_tensors(6, MiB))
    assert staged.wave is not None and staged.wave.capacity == 3 * MiB // 2
    stager.release(staged)
    stager.close()


def test_the_staging_dir_option_must_name_a_directory(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(ConfigurationError, match=f"staging_dir='{missing}'.*existing directory"):
        objckpt.AsyncOptions(staging_dir=str(missing))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ConfigurationError, match=f"staging_dir='{a_file}'"):
        objckpt.AsyncOptions(staging_dir=str(a_file))
    assert objckpt.AsyncOptions(staging_dir=str(tmp_path)).staging_dir == str(tmp_path)


def test_a_stager_sweeps_exited_processes_segments_from_its_staging_dir(tmp_path: Path) -> None:
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    ns = lifeline.segment_prefix().split("-")[1]
    stale = tmp_path / f"objckpt-{ns}-{exited.pid}-stale"
    mine = tmp_path / f"{lifeline.segment_prefix()}live"
    for p in (stale, mine):
        p.write_bytes(b"x" * 16)
    Stager(staging_dir=str(tmp_path)).close()
    assert not stale.exists() and mine.exists()


# -- two ranks ------------------------------------------------------------------------------


def test_no_room_on_rank_1_fails_the_save_on_both_ranks_and_the_next_commits(
    s3_bucket: StoreTarget, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    root = s3_bucket.url("ranks")
    args = (
        "no_room_on_rank1",
        2,
        str(tmp_path / "init"),
        root,
        s3_bucket.storage_options,
        str(out),
    )
    run_ranks(room_ranks, *args)
    full: list[dict[str, Any]] = [
        json.loads((out / f"full.rank{r}.json").read_text()) for r in range(2)
    ]
    assert [r["outcome"] for r in full] == ["error", "error"], full
    assert full[1]["type"] == "StagingSpaceError", full
    assert f"{256 * 1024} bytes needed, {64 * 1024} bytes free" in full[1]["error"], full
    assert str(out / "staging-rank1") in full[1]["error"], full
    assert full[1]["segments"] == []  # the failed reservation left nothing behind
    assert full[0]["type"] == "PeerRankError", full
    assert "rank 1" in full[0]["error"] and "StagingSpaceError" in full[0]["error"], full
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3_bucket.storage_options)
    assert not fs.exists(f"{root}/full/manifest.json".split("://", 1)[1])
    after = [json.loads((out / f"next.rank{r}.json").read_text()) for r in range(2)]
    assert [r["outcome"] for r in after] == ["ok", "ok"], after
