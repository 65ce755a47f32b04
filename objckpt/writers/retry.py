"""Retries for store requests: one policy value, applied where every request passes.

Why objckpt owns this instead of leaving it to the SDKs: s3fs retries each call
5 times and botocore retries again underneath, so a hard outage costs 25
attempts with two unrelated backoffs, and neither tells objckpt it is being
throttled nor knows a save's deadline. Here botocore is configured (through its
public ``Config``) for a single attempt with a per-request timeout, and
:class:`~objckpt.writers.s3client.RetryingS3FileSystem` (an s3fs subclass, so
uploads, reads, listings and deletes all pass it) runs each request through
:func:`call_with_retries`: capped exponential backoff with full jitter
(tenacity), transient errors only, bounded by the save's deadline.

Transient: HTTP 503/SlowDown and 500/InternalError, connection resets and
refusals, timeouts, truncated responses. Permanent (raised at once): 403, 404
(no bucket or key), 412 (the create-only commit lost), bad requests. Each
throttling answer is reported to observers, which is how upload concurrency
backs off (:mod:`objckpt.writers.throttle`).

GCS requests keep gcsfs's own retry loop (it already retries 5xx, 429 and
connection errors with backoff); the policy's timeout is not applied there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import http.client
import logging
import socket
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sized
from typing import Any, Protocol

import tenacity

from objckpt.errors import ConfigurationError, SaveDeadlineError
from objckpt.writers.accounting import current_counter
from objckpt.writers.deadline import current_deadline
from objckpt.writers.translate import causes, service_error

__all__ = [
    "RetryObserver",
    "RetryPolicy",
    "RetryingFileSystem",
    "call_with_retries",
    "is_throttle",
    "is_transient",
    "retry_call",
    "s3_options",
]

logger = logging.getLogger(__name__)

_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EREMOTEIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.EAGAIN}
_TRANSIENT_NAMES = {
    # botocore / aiobotocore / aiohttp / s3fs names, matched by name so that the
    # optional packages need not be importable here.
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "ResponseParserError",
    "HTTPClientError",
    "IncompleteReadError",
    "ClientPayloadError",
    "ClientConnectorError",
    "ClientConnectionError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "FSTimeoutError",
}
# Service error codes (botocore's ``Error.Code``) and HTTP statuses worth another try;
# anything else the service answered is permanent. Never read from message text: a
# ValueError naming step-0000005030 is not a 503.
_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded"}
)
_TRANSIENT_CODES = _THROTTLE_CODES | {"ServiceUnavailable", "InternalError", "RequestTimeout"}
_THROTTLE_STATUS = frozenset({429, 503})
_TRANSIENT_STATUS = _THROTTLE_STATUS | {500, 502, 504}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How store requests are retried.

    Attributes:
        attempts: Tries per request, the first included (1 = no retry).
        base_delay: First backoff in seconds; doubles per retry.
        max_delay: Cap on one backoff (seconds). Each wait is drawn uniformly
            from zero to the current cap ("full jitter"), so ranks that fail
            together do not retry together.
        timeout: Seconds one request may take to connect and to deliver each
            read; a stalled request fails and is retried.
    """

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.attempts, bool)
            or not isinstance(self.attempts, int)
            or self.attempts < 1
        ):
            raise ConfigurationError(
                f"option attempts={self.attempts!r} is invalid: expected an int >= 1"
            )
        for name in ("base_delay", "max_delay", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(
                    f"option {name}={value!r} is invalid: expected seconds > 0"
                )
        if self.max_delay < self.base_delay:
            raise ConfigurationError(
                f"option max_delay={self.max_delay!r} is invalid: expected >= base_delay"
            )


def _service_answer(exc: BaseException) -> tuple[str | None, int | None]:
    """The service's error code and HTTP status anywhere in ``exc``'s cause chain:
    botocore keeps them in ``response``, aiohttp puts the status on ``status``,
    gcsfs on ``code``."""
    for e in causes(exc):
        code, status = service_error(e)
        if code is not None or status is not None:
            return code, status
    return None, None


def is_throttle(exc: BaseException) -> bool:
    """A 503 SlowDown (or 429) answer: the store asks for fewer requests."""
    code, status = _service_answer(exc)
    if code is not None or status is not None:
        return code in _THROTTLE_CODES or status in _THROTTLE_STATUS
    # s3fs without the botocore cause: it maps SlowDown/503 to EBUSY.
    return any(isinstance(e, OSError) and e.errno == errno.EBUSY for e in causes(exc))


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed (by type, code and status only)."""
    chain = causes(exc)
    if any(
        isinstance(e, (PermissionError, FileNotFoundError, FileExistsError, SaveDeadlineError))
        for e in chain
    ):
        return False
    code, status = _service_answer(exc)
    if code is not None or status is not None:
        return code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
    for e in chain:
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if isinstance(
            e,
            (
                ConnectionError,
                TimeoutError,
                socket.timeout,
                asyncio.TimeoutError,
                http.client.IncompleteRead,
            ),
        ):
            return True
        if type(e).__name__ in _TRANSIENT_NAMES:
            return True
    return False


class RetryObserver(Protocol):
    """Told about every request outcome (the upload concurrency limiter is one)."""

    def throttled(self) -> None: ...

    def succeeded(self) -> None: ...


def s3_options(options: Mapping[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """s3fs options with the SDKs' own retries and checksums off and the request
    timeout set, unless the caller chose them."""
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    # objckpt sends the CRC32C of every PUT and part itself (S3 checks it in
    # transit), so botocore's own CRC and payload SHA256 would hash each byte twice
    # more (measured: 0.9 and 1.3 CPU s/GiB). A request without objckpt's checksum
    # (a listing, a GET) carries no payload to hash.
    config.setdefault("request_checksum_calculation", "when_required")
    config.setdefault("response_checksum_validation", "when_required")
    s3 = dict(config.get("s3") or {})
    s3.setdefault("payload_signing_enabled", False)
    config["s3"] = s3
    config.setdefault("connect_timeout", policy.timeout)
    config.setdefault("read_timeout", policy.timeout)
    out["config_kwargs"] = config
    return out


async def call_with_retries(
    call: Callable[..., Awaitable[Any]],
    policy: RetryPolicy,
    observers: Iterable[RetryObserver],
    what: Callable[[], str],
    method: str,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run one store request under ``policy`` and the current save's deadline.

    Each attempt is bounded by what is left of the deadline
    (:mod:`objckpt.writers.deadline`); retries stop once no time is left for one
    more, and the request fails with :class:`~objckpt.errors.SaveDeadlineError`
    naming the save and the object (``what()`` says which request it is, for
    messages). Every outcome is counted (the current
    :class:`~objckpt.writers.accounting.RequestCounter`) and told to ``observers``.
    """
    deadline = current_deadline()

    def out_of_time(state: tenacity.RetryCallState) -> bool:
        if state.attempt_number >= policy.attempts:
            return True
        # The next wait is at most max_delay; stop unless an attempt can follow it.
        return deadline is not None and deadline.remaining() <= 0

    retrying = tenacity.AsyncRetrying(
        stop=out_of_time,
        wait=tenacity.wait_random_exponential(multiplier=policy.base_delay, max=policy.max_delay),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=lambda state: _log_retry(state, what, policy),
        reraise=True,
    )
    counter = current_counter()
    body = kwargs.get("Body")
    sent = len(body) if isinstance(body, (bytes, bytearray, memoryview, Sized)) else 0
    async for attempt in retrying:
        with attempt:
            retry = attempt.retry_state.attempt_number > 1
            try:
                if deadline is None:
                    out = await call(method, *args, **kwargs)
                else:
                    left = deadline.remaining()
                    if left <= 0:
                        raise deadline.error(what())
                    try:
                        out = await asyncio.wait_for(call(method, *args, **kwargs), left)
                    except asyncio.TimeoutError as exc:
                        if deadline.remaining() > 0:
                            raise  # the request's own timeout: transient, retried
                        raise deadline.error(what()) from exc
            except Exception as exc:
                throttled = is_throttle(exc)
                if counter is not None:
                    counter.record(method, sent=sent, retry=retry, throttled=throttled)
                if throttled:
                    for o in list(observers):
                        o.throttled()
                raise
            if counter is not None:
                received = out.get("ContentLength", 0) if method == "get_object" else 0
                counter.record(
                    method,
                    sent=sent,
                    received=received if isinstance(received, int) else 0,
                    retry=retry,
                    throttled=False,
                )
            for o in list(observers):
                o.succeeded()
            return out
    raise AssertionError("unreachable")  # pragma: no cover - reraise=True


class RetryingFileSystem:
    """What objckpt's s3fs and gcsfs subclasses share: a policy, observers told of
    throttling, and one request run under :func:`call_with_retries`. Mixed in before
    the fsspec class (``class RetryingS3FileSystem(RetryingFileSystem, S3FileSystem)``).

    Args:
        retry_policy: How requests are retried (objckpt's default if omitted).
        *args, **kwargs: The filesystem's own options (``storage_options``).
    """

    def __init__(self, *args: Any, retry_policy: RetryPolicy | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry_policy = retry_policy or RetryPolicy()
        # Weak: a checkpointer shares one filesystem across saves, each save's store
        # observes it, and a finished store must not be kept (or told) forever.
        self._observers: weakref.WeakSet[Any] = weakref.WeakSet()

    def add_observer(self, observer: RetryObserver) -> None:
        """Tell ``observer`` of every throttled and every successful request."""
        self._observers.add(observer)

    async def _retried(
        self,
        call: Callable[..., Awaitable[Any]],
        what: Callable[[], str],
        method: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        return await call_with_retries(
            call, self.retry_policy, self._observers, what, method, *args, **kwargs
        )


def _log_retry(
    state: tenacity.RetryCallState, what: Callable[[], str], policy: RetryPolicy
) -> None:
    exc = state.outcome.exception() if state.outcome else None
    logger.info(
        "retrying %s after %s (attempt %d of %d)",
        what(),
        type(exc).__name__ if exc else "an error",
        state.attempt_number + 1,
        policy.attempts,
    )


def retry_call(fn: Callable[[], Any], policy: RetryPolicy, what: str) -> Any:
    """Call ``fn`` until it succeeds, raises a permanent error, or attempts run out
    (for work above single requests, such as reading a batch of ranges whose
    response body was cut off)."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.attempts),
        wait=tenacity.wait_random_exponential(multiplier=policy.base_delay, max=policy.max_delay),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=lambda s: logger.info(
            "retrying %s after %s (attempt %d of %d)",
            what,
            type(s.outcome.exception()).__name__ if s.outcome else "an error",
            s.attempt_number + 1,
            policy.attempts,
        ),
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            return fn()
    raise AssertionError("unreachable")  # pragma: no cover - reraise=True
