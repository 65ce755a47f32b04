"""Rank 0's commit helper process (pipeline/coordinator.py, pipeline/stock_task.py):
its failures, each a real process or a real store, and what the training side makes
of them."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from objckpt.errors import UploadError
from objckpt.format.commit import GlobalPlan, Layout
from objckpt.format.manifest import ObjectEntry
from objckpt.options import UploadOptions
from objckpt.pipeline import stock_task
from objckpt.pipeline.coordinator import CommitHelper
from objckpt.testing.plugin import StoreTarget
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
    """The helper's step 2 on a file:// store; it reads the index objects first, so
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
    with pytest.raises(UploadError, match=r"__index_1\.x\.json is gone"):
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


class _Stop(Exception):
    """Ends ``_finish`` where a test has seen what it needs."""


@pytest.mark.parametrize(
    ("rank", "split", "built"),
    [(0, True, True), (1, True, False), (0, False, False)],
    ids=["rank 0, split commit", "another rank", "in-thread commit"],
)
def test_rank_0_builds_a_new_plan_s_layout_before_it_waits_for_the_uploads(
    monkeypatch: pytest.MonkeyPatch, rank: int, split: bool, built: bool
) -> None:
    """Only rank 0 of a split commit builds the layout, after "already committed?"
    let the uploads go and before it waits for them; the commit then finds it kept."""
    from types import SimpleNamespace

    from objckpt.pipeline import commit_phase

    layouts: list[object] = []
    real = Layout.of

    def counting(metadata: Metadata, *args: Any) -> Layout:
        layouts.append(metadata)
        return real(metadata, *args)

    steps: list[str] = []

    def collect(writer: object, workers: object) -> None:
        steps.append(f"collect with {len(layouts)} layout(s)")
        raise _Stop

    monkeypatch.setattr(Layout, "of", counting)
    monkeypatch.setattr(commit_phase, "splits_commit", lambda location, world: split)
    monkeypatch.setattr(commit_phase, "_collect", collect)
    committer = commit_phase.Committer(lambda staged: None, 30.0, None, lambda exc: None)
    monkeypatch.setattr(committer._helper, "start", lambda: None)  # no process needed
    metadata = _metadata(4)
    plan = GlobalPlan(metadata)
    writer = SimpleNamespace(
        target=SimpleNamespace(location=Location.parse("s3://b/x"), rank=rank),
        global_plan=plan,
        queue_deferred=lambda: steps.append("queue") and None,
        pass_gate=lambda: steps.append("gate") and None,
    )
    with pytest.raises(_Stop):
        committer._finish(writer, None, None, 4, None, True)  # type: ignore[arg-type]
    assert steps == ["queue", "gate", f"collect with {int(built)} layout(s)"]
    assert plan.holds_metadata is not built  # a built layout lets DCP's Metadata go
    if built:
        assert plan.layout() is plan.layout()
        assert layouts == [metadata]  # kept: the commit does not build it again


def test_a_layout_that_fails_early_is_left_to_the_commit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure while building the layout early only logs: the commit builds it
    again inside the exchange, where the error reaches every rank."""
    from objckpt.pipeline import coordinator

    def broken(plan: GlobalPlan) -> Any:
        raise ValueError("bad plan")

    monkeypatch.setattr(coordinator.GlobalPlan, "layout", broken)
    plan = GlobalPlan(_metadata(2))
    with caplog.at_level(logging.WARNING, logger="objckpt.pipeline.coordinator"):
        CommitHelper.prepare_layout(plan)
    assert "building the plan's layout before the commit failed: bad plan" in caplog.text
    assert plan.holds_metadata  # the commit still has what it needs to build it


def _metadata(world: int) -> Metadata:
    """DCP metadata of one row-sharded tensor over ``world`` ranks."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks = [
        ChunkStorageMetadata(torch.Size([r * 4, 0]), torch.Size([4, 8])) for r in range(world)
    ]
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([4 * world, 8]), chunks
    )
    return Metadata({"w": md}, planner_data={"w": ("w",)})


_SHARED = {"moto": "s3_bucket", "rgw": "rgw_bucket", "fake-gcs": "fake_gcs_bucket"}


@pytest.fixture(params=[*_SHARED, "azurite"])
def shared_target(request: pytest.FixtureRequest) -> StoreTarget:
    """A store every process reaches (where commits run in the helper): S3 on moto and
    Ceph RGW, GCS on fake-gcs-server, Azure Blob on Azurite."""
    return request.getfixturevalue(_SHARED.get(request.param, "az_container"))


