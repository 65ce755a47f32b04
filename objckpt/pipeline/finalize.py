"""Cross-rank finalization through the c10d store, off the training path.

A commit needs every rank's upload results on the coordinator, and every rank
needs to learn the outcome. DCP does this with collectives, which would force
the training loop to call into the checkpointer on every rank at the same
moment. Instead each rank's background thread posts a small report under a key unique
to the save attempt in the process group's c10d store; the coordinator's thread
waits for all of them with a timeout (a dead rank becomes an error naming it,
never a hang), commits, and posts the outcome for the others to read.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from typing import Any

import torch.distributed as dist

from objckpt._torch import group_store
from objckpt.errors import BarrierTimeoutError, RequestFailedError, UploadError

__all__ = [
    "COMMIT_SECONDS",
    "BarrierTimeoutError",
    "RankExchange",
    "RequestFailedError",
    "StoreBarrier",
    "outcome_wait",
]

logger = logging.getLogger(__name__)

#: Seconds rank 0 is given for the commit itself (manifest, ``.metadata``) once every
#: rank's report is in: the other ranks wait :func:`outcome_wait` for its outcome.
COMMIT_SECONDS = 30.0


def outcome_wait(barrier_timeout: float) -> float:
    """How long a rank waits from its report for rank 0's outcome: the slowest rank's
    report may come ``barrier_timeout`` after this one's, rank 0 may wait
    ``barrier_timeout`` for it, then commits in :data:`COMMIT_SECONDS`."""
    return 2 * barrier_timeout + COMMIT_SECONDS


def _wait(store: Any, keys: list[str], timeout: float, what: str, label: str | None = None) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # DistStoreError / RuntimeError on timeout
        missing = [label or k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
        raise BarrierTimeoutError(
            f"{what}: no report from {', '.join(missing) or 'some ranks'} within {timeout:g} s "
            "(a rank died, hung, or stopped saving)"
        ) from exc


class RankExchange:
    """One save attempt's reports and outcome, exchanged through the store.

    Keys live under ``objckpt/<attempt>/``. A rank's report is small (each rank
    wrote its own index object first: :mod:`objckpt.format.commit`), so its
    bytes do not grow with the world size; the coordinator reads all W in one
    ``multi_get`` after one ``wait`` (two round trips, not one per rank). Keys are
    deleted once read, each by one rank, so a long job's store does not grow by a
    few keys per rank and save: a rank that reported success deletes its own key
    once it has the outcome (rank 0 once it gathered), the coordinator the keys of
    ranks that reported a failure (they return without waiting for the outcome),
    and the last rank to read the outcome deletes it (the outcome says how many
    will). Left behind only by a rank that never reads: one that died or stopped
    waiting before rank 0 published (its report, and the outcome with its counter).
    """

    def __init__(
        self, store: Any, attempt: str, rank: int, world: int, timeout: float, url: str
    ) -> None:
        self._store = store
        self._prefix = f"objckpt/{attempt}"
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.url = url
        self._posted_ok = False
        #: Ranks other than this one that reported a failure (they never read the outcome).
        self._failed: set[int] = set()

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/rank{rank}"

    def post(self, ok: bool, payload: Any) -> None:
        """Report this rank's results (ok) or its error message (not ok)."""
        self._posted_ok = ok
        self._store.set(self._key(self.rank), pickle.dumps((ok, payload)))

    def gather(self) -> list[Any]:
        """Coordinator: every rank's results in rank order; raises if any failed or is missing."""
        keys = [self._key(r) for r in range(self.world)]
        try:
            _wait(self._store, keys, self.timeout, f"saving {self.url}")
            raw = self._store.multi_get(keys)
        except BaseException:
            # A rank missing: the failed ranks that did report wait for nobody.
            present = [r for r in range(self.world) if self._store.check([self._key(r)])]
            self._failed = {
                r for r in present if r != self.rank and _failed(self._store, self._key(r))
            }
            _delete(
                self._store, [self._key(r) for r in present if r in self._failed or r == self.rank]
            )
            raise
        reports = [pickle.loads(v) for v in raw]  # objckpt's own ranks
        out, failures = [], []
        for r, (ok, payload) in enumerate(reports):
            if ok:
                out.append(payload)
            else:
                failures.append(f"rank {r}: {payload}")
        # Failed ranks do not wait for the outcome: their keys are the coordinator's.
        self._failed = {r for r, (ok, _) in enumerate(reports) if not ok and r != self.rank}
        _delete(
            self._store,
            [self._key(r) for r, (ok, _) in enumerate(reports) if not ok or r == self.rank],
        )
        if failures:
            raise UploadError(f"saving {self.url} failed on " + "; ".join(failures))
        return out

    def publish_outcome(self, error: str | None) -> None:
        """Coordinator: publish the outcome (None: committed) with how many ranks will
        read it: every other rank but those that reported a failure (they raised
        without waiting). The last of them deletes it; with none, it is not written."""
        readers = self.world - 1 - len(self._failed)
        if readers > 0:
            self._store.set(f"{self._prefix}/outcome", pickle.dumps((error, readers)))

    def outcome(self) -> str | None:
        """Non-coordinator: None if the coordinator committed, else its error message."""
        key = f"{self._prefix}/outcome"
        try:
            # Rank 0 itself waits up to `timeout` for the slowest rank, then commits.
            _wait(self._store, [key], outcome_wait(self.timeout), f"commit of {self.url}", "rank0")
        except BaseException:
            self._tidy_own()
            raise
        result: str | None
        result, readers = pickle.loads(self._store.get(key))
        self._tidy_own()
        if self._store.add(f"{key}/read", 1) == readers:  # the last reader tidies up
            _delete(self._store, [key, f"{key}/read"])
        return result

    def _tidy_own(self) -> None:
        """Delete this rank's own report once the coordinator is done with it (or gone)."""
        if self._posted_ok:
            _delete(self._store, [self._key(self.rank)])


