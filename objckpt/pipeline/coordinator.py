"""Rank 0's side of an async commit from the ranks' reports, its O(W) work in a helper.

Every rank wrote its own index object (the commit's step 1) before it reported.
Rank 0's training process gathers W small :class:`~objckpt.format.commit.RankReport`
records, then (on its commit thread; the steps of :mod:`objckpt.format.commit`):

2. asks its commit helper process to prepare the commit
   (:func:`~objckpt.pipeline.stock_task.prepare_stock`): rename the last
   ``.metadata`` of the plan where every rank's items are the same, read back the
   index objects where the store does not verify PUTs, read what an overwrite
   replaces; nothing is decoded there;
3. writes the manifest (one listing, the create-only PUT settled by read-back):
   the plan's :class:`~objckpt.format.commit.Layout`, built once per global
   plan with each chunk's writer from the plan, completed with this save's index
   keys and the ranks' ``raw_bytes``, naming ``.metadata`` where step 2 renamed it;
4. tells the other ranks the save committed, then asks the helper to write
   ``.metadata``, built whole from the index objects first where step 2 renamed none
   (:func:`~objckpt.pipeline.stock_task.publish_stock`), and delete what an
   overwrite replaced; rank 0's save completes once it did (or failed: logged, the
   checkpoint stays committed, as in-thread).

These are the steps of :func:`~objckpt.format.commit.commit_sequence`, the one
implementation of the commit's order; :class:`InHelper` is its helper-process
strategy (the in-thread one is ``format/commit.py``'s ``InThread``), and both build
``.metadata`` with the same code, so it is the same bytes. Each wait on the helper
is bounded, and a helper that does not answer in time is stopped (the next commit
starts a fresh one). Step 2 ends by the earlier of two bounds: ``commit_by``, the
time by which rank 0 must publish the outcome before the other ranks stop waiting
for it, less :data:`MANIFEST_RESERVE` for the manifest; and the save's deadline plus
:data:`~objckpt.pipeline.workers.WEDGED_AFTER` (the helper's reads end by then) plus
:data:`CPU_ALLOWANCE`. Then the save fails, nothing committed. Step 4 gets the settle
bound (:data:`~objckpt.format.settle.SETTLE_SECONDS`) for the PUT, or step 2's bound
where it builds ``.metadata`` first, each less when ``commit_by`` is nearer, inside
the helper, and that plus ``WEDGED_AFTER`` here; past it the helper is stopped, so
nothing it does lands after the save's handle completed.

Stopping the helper stops every commit it holds: with ``max_saves_in_flight > 1`` another
save's step 2 fails (that save fails on every rank, nothing committed) and a
``.metadata`` another save prepared but had not yet written is lost (that save stays
committed, without ``.metadata``, logged).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from objckpt.errors import InternalError, UploadError
from objckpt.format.commit import (
    CommitStrategy,
    GlobalPlan,
    Prepared,
    RankReport,
    StockLayout,
    commit_sequence,
    save_storage_meta,
)
from objckpt.format.index import with_writers
from objckpt.format.manifest import Manifest
from objckpt.format.settle import SETTLE_SECONDS, finish_without_metadata
from objckpt.options import UploadOptions
from objckpt.pipeline import stock_task
from objckpt.pipeline.deferred import DeferredWriter
from objckpt.pipeline.workers import WEDGED_AFTER, WorkerPool
from objckpt.writers.accounting import RequestStats
from objckpt.writers.deadline import Deadline
from objckpt.writers.location import Location

__all__ = ["CPU_ALLOWANCE", "MANIFEST_RESERVE", "CommitHelper", "InHelper"]

logger = logging.getLogger(__name__)

#: Seconds the helper's decoding and pickling may take past the save's deadline
#: (its reads end by the deadline; its CPU work is not a request).
CPU_ALLOWANCE = 60.0
#: Seconds of ``commit_by`` kept for the manifest's listing and PUT after step 2.
MANIFEST_RESERVE = 10.0


class CommitHelper:
    """Rank 0's commit from reports, with its helper process (started on rank 0's
    first commit from reports, restarted after it died or was stopped, until
    :meth:`close`)."""

    def __init__(self) -> None:
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the helper process in the background (rank 0, before its first
        commit: its interpreter and torch import overlap the uploads).

        Raises:
            UploadError: The helper is closed, or its process could not be started.
        """
        self._run(None)

    def _submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` in the helper, started if need be (UploadError as :meth:`start`)."""
        future = self._run(fn, *args)
        assert future is not None
        return future

    def _run(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any] | None:
        """Run ``fn(*args)`` in the helper (None: only start it). Under the lock, so
        that :meth:`close` cannot miss a process started here."""
        with self._lock:
            if self._closed:
                raise UploadError("the commit helper is closed (the checkpointer was closed)")
            fresh = self._pool is None
            if fresh:
                self._pool = WorkerPool(1, name="commit")
            pool = self._pool
            assert pool is not None
            try:
                if fn is not None:
                    return pool.submit(fn, *args)
                if fresh:  # imports torch there now
                    pool.submit(stock_task.discard_stock, "")
                else:  # a fresh process if the last one died or was stopped
                    pool.start()
                return None
            except OSError as exc:
                raise UploadError(
                    f"the commit helper process could not be started ({exc}); nothing was committed"
                ) from exc

    def pids(self) -> list[int]:
        """The live helper process (for tests and diagnostics)."""
        pool = self._pool
        return [] if pool is None else pool.pids()

    def close(self, timeout: float | None = None) -> None:
        """Stop the helper; later commits from reports are refused."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout)

    def _terminate(self, future: concurrent.futures.Future[Any], reason: str) -> bool:
        """Stop the helper if it still holds ``future``; whether it did."""
        pool = self._pool
        return pool is not None and bool(pool.terminate([future], reason))

    @staticmethod
    def prepare_layout(plan: GlobalPlan) -> None:
        """Build the plan's layout now, while the uploads run, so that the first save
        of a plan does not build it inside the commit, where every rank waits for the
        outcome (O(chunks): about 0.5 CPU-s at 1,024 ranks, 7 at 8,192; later saves
        of the plan keep it, and no longer DCP's ``Metadata``).

        A failure here is logged and left to the commit, which builds the layout
        again inside the rank exchange and so reports the error to every rank.
        """
        try:
            plan.layout()
        except Exception as exc:
            logger.warning("building the plan's layout before the commit failed: %s", exc)

    def commit(
        self,
        writer: DeferredWriter,
        reports: Sequence[RankReport],
        world: int,
        commit_by: float | None = None,
        committed: Callable[[Manifest], None] | None = None,
    ) -> Manifest:
        """Commit the save ``reports`` describe (see the module doc) through
        :func:`~objckpt.format.commit.commit_sequence` with :class:`InHelper`.

        Args:
            commit_by: The ``time.monotonic()`` by which the outcome must be
                published (the other ranks stop waiting then); None: no bound.
            committed: Called once the manifest is committed, before step 4.
        """
        if writer.global_plan is None or writer.rank_plan is None:
            raise InternalError("internal: commit without DCP metadata on the coordinator")
        target = writer.target
        attempt = writer.rank_plan.attempt
        manifest = commit_sequence(
            target.store,
            InHelper(self, writer, reports, commit_by),
            reports,
            attempt=attempt,
            world_size=world,
            overwrite=target.overwrite,
            user=target.user_metadata,
            requests=sum((r.requests for r in reports), RequestStats()),
            base=target.reuse_from,
            committed=committed,
        )
        target.close()
        return manifest

    def publish(
        self,
        location: Location,
        options: UploadOptions,
        attempt: str,
        named: frozenset[str],
        commit_by: float | None = None,
        deadline: Deadline | None = None,
        writers: dict[str, Any] | None = None,
        stock: bool = True,
    ) -> bool:
        """Step 4, after the commit: the helper writes ``.metadata`` (built whole first
        when ``writers``, the manifest's, are given: no template applied) and deletes
        what an overwrite replaced. Bounded so that rank 0's save still ends in time
        (past the bound the helper is stopped): the settle bound for the PUT, no later
        than ``commit_by`` allows, and where it builds first, everything by the bound
        step 2 had when it built it before the commit (:func:`prepare_bound`; none
        without a deadline or ``commit_by``), the PUT's settle bound starting after
        the build. Whether ``.metadata`` was written (without ``stock``: whether the
        one the URL held was deleted); when not, logged here (the save stays
        committed)."""
        now = time.monotonic()
        until = None  # when a build (writers given) must have ended, PUT included
        settle = SETTLE_SECONDS
        if writers is not None:
            until, _ = prepare_bound(deadline, commit_by)
            wait = None if until is None else max(0.0, until - now) + WEDGED_AFTER
        else:
            settle = settle_left(commit_by)
            wait = settle + WEDGED_AFTER
        reason: str | None = "it was not asked to"
        try:
            future = self._submit(
                stock_task.publish_stock, location, options, attempt, named, settle, writers, until
            )
            try:
                reason = future.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                self._terminate(future, f"writing {location.url}'s .metadata took too long")
                reason = f"no answer within {wait:g} s; the helper was stopped"
        except Exception as exc:
            reason = str(exc)
        if reason is not None and stock:
            logger.error(
                "%s committed, but its commit helper did not write .metadata (%s); stock DCP "
                "readers do not see this checkpoint yet and `objckpt verify` reports it; "
                "objckpt's readers load it",
                location.url,
                reason,
            )
        elif reason is not None:
            logger.warning(
                "%s committed, but its commit helper did not finish step 4 (%s)",
                location.url,
                reason,
            )
        return reason is None

    def _discard(self, attempt: str) -> None:
        """Forget ``attempt``'s prepared ``.metadata`` in the helper (best effort)."""
        try:
            self._submit(stock_task.discard_stock, attempt)
        except Exception as exc:
            logger.debug("could not discard the prepared .metadata of %s: %s", attempt, exc)

    def bounded(
        self,
        future: concurrent.futures.Future[Any],
        until: float | None,
        deadline: Deadline | None,
        what: str,
        attempt: str = "",
    ) -> Any:
        """``future``'s result by ``until`` (a ``time.monotonic()``; None: no bound).
        Past it the helper hangs: it is stopped (the next commit starts a fresh one)
        and the save fails; a helper that died fails it with UploadError.

        Args:
            deadline: The save's deadline when ``until`` is its bound (None: it is not).

        Raises:
            SaveDeadlineError: No answer by ``until``, the deadline's bound.
            UploadError: No answer by ``until`` (the exchange's bound), or the helper died.
        """
        timeout = None if until is None else max(0.0, until - time.monotonic())
        try:
            return future.result(timeout=timeout)
        except BrokenProcessPool as exc:  # killed, or out of memory: the next save starts one
            raise UploadError(
                f"{what}: the commit helper process died ({exc}); nothing was committed"
            ) from exc
        except concurrent.futures.TimeoutError:
            if not self._terminate(future, f"{what}: no answer within {timeout:g} s"):
                self._discard(attempt)  # it answered just now: its pickle is not needed
            message = (
                f"{what}: the commit helper process had no answer within {timeout:g} s "
                "(it was stopped); nothing was committed"
            )
            if deadline is not None:
                raise deadline.error(message) from None
            raise UploadError(message) from None


class InHelper(CommitStrategy):
    """Steps 2 and 4 of one commit in rank 0's commit helper process, from the index
    objects every rank wrote itself (the module doc; why: :mod:`objckpt.format.commit`)."""

    def __init__(
        self,
        helper: CommitHelper,
        writer: DeferredWriter,
        reports: Sequence[RankReport],
        commit_by: float | None,
    ) -> None:
        assert writer.global_plan is not None and writer.rank_plan is not None
        self._helper = helper
        self._writer = writer
        self._plan = writer.global_plan
        self._attempt = writer.rank_plan.attempt
        self._keys = [None if r.index is None else r.index.key for r in reports]
        self._indexes = [(rank, r.index) for rank, r in enumerate(reports) if r.index is not None]
        self._digests = [r.stock_digest for r in reports if r.index is not None]
        self._raw_bytes = sum(r.raw_bytes for r in reports)
        self._commit_by = commit_by
        #: Whether the save writes ``.metadata`` (UploadOptions.stock_metadata_max_ranks).
        self._stock = writer.target.upload.writes_stock_metadata(len(reports))
        #: Whether ``.metadata`` is built after the commit (no template applied).
        self._whole = False

    def prepare(self) -> Prepared:
        writer, target = self._writer, self._writer.target
        store = target.store
        layout = self._plan.layout()
        if layout.writers is None:
            raise InternalError("internal: a commit from reports without the plan's writers")
        storage_meta = save_storage_meta(
            self._plan.storage_meta, store.location.url, target.checkpoint_id, self._attempt
        )
        stock = None  # what building .metadata needs, where the save writes it
        if self._stock:
            stock = StockLayout(
                layout.for_save(True, self._keys, storage_meta),
                layout.properties,
                self._plan.planner_data,
                storage_meta,
                layout.token,
            )
        what = f"preparing {store.location.url}'s commit ({len(self._indexes)} index objects)"
        until, limit = prepare_bound(writer.deadline, self._commit_by)
        prepared: stock_task.StockPrepared = self._helper.bounded(
            self._helper._submit(
                stock_task.prepare_stock,
                store.location,
                target.upload,
                writer.deadline,
                self._attempt,
                stock,
                self._indexes,
                target.overwrite,
                self._digests,
            ),
            until,
            limit,
            what,
            self._attempt,
        )
        self._whole = self._stock and prepared.metadata is None
        doc = with_writers(
            layout.for_save(False, self._keys, storage_meta),
            layout.writers,
            self._keys,
            self._raw_bytes,
        )
        return Prepared(doc, prepared.metadata, prepared.requests, self._stock)

    def discard(self) -> None:
        self._helper._discard(self._attempt)

    def publish(self, named: frozenset[str]) -> bool:
        target = self._writer.target
        layout = self._plan.layout()
        done = self._helper.publish(
            target.store.location,
            target.upload,
            self._attempt,
            named,
            self._commit_by,
            self._writer.deadline,
            layout.writers if self._whole else None,
            self._stock,
        )
        if done or self._stock:
            return done
        # The helper did not delete the .metadata this save replaces (restarted,
        # stopped): it needs nothing the helper held, so rank 0 does, within what is
        # left of the step's bound (the replaced objects stay for gc: what they were
        # died with the helper).
        url = target.store.location.url
        seconds = settle_left(self._commit_by)
        if seconds <= 0:
            logger.warning(
                "%s committed; no time is left to delete the .metadata it replaces "
                "(`objckpt verify` reports one of another attempt)",
                url,
            )
            return False
        logger.warning("%s committed: rank 0 deletes the .metadata it replaces itself", url)
        bound = stock_task.after_commit(seconds, f"{url}'s step 4")
        return finish_without_metadata(target.store, frozenset(), bound=bound) is None


def settle_left(commit_by: float | None) -> float:
    """Seconds step 4's PUT or DELETE may take after the commit: the settle bound, less
    where ``commit_by`` (a ``time.monotonic()``) is nearer, keeping ``WEDGED_AFTER``
    for the answer to come back (0: none left)."""
    if commit_by is None:
        return SETTLE_SECONDS
    return max(0.0, min(SETTLE_SECONDS, commit_by - time.monotonic() - WEDGED_AFTER))


def prepare_bound(
    deadline: Deadline | None, commit_by: float | None
) -> tuple[float | None, Deadline | None]:
    """When step 2 must have answered (a ``time.monotonic()``; None: no bound): the
    earlier of ``commit_by`` less :data:`MANIFEST_RESERVE` and the deadline plus
    ``WEDGED_AFTER`` plus :data:`CPU_ALLOWANCE`; with ``deadline`` when it is that
    bound (a miss is then the deadline's error), else None."""
    by_exchange = None if commit_by is None else commit_by - MANIFEST_RESERVE
    by_deadline = None if deadline is None else deadline.at + WEDGED_AFTER + CPU_ALLOWANCE
    if by_deadline is not None and (by_exchange is None or by_deadline <= by_exchange):
        return by_deadline, deadline
    return by_exchange, None
