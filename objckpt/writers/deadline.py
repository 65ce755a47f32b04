"""A deadline that every store request of one save shares.

Why: with the endpoint frozen (connections accepted, nothing answered), each part
waits ``RetryPolicy.attempts`` x ``timeout`` in turn, so a save took 20 minutes to
fail. A save sets one :class:`Deadline` (``UploadOptions.deadline`` seconds from
its start) in a context variable; the retry layer bounds every attempt by what is
left and stops retrying once nothing is, raising :class:`SaveDeadlineError` that
names the rank and the object. Context variables follow the request onto the
filesystem's event loop thread (``run_coroutine_threadsafe`` copies the caller's
context), and upload worker processes get the same absolute deadline
(``time.monotonic`` is one clock for every process on a Linux host).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Iterator

from objckpt.errors import SaveDeadlineError

__all__ = ["Deadline", "bounded_by", "current_deadline"]


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When a save must have ended (a ``time.monotonic()`` value), and for whom.

    Attributes:
        at: The monotonic time the save's requests must be answered by.
        seconds: The budget the save started with (for messages).
        who: What is saving, for messages, e.g. ``"rank 3 saving s3://b/ckpt"``.
    """

    at: float
    seconds: float
    who: str

    @classmethod
    def start(cls, seconds: float | None, who: str) -> Deadline | None:
        """A deadline ``seconds`` from now; None when the save has none."""
        if seconds is None:
            return None
        return cls(time.monotonic() + seconds, seconds, who)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def error(self, what: str) -> SaveDeadlineError:
        return SaveDeadlineError(
            f"{self.who}: {what} was not done within the save's deadline of "
            f"{self.seconds:g} s (UploadOptions.deadline); the save was not committed"
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