def _failed(store: Any, key: str) -> bool:
    """Whether the report under ``key`` says its rank failed. One that cannot be read
    counts as a success: that rank may still read the outcome, and a reader counted
    too many only leaves a key behind, where one counted too few waits in vain."""
    try:
        return not pickle.loads(store.get(key))[0]
    except Exception:
        return False


def _delete(store: Any, keys: list[str]) -> None:
    for key in keys:
        try:
            store.delete_key(key)
        except Exception as exc:  # a store without deletion only wastes a key
            logger.debug("cannot delete c10d key %s: %s", key, exc)


class StoreBarrier:
    """:class:`~objckpt.pipeline.queue.RankBarrier` over the c10d store (for AsyncCallsQueue).

    Per request, each rank bumps a counter (and records a failure); the rank that
    completes the count sets one ``all`` key, so deciding "done everywhere" reads
    O(1) keys per rank instead of one per rank (O(W^2) store requests per job).
    A request that failed on any rank is reported as failed on every rank. Keys are
    deleted by the last rank to conclude.

    Args:
        process_group: The ranks that must all arrive (default group when None).
        name: Unique name of this barrier in the job. When None, every rank's
            n-th ``StoreBarrier`` is numbered n (ranks build them in the same order,
            like any collective), so two queues never see each other's keys.
    """

    def __init__(
        self,
        process_group: Any | None = None,
        prefix: str = "objckpt/queue",
        *,
        name: str | None = None,
    ) -> None:
        self._store = group_store(process_group)
        self._rank = dist.get_rank(process_group)
        self._world = dist.get_world_size(process_group)
        if name is None:
            name = str(self._store.add(f"{prefix}/instances/rank{self._rank}", 1))
        self._prefix = f"{prefix}/{name}"

    def arrive(self, key: str, ok: bool) -> None:
        base = f"{self._prefix}/{key}"
        if not ok:
            self._store.set(f"{base}/failed/rank{self._rank}", b"1")
            self._store.add(f"{base}/failed", 1)
        if self._store.add(f"{base}/arrived", 1) == self._world:
            self._store.set(f"{base}/all", b"1")

    def all_arrived(self, key: str, timeout: float | None) -> bool:
        """Whether every rank arrived; raises when a rank's work failed.

        Raises:
            BarrierTimeoutError: Not every rank arrived within ``timeout`` (blocking).
            RequestFailedError: Some rank's work failed; the request must not be
                finalized as a success.
        """
        base = f"{self._prefix}/{key}"
        if not timeout:
            if not self._store.check([f"{base}/all"]):
                return False
        else:
            _wait(self._store, [f"{base}/all"], timeout, f"async request {key}", label="a rank")
        failed = int(self._store.add(f"{base}/failed", 0))
        ranks = []
        if failed:
            ranks = [r for r in range(self._world) if self._store.check([f"{base}/failed/rank{r}"])]
        if self._store.add(f"{base}/read", 1) == self._world:
            _delete(
                self._store,
                [f"{base}/{k}" for k in ("arrived", "all", "failed", "read")]
                + [f"{base}/failed/rank{r}" for r in ranks],
            )
        if failed:
            raise RequestFailedError(
                f"async request {key} failed on rank(s) {', '.join(map(str, ranks))}; "
                "its finalize functions were not run"
            )
        return True
