"""Which failed store requests are worth another try, and which say "slow down".

Transient: HTTP 503/SlowDown and 429, 500/InternalError, 502, 504, 408
RequestTimeout, connection resets and refusals, timeouts, truncated responses, and a
body the store refused because it did not match the checksum sent with it (S3's
``BadDigest``, Azure's ``Md5Mismatch`` and ``Crc64Mismatch``: damaged on the way, sent
again from the same bytes, at most :data:`DAMAGED_TRIES` times in all, since bytes
that changed under the upload fail every try: :func:`is_damaged`).
Permanent (raised at once): 403, 404 (no bucket or key), 412 (the create-only commit
lost), other 4xx answers, a TLS certificate the client does not trust, and a
deadline that ran out. A transient failure that
repeats past ``RetryPolicy.give_up_after`` is taken as persistent by the retry loop,
which says what the store answered (:func:`answer_of`). Judged by type, service code
and HTTP status only, never by message text: a ValueError naming step-0000005030 is
not a 503. Kept apart from the retry loop (:mod:`objckpt.writers.retry`) because the
rules are a table of backend names that grows with each backend, and the loop should
not.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import socket
import ssl

from objckpt.errors import RequestDeadlineError, SaveDeadlineError, StoreRefusedError
from objckpt.writers.translate import causes, service_error

__all__ = [
    "DAMAGED_TRIES",
    "answer_of",
    "asks_to_slow_down",
    "is_damaged",
    "is_throttle",
    "is_transient",
]

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
    # azure-core's transport errors: no answer, or none complete.
    "ServiceRequestError",
    "ServiceResponseError",
    "ServiceRequestTimeoutError",
    "ServiceResponseTimeoutError",
}
# Service error codes (botocore's ``Error.Code``) and HTTP statuses worth another try;
# anything else the service answered is permanent. Never read from message text: a
# ValueError naming step-0000005030 is not a 503.
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "ServerBusy",  # Azure Blob's throttling answer (503)
    }
)
#: A body that did not match the checksum sent with it (a 400, but not the request's fault).
_DAMAGED_CODES = frozenset({"BadDigest", "Md5Mismatch", "Crc64Mismatch"})
#: Sends of one body the store refused for its checksum, the first included: damage on
#: the way is rare (TCP and TLS check it too), so a third refusal says the path damages
#: every request, or the bytes changed between their checksum and their send (S3's
#: parts and Azure's blocks go from the caller's memory).
DAMAGED_TRIES = 3
_TRANSIENT_CODES = (
    _THROTTLE_CODES | _DAMAGED_CODES | {"ServiceUnavailable", "InternalError", "RequestTimeout"}
)
_THROTTLE_STATUS = frozenset({429, 503})
_TRANSIENT_STATUS = _THROTTLE_STATUS | {408, 500, 502, 504}


def _service_answer(exc: BaseException) -> tuple[str | None, int | None]:
    """The service's error code and HTTP status anywhere in ``exc``'s cause chain:
    botocore keeps them in ``response``, aiohttp puts the status on ``status``,
    gcsfs on ``code``."""
    for e in causes(exc):
        code, status = service_error(e)
        if code is not None or status is not None:
            return code, status
    return None, None


def answer_of(exc: BaseException) -> str | None:
    """What the store answered, for messages (``"HTTP 500 InternalError"``), or None
    where the request got no answer (refused or reset connection, timeout)."""
    code, status = _service_answer(exc)
    if code is None and status is None:
        if any(isinstance(e, OSError) and e.errno == errno.EBUSY for e in causes(exc)):
            return "SlowDown"  # s3fs's mapping of a 503 without its botocore cause
        return None
    return " ".join(p for p in (f"HTTP {status}" if status else None, code) if p)


def is_throttle(exc: BaseException) -> bool:
    """A 503 SlowDown (or 429) answer: the store asks for fewer requests."""
    code, status = _service_answer(exc)
    if code is not None or status is not None:
        return code in _THROTTLE_CODES or status in _THROTTLE_STATUS
    # s3fs without the botocore cause: it maps SlowDown/503 to EBUSY.
    return any(isinstance(e, OSError) and e.errno == errno.EBUSY for e in causes(exc))


def asks_to_slow_down(exc: BaseException) -> bool:
    """A throttling answer that says so (S3's ``SlowDown`` code, Azure's ``ServerBusy``,
    a 429), as opposed to a bare 503, which a load balancer or a
    failing proxy gives as well: only the first is a store asking for fewer requests
    for as long as it needs."""
    code, status = _service_answer(exc)
    # Without the service's answer it is not known to be one: s3fs maps a bare 503,
    # ServiceUnavailable and a 409 to EBUSY as well as SlowDown (it counts).
    return code in _THROTTLE_CODES or status == 429


def is_damaged(exc: BaseException) -> bool:
    """The store refused a body that did not match the checksum sent with it."""
    return _service_answer(exc)[0] in _DAMAGED_CODES


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
                StoreRefusedError,
                ssl.SSLCertVerificationError,  # the same certificate is refused again
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
