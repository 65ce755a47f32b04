"""Async request queue with the reference systems' semantics, over the checkpointer.

Megatron users know NVIDIA's ``AsyncCallsQueue``/``AsyncRequest`` (the resiliency
extension's API): a checkpoint strategy returns a request, the training loop
schedules it and finalizes it every few steps. Here the queue is a thin adapter
over :class:`~objckpt.AsyncCheckpointer`, not a second way to save:
``AsyncCheckpointer.async_request`` starts a save exactly as ``save`` does and
returns its request, whose work the queue does not run (the checkpointer's
workers upload and its commit thread commits, on every rank); the queue only
waits for that save's outcome and then runs the request's finalize functions, in
order. A request built from a plain callable (``AsyncRequest(fn, args, ...)``)
runs it on the queue's executor instead, as the reference API does, for
finalize-ordered work that is not an objckpt save.

``schedule_async_request`` starts a request's work in the background and returns
its index; ``maybe_finalize_async_calls`` runs, in schedule order and exactly
once, the finalize functions of every request whose work is done on *every*
rank. A request is frozen when scheduled: adding a finalize function afterwards
raises, so nothing can sneak in between "done" and "finalized".

Unlike NVIDIA's ``AsyncCallsQueue``, the work does not run in a fork of the
training process (forking after CUDA or client threads exist is the known cause
of deadlocks and corruption), and "done on every rank" is decided through the
c10d store rather than a collective the training loop must call on all ranks.

Nothing a callback raises is lost: a failed report to the barrier (a
``Future`` done-callback, whose errors ``concurrent.futures`` would only log
without the request) is logged with the request's index and raised by this rank's
next finalize of that request, and a finalize function's error is logged with
the request's index and raised to the caller.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from objckpt.errors import ObjckptError, RequestFailedError

if TYPE_CHECKING:
    from objckpt.pipeline.handle import SaveHandle

__all__ = ["AsyncCallsQueue", "AsyncRequest", "RankBarrier"]

logger = logging.getLogger(__name__)


class RankBarrier(Protocol):
    """Decides when a request is done on every rank (see :mod:`objckpt.pipeline.finalize`)."""

    def arrive(self, key: str, ok: bool) -> None:
        """This rank's work for ``key`` ended (``ok``: without an error)."""
        ...

    def all_arrived(self, key: str, timeout: float | None) -> bool:
        """Whether every rank arrived (waiting up to ``timeout``); raises
        :class:`~objckpt.errors.RequestFailedError` when any rank's work failed."""
        ...


