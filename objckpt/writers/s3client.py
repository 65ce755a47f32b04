"""The s3fs filesystem objckpt builds for ``s3://``: s3fs with objckpt's retries.

Why a subclass and not s3fs as is: s3fs retries each request itself (its class
attribute ``retries``, 5 tries) on top of botocore's retries, does not know a
save's deadline, and tells nobody about throttling. This subclass sets s3fs's loop
to one try and overrides ``_call_s3``, the one coroutine every s3fs request goes
through, to run it under :func:`~objckpt.writers.retry.call_with_retries`.

A GET's answer is read whole inside that retried request (where it was ranged, or
is small enough to hold): a body cut off after its 200 is then retried like a
refused request, by the one retry layer, instead of by a second loop around the
whole read that multiplied the attempts. s3fs reads such bodies whole anyway, from
a :class:`_ReadBody` now. A large whole-object GET (a streamed download) keeps its
streaming body.

``_call_s3`` and ``retries`` are s3fs internals: ``tests/store/test_s3client.py`` pins
them for the s3fs range objckpt supports (``s3fs>=2024.6``), so a release that
changes them fails there, not in a user's save. So are ``_s3`` and ``_s3creator``,
which :meth:`RetryingS3FileSystem.close_connections` closes
(``tests/pipeline/test_async.py`` counts the sockets left after a checkpointer's close).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from s3fs import S3FileSystem

from objckpt.writers.retry import RetryingFileSystem

__all__ = ["RetryingS3FileSystem"]

#: Largest unranged GET body read inside the retried request (larger ones stream).
_WHOLE_BODY_LIMIT = 64 * 1024 * 1024


class _ReadBody:
    """An answer's body already read: the part of aiobotocore's ``StreamingBody``
    that s3fs uses (``read`` and ``close``)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    async def read(self, amt: int | None = None) -> bytes:
        if self._at == 0 and (amt is None or amt < 0 or amt >= len(self._data)):
            self._at = len(self._data)
            return self._data  # the whole body, not a copy
        end = len(self._data) if amt is None or amt < 0 else self._at + amt
        out = self._data[self._at : end]
        self._at += len(out)
        return out

    def close(self) -> None:
        pass


class RetryingS3FileSystem(RetryingFileSystem, S3FileSystem):
    """``S3FileSystem`` whose requests follow a :class:`~objckpt.RetryPolicy` and the
    save's deadline (``retry_policy=`` besides s3fs's own options)."""

    retries = 1  # s3fs's own retry loop: one try; call_with_retries retries instead

    async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
        # Only the names, not ``kwargs``: tenacity's retry state forms reference cycles
        # that live until a garbage collection, and a closure over ``kwargs`` would keep
        # each request's Body (a 16 MiB part) alive with them (measured: ~10 parts per
        # upload worker after a save).
        bucket, key = kwargs.get("Bucket"), kwargs.get("Key")

        def what() -> str:
            target = f"s3://{bucket}/{key}" if key else f"s3://{bucket}" if bucket else "S3"
            return f"S3 {method} of {target}"

        call = self._get_and_read if method == "get_object" else super()._call_s3
        return await self._retried(call, what, method, *akwarglist, **kwargs)

    async def _get_and_read(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
        """One GET with its body read (ranged or small), as one attempt."""
        resp = await super()._call_s3(method, *akwarglist, **kwargs)
        size = resp.get("ContentLength")
        ranged = "Range" in kwargs or any("Range" in a for a in akwarglist)
        if not ranged and not (isinstance(size, int) and size <= _WHOLE_BODY_LIMIT):
            return resp
        body = resp["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return {**resp, "Body": _ReadBody(bytes(data))}

    async def close_connections(self) -> None:
        """Close this filesystem's client and its connections now, on its loop (s3fs
        closes them only when the filesystem is garbage collected); a later request
        would open a new client."""
        creator = getattr(self, "_s3creator", None)
        self._s3 = None
        if creator is not None:
            self._s3creator = None
            await creator.__aexit__(None, None, None)

    def endpoint(self) -> str | None:
        """The S3 endpoint this filesystem's client talks to (scheme, host and port)."""
        client = getattr(self, "_s3", None)
        url = getattr(getattr(client, "meta", None), "endpoint_url", None)
        if not isinstance(url, str):
            url = (self.client_kwargs or {}).get("endpoint_url") or getattr(
                self, "endpoint_url", None
            )
        if not isinstance(url, str) or not url:
            return None
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}" if parts.scheme else url.split("?")[0]
