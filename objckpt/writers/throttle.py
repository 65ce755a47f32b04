"""Upload concurrency that backs off under throttling and recovers (AIMD).

S3 answers 503 SlowDown when a prefix gets more requests than it can take at
the moment. Retrying at the same concurrency keeps the pressure on; TCP's
answer works here too: halve the number of requests in flight on a throttling
answer (at most once per ``cooldown``, so one burst of 503s counts once), and
add one slot per window of successes (``1/limit`` per success). The save goes
on at the rate the store accepts and speeds up again when it may.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

__all__ = ["AimdLimit", "LimitStats"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LimitStats:
    """What the limiter did: current and lowest limit, how often it backed off."""

    limit: float
    lowest: float
    decreases: int


class AimdLimit:
    """A counting semaphore whose size moves between 1 and ``maximum``."""

    def __init__(self, maximum: int, *, cooldown: float = 0.5) -> None:
        self.maximum = maximum
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
        logger.info("store throttling: upload concurrency %d -> %d", int(before), int(self._limit))

    def succeeded(self) -> None:
        """Additive increase: about one slot per window of successful requests."""
        with self._cond:
            if self._limit < self.maximum:
                self._limit = min(float(self.maximum), self._limit + 1.0 / self._limit)
                self._cond.notify_all()

    def stats(self) -> LimitStats:
        with self._cond:
            return LimitStats(self._limit, self._lowest, self._decreases)
