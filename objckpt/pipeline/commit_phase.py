"""One async save after ``save()`` returned: this rank's uploads, then the commit.

Runs on a reused background thread per save (never the training thread), so no
call of the training loop is needed for a save to finish::

    every rank:  queue deferred uploads -> rank 0's "already committed?" answer
                 (a bare save's: its uploads wait for it) -> (rank 0, a new plan:
                 build its layout) -> wait for the uploads
                 -> free the staging set -> PUT its own index object
                 post a small report (c10d store, keyed by the save's attempt)
    rank 0:      gather the reports (timeout) -> manifest (the plan's writers;
                 .metadata's entry where the helper renamed its template) ->
                 publish the outcome -> its commit helper process writes .metadata,
                 built from the index objects where not renamed (pipeline/coordinator.py)
    others:      wait for rank 0's outcome (timeout)

That split needs a store every process reaches alike (:func:`splits_commit`); on a
``file://`` path (perhaps node-local) or ``memory://``, and with one rank, each rank
posts its write results instead and rank 0 commits them in-thread. Both are the one
commit sequence of :mod:`objckpt.format.commit` with one of its two strategies
(``InHelper``, ``InThread``): which one only decides where the work runs, never the
bytes of the checkpoint.

The save's future gets the committed manifest (rank 0), None (other ranks) or
the error; a rank's own upload error wins over the coordinator's summary of it.

Every wait here is bounded, so the thread ends by :meth:`Committer.ends_by`: the
uploads by the save's deadline plus :data:`WEDGED_AFTER` (an upload still
outstanding then hangs: its workers are killed and the save fails naming the
objects; :data:`ACT_WITHIN` more is allowed for that on a loaded host), the exchange
by the barrier timeout. A save without a deadline
(``UploadOptions(deadline=None)``) waits for its uploads as long as they take.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from objckpt._torch import group_store
from objckpt.dcp.serialize import written_object
from objckpt.errors import InternalError, UploadError
from objckpt.format.commit import (
    commit_checkpoint,
    requests_result,
    write_rank_index,
    written_objects,
)
from objckpt.format.manifest import Manifest
from objckpt.pipeline.coordinator import CommitHelper
from objckpt.pipeline.deferred import DeferredWriter
from objckpt.pipeline.finalize import COMMIT_SECONDS, RankExchange, outcome_wait
from objckpt.pipeline.handle import SaveHandle
from objckpt.pipeline.stage import Staged
from objckpt.pipeline.workers import WEDGED_AFTER, WorkerPool
from objckpt.writers import store_family
from objckpt.writers.accounting import counting
from objckpt.writers.deadline import bounded_by
from objckpt.writers.location import Location
from objckpt.writers.translate import describe

__all__ = ["ACT_WITHIN", "WEDGED_AFTER", "Committer", "exchange_for", "splits_commit"]

#: Seconds the commit thread is given, past its own bound, to act on it: kill a
#: wedged worker and fail the save. ``close()`` waits them out before it gives up on
#: a save and kills every worker, so that a save a wedged worker holds fails with
#: its own deadline error, not with the closing's kill (both wake at one instant).
ACT_WITHIN = 10.0

logger = logging.getLogger(__name__)


def exchange_for(
    writer: DeferredWriter, process_group: Any, world: int, timeout: float
) -> RankExchange:
    """The c10d-store exchange of ``writer``'s save attempt (saves in a process group
    only: a ``no_dist`` save, like one outside a group, commits without it)."""
    target = writer.target
    if target.attempt is None:
        raise InternalError("internal: rank exchange before the attempt was agreed")
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
        workers: The upload workers, stopped when an upload outlives its save's
            deadline by :data:`WEDGED_AFTER` (None: nothing to stop).
    """

    def __init__(
        self,
        release: Callable[[Staged], None],
        barrier_timeout: float,
        on_commit: Callable[[str, Manifest], Any] | None,
        on_error: Callable[[BaseException], None],
        workers: WorkerPool | None = None,
    ) -> None:
        self._release = release
        self._timeout = barrier_timeout
        self._on_commit = on_commit
        self._on_error = on_error
        self._workers = workers
        #: Rank 0's commit from the ranks' reports, and its helper process.
        self._helper = CommitHelper()

    def close(self, timeout: float | None = None) -> None:
        """Stop rank 0's commit helper process (if it was started)."""
        self._helper.close(timeout)

    def ends_by(self, writer: DeferredWriter, distributed: bool) -> float | None:
        """The ``time.monotonic()`` by which :meth:`finalize` has settled ``writer``'s
        save (None: the save has no deadline, so its uploads have no bound).

        The uploads end by the deadline plus :data:`WEDGED_AFTER` (and
        :data:`ACT_WITHIN` for the thread to act on it); then rank 0 gathers
        (``barrier_timeout``), while the other ranks wait up to twice that plus 30 s
        for rank 0's outcome (see ``RankExchange.outcome``). An on-commit hook that
        never returns is the one thing that can keep the thread past it. (Not
        counted: a manifest PUT whose outcome must be settled by reading it back once
        the deadline is spent, which has :data:`~objckpt.format.settle.SETTLE_SECONDS`
        of its own; ``close()`` then reports the save abandoned while it settles.)
        """
        if writer.deadline is None:
            return None
        exchange = outcome_wait(self._timeout) if distributed else 0.0
        return writer.deadline.at + WEDGED_AFTER + exchange + ACT_WITHIN

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
        url = writer.target.location.url
        counter = writer.target.request_counter
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
        split = distributed and splits_commit(writer.target.location, world)
        if split and writer.target.rank == 0:
            try:  # its start overlaps the uploads
                self._helper.start()
            except Exception as exc:  # the commit tries again, inside the exchange
                logger.warning("the commit helper did not start early: %s", describe(exc))
        queueing_error = writer.queue_deferred()
        refusal = writer.pass_gate()  # rank 0's "already committed?" (target_check)
        if refusal is not None:  # nothing was uploaded; no rank gathers
            self._release(staged)
            raise refusal
        if split and writer.target.rank == 0 and writer.global_plan is not None:
            self._helper.prepare_layout(writer.global_plan)  # while the uploads run
        results, error = _collect(writer, self._workers)
        error = queueing_error or error
        self._release(staged)
        handle.record_written(written_objects(results))
        rank_plan = writer.rank_plan
        assert rank_plan is not None
        if not distributed:
            if error is not None:
                raise error
            manifest = self._commit(writer, [results], world)
            self._after_commit(writer, handle, manifest)
            return manifest
        exchange = exchange_for(writer, process_group, world, self._timeout)
        report: Any = results
        if error is None and split:
            try:  # this rank's own index object, before it reports
                report = write_rank_index(
                    writer.target.store,
                    results,
                    rank_plan.rank,
                    rank_plan.attempt,
                    lambda: writer.target.requests,
                    (i.index for i in writer.items),
                    writer.target.upload.writes_stock_metadata(world),
                )
            except BaseException as exc:
                error = exc
        exchange.post(error is None, report if error is None else describe(error))
        if rank_plan.rank == 0:
            return self._coordinate(writer, handle, exchange, world, split)
        if error is not None:
            raise error
        outcome = exchange.outcome()
        if outcome is not None:
            raise UploadError(outcome)
        return None

    def _coordinate(
        self,
        writer: DeferredWriter,
        handle: SaveHandle,
        exchange: RankExchange,
        world: int,
        split: bool,
    ) -> Manifest:
        # The other ranks wait outcome_wait(barrier_timeout) from their reports, which
        # came at most barrier_timeout before this one: the outcome is published
        # before then.
        commit_by = time.monotonic() + self._timeout + COMMIT_SECONDS
        published: list[Manifest] = []

        def committed(manifest: Manifest) -> None:  # decided by the manifest: tell them now
            published.append(manifest)  # first: no error is published after a None may have been
            exchange.publish_outcome(None)

        try:
            reports = exchange.gather()
            if split:
                manifest = self._helper.commit(writer, reports, world, commit_by, committed)
            else:
                manifest = self._commit(writer, reports, world, committed)
        except BaseException as exc:
            if not published:
                exchange.publish_outcome(describe(exc))
                raise
            if not isinstance(exc, Exception):  # an interrupt: the save stays committed
                raise
            # Step 4 logs its own failures; anything else after the commit is logged
            # too: the save is committed, as every other rank was told.
            logger.error(
                "%s committed, but rank 0 failed after it: %s",
                writer.target.location.url,
                describe(exc),
            )
            manifest = published[0]
        self._after_commit(writer, handle, manifest)
        return manifest

    def _commit(
        self,
        writer: DeferredWriter,
        results: list[list[WriteResult]],
        world: int,
        committed: Callable[[Manifest], None] | None = None,
    ) -> Manifest:
        if writer.global_plan is None or writer.rank_plan is None:
            raise InternalError("internal: commit without DCP metadata on the coordinator")
        target = writer.target
        manifest = commit_checkpoint(
            target.store,
            writer.global_plan.metadata(),
            results,
            attempt=writer.rank_plan.attempt,
            world_size=world,
            overwrite=target.overwrite,
            user=target.user_metadata,
            checkpoint_id=target.checkpoint_id,
            base=target.reuse_from,
            committed=committed,
            plan=writer.global_plan,
            stock=target.upload.writes_stock_metadata(world),
        )
        target.close()
        return manifest

    def _after_commit(self, writer: DeferredWriter, handle: SaveHandle, manifest: Manifest) -> None:
        """The commit hooks (the checkpointer's, then the save's own), once every rank
        can learn that the save committed: an error is logged, never the save's
        outcome (the checkpoint is committed)."""
        if self._on_commit is not None:
            url = writer.target.location.url
            try:
                self._on_commit(url, manifest)
            except Exception:
                logger.exception("the on-commit hook failed after %s committed", url)
        handle.run_commit_hook(manifest)


