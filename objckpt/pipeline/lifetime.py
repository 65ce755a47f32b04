"""Bounded endings: saves still in flight when their owner closes or the interpreter exits.

Closing waits for each save in flight until its own bound (its deadline, then the
commit's waits: :meth:`~objckpt.pipeline.commit_phase.Committer.ends_by`), never
longer: :func:`wait_bounded`, and :func:`run_bounded` for a close made of steps
that live elsewhere (the manager's promotions and backups).

At exit:
An async save runs on daemon threads and in worker processes that exit with the
training process, so a script that ends without waiting (no ``result()``, no
``wait_until_finished()``, no ``with`` block) used to lose its last save with no
word: nothing committed, nothing said (stock ``dcp.async_save`` loses it too).
Each checkpointer registers an ``atexit`` hook that holds it weakly (so the hook
never keeps it alive) and that ``close()`` removes. At exit the hook warns, naming
every save in flight and how to wait for it, then waits up to
``AsyncOptions.exit_timeout``.

The warning is a log record only, one line: where logging is not set up, Python's
last-resort handler prints it to stderr as it is. (A ``warnings.warn`` beside it
printed the message a second time, followed by the source line that called it,
which read like a traceback fragment; and under ``-W error`` it would become an
exception inside the exit hook.)

Why wait by default: Python's own convention is to finish pending work at exit
(non-daemon threads are joined, executors drain), and a script's last checkpoint
is the one a user misses most. Why bounded: a stuck store must not hang the
exit; a save not done by then is dropped, and a second warning says so.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

from objckpt.pipeline.handle import SaveHandle

__all__ = ["register", "run_bounded", "wait_bounded", "warn_and_wait"]

logger = logging.getLogger(__name__)

HOW_TO_WAIT = (
    "wait for saves before the script ends: handle.result(), "
    "wait_until_finished() (AsyncCheckpointer or CheckpointManager), or a `with` block"
)


class _Owner(Protocol):
    def _at_exit(self) -> None: ...


def register(owner: _Owner) -> Callable[[], None]:
    """Call ``owner._at_exit()`` at interpreter exit while ``owner`` lives; returns
    the hook, for ``atexit.unregister`` when the owner closes."""
    hook = functools.partial(_at_exit, weakref.ref(owner))
    atexit.register(hook)
    return hook


def _at_exit(ref: weakref.ref[_Owner]) -> None:
    owner = ref()
    if owner is not None:
        owner._at_exit()


def wait_bounded(handles: Sequence[SaveHandle], until: float | None = None) -> list[SaveHandle]:
    """Wait for ``handles``, each at most until its own bound (and ``until``, a
    ``time.monotonic()``); returns those still running."""
    return [h for h in handles if not h.settled(until)]


def run_bounded(fn: Callable[[], None], timeout: float | None, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait for it up to ``timeout`` seconds (None:
    until it ends); re-raises its error. False, logged naming ``what``, when it is
    still running then: it is abandoned to its thread."""
    finished = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # raised on the caller's thread below
            failure.append(exc)
        finally:
            finished.set()

    threading.Thread(target=run, name="objckpt-closing", daemon=True).start()
    if not finished.wait(timeout):
        logger.warning("%s: still running after %.0f s, abandoned", what, timeout)
        return False
    if failure:
        raise failure[0]
    return True


def warn_and_wait(pending: Sequence[SaveHandle], wait: float) -> list[SaveHandle]:
    """Name the saves in flight at exit, wait up to ``wait`` seconds for them, and
    name those dropped; returns them."""
    if not pending:
        return []
    urls = ", ".join(h.url for h in pending)
    then = (
        f"waiting up to {wait:g} s for them (AsyncOptions.exit_timeout)"
        if wait
        else "they are dropped, not committed (AsyncOptions.exit_timeout=0)"
    )
    logger.warning(
        "objckpt: the interpreter is exiting with %d async save(s) in flight: %s; %s; %s",
        len(pending),
        urls,
        then,
        HOW_TO_WAIT,
    )
    if not wait:
        return list(pending)
    dropped = wait_bounded(pending, time.monotonic() + wait)
    if dropped:
        logger.warning(
            "objckpt: dropped at exit, not committed: %s "
            "(still in flight after AsyncOptions.exit_timeout=%g s); %s",
            ", ".join(h.url for h in dropped),
            wait,
            HOW_TO_WAIT,
        )
    return dropped
