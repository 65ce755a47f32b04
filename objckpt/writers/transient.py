"""Which failed store requests are worth another try, and which say "slow down".

Transient: HTTP 503/SlowDown and 500/InternalError, connection resets and
refusals, timeouts, truncated responses. Permanent (raised at once): 403, 404
(no bucket or key), 412 (the create-only commit lost), bad requests, and a
deadline that ran out. Judged by type, service code and HTTP status only, never
by message text: a ValueError naming step-0000005030 is not a 503. Kept apart
from the retry loop (:mod:`objckpt.writers.retry`) because the rules are a table
of backend names that grows with each backend, and the loop should not.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import socket

from objckpt.errors import RequestDeadlineError, SaveDeadlineError
from objckpt.writers.translate import causes, service_error

__all__ = ["is_throttle", "is_transient"]

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
        isinstance(
            e,
            (
                PermissionError,
                FileNotFoundError,
                FileExistsError,
                SaveDeadlineError,
                RequestDeadlineError,
            ),
        )
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
