"""Cross-rank finalization through the c10d store, off the training path.

A commit needs every rank's upload results on the coordinator, and every rank
needs to learn the outcome. DCP does this with collectives, which would force
the training loop to call into the checkpointer on every rank at the same
moment. Instead each rank's background thread posts its results under a key
unique to the save attempt in the process group's c10d store; the coordinator's
thread waits for all of them with a timeout (a dead rank becomes an error naming
it, never a hang), commits, and posts the outcome for the others to read.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from typing import Any

import torch.distributed as dist

from objckpt.errors import ObjckptError, UploadError

__all__ = ["BarrierTimeoutError", "RankExchange", "StoreBarrier", "group_store"]

logger = logging.getLogger(__name__)


class BarrierTimeoutError(ObjckptError, TimeoutError):
    """Some ranks did not report within the barrier timeout."""


def group_store(process_group: Any | None = None) -> Any:
    """The c10d store of ``process_group`` (the default group when None)."""
    from torch.distributed import distributed_c10d as c10d

    if process_group is None:
        return c10d._get_default_store()
    return c10d._get_process_group_store(process_group)


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
    """One save attempt's results and outcome, exchanged through the store."""

    def __init__(
        self, store: Any, attempt: str, rank: int, world: int, timeout: float, url: str
    ) -> None:
        self._store = store
        self._prefix = f"objckpt/{attempt}"
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.url = url

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/rank{rank}"

    def post(self, ok: bool, payload: Any) -> None:
        """Report this rank's results (ok) or its error message (not ok)."""
        self._store.set(self._key(self.rank), pickle.dumps((ok, payload)))

    def gather(self) -> list[Any]:
        """Coordinator: every rank's results in rank order; raises if any failed or is missing."""
        keys = [self._key(r) for r in range(self.world)]
        _wait(self._store, keys, self.timeout, f"saving {self.url}")
        out, failures = [], []
        for r, key in enumerate(keys):
            ok, payload = pickle.loads(self._store.get(key))  # written by objckpt's own ranks
            if ok:
                out.append(payload)
            else:
                failures.append(f"rank {r}: {payload}")
        if failures:
            raise UploadError(f"saving {self.url} failed on " + "; ".join(failures))
        return out

    def publish_outcome(self, error: str | None) -> None:
        self._store.set(f"{self._prefix}/outcome", pickle.dumps(error))

    def outcome(self) -> str | None:
        """Non-coordinator: None if the coordinator committed, else its error message."""
        key = f"{self._prefix}/outcome"
        # Rank 0 itself waits up to `timeout` for the slowest rank, then commits.
        _wait(self._store, [key], 2 * self.timeout + 30, f"commit of {self.url}", label="rank0")
        result: str | None = pickle.loads(self._store.get(key))
        return result


class StoreBarrier:
    """:class:`~objckpt.queue.RankBarrier` over the c10d store (for AsyncCallsQueue)."""

    def __init__(self, process_group: Any | None = None, prefix: str = "objckpt/queue") -> None:
        self._store = group_store(process_group)
        self._rank = dist.get_rank(process_group)
        self._world = dist.get_world_size(process_group)
        self._prefix = prefix

    def arrive(self, key: str, ok: bool) -> None:
        self._store.set(f"{self._prefix}/{key}/rank{self._rank}", b"1" if ok else b"0")

    def all_arrived(self, key: str, timeout: float | None) -> bool:
        keys = [f"{self._prefix}/{key}/rank{r}" for r in range(self._world)]
        if not timeout:
            return all(self._store.check([k]) for k in keys)
        _wait(self._store, keys, timeout, f"async request {key}")
        return True