def test_a_save_from_the_template_reads_index_objects_only_where_puts_are_unverified(
    shared_target: StoreTarget, helper: CommitHelper
) -> None:
    """#46: a later save of a plan takes its ``.metadata`` from the template. Where the
    store verified each rank's index PUT against its CRC32C (S3) the helper reads none
    of the W index objects (8,192 GETs at 8,192 ranks; unfixed it read every one on
    every save), and one lost before the commit is refused by the commit's listing,
    by name, nothing committed. Elsewhere (GCS, Azure) it still reads them back: a
    lost one, or one whose bytes differ from its rank's report, is refused there."""
    from commit_strategies import commit_via, one_value_save

    from objckpt.format.layout import MANIFEST_KEY
    from objckpt.writers import open_store

    def at(step: str) -> Any:
        return open_store(
            Location.parse(shared_target.url(step), shared_target.storage_options),
            UploadOptions(),
        )

    verified = at("probe").verifies_writes
    plan = None  # one global plan for every save (DCP's plan cache keeps it)

    def save(step: str, attempt: str, before_commit: Any = None) -> Any:
        """One save of the plan under ``step``, committed through the one helper."""
        nonlocal plan
        store = at(step)
        metadata, results = one_value_save(store, attempt, b"value")
        plan = plan or GlobalPlan(metadata, results)
        return store, commit_via(
            "helper",
            store,
            plan,
            results,
            attempt=attempt,
            world_size=1,
            overwrite=False,
            helper=helper,
            before_commit=before_commit,
        )

    gets, named = [], []
    for n, step in enumerate(("step-1", "step-2")):
        attempt = f"{n + 1}" * 16
        store, manifest = save(step, attempt)
        assert manifest.requests is not None
        gets.append(manifest.requests.requests.get("GET", 0))
        named.append(manifest.object(".metadata") is not None)
        written = pickle.loads(store.read(".metadata"))  # built in place: a bytearray
        assert written.storage_meta.save_id == attempt
        names = {i.relative_path for i in written.storage_data.values()}
        assert names == {f"__0_0.{attempt}.distcp"}
    # The first save builds .metadata after its commit (the manifest does not name
    # it), the second renames the template before it (named with its CRC32C).
    assert named == [False, True]
    if verified:  # neither read its index before the commit (unfixed: [1, 0])
        assert gets == [0, 0]
    elif "GET" in manifest.requests.requests:  # counted on GCS, not on Azure
        assert gets == [1, 1]

    def refused(step: str, attempt: str, change: Any, reason: str) -> None:
        """A save whose index object ``change`` alters before the commit fails with
        ``reason``, and nothing is committed."""
        store = at(step)

        def before_commit(reports: Any) -> None:
            change(store, reports[0].index.key)

        with pytest.raises(UploadError, match=reason):
            save(step, attempt, before_commit)
        assert not store.exists(MANIFEST_KEY)

    def lose(store: Any, key: str) -> None:
        store.delete(key)

    lost = r"__index_0\.3{16}\.json"
    refused(
        "step-3",
        "3" * 16,
        lose,
        rf"missing \({lost}\).*nothing was committed" if verified else rf"{lost} is gone",
    )
    if verified:
        return

    def alter(store: Any, key: str) -> None:  # the same size, other bytes
        store.put(key, store.read(key).replace(b"4444", b"5555", 1))

    refused("step-4", "4" * 16, alter, r"__index_0\.4{16}\.json holds .* its rank wrote")


