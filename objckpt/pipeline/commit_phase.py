"""One async save after ``save()`` returned: this rank's uploads, then the commit.

Runs on a reused background thread per save (never the training thread), so no
call of the training loop is needed for a save to finish::

    every rank:  queue deferred uploads -> wait for them -> free the staging set
                 post results (c10d store, keyed by the save's attempt)
    rank 0:      gather every rank's results (timeout) -> .metadata -> manifest
                 publish the outcome
    others:      wait for rank 0's outcome (timeout)

The save's future gets the committed manifest (rank 0), None (other ranks) or
the error; a rank's own upload error wins over the coordinator's summary of it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from objckpt._torch import group_store
from objckpt.dcp.serialize import written_object
from objckpt.errors import ObjckptError, UploadError
from objckpt.format.commit import commit_checkpoint, requests_result, written_objects
from objckpt.format.manifest import Manifest
from objckpt.pipeline.deferred import DeferredWriter
from objckpt.pipeline.finalize import RankExchange
from objckpt.pipeline.handle import SaveHandle
from objckpt.pipeline.stage import Staged
from objckpt.writers.accounting import counting
from objckpt.writers.deadline import bounded_by
from objckpt.writers.translate import describe

__all__ = ["Committer", "exchange_for"]

logger = logging.getLogger(__name__)


def exchange_for(
    writer: DeferredWriter, process_group: Any, world: int, timeout: float
) -> RankExchange:
    """The c10d-store exchange of ``writer``'s save attempt."""
    target = writer.writer
    if target.attempt is None:
        raise ObjckptError("internal: rank exchange before the attempt was agreed")
    return RankExchange(
        group_store(process_group), target.attempt, target.rank, world, timeout, target.location.url
    )


class Committer:
    """Finishes queued saves: what a checkpointer's commit threads run.

    Args:
        release: Gives a save's staging set back once its uploads ended.
        barrier_timeout: How long a rank waits for the others through the store.
        on_commit: Called on the coordinator with (url, manifest) after each commit.
        on_error: Records a failed save's error (for ``check_for_errors``).
    """

    def __init__(
        self,
        release: Callable[[Staged], None],
        barrier_timeout: float,
        on_commit: Callable[[str, Manifest], Any] | None,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._release = release
        self._timeout = barrier_timeout
        self._on_commit = on_commit
        self._on_error = on_error

    def finalize(
        self,
        writer: DeferredWriter,
        staged: Staged,
        handle: SaveHandle,
        future: concurrent.futures.Future[Manifest | None],
        world: int,
        process_group: Any | None,
        distributed: bool,
    ) -> None:
        """Finish one save within its deadline and settle ``future`` either way."""
        url = writer.writer.location.url
        counter = writer.writer.request_counter
        try:
            with counting(counter), bounded_by(writer.deadline):
                manifest = self._finish(writer, staged, handle, world, process_group, distributed)
            future.set_result(manifest)
        except BaseException as exc:
            logger.error("async save of %s failed: %s", url, describe(exc))
            self._on_error(exc)
            future.set_exception(exc)

    def _finish(
        self,
        writer: DeferredWriter,
        staged: Staged,
        handle: SaveHandle,
        world: int,
        process_group: Any | None,
        distributed: bool,
    ) -> Manifest | None:
        queueing_error = writer.queue_deferred()
        results, error = _collect(writer)
        error = queueing_error or error
        self._release(staged)
        handle._set_written(written_objects(results))
        rank_plan = writer.rank_plan
        assert rank_plan is not None
        if not distributed:
            if error is not None:
                raise error
            manifest = self._commit(writer, [results], world)
            self._after_commit(writer, manifest)
            return manifest
        exchange = exchange_for(writer, process_group, world, self._timeout)
        exchange.post(error is None, results if error is None else describe(error))
        if rank_plan.rank == 0:
            return self._coordinate(writer, exchange, world)
        if error is not None:
            raise error
        outcome = exchange.outcome()
        if outcome is not None:
            raise UploadError(outcome)
        return None

    def _coordinate(self, writer: DeferredWriter, exchange: RankExchange, world: int) -> Manifest:
        try:
            all_results = exchange.gather()
            manifest = self._commit(writer, all_results, world)
        except BaseException as exc:
            exchange.publish_outcome(describe(exc))
            raise
        exchange.publish_outcome(None)
        self._after_commit(writer, manifest)
        return manifest

    def _commit(
        self, writer: DeferredWriter, results: list[list[WriteResult]], world: int
    ) -> Manifest:
        if writer.metadata is None or writer.rank_plan is None:
            raise ObjckptError("internal: commit without DCP metadata on the coordinator")
        target = writer.writer
        manifest = commit_checkpoint(
            target.store,
            writer.metadata,
            results,
            attempt=writer.rank_plan.attempt,
            world_size=world,
            overwrite=target.overwrite,
            user=target.user_metadata,
            checkpoint_id=target.checkpoint_id,
        )
        target.close()
        return manifest

    def _after_commit(self, writer: DeferredWriter, manifest: Manifest) -> None:
        """The commit hook, once every rank can learn that the save committed: its
        error is logged, never the save's outcome (the checkpoint is committed)."""
        if self._on_commit is None:
            return
        url = writer.writer.location.url
        try:
            self._on_commit(url, manifest)
        except Exception:
            logger.exception("the on-commit hook failed after %s committed", url)


def _collect(writer: DeferredWriter) -> tuple[list[WriteResult], BaseException | None]:
    """This rank's write results (and its request totals), or its first upload error."""
    results: list[WriteResult] = []
    error: BaseException | None = None
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_result(None)
    for p in writer.pending:
        try:
            record = p.future.result()
        except BrokenProcessPool as exc:
            error = error or UploadError(
                f"an upload worker died while saving {writer.writer.location.url} "
                "(killed or out of memory); the save was not committed"
            )
            error.__cause__ = exc
            continue
        except BaseException as exc:
            error = error or exc
            continue
        writer.writer.request_counter.add(record.requests)
        results.extend(written_object(p.obj, writer.items, record, done).write_results())
    # The rank's requests so far travel with its results; the coordinator sums them.
    results.append(requests_result(writer.writer.requests))
    return results, error