class AsyncRequest:
    """Work to run in the background plus functions to run once it is done everywhere.

    Args:
        async_fn: Callable run in the background (None: nothing to run).
        async_fn_args: Its positional arguments.
        finalize_fns: Called in order, once, after the work is done on all ranks.
        async_fn_kwargs: Its keyword arguments.

    The request of an objckpt save comes from
    :meth:`~objckpt.AsyncCheckpointer.async_request` (:meth:`for_save`): its work is
    the save the checkpointer already runs.
    """

    __slots__ = (
        "_finalize_fns",
        "_frozen",
        "_save",
        "async_fn",
        "async_fn_args",
        "async_fn_kwargs",
    )

    def __init__(
        self,
        async_fn: Callable[..., Any] | None,
        async_fn_args: Sequence[Any] = (),
        finalize_fns: Sequence[Callable[[], Any]] = (),
        async_fn_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.async_fn = async_fn
        self.async_fn_args = tuple(async_fn_args)
        self.async_fn_kwargs = dict(async_fn_kwargs or {})
        self._finalize_fns = list(finalize_fns)
        self._frozen = False
        self._save: SaveHandle | None = None

    @classmethod
    def for_save(
        cls, handle: SaveHandle, finalize_fns: Sequence[Callable[[], Any]] = ()
    ) -> AsyncRequest:
        """The request whose work is a save an :class:`~objckpt.AsyncCheckpointer`
        has started: done when ``handle`` has committed (on every rank: the commit
        is the ranks' agreement) or failed, so the queue runs nothing of its own."""
        request = cls(None, (), finalize_fns)
        request._save = handle
        return request

    @property
    def save(self) -> SaveHandle | None:
        """The save this request stands for (None: its work is ``async_fn``)."""
        return self._save

    @property
    def is_frozen(self) -> bool:
        return self._frozen

    @property
    def finalize_fns(self) -> tuple[Callable[[], Any], ...]:
        return tuple(self._finalize_fns)

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append a finalize function; raises once the request is scheduled."""
        if self._frozen:
            raise ObjckptError(
                "cannot add a finalize function to an AsyncRequest that is already scheduled"
            )
        self._finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """A frozen copy (the queue schedules copies, so the caller's object stays editable)."""
        out = AsyncRequest(
            self.async_fn, self.async_fn_args, self._finalize_fns, self.async_fn_kwargs
        )
        out._save = self._save
        out._frozen = True
        return out


@dataclasses.dataclass
class _Active:
    index: int
    request: AsyncRequest
    future: concurrent.futures.Future[Any]
    #: Set once this rank's end was reported to the barrier (or that failed).
    arrived: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: This rank's report to the barrier failed: the request cannot conclude.
    arrive_error: BaseException | None = None


def _arrive(barrier: RankBarrier, call: _Active) -> None:
    """Report ``call``'s end to ``barrier`` (a done-callback: it must not raise)."""
    try:
        barrier.arrive(f"req{call.index}", call.future.exception() is None)
    except Exception as exc:
        logger.error(
            "async request %d: reporting its end to the other ranks failed: %s",
            call.index,
            exc,
            exc_info=True,
        )
        call.arrive_error = exc
    finally:
        call.arrived.set()


def _outcome_of(handle: SaveHandle) -> concurrent.futures.Future[Any]:
    """A future settled with ``handle``'s save: its manifest, or its error."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def settle(done: SaveHandle) -> None:
        exc = done.exception(0)
        if exc is None:
            future.set_result(done.result(0))
        else:
            future.set_exception(exc)

    handle.add_done_callback(settle)
    return future


class AsyncCallsQueue:
    """Schedules :class:`AsyncRequest` work and finalizes it in order.

    Args:
        executor: Runs the ``async_fn`` of requests that are not saves (default:
            one background thread, so they run in order); any ``Executor``. A
            save's request (``AsyncCheckpointer.async_request``) uses none.
        barrier: Cross-rank completion; None means this process alone decides.
        finalize_timeout: Seconds a blocking finalize waits for other ranks
            before raising.
    """

    def __init__(
        self,
        executor: concurrent.futures.Executor | None = None,
        barrier: RankBarrier | None = None,
        finalize_timeout: float = 600.0,
    ) -> None:
        self._own_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="objckpt-async"
        )
        self._barrier = barrier
        self._timeout = finalize_timeout
        self._calls: collections.deque[_Active] = collections.deque()
        self._next = 0
        self._lock = threading.RLock()  # callable from any thread

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Freeze ``request``, start its work, and return its index (0, 1, 2, ...)."""
        with self._lock:
            frozen = request.freeze()
            request._frozen = True  # the caller's object is frozen too: it was handed over
            index = self._next
            self._next += 1
            future: concurrent.futures.Future[Any]
            if frozen.save is not None:  # the checkpointer runs it: wait for its outcome
                future = _outcome_of(frozen.save)
            elif frozen.async_fn is None:
                future = concurrent.futures.Future()
                future.set_result(None)
            else:
                future = self._executor.submit(
                    frozen.async_fn, *frozen.async_fn_args, **frozen.async_fn_kwargs
                )
            call = _Active(index, frozen, future)
            self._calls.append(call)
            barrier = self._barrier
            if barrier is not None:
                future.add_done_callback(lambda f: _arrive(barrier, call))
            return index

    def _done_everywhere(self, call: _Active, blocking: bool) -> bool:
        if blocking:
            call.future.exception()  # wait; errors surface below
        elif not call.future.done():
            return False
        if self._barrier is None:
            return True
        # The report runs as the future's callback, after waiters were woken.
        if not call.arrived.wait(None if blocking else 0.0):
            return False
        if call.arrive_error is not None:  # the other ranks never heard of its end
            raise RequestFailedError(
                f"async request {call.index}: this rank could not report its end to the "
                f"other ranks ({call.arrive_error}); its finalize functions were not run"
            ) from call.arrive_error
        return self._barrier.all_arrived(f"req{call.index}", self._timeout if blocking else 0.0)

    def maybe_finalize_async_calls(self, blocking: bool = False) -> list[int]:
        """Finalize every leading request that is done on all ranks; return their indices.

        Args:
            blocking: Wait for all scheduled requests instead of only finished ones.

        Raises:
            Exception: The request's own error (its finalize functions do not run;
                the request is dropped so later ones can proceed).
            RequestFailedError: The request failed on another rank (dropped too).
        """
        finalized: list[int] = []
        with self._lock:
            while self._calls:
                call = self._calls[0]
                try:
                    if not self._done_everywhere(call, blocking):
                        break
                except RequestFailedError:
                    self._calls.popleft()  # failed somewhere: dropped, never finalized
                    own = call.future.exception()
                    if own is not None:  # this rank's own error says more
                        raise own from None
                    raise
                self._calls.popleft()
                exc = call.future.exception()
                if exc is not None:
                    raise exc
                for n, fn in enumerate(call.request.finalize_fns):
                    try:
                        fn()
                    except Exception:
                        logger.error(
                            "async request %d: finalize function %d of %d (%r) failed; the "
                            "ones after it were not run",
                            call.index,
                            n + 1,
                            len(call.request.finalize_fns),
                            fn,
                            exc_info=True,
                        )
                        raise
                finalized.append(call.index)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        with self._lock:
            return len(self._calls)

    def close(self) -> None:
        """Finalize everything still scheduled, then release the default executor."""
        try:
            self.maybe_finalize_async_calls(blocking=True)
        finally:
            if self._own_executor:
                self._executor.shutdown(wait=True)
