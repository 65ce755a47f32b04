"""``SaveHandle``: what the caller holds while an async save finishes in the background.

A handle is a thin view over a ``concurrent.futures.Future`` so the caller never
touches the pipeline's threads: it can poll (``done``), wait (``result``), or be
told (``add_done_callback``), and the save's own error is re-raised unchanged.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from objckpt.format.manifest import Manifest
from objckpt.writers.accounting import RequestCounter, RequestStats

__all__ = ["SaveHandle"]


class SaveHandle:
    """The outcome of one async save.

    ``result()`` returns the committed :class:`~objckpt.Manifest` on the
    coordinator and None on other ranks (once the coordinator has committed).
    """

    def __init__(
        self,
        url: str,
        future: concurrent.futures.Future[Manifest | None],
        counter: RequestCounter | None = None,
    ) -> None:
        self.url = url
        self._future = future
        self._counter = counter or RequestCounter()
        #: Seconds ``save`` waited for earlier saves to finish uploading before it
        #: could stage this one (``AsyncOptions.max_in_flight``): part of the stall.
        self.waited_for_earlier = 0.0

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
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # the save's own error is a TimeoutError (barrier)
                raise
            raise TimeoutError(f"save of {self.url} not finished within {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it committed), waiting up to ``timeout`` seconds."""
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        """Call ``fn(handle)`` once the save has committed or failed."""
        self._future.add_done_callback(lambda _: fn(self))
