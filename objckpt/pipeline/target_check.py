"""What an async save knows about its target, and the one question it asks off the stall.

Two round trips could sit in ``save()`` before it returns, and neither needs to:

* the **preflight** (bucket reachable, credentials may write): needed once per
  bucket and process, before the first copy, so credentials that cannot write fail
  before anything is staged. :class:`TargetCache` remembers the buckets proven and
  keeps one filesystem client per store settings (:class:`~objckpt.writers.clients.OwnedClients`),
  so later saves pay for neither.
* **"already committed?"** (one LIST of the URL, and a GET of a manifest found):
  tens to hundreds of milliseconds on S3, longer than copying a quarter of a GiB.
  A :class:`~objckpt.CheckpointManager` never asks: its step catalog knows which
  steps are committed (``SaveRequest.exists``), and the create-only manifest is the
  real guard against a writer it does not know about. A bare save asks on rank 0,
  on the checkpointer's checker thread, while the caller's tensors are copied;
  ``save()`` returns without the answer and the save's uploads are held
  (:meth:`~objckpt.pipeline.deferred.DeferredWriter.hold_uploads`) until its
  commit thread has it::

      rank 0, checker thread:  the check -> (attempt agreed) publish the answer
      rank 0, commit thread:   wait for the check (bounded by the save's deadline)
      others, commit thread:   wait for the answer under ``objckpt/<attempt>/checked``

  (A rank staged in waves reuses its staging memory once a wave is uploaded, so
  it cannot hold uploads: it waits for the answer before its first upload.)

A refusal fails the save on every rank with nothing uploaded: rank 0 raises its
own error (:class:`~objckpt.errors.CheckpointExistsError`), the others a
:class:`~objckpt.errors.PeerRankError` naming rank 0. The answer travels through
the c10d store, set on rank 0's checker thread and read on the other ranks' commit
threads, never through a collective on the training thread: one key set by rank
0, one read and one counter add by each other rank (the last reader deletes both),
so no rank's cost grows with the world size.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import pickle
import threading
from typing import Any

from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.errors import BarrierTimeoutError, PeerRankError
from objckpt.pipeline.finalize import outcome_wait
from objckpt.pipeline.workers import WEDGED_AFTER
from objckpt.writers.accounting import RequestCounter
from objckpt.writers.clients import OwnedClients
from objckpt.writers.deadline import Deadline
from objckpt.writers.translate import describe

__all__ = ["CheckGate", "TargetCache"]

logger = logging.getLogger(__name__)


class TargetCache:
    """Filesystem clients by store settings and buckets already proven writable.

    A save's stall should not pay for a new HTTP session or a preflight round trip,
    so both outlive the save that created them. The clients are this cache's own
    (not the process's shared ones), so that :meth:`close` can release them with
    the loop thread they run on: a closed checkpointer leaves no thread or socket.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients = OwnedClients("objckpt-saves")  # one client per settings
        self._checked: set[tuple[str, str]] = set()

    def attach(self, target: ObjectStoreWriter) -> None:
        """Give ``target`` the client for its settings, a request counter, and a preflight
        only when its bucket has not been proven writable yet. "Already committed?"
        is left to the save (see the module docstring)."""
        loc = target.location
        with self._lock:
            target.attach(
                clients=self._clients,
                preflight=(loc.protocol, loc.bucket) not in self._checked,
                requests=RequestCounter(),
                check_existing=False,
            )

    def proven(self, target: ObjectStoreWriter) -> None:
        """Record that a save to ``target``'s bucket got past its preflight."""
        with self._lock:
            self._checked.add((target.location.protocol, target.location.bucket))

    def close(self, timeout: float) -> None:
        """Close the clients, their connections and their loop thread (no save may
        use them any more; one still running fails), waiting up to ``timeout``
        seconds for each step."""
        self._clients.close(timeout)


class CheckGate:
    """Rank 0's answer to "already committed?" for one save, as every rank waits for it.

    Built before the ranks agree on the save's attempt; its c10d key is named after
    the attempt, read from ``target`` when needed.

    Args:
        check: Rank 0's check (None on the other ranks).
        store: The group's c10d store (None: no other rank to tell or ask).
        target: This rank's writer for the save.
        world: The ranks that save together.
        barrier_timeout: How long other ranks wait for the answer when the save has
            no deadline (:func:`~objckpt.pipeline.finalize.outcome_wait`, as for the commit).
    """

    def __init__(
        self,
        check: concurrent.futures.Future[None] | None,
        store: Any | None,
        target: ObjectStoreWriter,
        world: int,
        barrier_timeout: float,
    ) -> None:
        self._check = check
        self._store = store
        self._target = target
        self._world = world
        self._barrier_timeout = barrier_timeout
        self._answered = False
        self._refusal: BaseException | None = None

    def _key(self) -> str:
        return f"objckpt/{self._target.attempt}/checked"

    def publish(self) -> None:
        """Rank 0, on the checker thread once the attempt is agreed: set the answer's
        key as soon as the check has it, whatever this rank's training thread does
        (a rank staged in waves waits for it before its first upload, inside DCP's
        collectives)."""
        check, store = self._check, self._store
        if check is None or store is None or self._world < 2:
            return
        refusal = check.exception()  # it ran first on this thread
        answer = None if refusal is None else describe(refusal)
        try:
            store.set(self._key(), pickle.dumps(answer))
        except Exception as exc:  # the other ranks then fail on their own wait
            logger.error(
                "cannot tell the other ranks rank 0's answer for %s: %s",
                self._target.location.url,
                describe(exc),
            )

    def answer(self, deadline: Deadline | None) -> BaseException | None:
        """Rank 0's refusal (its own error on rank 0, a :class:`PeerRankError` naming
        it on the others), or a :class:`BarrierTimeoutError` when rank 0 did not answer
        in time; None when the save may upload. Asked once; later calls repeat it.

        Args:
            deadline: The save's: rank 0's check is bounded by it, so the wait for
                the answer ends by it plus :data:`WEDGED_AFTER`.
        """
        if not self._answered:
            self._refusal = self._wait(deadline)
            self._answered = True
        return self._refusal

    def _wait(self, deadline: Deadline | None) -> BaseException | None:
        url = self._target.location.url
        if self._check is not None:
            return _settle(self._check, deadline, url)
        if self._store is None or self._world < 2:
            return None
        store, key = self._store, self._key()
        if deadline is None:
            wait = outcome_wait(self._barrier_timeout)
        else:
            wait = max(1.0, deadline.remaining() + WEDGED_AFTER)
        try:
            store.wait([key], datetime.timedelta(seconds=wait))
        except Exception as exc:  # DistStoreError / RuntimeError on timeout
            error = BarrierTimeoutError(
                f'saving {url}: no answer from rank 0 to "already committed?" within '
                f"{wait:g} s (rank 0 died, hung, or stopped saving); nothing of this save "
                "was uploaded"
            )
            error.__cause__ = exc
            return error
        answer: str | None = pickle.loads(store.get(key))  # objckpt's own rank 0 wrote it
        if store.add(f"{key}/read", 1) == self._world - 1:  # the last reader tidies up
            for k in (key, f"{key}/read"):
                try:
                    store.delete_key(k)
                except Exception as exc:  # a store without deletion only wastes a key
                    logger.debug("cannot delete c10d key %s: %s", k, exc)
        if answer is None:
            return None
        return PeerRankError(
            f"save of {url} was refused on rank 0: {answer}; nothing was uploaded", rank=0
        )


def _settle(
    check: concurrent.futures.Future[None], deadline: Deadline | None, url: str
) -> BaseException | None:
    """Rank 0: its check's error, or None; bounded by the save's deadline (the
    check's requests fail by then; a wait past it plus WEDGED_AFTER is a hang)."""
    if deadline is None:
        return check.exception()
    done, _ = concurrent.futures.wait([check], max(0.0, deadline.remaining() + WEDGED_AFTER))
    if not done:
        return deadline.error(f'the "already committed?" check of {url}')
    return check.exception()
