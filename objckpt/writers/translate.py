"""Translate backend errors into objckpt's hierarchy, at the store boundary.

Backends disagree on how they say the same thing: botocore raises
``NoCredentialsError``, s3fs turns a 403 into ``PermissionError``, aiohttp raises
``ClientConnectorError``, gcsfs an ``HttpError`` and azure-storage-blob (under
adlfs) an ``HttpResponseError`` with ``status_code`` and ``error_code``. Callers of
objckpt see one class per meaning, with the original kept as ``__cause__``.

A client may mark an exception with ``objckpt_hint`` (a sentence of its own, never
the request's options), said after a refusal's description: objckpt's S3 client
names ``requester_pays`` beside a bare 403 AccessDenied, as a requester-pays
bucket answers one.

Backend messages can quote request URLs, and a presigned URL carries a signature,
so query strings are cut from any text that is copied into our messages.
"""

from __future__ import annotations

import asyncio
import re
import ssl

from objckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    MissingCredentialsError,
    ObjckptError,
    StoreError,
    StoreUnreachableError,
)

__all__ = [
    "causes",
    "describe",
    "precondition_failed",
    "service_error",
    "status_code",
    "translate",
    "unsatisfiable_range",
]

_QUERY = re.compile(r"\?[^\s'\"]*")
_CREDENTIAL_ERRORS = (
    "NoCredentialsError",
    "PartialCredentialsError",
    "DefaultCredentialsError",
    "CredentialUnavailableError",  # azure-identity: no credential source found
)
_UNREACHABLE_ERRORS = (
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "FSTimeoutError",
    "ConnectionClosedError",
    "ServiceRequestError",  # azure-core: the request could not be sent
    "ServiceResponseError",  # azure-core: no (complete) answer came back
)

# What a store's refusal code means for the person holding the credentials.
_CREDENTIAL_HINTS = {
    "InvalidAccessKeyId": "the store does not know this access key id (wrong key, or "
    "keys for another account or endpoint)",
    "SignatureDoesNotMatch": "the secret key does not match the access key id",
    "ExpiredToken": "the session token has expired; refresh the credentials",
    "InvalidToken": "the session token is not valid",
    "TokenRefreshRequired": "the session token must be refreshed",
    "401": "the store rejected the credentials (401)",
    "AuthenticationFailed": "the store rejected the account key or SAS token "
    "(Azure AuthenticationFailed: wrong key, expired SAS, or a clock far off)",
}
# Where a private CA's bundle is given, by protocol (a certificate refused by the client).
_S3_CA_HINT = (
    "for a store whose certificate a private CA signed, give that CA's bundle in "
    "storage_options client_kwargs={'verify': '/path/to/ca.pem'} or AWS_CA_BUNDLE"
)
_CA_HINTS = {
    "s3": _S3_CA_HINT,
    "s3a": _S3_CA_HINT,
    "": "for a store whose certificate a private CA signed, give that CA's bundle as its "
    "client library documents (SSL_CERT_FILE for most)",
}
# Azure's codes for "these credentials may not do this" (its 403s).
_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "403",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "AuthorizationSourceIPMismatch",
        "AuthorizationProtocolMismatch",
        "InsufficientAccountPermissions",
        "AccountIsDisabled",
    }
)


def describe(exc: BaseException, limit: int = 300) -> str:
    """A short, credential-free description of a backend exception."""
    text = _QUERY.sub("?…", str(exc)).strip()
    if len(text) > limit:
        text = text[:limit] + "…"
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (at most 8, no cycles):
    wrappers such as s3fs keep the backend's own error there."""
    out: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in out and len(out) < 8:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


_LEADING_STATUS = re.compile(r"^(\d{3}) ")


def service_error(exc: BaseException) -> tuple[str | None, int | None]:
    """The service's error code and HTTP status carried by this one exception:
    botocore's ``response`` (``Error.Code``, ``HTTPStatusCode``), azure-core's
    ``HttpResponseError`` (``error_code``, ``status_code``), aiohttp's ``status``,
    gcsfs's ``code`` on its ``HttpError``, and gcsfs's plain ``OSError`` for a 403,
    whose message begins ``Forbidden``."""
    if "HttpResponseError" in _names(exc):
        code = getattr(exc, "error_code", None)
        code = getattr(code, "value", code)  # azure-storage's StorageErrorCode enum
        status = getattr(exc, "status_code", None)
        return (
            str(code) if code else None,
            status if isinstance(status, int) and not isinstance(status, bool) else None,
        )
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return (str(code) if code else None, status if isinstance(status, int) else None)
    # Only where these attributes are an HTTP answer: aiohttp's payload errors also
    # carry a ``code`` (400 for a body cut short), which is no answer from the store.
    names = _names(exc)
    attr = "status" if "ClientResponseError" in names else "code" if "HttpError" in names else None
    value = getattr(exc, attr, None) if attr else None
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
        return None, value
    if type(exc) is OSError and exc.args and isinstance(exc.args[0], str):
        if exc.args[0].startswith("Forbidden"):
            return None, 403
        leading = _LEADING_STATUS.match(exc.args[0])  # "403 Forbidden", as HTTP reports it
        if leading:
            return None, int(leading.group(1))
    return None, None


