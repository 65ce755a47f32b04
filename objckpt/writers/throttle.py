"""Upload concurrency that backs off under throttling and recovers (AIMD).

S3 answers 503 SlowDown when a prefix gets more requests than it can take at
the moment. Retrying at the same concurrency keeps the pressure on; TCP's
answer works here too: halve the number of requests in flight on a throttling
answer (at most once per ``cooldown``, so one burst of 503s counts once), and
add one slot per window of successes (``1/limit`` per success). The save goes
on at the rate the store accepts and speeds up again when it may.

Per prefix: S3 partitions a bucket by key prefix, and a 503 from one partition says
nothing of the others. :class:`PrefixLimits` keeps one AIMD limit per directory an
object is written to, within the store's cap (``max_parts_in_flight``, which bounds
the memory held by requests): a throttled directory halves its own share, and
uploads to the others (the spread directories of ``persistent_prefixes``, or
``prefix_entropy``'s) go on at full concurrency. The retry layer learns which
directory a throttled request was for from :func:`request_subject`, set around the
request's submission (:meth:`ObjectStore.send`); a request without one (a listing,
a request made outside a save's uploads) counts against the whole store.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import posixpath
import threading
import time
from collections.abc import Iterator

__all__ = ["AimdLimit", "LimitStats", "PrefixLimits", "current_subject", "request_subject"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LimitStats:
    """What the limiter did: current and lowest limit, how often it backed off."""

    limit: float
    lowest: float
    decreases: int


class AimdLimit:
    """A counting semaphore whose size moves between 1 and ``maximum``."""

    def __init__(self, maximum: int, *, cooldown: float = 0.5, name: str = "upload") -> None:
        self.maximum = maximum
        self.name = name
        self._limit = float(maximum)
        self._lowest = float(maximum)
        self._inflight = 0
        self._decreases = 0
        self._cooldown = cooldown
        self._last_decrease = 0.0
        self._cond = threading.Condition()

    def acquire(self) -> None:
        with self._cond:
            while self._inflight >= max(1, int(self._limit)):
                self._cond.wait()
            self._inflight += 1

    def release(self, _: object = None) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def throttled(self) -> None:
        """Multiplicative decrease (once per cooldown)."""
        with self._cond:
            now = time.monotonic()
            if now - self._last_decrease < self._cooldown:
                return
            self._last_decrease = now
            before = self._limit
            self._limit = max(1.0, self._limit / 2)
            self._lowest = min(self._lowest, self._limit)
            self._decreases += 1
        logger.info(
            "store throttling: %s concurrency %d -> %d", self.name, int(before), int(self._limit)
        )

    def succeeded(self) -> None:
        """Additive increase: about one slot per window of successful requests."""
        with self._cond:
            if self._limit < self.maximum:
                self._limit = min(float(self.maximum), self._limit + 1.0 / self._limit)
                self._cond.notify_all()

    def stats(self) -> LimitStats:
        with self._cond:
            return LimitStats(self._limit, self._lowest, self._decreases)


_SUBJECT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "objckpt_request_subject", default=None
)


def current_subject() -> str | None:
    """The store path of the object the request being made is for (None: unknown)."""
    return _SUBJECT.get()


@contextlib.contextmanager
def request_subject(path: str) -> Iterator[None]:
    """Requests made or scheduled in this block (on the filesystem's event loop too:
    its tasks copy this context) are for the object at ``path``."""
    token = _SUBJECT.set(path)
    try:
        yield
    finally:
        _SUBJECT.reset(token)


class PrefixLimits:
    """At most ``maximum`` requests in flight in all, and within them an AIMD limit
    per prefix (the directory of the object a request is for; see the module
    docstring). A throttling answer for an object halves its directory's limit; one
    for no known object halves the whole store's. Each directory's limit lives as
    long as this store (one save): one per directory the save writes to.

    Deadlock-free: a slot is taken in the directory first, then in the whole store,
    and a thread that waits for the store's slot never holds another store slot.
    """

    def __init__(self, maximum: int, *, cooldown: float = 0.5) -> None:
        self.maximum = maximum
        self._cooldown = cooldown
        self._total = AimdLimit(maximum, cooldown=cooldown)
        self._prefixes: dict[str, AimdLimit] = {}
        self._lock = threading.Lock()

    def _of(self, path: str) -> AimdLimit:
        prefix = posixpath.dirname(path)
        with self._lock:
            limit = self._prefixes.get(prefix)
            if limit is None:
                limit = AimdLimit(self.maximum, cooldown=self._cooldown, name=f"upload ({prefix}/)")
                self._prefixes[prefix] = limit
            return limit

    def acquire(self, path: str | None = None) -> None:
        """Wait for a slot for a request for ``path`` (None: for no one object)."""
        if path is not None:
            self._of(path).acquire()
        self._total.acquire()

    def release(self, path: str | None = None) -> None:
        """Free what :meth:`acquire` took for ``path``."""
        self._total.release()
        if path is not None:
            self._of(path).release()

    def throttled(self, subject: str | None = None) -> None:
        """A request for ``subject`` was answered "slow down"."""
        (self._total if subject is None else self._of(subject)).throttled()

    def succeeded(self, subject: str | None = None) -> None:
        """A request for ``subject`` succeeded."""
        (self._total if subject is None else self._of(subject)).succeeded()

    def stats(self, path: str | None = None) -> LimitStats:
        """What the limit of ``path``'s directory did (None: the whole store's)."""
        return (self._total if path is None else self._of(path)).stats()
