"""Deadlines that bound store requests: one per save, else one per request.

Why: with the endpoint frozen (connections accepted, nothing answered), each part
waits ``RetryPolicy.attempts`` x ``timeout`` in turn, so a save took 20 minutes to
fail. A save sets one :class:`Deadline` (``UploadOptions.deadline`` seconds from
its start) in a context variable; the retry layer bounds every attempt by what is
left, retries transient failures for as long as another attempt can start before
it, and then raises :class:`SaveDeadlineError` naming the rank and the object.
Context variables follow the request onto the filesystem's event loop thread
(``run_coroutine_threadsafe`` copies the caller's context), and upload worker
processes get the same absolute deadline (``time.monotonic`` is one clock for
every process on a Linux host).

Reads, listings, HEADs and deletes belong to no save: there each request with its
retries gets a deadline of its own (``RetryPolicy.request_deadline``, see
:meth:`Deadline.for_request`), so ``objckpt info`` against a silent endpoint fails
in that time with :class:`RequestDeadlineError` instead of after ``attempts`` x
``timeout`` (and more where one operation makes several requests).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, TypeVar

from objckpt.errors import (
    RequestDeadlineError,
    SaveDeadlineError,
    StoreError,
    StoreRefusedError,
    StoreUnreachableError,
)

__all__ = ["Deadline", "bounded_by", "current_deadline", "each_in_context"]

_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When a save (or one request) must have ended (a ``time.monotonic()`` value),
    and for whom.

    Attributes:
        at: The monotonic time the requests must be answered by.
        seconds: The budget it started with (for messages).
        who: What is saving, for messages, e.g. ``"rank 3 saving s3://b/ckpt"``; for
            a request's own deadline, the endpoint asked (or ``""``).
        kind: ``"save"`` (``UploadOptions.deadline``: retries go on until it) or
            ``"request"`` (``RetryPolicy.request_deadline``: at most ``attempts``
            tries within it).
        option: The setting that gave this bound, named in messages (a save's
            preflight is bounded by ``preflight_timeout`` inside the save's deadline).
        outcome: What a miss means for the save, said in messages (a bound of a
            step after the commit: the save stays committed).
    """

    at: float
    seconds: float
    who: str
    kind: Literal["save", "request"] = "save"
    option: str = "UploadOptions.deadline"
    outcome: str = "the save was not committed"

    @classmethod
    def start(cls, seconds: float | None, who: str) -> Deadline | None:
        """A save's deadline ``seconds`` from now; None when the save has none."""
        if seconds is None:
            return None
        return cls(time.monotonic() + seconds, seconds, who)

    @classmethod
    def for_request(cls, seconds: float | None, endpoint: str | None) -> Deadline | None:
        """One request's deadline (with its retries) ``seconds`` from now, where no
        save's applies; None when ``seconds`` is None (no bound)."""
        if seconds is None:
            return None
        return cls(time.monotonic() + seconds, seconds, endpoint or "", "request")

    @classmethod
    def capped(cls, outer: Deadline | None, seconds: float, who: str, option: str) -> Deadline:
        """A bound of ``seconds`` from now for one step of a save (its preflight),
        never later than the save's own deadline ``outer``; retried like a save's."""
        at = time.monotonic() + seconds
        if outer is not None and outer.at <= at:
            return outer
        return cls(at, seconds, outer.who if outer is not None else who, "save", option)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def error(
        self, what: str, attempts: int = 0, last: str = "", answered: str | None = None
    ) -> StoreError:
        """The error for ``what`` (e.g. ``"S3 get_object of s3://b/k"``) not done in time.

        Args:
            what: The request, naming its object.
            attempts: How many attempts were made (0: not counted).
            last: A description of the last attempt's failure, if one failed.
            answered: What the store answered the last attempt (``"HTTP 503
                SlowDown"``), None where it gave no answer: a message never says
                "no answer" to a store that answered.
        """
        tried = f" after {attempts} attempt{'s' if attempts != 1 else ''}" if attempts else ""
        why = f" (last: {last})" if last else ""
        if self.kind == "request":
            where = f" at endpoint {self.who}" if self.who else ""
            if answered is not None:
                return StoreRefusedError(
                    f"{what}{where} was answered {answered}{tried} within "
                    f"{self.seconds:g} s{why} (RetryPolicy.request_deadline): the store "
                    "keeps refusing the request"
                )
            return RequestDeadlineError(
                f"{what}{where} got no answer within {self.seconds:g} s{tried}{why} "
                "(RetryPolicy.request_deadline): the store is unreachable or too slow; "
                "raise request_deadline for a slow link"
            )
        if self.option != "UploadOptions.deadline":
            # One step's own bound (the preflight): the store's answer decides the kind.
            if answered is not None:
                return StoreRefusedError(
                    f"{self.who}: {what} was answered {answered}{tried} within "
                    f"{self.seconds:g} s ({self.option}){why}; {self.outcome}"
                )
            return StoreUnreachableError(
                f"{self.who}: {what} got no answer within {self.seconds:g} s{tried}{why} "
                f"({self.option}); {self.outcome}"
            )
        outcome = f"; the store answered {answered}" if answered is not None else ""
        return SaveDeadlineError(
            f"{self.who}: {what} was not done within the save's deadline of "
            f"{self.seconds:g} s{tried}{outcome}{why} (UploadOptions.deadline); "
            f"{self.outcome}"
        )


_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "objckpt_save_deadline", default=None
)


def current_deadline() -> Deadline | None:
    """The deadline of the save this code runs for, if it has one."""
    return _CURRENT.get()


@contextlib.contextmanager
def bounded_by(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Bound every store request made in this block (and what it schedules on the
    filesystem's event loop) by ``deadline``."""
    token = _CURRENT.set(deadline)
    try:
        yield deadline
    finally:
        _CURRENT.reset(token)


def each_in_context(
    fn: Callable[[_T], _R], items: Sequence[_T], *, lanes: int, name: str
) -> list[_R]:
    """``fn`` of each of ``items``, in order, ``lanes`` at a time on threads named
    ``name``, each in a copy of the caller's context: its requests bounded by the
    caller's deadline and counted with the caller's requests. One item, or one lane,
    runs on the calling thread. The first error raised is raised here, once every
    call has ended."""
    if len(items) <= 1 or lanes <= 1:
        return [fn(i) for i in items]
    with concurrent.futures.ThreadPoolExecutor(
        min(lanes, len(items)), thread_name_prefix=name
    ) as pool:
        futures = [pool.submit(contextvars.copy_context().run, fn, i) for i in items]
        return [f.result() for f in futures]
