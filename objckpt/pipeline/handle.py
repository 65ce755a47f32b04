"""``SaveHandle``: what the caller holds while an async save finishes in the background.

A handle is a thin view over a ``concurrent.futures.Future`` so the caller never
touches the pipeline's threads: it can poll (``done``), wait (``result``), or be
told (``add_done_callback``), and the save's own error is re-raised unchanged.

Its whole lifecycle is given when it is built, so no other module reaches inside
it: the time bound the pipeline guarantees (``ends_by``) and what the caller runs
when the save ends, before the handle reports it (a :class:`SaveLifecycle`: the
manager's bookkeeping, a local save's promotion). The pipeline then drives the
transitions it owns through public methods: :meth:`SaveHandle.record_written`
(this rank's objects, before the save resolves), :meth:`SaveHandle.run_commit_hook`
(the coordinator's, once committed) and :meth:`SaveHandle.settled` (a wait no
longer than the save's own bound).

A save has up to three ends: its commit, durable on the primary (a promoted local
save) and replicated on other nodes (a local tier with replicas). Each is one
:class:`_End`: the future that reports it, when it was reached and a wait that
names it, so the three never drift apart.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, cast

from objckpt.format.manifest import Manifest, ObjectEntry
from objckpt.writers.accounting import RequestCounter, RequestStats

__all__ = ["EndHook", "SaveHandle", "SaveLifecycle"]

logger = logging.getLogger(__name__)

#: Runs when a save ends, before its handle reports it: ``hook(handle, error or None)``.
EndHook = Callable[["SaveHandle", BaseException | None], None]


@dataclasses.dataclass(frozen=True)
class SaveLifecycle:
    """What the caller of a save attaches to its handle when it is built.

    Attributes:
        tier: ``"primary"`` (the object store) or ``"local"`` (a LocalTier).
        promotion: A local save picked for promotion: ends when the step is
            committed on the primary (None: not promoted, or not a local save).
        replication: A local save whose files other nodes copy (``LocalTier(replicas=)``):
            ends with True once every node's files of the step are held by the
            tier's other nodes too, False when replication failed (never an error:
            the step stays committed on the local tier).
        on_end: Run in order when the save ends, before the handle reports it, so
            whoever waits on the handle sees what they recorded (the manager's step
            lists). A hook's own failure is logged, never the save's outcome.
        on_commit: Run on the coordinator (rank 0) once the save's manifest is
            committed, with that manifest, on the commit's thread (what the manager
            does for the whole job: record the step, back it up, apply retention).
            Its failure is logged, never the save's outcome.
    """

    tier: Literal["primary", "local"] = "primary"
    promotion: concurrent.futures.Future[None] | None = None
    replication: concurrent.futures.Future[bool] | None = None
    on_end: tuple[EndHook, ...] = ()
    on_commit: Callable[[Manifest], None] | None = None


def _reached(at: list[float], fut: concurrent.futures.Future[Any]) -> None:
    """Record in ``at`` when ``fut`` succeeded (a replication that returned False did not)."""
    if not fut.cancelled() and fut.exception() is None and fut.result() is not False:
        at.append(time.monotonic())


class _End:
    """One end a save reaches: the future that reports it, when it was reached, and a
    wait that names it when it times out.

    Args:
        what: The end, as a timeout names it (``"finished"``, ``"durable"``).
        url: The save's URL, named in a timeout.
        started: The save's ``time.monotonic()`` start.
        future: What the wait returns (its result; its error re-raised).
        timed_by: The future whose success reaches the end (default ``future``); one
            that returns False has not (a replication that failed).
    """

    def __init__(
        self,
        what: str,
        url: str,
        started: float,
        future: concurrent.futures.Future[Any],
        timed_by: concurrent.futures.Future[Any] | None = None,
    ) -> None:
        self.what = what
        self.future = future
        self._url = url
        self._started = started
        self._at: list[float] = []  # when it was reached (empty: not yet)
        # A future keeps its callbacks: a bound method of this end would make a
        # cycle (end -> future -> callback -> end) holding the result (the manifest)
        # until a full collection of the cyclic garbage collector.
        (timed_by or future).add_done_callback(functools.partial(_reached, self._at))

    @property
    def seconds(self) -> float | None:
        """Seconds from the save's start to this end (None: not reached)."""
        return self._at[0] - self._started if self._at else None

    def wait(self, timeout: float | None) -> Any:
        """The end's result, waiting up to ``timeout`` seconds; re-raises its error.

        Raises:
            TimeoutError: Not reached within ``timeout`` seconds.
        """
        try:
            return self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self.future.done():  # its own error is a TimeoutError (a barrier's)
                raise
            raise TimeoutError(f"save of {self._url} not {self.what} within {timeout} s") from None


