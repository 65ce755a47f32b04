"""A model of S3's request-rate partitions, for the fault proxy (#46).

AWS documents 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second
"per partitioned prefix", and that S3 scales a busy bucket gradually: while it
splits a hot key range into more partitions it answers 503 SlowDown. Partitions are
key *ranges*, not directories, and they are split where the load is. The model here
keeps exactly that much, with a clock the caller gives (tests step it by hand):

* the keyspace starts as one partition (``[""; ∞)``);
* each partition has a token bucket for writes and one for reads, filled at its rate
  (``scale`` shrinks S3's rates so a 2-core machine can drive them) and holding
  ``burst`` seconds of it; a request that finds its bucket empty is refused;
* a partition that keeps refusing for ``split_after`` seconds (a quiet second ends the
  streak) is split into ``fanout`` ranges at the quantiles of the keys it served
  lately, each with its own full buckets, as S3 moves a hot range onto new partitions.

What this shows and the real service also does: a new step's keys sort after every
key of the step before, so they all fall into the last range and wait for it to split
again, whatever digits follow the step's directory; keys spread over prefixes that
persist across steps land in ranges that were split already. What it leaves out: S3
also merges idle partitions and splits on its own schedule (minutes, not a fixed
``split_after``), by load rather than by the distinct keys seen lately; the model
keeps separate read and write budgets per partition, as AWS states its figures
(whether S3 shares them is not documented); requests without a key (listings, a
bulk ``DeleteObjects``) are not limited. The rates are a scaled model, not a
measurement of any store. (Not to be confused with :mod:`objckpt.writers.throttle`,
the client's own upload concurrency, which backs off when a store answers SlowDown.)
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from collections.abc import Callable

__all__ = ["PartitionModel", "PrefixRates"]

_SAMPLE = 512  # keys a partition remembers to place its split points


@dataclasses.dataclass(frozen=True)
class PrefixRates:
    """Per-partition request rates and how partitions split.

    Attributes:
        writes: PUT/COPY/POST/DELETE per second per partition (S3: 3,500).
        reads: GET/HEAD per second per partition (S3: 5,500).
        scale: Multiplies both rates (0.01: 35 and 55 per second).
        burst: Seconds of its rate a partition's bucket holds.
        split_after: Seconds a partition keeps refusing before it splits.
        fanout: Ranges one split makes.
    """

    writes: float = 3500.0
    reads: float = 5500.0
    scale: float = 1.0
    burst: float = 1.0
    split_after: float = 5.0
    fanout: int = 4

    def __post_init__(self) -> None:
        if min(self.writes, self.reads, self.scale, self.burst) <= 0:
            raise ValueError(f"PrefixRates needs positive rates, scale and burst: {self}")
        if self.split_after < 0 or self.fanout < 2:
            raise ValueError(f"PrefixRates needs split_after >= 0 and fanout >= 2: {self}")


class _Partition:
    def __init__(self, low: str, rates: PrefixRates, now: float) -> None:
        self.low = low
        self.rates = rates
        self.tokens = {True: self._cap(True), False: self._cap(False)}
        self.filled = now
        self.refusing_since: float | None = None
        self.last_refusal = now
        self.keys: list[str] = []
        self.served = 0

    def _rate(self, write: bool) -> float:
        return (self.rates.writes if write else self.rates.reads) * self.rates.scale

    def _cap(self, write: bool) -> float:
        return max(1.0, self._rate(write) * self.rates.burst)

    def admit(self, key: str, write: bool, now: float) -> bool:
        elapsed, self.filled = max(0.0, now - self.filled), now
        for kind in (True, False):
            self.tokens[kind] = min(self._cap(kind), self.tokens[kind] + elapsed * self._rate(kind))
        if len(self.keys) < _SAMPLE:
            self.keys.append(key)
        else:  # keep the latest keys: the load a split follows is the current one
            self.keys[self.served % _SAMPLE] = key
        self.served += 1
        if self.refusing_since is not None and now - self.last_refusal > 1.0:
            self.refusing_since = None  # a quiet second ends the streak
        if self.tokens[write] >= 1.0:
            self.tokens[write] -= 1.0
            return True
        self.last_refusal = now
        if self.refusing_since is None:
            self.refusing_since = now
        return False

    def due(self, now: float) -> bool:
        since = self.refusing_since
        return since is not None and now - since >= self.rates.split_after

    def cuts(self) -> list[str]:
        """Where to split: the quantiles of the keys it served lately, above ``low``."""
        keys = sorted(set(k for k in self.keys if k > self.low))
        if not keys:
            return []
        n = self.rates.fanout
        picked = {keys[(len(keys) * i) // n] for i in range(1, n)}
        return sorted(picked)


class PartitionModel:
    """The keyspace of one bucket as S3 partitions it (the module doc), thread-safe.

    Args:
        rates: The rates and the split rule.
        clock: Seconds, monotonic (``time.monotonic`` by default; tests pass their own).
    """

    def __init__(self, rates: PrefixRates, clock: Callable[[], float] = time.monotonic) -> None:
        self.rates = rates
        self._clock = clock
        self._lock = threading.Lock()
        self._parts = [_Partition("", rates, clock())]
        self._lows = [""]
        self.splits = 0
        self.refused = 0
        self.refused_writes = 0  # of ``refused``: those of writes
        self.admitted = 0
        #: (partition, whole second) -> requests admitted then.
        self._per_second: dict[tuple[int, int], int] = {}

    def admit(self, key: str, write: bool) -> bool:
        """Whether ``key``'s request is served now (False: answer 503 SlowDown)."""
        with self._lock:
            now = self._clock()
            part = self._parts[bisect.bisect_right(self._lows, key) - 1]
            ok = part.admit(key, write, now)
            if ok:
                self.admitted += 1
                slot = (id(part), int(now))
                self._per_second[slot] = self._per_second.get(slot, 0) + 1
            else:
                self.refused += 1
                self.refused_writes += write
                if part.due(now):
                    self._split(part, now)
            return ok

    def _split(self, part: _Partition, now: float) -> None:
        cuts = part.cuts()
        if not cuts:  # one hot key: nothing to split it by; start the streak again
            part.refusing_since = None
            return
        index = self._parts.index(part)
        fresh = [_Partition(low, self.rates, now) for low in [part.low, *cuts]]
        self._parts[index : index + 1] = fresh
        self._lows[index : index + 1] = [p.low for p in fresh]
        self.splits += 1

    @property
    def partitions(self) -> list[str]:
        """Each partition's lowest key, in order."""
        with self._lock:
            return list(self._lows)

    def peak_per_second(self) -> int:
        """The most requests one partition served in one whole second (up to its rate
        plus its burst: the bucket starts full)."""
        with self._lock:
            return max(self._per_second.values(), default=0)