def test_a_step_whose_metadata_came_after_its_commit_verifies_copies_and_survives_overwrite(
    tmp_path: Path, helper: CommitHelper
) -> None:
    """#46: a save committed through the helper with no template builds ``.metadata``
    after its manifest, which does not name it. ``objckpt verify`` passes it, reports
    one left by another attempt and a missing one by name; a copy carries it (onto a
    step whose manifest named its own too, replacing it) but not another attempt's;
    an overwrite whose manifest does not name it keeps the new one (the replaced
    manifest named ``.metadata``, and it is replaced, never deleted as superseded); a
    copy that carries none deletes the destination's, then what only it pointed at."""
    from commit_strategies import commit_via, one_value_save

    from objckpt.ops.maintain.verify import copy_checkpoint, verify_checkpoint
    from objckpt.writers import open_store

    def store_at(where: str) -> Any:
        return open_store(Location.parse(f"file://{tmp_path}/{where}"), UploadOptions())

    src = store_at("src/step-1")
    attempt = "1" * 16
    metadata, results = one_value_save(src, attempt, b"value")
    manifest = commit_via(
        "in-thread", src, metadata, results, attempt=attempt, world_size=1, overwrite=False
    )
    assert manifest.object(".metadata") is not None  # built in-thread: named
    attempt = "2" * 16
    metadata, results = one_value_save(src, attempt, b"other")
    manifest = commit_via(
        "helper",
        src,
        metadata,
        results,
        attempt=attempt,
        world_size=1,
        overwrite=True,
        helper=helper,
    )
    assert manifest.object(".metadata") is None  # built after the commit: not named
    written = pickle.loads(src.read(".metadata"))  # the overwrite's, not deleted after
    assert written.storage_meta.save_id == attempt
    assert verify_checkpoint(src.location).ok

    copy_checkpoint(src.location, Location.parse(f"file://{tmp_path}/dst/step-1"))
    assert store_at("dst/step-1").read(".metadata") == src.read(".metadata")
    assert verify_checkpoint(Location.parse(f"file://{tmp_path}/dst/step-1")).ok
    # Over a step whose manifest names its .metadata: replaced, not deleted after.
    over = store_at("over/step-1")
    metadata, results = one_value_save(over, "4" * 16, b"older")
    commit_via(
        "in-thread", over, metadata, results, attempt="4" * 16, world_size=1, overwrite=False
    )
    copy_checkpoint(src.location, over.location, overwrite=True)
    assert over.read(".metadata") == src.read(".metadata")
    assert not over.exists("__0_0.4444444444444444.distcp")  # the replaced payload
    assert verify_checkpoint(over.location).ok

    src.put(".metadata", src.read(".metadata").replace(attempt.encode(), b"3" * 16))
    report = verify_checkpoint(src.location)
    assert [(c.key, c.problem) for c in report.failures] == [
        (".metadata", f"does not name this checkpoint's attempt {attempt}: another save's")
    ]
    copy_checkpoint(src.location, Location.parse(f"file://{tmp_path}/stale/step-1"))
    assert not store_at("stale/step-1").exists(".metadata")  # another save's: not copied
    # Over a step whose .metadata is unnamed too, none copied: the replaced .metadata
    # goes (a stock reader must not load the replaced checkpoint beside the new
    # manifest), then the payload only it pointed at.
    under = store_at("under/step-1")
    metadata, results = one_value_save(under, "5" * 16, b"under")
    named = commit_via(
        "helper",
        under,
        metadata,
        results,
        attempt="5" * 16,
        world_size=1,
        overwrite=False,
        helper=helper,
    )
    assert named.object(".metadata") is None
    copy_checkpoint(src.location, under.location, overwrite=True)
    assert not under.exists(".metadata")  # before #46's limit: the replaced one stayed
    assert not under.exists("__0_0.5555555555555555.distcp")
    src.delete(".metadata")
    (failure,) = verify_checkpoint(src.location).failures
    assert failure.key == ".metadata" and failure.problem is not None
    assert failure.problem.startswith("missing: the save writes it after its commit")


def test_a_plan_committed_in_thread_keeps_its_writers_not_dcp_s_results(
    tmp_path: Path, helper: CommitHelper
) -> None:
    """An in-thread commit of a plan keeps the writer columns it encoded and lets DCP's
    gathered write results go (W lists of them at rank 0 for as long as the plan is
    reused); a later commit of the same plan through the helper (the plan cache does
    not key plans by store) still has its writers."""
    from commit_strategies import commit_via, one_value_save

    from objckpt.format.commit import commit_checkpoint
    from objckpt.writers import open_store

    first = open_store(Location.parse(f"file://{tmp_path}/a/step-1"), UploadOptions())
    metadata, results = one_value_save(first, "1" * 16, b"value")
    plan = GlobalPlan(metadata, results)
    commit_checkpoint(
        first, plan.metadata(), results, attempt="1" * 16, world_size=1, overwrite=False, plan=plan
    )
    assert plan._results is None  # unfixed: kept for the life of the plan
    later = open_store(Location.parse(f"file://{tmp_path}/b/step-1"), UploadOptions())
    _, results = one_value_save(later, "2" * 16, b"other")
    manifest = commit_via(
        "helper",
        later,
        plan,
        results,
        attempt="2" * 16,
        world_size=1,
        overwrite=False,
        helper=helper,
    )
    assert manifest.metadata["state_dict"]["step"]["writer"] == 0
    assert pickle.loads(later.read(".metadata")).storage_meta.save_id == "2" * 16
