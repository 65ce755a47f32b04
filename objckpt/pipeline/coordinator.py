"""Rank 0's side of an async commit from the ranks' reports, its O(W) work in a helper.

Rank 0's training process gathers W small :class:`~objckpt.format.rank_commit.RankReport`
records, then (on its commit thread):

1. asks its commit helper process to prepare ``.metadata`` and the chunk writers
   from the index objects the ranks wrote (:func:`~objckpt.pipeline.stock_task.prepare_stock`);
2. writes the manifest (one listing, the create-only PUT settled by read-back):
   the plan's :class:`~objckpt.format.rank_commit.Layout`, built once per global
   plan, completed with this save's writers and keys;
3. asks the helper to write ``.metadata`` and delete what an overwrite replaced
   (:func:`~objckpt.pipeline.stock_task.publish_stock`); the save completes once
   it did (or failed: logged, the checkpoint stays committed, as in-thread).

The commit order is the in-thread one's (format/commit.py); only where the work
runs changed. Each wait on the helper is bounded: by the save's deadline plus
:data:`~objckpt.pipeline.workers.WEDGED_AFTER` (then the helper is stopped and
the save fails, nothing committed), and for step 3 by the settle bound.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from objckpt.errors import ObjckptError, UploadError
from objckpt.format.commit import commit_manifest, save_storage_meta
from objckpt.format.manifest import Manifest
from objckpt.format.rank_commit import Layout, RankReport
from objckpt.format.rank_index import with_writers
from objckpt.format.settle import SETTLE_SECONDS
from objckpt.pipeline import stock_task
from objckpt.pipeline.deferred import DeferredWriter
from objckpt.pipeline.workers import WEDGED_AFTER, WorkerPool
from objckpt.writers.accounting import RequestStats
from objckpt.writers.deadline import Deadline

__all__ = ["CommitHelper"]

logger = logging.getLogger(__name__)


class CommitHelper:
    """Rank 0's commit from reports, with its helper process (started on first use,
    kept for the checkpointer's life: :meth:`close`)."""

    def __init__(self) -> None:
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()
        self._layout: tuple[Metadata, Layout] | None = None

    def start(self) -> None:
        """Start the helper process in the background (rank 0, before its first
        commit: its interpreter and torch import overlap the uploads)."""
        with self._lock:
            if self._pool is None:
                self._pool = WorkerPool(1, name="commit")
                self._pool.submit(stock_task.discard_stock, "")  # imports torch there now
            pool = self._pool
        pool.start()

    def _submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        self.start()
        assert self._pool is not None
        return self._pool.submit(fn, *args)

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout)

    def layout(self, metadata: Metadata) -> Layout:
        """The plan's layout: kept while saves reuse the same global metadata."""
        cached = self._layout
        if cached is not None and cached[0] is metadata:
            return cached[1]
        layout = Layout.of(metadata)
        self._layout = (metadata, layout)
        return layout

    def commit(self, writer: DeferredWriter, reports: Sequence[RankReport], world: int) -> Manifest:
        """Commit the save ``reports`` describe (see the module doc)."""
        if writer.metadata is None or writer.rank_plan is None:
            raise ObjckptError("internal: commit without DCP metadata on the coordinator")
        target = writer.writer
        store = target.store
        attempt = writer.rank_plan.attempt
        layout = self.layout(writer.metadata)
        storage_meta = save_storage_meta(
            writer.metadata, store.location.url, target.checkpoint_id, attempt
        )
        keys = [None if r.index is None else r.index.key for r in reports]
        indexes = [(rank, r.index) for rank, r in enumerate(reports) if r.index is not None]
        stock = stock_task.StockLayout(
            layout.for_save(True, keys, storage_meta),
            layout.properties,
            writer.metadata.planner_data,
            storage_meta,
        )
        prepared: stock_task.StockPrepared = _bounded(
            self._submit(
                stock_task.prepare_stock,
                store.location,
                target.upload,
                writer.deadline,
                attempt,
                stock,
                indexes,
                target.overwrite,
            ),
            writer.deadline,
            self,
            f"preparing {store.location.url}'s .metadata from {len(indexes)} index objects",
        )
        objects = {o.key: o for r in reports for o in r.objects}
        objects.update((e.key, e) for _, e in indexes)
        objects[prepared.metadata.key] = prepared.metadata
        requests = sum((r.requests for r in reports), RequestStats()) + prepared.requests
        try:
            manifest = commit_manifest(
                store,
                attempt=attempt,
                world_size=world,
                objects=objects.values(),
                metadata=with_writers(
                    layout.for_save(False, keys, storage_meta),
                    prepared.writers,
                    keys,
                    prepared.raw_bytes,
                ),
                user=target.user_metadata,
                requests=requests,
                overwrite=target.overwrite,
            )
        except BaseException:
            self._submit(stock_task.discard_stock, attempt)
            raise
        published = self._submit(
            stock_task.publish_stock,
            store.location,
            target.upload,
            attempt,
            frozenset(o.key for o in manifest.objects),
        )
        try:  # its own requests are bounded by the settle time
            published.result(timeout=SETTLE_SECONDS + WEDGED_AFTER)
        except Exception as exc:
            logger.error(
                "%s committed, but its commit helper did not write .metadata (%s); stock "
                "DCP readers do not see this checkpoint yet, objckpt's readers load it",
                store.location.url,
                exc,
            )
        target.close()
        return manifest


def _bounded(
    future: concurrent.futures.Future[Any],
    deadline: Deadline | None,
    helper: CommitHelper,
    what: str,
) -> Any:
    """``future``'s result by the save's deadline plus WEDGED_AFTER; past it the
    helper hangs: it is stopped (the next commit starts a fresh one) and the save
    fails with the deadline's :class:`~objckpt.errors.SaveDeadlineError`; a helper
    that died fails it with :class:`~objckpt.errors.UploadError`."""
    timeout = None if deadline is None else max(0.0, deadline.remaining() + WEDGED_AFTER)
    try:
        return future.result(timeout=timeout)
    except BrokenProcessPool as exc:  # killed, or out of memory: the next save starts one
        raise UploadError(
            f"{what}: the commit helper process died ({exc}); nothing was committed"
        ) from exc
    except concurrent.futures.TimeoutError:
        pool = helper._pool
        if pool is not None:
            pool.terminate([future], "no answer past the save's deadline")
        assert deadline is not None
        raise deadline.error(
            f"{what}: the commit helper process had no answer {WEDGED_AFTER:g} s past "
            "the deadline (it was stopped); nothing was committed"
        ) from None
