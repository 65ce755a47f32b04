"""Errors are classified by exception type, service error code and HTTP status only."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError

from objckpt.errors import AccessDeniedError, StoreError
from objckpt.writers.retry import is_throttle, is_transient
from objckpt.writers.transient import asks_to_slow_down, is_damaged
from objckpt.writers.translate import translate


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


class _ContentLengthError(Exception):
    """Shaped like aiohttp's ClientPayloadError cause: a ``code`` that is no HTTP answer."""

    code = 400


class ClientPayloadError(Exception):
    pass


def _cut_body() -> BaseException:
    return _wrapped(_ContentLengthError(), ClientPayloadError("Response payload is not completed"))


def _wrapped(cause: BaseException, outer: BaseException) -> BaseException:
    """As s3fs raises: its own OSError, the botocore error kept as the cause."""
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("no such key: step-0000005030 (InternalError in the name)"),
        RuntimeError("503 appears in this message but nothing answered 503"),
        _client_error("AccessDenied", 403),
        _client_error("NoSuchKey", 404),
        _client_error("PreconditionFailed", 412),
        _client_error("InvalidMd5", 400),  # a malformed header is sent malformed again
        _wrapped(_client_error("AccessDenied", 403), OSError(errno.EACCES, "denied")),
    ],
)
def test_not_transient(exc: BaseException) -> None:
    assert not is_transient(exc)
    assert not is_throttle(exc)


@pytest.mark.parametrize(
    ("exc", "throttle", "asks"),
    [
        (_client_error("SlowDown", 503), True, True),
        (_client_error("TooManyRequests", 429), True, True),
        (_client_error("ServerBusy", 503), True, True),  # Azure Blob's throttling
        # A 503 that does not name throttling (a load balancer's, a failing proxy's):
        # concurrency backs off, but it uses up attempts like any other failure.
        (_client_error("ServiceUnavailable", 503), True, False),
        (_client_error("InternalError", 500), False, False),
        # A body that did not match the checksum sent with it: damaged on the way.
        (_client_error("BadDigest", 400), False, False),
        (_client_error("Md5Mismatch", 400), False, False),
        (_client_error("Crc64Mismatch", 400), False, False),
        (_wrapped(_client_error("SlowDown", 503), OSError(errno.EBUSY, "SlowDown")), True, True),
        # s3fs's EBUSY without its cause: SlowDown, or a bare 503, or a 409: it counts.
        (OSError(errno.EBUSY, "busy"), True, False),
        (ConnectionResetError(), False, False),
        (_cut_body(), False, False),  # a body cut short (aiohttp's code=400 is no answer)
        (TimeoutError(), False, False),
    ],
)
def test_transient(exc: BaseException, throttle: bool, asks: bool) -> None:
    """``asks``: the store asks for fewer requests by name, so a read waits it out
    until its ``request_deadline`` instead of counting it among ``attempts``."""
    assert is_transient(exc)
    assert is_throttle(exc) is throttle
    assert asks_to_slow_down(exc) is asks


@pytest.mark.parametrize(
    "exc",
    [
        OSError("403 Forbidden"),
        OSError("Forbidden: gs://bucket/key"),  # gcsfs's 403
        _client_error("AccessDenied", 403),
        _wrapped(_client_error("AllAccessDisabled", 403), OSError("denied")),
        PermissionError("no"),
    ],
)
def test_refusals_are_access_denied(exc: BaseException) -> None:
    assert isinstance(translate(exc, url="s3://b/k", action="writing"), AccessDeniedError)


@pytest.mark.parametrize(
    "exc",
    [
        OSError("could not read 403 objects"),  # a count, not a status
        ValueError("AccessDenied is a word in this message"),
    ],
)
def test_message_text_does_not_decide(exc: BaseException) -> None:
    err = translate(exc, url="s3://b/k", action="writing")
    assert type(err) is StoreError and "s3://b/k" in str(err)


def test_a_body_refused_for_its_checksum_is_damaged_and_nothing_else_is() -> None:
    """``is_damaged`` bounds how often such a body is sent again (the retry loop)."""
    assert all(
        is_damaged(_client_error(c, 400)) for c in ("BadDigest", "Md5Mismatch", "Crc64Mismatch")
    )
    assert not any(
        is_damaged(e)
        for e in (_client_error("InvalidMd5", 400), _client_error("SlowDown", 503), TimeoutError())
    )