def precondition_failed(exc: BaseException) -> bool:
    """Whether the store answered 412 PreconditionFailed (anywhere in ``exc``'s causes).

    On a create-only PUT that always means "the key exists". s3fs says so
    (``FileExistsError``) only when the answer names the ``If-None-Match``
    condition; some S3-compatible stores leave the condition out, and their 412
    became a plain ``OSError`` that skipped the commit's read-back."""
    for seen in causes(exc):
        code, status = service_error(seen)
        if code == "PreconditionFailed" or status == 412:
            return True
    return False


def unsatisfiable_range(exc: BaseException) -> bool:
    """Whether the store answered 416 (anywhere in ``exc``'s causes): the range
    asked for starts at or past the object's end (RFC 9110), e.g. any range of an
    empty object. s3fs says so as ``OSError(EINVAL)`` whose text is whatever the
    store put in its ``Message`` (Ceph RGW puts none), so the answer is judged by
    its code and status, never by that text."""
    for seen in causes(exc):
        code, status = service_error(seen)
        if code == "InvalidRange" or status == 416:
            return True
    return False


def status_code(exc: BaseException) -> str | None:
    """The service's error code (``AccessDenied``, ``InvalidAccessKeyId``) of ``exc``
    or of the exception it was raised from, else its HTTP status (``"403"``)."""
    for seen in causes(exc):
        code, status = service_error(seen)
        if code is not None:
            return code
        if status is not None:
            return str(status)
    return None


def translate(
    exc: BaseException, *, url: str, action: str, missing_is_bucket: bool = False
) -> ObjckptError:
    """Map a backend exception to objckpt's hierarchy.

    Args:
        exc: What the backend raised.
        url: The URL (or object URL) the operation was about; it is named in the message.
        action: What was being done, e.g. ``"uploading"``, for the message.
        missing_is_bucket: A "not found" here means the bucket is missing.

    Returns:
        The error to raise (with ``raise ... from exc``). objckpt errors pass through.
    """
    if isinstance(exc, ObjckptError):
        return exc
    names = _names(exc)
    detail = describe(exc)
    if names & set(_CREDENTIAL_ERRORS):
        return MissingCredentialsError(
            f"no credentials found while {action} {url}: set them in the environment "
            f"(AWS_ACCESS_KEY_ID/AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS) or storage_options"
        )
    code = status_code(exc)
    if code in _CREDENTIAL_HINTS:
        return AccessDeniedError(
            f"credentials rejected while {action} {url}: {_CREDENTIAL_HINTS[code]} ({detail})"
        )
    if isinstance(exc, PermissionError) or code in _ACCESS_CODES:
        hint = next((h for e in causes(exc) if (h := getattr(e, "objckpt_hint", None))), None)
        more = f"; {hint}" if isinstance(hint, str) else ""
        return AccessDeniedError(f"access denied while {action} {url}: {detail}{more}")
    if code == "NoSuchBucket":  # S3 says which: not a missing object, the bucket
        bucket = url.partition("://")[2].split("/", 1)[0]
        return BucketNotFoundError(f"bucket {bucket!r} of {url} does not exist ({detail})")
    if code == "ContainerNotFound" or (isinstance(exc, FileNotFoundError) and missing_is_bucket):
        return BucketNotFoundError(f"bucket or root of {url} does not exist ({detail})")
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in causes(exc)):
        return StoreError(
            f"the store's TLS certificate was not trusted while {action} {url}: {detail}; "
            f"{_CA_HINTS.get(url.partition('://')[0], _CA_HINTS[''])}"
        )
    if names & set(_UNREACHABLE_ERRORS) or isinstance(
        exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)
    ):
        return StoreUnreachableError(f"store unreachable while {action} {url}: {detail}")
    return StoreError(f"store error while {action} {url}: {detail}")