def splits_commit(location: Location, world: int) -> bool:
    """Whether a distributed save's commit runs in rank 0's helper process (each rank
    writes its own index, the helper reads them all back): only with more than one
    rank and a store every process reaches alike. A ``file://`` path may be
    node-local (a LocalTier: each node's own directory) and ``memory://`` is private
    to its process, so there rank 0 commits in-thread from the posted write results."""
    return world > 1 and store_family(location.protocol).shared_by_processes


def _collect(
    writer: DeferredWriter, workers: WorkerPool | None
) -> tuple[list[WriteResult], BaseException | None]:
    """This rank's write results (and its request totals), or its first upload error.

    Waits until the save's deadline plus :data:`WEDGED_AFTER`: an upload still
    outstanding then is held by a wedged worker (a live one fails its requests at
    the deadline), so the save fails with a :class:`SaveDeadlineError` naming the
    objects, and those workers are killed so the next save gets fresh ones.
    """
    results: list[WriteResult] = []
    error: BaseException | None = None
    deadline = writer.deadline
    futures = [p.future for p in writer.pending]
    timeout = None if deadline is None else max(0.0, deadline.remaining() + WEDGED_AFTER)
    _, outstanding = concurrent.futures.wait(futures, timeout=timeout)
    if outstanding and deadline is not None:
        keys = [p.obj.key for p in writer.pending if p.future in outstanding]
        named = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        error = deadline.error(
            f"the upload of {len(keys)} object(s) ({named}) had no answer from its upload "
            f"worker {WEDGED_AFTER:g} s past the deadline (the worker is stuck; it was stopped)"
        )
        if workers is not None:
            workers.terminate(outstanding, f"{deadline.who}: no answer past the save's deadline")
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_result(None)
    for p in writer.pending:
        if p.future in outstanding:
            continue
        try:
            record = p.future.result()
        except BrokenProcessPool as exc:
            if error is None:
                error = UploadError(
                    f"an upload worker died while saving {writer.target.location.url} "
                    f"(killed or out of memory: {exc}); the save was not committed"
                )
                error.__cause__ = exc
            continue
        except BaseException as exc:
            if error is not None:  # the first error is the save's; the rest go to the log
                logger.debug("another upload of %s failed too: %s", p.obj.key, describe(exc))
            error = error or exc
            continue
        writer.target.request_counter.add(record.requests)
        results.extend(written_object(p.obj, writer.items, record, done).write_results())
    # The rank's requests so far travel with its results; the coordinator sums them.
    results.append(requests_result(writer.target.requests))
    return results, error
