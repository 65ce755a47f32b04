"""The commit run by either strategy, for tests of the commit's guarantees.

``format/commit.py`` has one commit sequence and two strategies: in the committing
thread (:class:`~objckpt.format.commit.InThread`, what ``commit_checkpoint`` runs) and
in rank 0's commit helper process (:class:`~objckpt.pipeline.coordinator.InHelper`).
:func:`commit_via` commits the same write results through either, so one test of a
guarantee runs against both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from objckpt.format.commit import GlobalPlan, commit_checkpoint, write_rank_index
from objckpt.format.manifest import Manifest
from objckpt.options import UploadOptions
from objckpt.pipeline.coordinator import CommitHelper
from objckpt.writers.accounting import RequestStats
from objckpt.writers.base import ObjectStore

#: The strategies' names, for ``pytest.mark.parametrize``.
STRATEGIES = ("in-thread", "helper")


def commit_via(
    strategy: str,
    store: ObjectStore,
    metadata: Metadata | GlobalPlan,
    results: Iterable[Iterable[WriteResult]],
    *,
    attempt: str,
    world_size: int,
    overwrite: bool,
    user: Mapping[str, Any] | None = None,
    checkpoint_id: str | os.PathLike[str] | None = None,
    base: str | None = None,
    helper: CommitHelper | None = None,
    before_commit: Any = None,
    upload: UploadOptions | None = None,
) -> Manifest:
    """Commit ``results`` (one list per rank) as ``commit_checkpoint`` does, through
    ``strategy``: ``"in-thread"`` or ``"helper"`` (each rank's index object written as
    the rank would, then rank 0's helper process builds and writes ``.metadata``).

    Args:
        metadata: The global plan's metadata, or a :class:`GlobalPlan` kept across
            saves (its layout is what a later save of the plan reuses).
        helper: The helper to commit through, kept open (None: a fresh one, closed
            after): a helper that committed a plan before renames its ``.metadata``.
        before_commit: Called with the ranks' reports once their index objects are
            written, before the helper commits (helper strategy only).
        upload: The save's options (whether it writes ``.metadata``)."""
    upload = upload or UploadOptions()
    results = [list(r) for r in results]
    plan = metadata if isinstance(metadata, GlobalPlan) else GlobalPlan(metadata, results)
    if strategy == "in-thread":
        return commit_checkpoint(
            store,
            plan.metadata(),
            results,
            attempt=attempt,
            world_size=world_size,
            overwrite=overwrite,
            user=user,
            checkpoint_id=checkpoint_id,
            base=base,
            stock=upload.writes_stock_metadata(world_size),
        )
    assert strategy == "helper", strategy
    reports = [
        write_rank_index(store, r, rank, attempt, RequestStats, planned(r))
        for rank, r in enumerate(results)
    ]
    target = SimpleNamespace(
        store=store,
        checkpoint_id=checkpoint_id,
        upload=upload,
        overwrite=overwrite,
        user_metadata=user,
        reuse_from=base,
        close=lambda: None,
    )
    writer = SimpleNamespace(
        target=target,
        global_plan=plan,
        rank_plan=SimpleNamespace(attempt=attempt),
        deadline=None,
    )
    if before_commit is not None:
        before_commit(reports)
    if helper is not None:
        return helper.commit(writer, reports, world_size)  # type: ignore[arg-type]
    fresh = CommitHelper()
    try:
        return fresh.commit(writer, reports, world_size)  # type: ignore[arg-type]
    finally:
        fresh.close(timeout=30)


def planned(results: Iterable[WriteResult]) -> list[Any]:
    """The items a rank's plan gave it, as its write results name them (what a rank's
    placeholders tell DCP's ``finish``, and the rank checks its index against)."""
    from objckpt.format.commit import REQUESTS_FQN

    return [wr.index for wr in results if wr.index.fqn != REQUESTS_FQN]


def one_value_save(store: ObjectStore, attempt: str, value: bytes) -> tuple[Metadata, list]:
    """A one-rank save of one bytes value, its payload object already on ``store``:
    the DCP metadata and the rank's write results to commit."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from objckpt.format.dcp_json import StoredItem
    from objckpt.writers.checksum import Crc32c

    key = f"__0_0.{attempt}.distcp"
    store.put(key, value)
    crc = Crc32c()
    crc.update(value)
    item = StoredItem(key, 0, len(value), crc.hexdigest(), len(value), crc.hexdigest())
    metadata = Metadata({"step": BytesStorageMetadata()}, planner_data={"step": ("step",)})
    return metadata, [[WriteResult(MetadataIndex("step"), len(value), item)]]
