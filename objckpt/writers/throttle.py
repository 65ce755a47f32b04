"""Request concurrency that backs off where the store asked, and recovers (AIMD).

S3 answers 503 SlowDown when a partition (a range of keys) gets more requests than
it can take at the moment; GCS and Azure answer 429 or 503 likewise. Retrying at
the same concurrency keeps the pressure on. TCP's answer works here too: halve the
number of requests in flight on a throttling answer (at most once per
``cooldown``, so one burst of refusals counts once), add about one slot per window
of successes, and lift the limit when it is back where it was cut.

*Where* to halve (#46): a client cannot see the store's partitions, only the keys
it was refused on. :class:`Backoff` keeps a limit per key *directory* (the key
without its last component: ``bucket/root/step-5``, or a spread layout's
``bucket/root/spread-a/step-5``), so a save throttled in one directory slows down
there while reads and writes elsewhere in the process go on at full speed. When
refusals come from two or more directories within one cooldown, the hot range
spans them (a new bucket is one partition; a spread layout's first save meets
exactly that), and the limit on all the client's requests is halved as well.

One :class:`Backoff` belongs to one filesystem object (objckpt's S3, GCS and Azure
filesystems own one each), so every store in a process that shares a client
shares what it learned. Requests wait for a slot in arrival order within their
directory; a directory whose head waiter cannot go does not hold up the others.
A request holds its slot from its first attempt to its last, the waits between them
included (:func:`~objckpt.writers.retry.call_with_retries`, which waits for it within
the request's deadline): a request waiting to be sent again is still in flight.
Directory limits are kept for at most ``keep`` directories that have nothing in
flight (the oldest go first: forgetting a limit costs a few more refusals, never
correctness).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

__all__ = ["Backoff", "BackoffStats", "Slot", "directory_of"]

logger = logging.getLogger(__name__)


def directory_of(name: str) -> str:
    """The directory a request on ``name`` (``bucket/key``, or ``bucket/prefix/`` for
    a listing) is limited by: ``name`` up to its last ``/`` (all of it where it has
    none: a request on the bucket itself)."""
    return name.rsplit("/", 1)[0] if "/" in name else name


@dataclasses.dataclass(frozen=True)
class BackoffStats:
    """What a :class:`Backoff` did since it was built.

    Attributes:
        directory_cuts: Times a directory's limit was halved.
        client_cuts: Times the limit on all requests was halved (refusals from two
            or more directories within one cooldown).
        lowest: The lowest limit any directory or the client had; None if none was
            ever cut.
        limited: Directories limited now, each with its current limit.
        client_limit: The limit on all requests now; None when there is none.
    """

    directory_cuts: int
    client_cuts: int
    lowest: float | None
    limited: tuple[tuple[str, float], ...]
    client_limit: float | None


class _Waiter:
    __slots__ = ("future", "state")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.state: Literal["waiting", "granted", "gone"] = "waiting"


class _Limit:
    """One AIMD limit: None until a cut, lifted again at its ceiling.

    After the first cut of an episode (from what was in flight, the ceiling), the
    limit grows by one request per success up to half the ceiling (doubling per
    window, as TCP's slow start), then by one per window up to the ceiling, where it
    is lifted: a storm that cut it to 1 does not leave it there for thousands of
    requests."""

    __slots__ = ("ceiling", "inflight", "last_cut", "limit", "threshold", "waiters")

    def __init__(self) -> None:
        self.limit: float | None = None
        self.ceiling = 0.0
        self.threshold = 0.0
        self.inflight = 0
        self.last_cut = -math.inf
        self.waiters: deque[_Waiter] = deque()

    def fits(self) -> bool:
        return self.limit is None or self.inflight < max(1, int(self.limit))

    def cut(self, now: float, cooldown: float) -> bool:
        """Halve (from what is in flight, the first time); False within the cooldown."""
        if now - self.last_cut < cooldown:
            return False
        self.last_cut = now
        if self.limit is None:
            self.ceiling = float(max(2, self.inflight))
            self.limit = self.threshold = self.ceiling / 2
        else:
            self.limit = max(1.0, self.limit / 2)
        return True

    def grow(self) -> None:
        if self.limit is not None:
            self.limit += 1.0 if self.limit < self.threshold else 1.0 / self.limit
            if self.limit >= self.ceiling:
                self.limit = None

    def forget_if_stale(self, now: float, after: float) -> bool:
        """Lift a limit not cut for ``after`` seconds; True if it was lifted."""
        if self.limit is not None and now - self.last_cut > after:
            self.limit = None
            return True
        return False

    def idle(self) -> bool:
        return self.inflight == 0 and not self.waiters


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Backoff:
    """Per-directory and client-wide AIMD limits on requests in flight.

    Args:
        cooldown: Seconds within which further refusals do not halve a limit again,
            and within which refusals from two directories halve the client's.
        keep: Limited directories kept while nothing is in flight in them.
        forget_after: Seconds after its last cut a limit is lifted by the next
            request (the store has had time to split the range, or the load moved).
        clock: Monotonic seconds (tests give their own).
    """

    def __init__(
        self,
        *,
        cooldown: float = 0.5,
        keep: int = 256,
        forget_after: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cooldown = cooldown
        self._keep = keep
        self._forget_after = forget_after
        self._clock = clock
        self._lock = threading.Lock()
        self._client = _Limit()
        self._dirs: dict[str, _Limit] = {}
        #: Limited directories with nothing in flight, oldest first (at most ``keep``).
        self._idle: dict[str, None] = {}
        #: Directories with requests waiting, in the order they began to wait.
        self._queued: dict[str, None] = {}
        #: Directory -> time of its latest refusal, within the cooldown.
        self._refused: dict[str, float] = {}
        self._directory_cuts = 0
        self._client_cuts = 0
        self._lowest: float | None = None

    def try_enter(self, prefix: str) -> bool:
        """Take a slot in ``prefix``'s directory if one is free now, without waiting."""
        with self._lock:
            entry = self._entry(prefix)
            if self._take_if_free(entry):
                return True
            self._forget(prefix, entry)
            return False

    async def enter(self, prefix: str) -> None:
        """Wait for a slot in ``prefix``'s directory and the client's (in arrival order
        within the directory)."""
        with self._lock:
            entry = self._entry(prefix)
            if self._take_if_free(entry):
                return
            waiter = _Waiter(asyncio.get_running_loop().create_future())
            entry.waiters.append(waiter)
            self._queued[prefix] = None
        try:
            await waiter.future
        except BaseException:
            with self._lock:
                if waiter.state == "granted":
                    self._give_back(prefix, False)
                elif waiter.state == "waiting":
                    waiter.state = "gone"
                    entry.waiters.remove(waiter)
                    if not entry.waiters:
                        self._queued.pop(prefix, None)
                    self._forget(prefix, entry)
                    self._wake()
            raise

    def throttled(self, prefix: str) -> None:
        """A request holding a slot of ``prefix`` was asked to slow down."""
        with self._lock:
            self._throttled(prefix, self._dirs[prefix])

    def leave(self, prefix: str, served: bool) -> None:
        """Give back ``prefix``'s slot; ``served``: the store answered the request
        (a success, or an answer such as 404 or 412 that retrying would not change)."""
        with self._lock:
            self._give_back(prefix, served)

    def slot(self, prefix: str) -> Slot:
        """``prefix``'s slot, for one request's attempts."""
        return Slot(self, prefix)

    def stats(self) -> BackoffStats:
        with self._lock:
            limited = tuple(
                (name, entry.limit) for name, entry in self._dirs.items() if entry.limit is not None
            )
            return BackoffStats(
                self._directory_cuts, self._client_cuts, self._lowest, limited, self._client.limit
            )

    # -- under the lock ---------------------------------------------------------------
    def _entry(self, prefix: str) -> _Limit:
        """``prefix``'s entry, made active (out of ``_idle``), stale limits lifted first
        (and whoever that lets go, granted)."""
        now = self._clock()
        entry = self._dirs.get(prefix)
        lifted = entry is not None and entry.forget_if_stale(now, self._forget_after)
        if self._client.forget_if_stale(now, self._forget_after) or lifted:
            self._wake()
        entry = self._dirs.get(prefix)  # waking may have forgotten it
        if entry is None:
            entry = self._dirs[prefix] = _Limit()
        self._idle.pop(prefix, None)
        return entry

    def _take_if_free(self, entry: _Limit) -> bool:
        """Take a slot where no one of the directory waits and both limits have room."""
        if entry.waiters or not (entry.fits() and self._client.fits()):
            return False
        self._take(entry)
        return True

    def _take(self, entry: _Limit) -> None:
        entry.inflight += 1
        self._client.inflight += 1

    def _give_back(self, prefix: str, served: bool) -> None:
        entry = self._dirs[prefix]
        if served:
            entry.grow()
            self._client.grow()
        entry.inflight -= 1
        self._client.inflight -= 1
        self._forget(prefix, entry)
        self._wake()

    def _throttled(self, prefix: str, entry: _Limit) -> None:
        now = self._clock()
        self._refused = {d: t for d, t in self._refused.items() if now - t < self._cooldown}
        self._refused[prefix] = now
        if entry.cut(now, self._cooldown):
            self._directory_cuts += 1
            self._note_lowest(entry)
            logger.info("store throttling in %s: at most %d requests there", prefix, entry.limit)
        if len(self._refused) > 1 and self._client.cut(now, self._cooldown):
            self._client_cuts += 1
            self._note_lowest(self._client)
            logger.info(
                "store throttling in %d directories: at most %d requests in all",
                len(self._refused),
                self._client.limit,
            )

    def _note_lowest(self, entry: _Limit) -> None:
        assert entry.limit is not None
        self._lowest = entry.limit if self._lowest is None else min(self._lowest, entry.limit)

    def _forget(self, prefix: str, entry: _Limit) -> None:
        """An idle directory's entry goes, or is kept while limited (``keep`` at most,
        the oldest going first)."""
        if not entry.idle():
            return
        if entry.limit is None:
            self._dirs.pop(prefix, None)
            return
        self._idle[prefix] = None
        while len(self._idle) > self._keep:
            oldest = next(iter(self._idle))
            del self._idle[oldest]
            del self._dirs[oldest]

    def _wake(self) -> None:
        """Grant every waiter whose directory and the client have room, in arrival
        order within each directory; a directory that has no room holds up no other.
        Run after every change of a count or a limit, so a waiter left waiting has
        no room."""
        for prefix in list(self._queued):
            if not self._client.fits():
                return
            entry = self._dirs[prefix]
            while entry.waiters and entry.fits() and self._client.fits():
                waiter = entry.waiters.popleft()
                self._take(entry)
                waiter.state = "granted"
                try:
                    waiter.future.get_loop().call_soon_threadsafe(_resolve, waiter.future)
                except RuntimeError:  # its loop is closed: its task can never run again
                    waiter.state = "gone"
                    entry.inflight -= 1
                    self._client.inflight -= 1
            if not entry.waiters:
                del self._queued[prefix]
                self._forget(prefix, entry)


@dataclasses.dataclass
class Slot:
    """One directory's slot in a :class:`Backoff`, held by one request from its first
    attempt to its last.

    Attributes:
        served: Set by the retry layer when the store answered the request for good
            (a success, or an answer retrying would not change, such as a 404): what
            grows the limits when the slot is left. Not set for a request that gave
            up on throttling, errors or its deadline.
    """

    backoff: Backoff
    prefix: str
    served: bool = False

    def try_enter(self) -> bool:
        return self.backoff.try_enter(self.prefix)

    async def enter(self) -> None:
        await self.backoff.enter(self.prefix)

    def throttled(self) -> None:
        self.backoff.throttled(self.prefix)

    def leave(self) -> None:
        self.backoff.leave(self.prefix, self.served)
