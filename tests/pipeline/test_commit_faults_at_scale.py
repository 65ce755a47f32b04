"""One rank's fault during the commit at 1,024 simulated ranks (#46).

The real exchange (:class:`~objckpt.pipeline.finalize.RankExchange` on a c10d
``HashStore``) and rank 0's real commit (``Committer._coordinate``, in-thread on a
``file://`` store), with 1,024 ranks' reports: one rank failing, one rank silent,
or the commit itself refused ends every rank that waits in the same outcome, names
the rank or the cause, commits nothing and leaves no c10d key behind; without a
fault every rank hears "committed".
"""

from __future__ import annotations

import concurrent.futures
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from objckpt.errors import BarrierTimeoutError, CheckpointExistsError, UploadError
from objckpt.format.commit import GlobalPlan
from objckpt.format.dcp_json import StoredItem
from objckpt.format.layout import MANIFEST_KEY
from objckpt.options import UploadOptions
from objckpt.pipeline.commit_phase import Committer
from objckpt.pipeline.finalize import RankExchange
from objckpt.pipeline.handle import SaveHandle
from objckpt.writers import open_store
from objckpt.writers.location import Location
from objckpt.writers.translate import describe

WORLD = 1024
ATTEMPT = "5" * 16
FAULTY = 517


def _save(world: int) -> tuple[Any, list[list[WriteResult]]]:
    """A tensor of ``world`` rows, one row per rank: DCP's global plan and each rank's
    write results (one item in one payload object)."""
    plans = []
    for r in range(world):
        plans.append(
            SavePlan(
                [
                    WriteItem(
                        index=MetadataIndex("w", torch.Size([r, 0])),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 4])),
                            properties=TensorProperties(dtype=torch.float32),
                            size=torch.Size([world, 4]),
                        ),
                    )
                ]
            )
        )
    global_plans, metadata = create_default_global_save_plan(plans)
    results = []
    for r, plan in enumerate(global_plans):
        key = f"__{r}_0.{ATTEMPT}.distcp"
        item = StoredItem(key, 0, 16, "00000000", 16, "00000000")
        results.append([WriteResult(plan.items[0].index, 16, item)])
    return metadata, results


def _close_fails() -> None:
    raise RuntimeError("closing the store failed")


def _writer(tmp_path: Path, metadata: Any, close: Any = lambda: None) -> Any:
    store = open_store(Location.parse(f"file://{tmp_path}/step"), UploadOptions())
    target = types.SimpleNamespace(
        store=store,
        location=store.location,
        checkpoint_id=None,
        upload=UploadOptions(),
        overwrite=False,
        reuse_from=None,
        user_metadata={},
        close=close,
    )
    rank_plan = types.SimpleNamespace(attempt=ATTEMPT, rank=0)
    return types.SimpleNamespace(
        global_plan=GlobalPlan(metadata), rank_plan=rank_plan, deadline=None, target=target
    )


def _commit(
    tmp_path: Path, fault: str, timeout: float = 30.0
) -> tuple[BaseException | None, list[str | None], Any]:
    """Every rank's report (``fault`` on rank FAULTY), rank 0's commit, then each
    waiting rank's outcome: (rank 0's error, the others' outcomes, the c10d store)."""
    metadata, results = _save(WORLD)
    writer = _writer(tmp_path, metadata, _close_fails if fault == "after" else lambda: None)
    store = dist.HashStore()
    exchanges = [
        RankExchange(store, ATTEMPT, r, WORLD, timeout, writer.target.location.url)
        for r in range(WORLD)
    ]
    for r in range(WORLD):
        if r == FAULTY and fault == "failing":
            exchanges[r].post(False, "OSError: [Errno 28] No space left on device")
        elif not (r == FAULTY and fault == "silent"):
            exchanges[r].post(True, results[r])
    committer = Committer(lambda staged: None, timeout, None, lambda exc: None)
    error: BaseException | None = None
    try:
        handle = SaveHandle(writer.target.location.url, concurrent.futures.Future())
        committer._coordinate(writer, handle, exchanges[0], WORLD, split=False)
    except BaseException as exc:
        error = exc
    finally:
        committer.close()
    waiting = [r for r in range(1, WORLD) if not (r == FAULTY and fault in ("failing", "silent"))]
    return error, [exchanges[r].outcome() for r in waiting], store


def test_without_a_fault_every_rank_hears_committed(tmp_path: Path) -> None:
    error, outcomes, store = _commit(tmp_path, "none")
    assert error is None
    assert outcomes == [None] * (WORLD - 1)
    assert (tmp_path / "step" / MANIFEST_KEY).exists()
    assert store.num_keys() == 0


def test_one_failing_rank_fails_the_save_on_every_rank_naming_it(tmp_path: Path) -> None:
    error, outcomes, store = _commit(tmp_path, "failing")
    assert isinstance(error, UploadError) and f"rank {FAULTY}: OSError" in str(error)
    assert len(outcomes) == WORLD - 2 and set(outcomes) == {describe(error)}
    assert not (tmp_path / "step" / MANIFEST_KEY).exists()
    assert store.num_keys() == 0  # the failed rank's report too: rank 0 deleted it


def test_one_silent_rank_fails_the_save_on_every_rank_within_the_timeout(tmp_path: Path) -> None:
    error, outcomes, store = _commit(tmp_path, "silent", timeout=1.0)
    assert isinstance(error, BarrierTimeoutError)
    assert f"no report from rank{FAULTY} within 1 s" in str(error)
    assert len(outcomes) == WORLD - 2 and all(
        o is not None and f"rank{FAULTY}" in o for o in outcomes
    )
    assert not (tmp_path / "step" / MANIFEST_KEY).exists()
    # Left for the silent rank, which never reads (RankExchange's doc): the outcome
    # and its read counter, one short of the readers the outcome names.
    assert store.num_keys() == 2


def test_a_refused_commit_fails_the_save_on_every_rank_and_leaves_the_winner(
    tmp_path: Path,
) -> None:
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / MANIFEST_KEY).write_bytes(b'{"attempt": "another"}')
    error, outcomes, store = _commit(tmp_path, "none")
    assert isinstance(error, CheckpointExistsError)
    assert len(outcomes) == WORLD - 1 and set(outcomes) == {describe(error)}
    assert "already committed" in describe(error)
    assert (tmp_path / "step" / MANIFEST_KEY).read_bytes() == b'{"attempt": "another"}'
    assert store.num_keys() == 0


def test_a_failure_after_the_commit_leaves_every_rank_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The manifest decides: once it is committed (and the other ranks told), a
    failure of rank 0 after it (here: closing the store) is logged, and rank 0 returns
    the manifest like every other rank (unfixed, it published the error to every rank
    while the checkpoint stood committed)."""
    error, outcomes, store = _commit(tmp_path, "after")
    assert error is None
    assert outcomes == [None] * (WORLD - 1)
    assert (tmp_path / "step" / MANIFEST_KEY).exists()
    assert "rank 0 failed after it: RuntimeError: closing the store failed" in caplog.text
    assert store.num_keys() == 0