class SaveHandle:
    """The outcome of one async save.

    ``result()`` returns the committed :class:`~objckpt.Manifest` on the
    coordinator and None on other ranks (once the coordinator has committed).

    A save to the object store is durable when it commits. A save to a
    :class:`~objckpt.LocalTier` commits on this node's disk first; it is durable
    once promoted to the primary root (``wait_durable``), and never when the
    tier's ``promote_every`` does not pick it (``will_be_durable`` is then False).
    """

    def __init__(
        self,
        url: str,
        future: concurrent.futures.Future[Manifest | None],
        counter: RequestCounter | None = None,
        staged: threading.Event | None = None,
        *,
        ends_by: float | None = None,
        lifecycle: SaveLifecycle | None = None,
        waited_for_earlier: float = 0.0,
        attempt: str | None = None,
    ) -> None:
        lifecycle = lifecycle or SaveLifecycle()
        self.url = url
        self._staged = staged
        self._counter = counter or RequestCounter()
        #: Seconds ``save`` waited for earlier saves to finish uploading before it
        #: could stage this one (``AsyncOptions.max_saves_in_flight``): part of the stall.
        self.waited_for_earlier = waited_for_earlier
        #: The save attempt's id (the same on every rank).
        self.attempt = attempt
        #: ``"primary"`` (the object store) or ``"local"`` (a LocalTier).
        self.tier: Literal["primary", "local"] = lifecycle.tier
        self._ends_by = ends_by
        self._on_commit = lifecycle.on_commit
        self._started = started = time.monotonic()
        self._written: tuple[ObjectEntry, ...] = ()
        hooks = lifecycle.on_end
        # What the handle reports: the commit's outcome once the hooks ran. The commit's
        # time is taken first, so a hook sees it.
        reported: concurrent.futures.Future[Manifest | None] = (
            concurrent.futures.Future() if hooks else future
        )
        self._commit = _End("finished", url, started, reported, timed_by=future)
        if hooks:
            future.add_done_callback(self._relay(reported, hooks))
        self._future = reported
        self._durable = (
            None
            if lifecycle.promotion is None
            else _End("durable", url, started, lifecycle.promotion)
        )
        self._replicated = (
            None
            if lifecycle.replication is None
            else _End("replicated", url, started, lifecycle.replication)
        )

    def run_commit_hook(self, manifest: Manifest) -> None:
        """Coordinator, the commit's thread: the save committed ``manifest``; run the
        lifecycle's ``on_commit`` (its failure is logged: the step is committed)."""
        if self._on_commit is None:
            return
        try:
            self._on_commit(manifest)
        except Exception:
            logger.exception("the on-commit hook failed after %s committed", self.url)

    def _relay(
        self, outer: concurrent.futures.Future[Manifest | None], hooks: tuple[EndHook, ...]
    ) -> Callable[[concurrent.futures.Future[Manifest | None]], None]:
        """Settles ``outer`` with the commit's outcome, once ``hooks`` ran."""

        def relay(f: concurrent.futures.Future[Manifest | None]) -> None:
            exc = f.exception()
            for hook in hooks:
                try:
                    hook(self, exc)
                except Exception:
                    logger.exception("after the save of %s", self.url)
            if exc is not None:
                outer.set_exception(exc)
            else:
                outer.set_result(f.result())

        return relay

    @property
    def ends_by(self) -> float | None:
        """The ``time.monotonic()`` by which the pipeline has settled this save, even
        with a worker or the store stuck (None: the save has no deadline). A wait
        past it would wait for something stuck: closing gives up on it there."""
        return self._ends_by

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the state dict is copied to staging memory; from then on the
        caller may change its tensors. Returns at once unless
        ``AsyncOptions.background_staging`` deferred the copy; False on timeout.
        A copy that failed (a tensor changed before it ended) also counts as over:
        its error is the save's (``result()``)."""
        return True if self._staged is None else self._staged.wait(timeout)

    def record_written(self, objects: tuple[ObjectEntry, ...]) -> None:
        """The pipeline records this rank's objects before the save resolves."""
        self._written = objects

    @property
    def written(self) -> tuple[ObjectEntry, ...]:
        """The payload objects this rank wrote (key, size, CRC32C), once done."""
        return self._written

    @property
    def seconds_to_commit(self) -> float | None:
        """Seconds from ``save`` to the commit of this save's tier (None: not yet)."""
        return self._commit.seconds

    # -- durability -----------------------------------------------------------------------
    @property
    def will_be_durable(self) -> bool:
        """False for a local save its tier does not promote."""
        return self.tier == "primary" or self._durable is not None

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until the save is committed on the primary root; False when it never
        will be (a local step not promoted). Re-raises the save's or the promotion's
        error.

        Raises:
            TimeoutError: Not durable within ``timeout`` seconds.
        """
        if self.tier == "primary":
            self.result(timeout)
            return True
        if self._durable is None:
            self.result(timeout)
            return False
        self._durable.wait(timeout)
        return True

    @property
    def seconds_to_durable(self) -> float | None:
        """Seconds from ``save`` to the commit on the primary (None: not durable yet)."""
        if self.tier == "primary":
            return self.seconds_to_commit
        return None if self._durable is None else self._durable.seconds

    # -- replicas on other nodes ----------------------------------------------------------
    @property
    def will_be_replicated(self) -> bool:
        """Whether other nodes copy this save's files (a local save with
        ``LocalTier(replicas=)`` >= 2 over more than one node)."""
        return self._replicated is not None

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait until other nodes hold this save's files; True once every node's
        files of the step are held by the tier's ``replicas`` nodes, False when
        replication failed or is not asked for. A replication failure is reported
        here (and in ``tier_status()``), never raised: the step stays committed on
        the local tier. Re-raises the save's own error.

        Raises:
            TimeoutError: Replication still running after ``timeout`` seconds.
        """
        self.result(timeout)
        if self._replicated is None:
            return False
        try:
            return bool(self._replicated.wait(timeout))
        except concurrent.futures.CancelledError:
            return False

    @property
    def seconds_to_replicated(self) -> float | None:
        """Seconds from ``save`` until other nodes held its files (None: not yet, or never)."""
        return None if self._replicated is None else self._replicated.seconds

    @property
    def requests(self) -> RequestStats:
        """Store requests this rank made for the save so far (its upload workers'
        included once their objects are done; final once ``done()``)."""
        return self._counter.snapshot()

    @property
    def total_requests(self) -> RequestStats | None:
        """Every rank's requests, as recorded in the committed manifest (the
        coordinator's handle, once committed; None elsewhere)."""
        if not self._future.done() or self._future.exception() is not None:
            return None
        manifest = self._future.result()
        return None if manifest is None else manifest.requests

    def done(self) -> bool:
        """True once the save has committed or failed (never blocks)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Manifest | None:
        """Wait for the commit; re-raises the save's error.

        Raises:
            TimeoutError: Not finished within ``timeout`` seconds.
        """
        return cast("Manifest | None", self._commit.wait(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it committed), waiting up to ``timeout`` seconds."""
        return self._future.exception(timeout)

    def settled(self, until: float | None = None) -> bool:
        """Wait until the save ends, at most until ``until`` (a ``time.monotonic()``;
        None: no bound of the caller's), never past its own bound :attr:`ends_by`;
        whether it ended."""
        bounds = [b for b in (until, self._ends_by) if b is not None]
        until = min(bounds) if bounds else None
        timeout = None if until is None else max(0.0, until - time.monotonic())
        try:
            self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            return self._future.done()
        return True

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        """Call ``fn(handle)`` once the save has committed or failed."""
        self._future.add_done_callback(lambda _: fn(self))
