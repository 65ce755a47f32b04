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
streaming body. A load's payload ranges go into the memory the reader gave
(:meth:`RetryingS3FileSystem.cat_ranges_into`), again one retried attempt per ranged
GET, its body included: ranges of a MiB and more are received into it by a
synchronous mirror of this client (:mod:`objckpt.writers.s3_direct`: no copy), shorter
ones streamed through aiohttp, each chunk copied once.

Two more overrides, for store options: ``_exists`` of a bare bucket under
``requester_pays=True`` is a one-key listing (s3fs first asks HeadBucket and
GetBucketLocation, which cannot carry ``RequestPayer``); and a PutObject's
``IfNoneMatch`` is checked against botocore's model before it is sent (s3fs drops
every parameter its botocore does not know, which would turn the create-only commit
into an overwrite on a botocore from before S3's conditional writes).

``_call_s3``, ``retries`` and ``_exists`` are s3fs internals: ``tests/store/test_s3client.py`` pins
them for the s3fs range objckpt supports (``s3fs>=2024.6``), so a release that
changes them fails there, not in a user's save. So are ``_s3`` and ``_s3creator``,
which :meth:`RetryingS3FileSystem.close_connections` closes
(``tests/pipeline/test_async.py`` counts the sockets left after a checkpointer's close).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from fsspec.asyn import sync_wrapper
from s3fs import S3FileSystem
from s3fs.core import version_id_kw

from objckpt.errors import ConfigurationError
from objckpt.writers.reads import SpanSink, receive_into
from objckpt.writers.retry import RetryingFileSystem
from objckpt.writers.s3_direct import DIRECT_FROM, DirectGets, mirrorable
from objckpt.writers.translate import status_code

__all__ = ["REQUESTER_PAYS_HINT", "RetryingS3FileSystem"]

logger = logging.getLogger(__name__)

#: Said with an S3 AccessDenied answer when requests carry no ``RequestPayer``.
REQUESTER_PAYS_HINT = (
    "if the bucket is requester-pays, set storage_options requester_pays=True "
    "(S3 refuses requests without x-amz-request-payer with 403 AccessDenied)"
)

#: Parameters a request must carry as objckpt asked, by s3fs method name: checked
#: against botocore's model (see ``_require_parameter``).
_MUST_BE_SENT = {"put_object": ("IfNoneMatch", "IfMatch")}

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Large ranges' receiver (:meth:`_direct_gets`), and whether there is none.
        self._direct: DirectGets | None = None
        self._no_direct = False

    async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
        call = self._get_and_read if method == "get_object" else super()._call_s3
        return await self._call_via(call, method, *akwarglist, **kwargs)

    async def _call_via(
        self, call: Callable[..., Awaitable[Any]], method: str, *akwarglist: Any, **kwargs: Any
    ) -> Any:
        """``call(method, ...)`` as one retried request, its parameters checked."""
        # Only the names, not ``kwargs``: tenacity's retry state forms reference cycles
        # that live until a garbage collection, and a closure over ``kwargs`` would keep
        # each request's Body (a 16 MiB part) alive with them (measured: ~10 parts per
        # upload worker after a save).
        bucket, key = kwargs.get("Bucket"), kwargs.get("Key")

        def what() -> str:
            target = f"s3://{bucket}/{key}" if key else f"s3://{bucket}" if bucket else "S3"
            return f"S3 {method} of {target}"

        for name in _MUST_BE_SENT.get(method, ()):
            if name in kwargs:
                await self._require_parameter(method, name)
        try:
            name = f"{bucket or ''}/{key or kwargs.get('Prefix') or ''}"
            return await self._retried(call, what, name, method, *akwarglist, **kwargs)
        except PermissionError as exc:
            if not self.requester_pays and status_code(exc) == "AccessDenied":
                # AWS answers a request to a requester-pays bucket without
                # ``x-amz-request-payer`` with a bare 403 AccessDenied.
                exc.objckpt_hint = REQUESTER_PAYS_HINT  # type: ignore[attr-defined]
            raise

    async def _require_parameter(self, method: str, name: str) -> None:
        """Refuse a request whose parameter ``name`` the installed botocore does not
        know: s3fs drops such parameters without a word (it filters every request's
        arguments by botocore's model), and without ``IfNoneMatch`` the create-only
        commit would be a plain PUT that overwrites."""
        await self.set_session()
        meta = self.s3.meta
        operation = meta.method_to_api_mapping.get(method, method)
        shape = meta.service_model.operation_model(operation).input_shape
        if shape is None or name not in shape.members:
            import botocore

            raise ConfigurationError(
                f"the installed botocore {botocore.__version__} does not know {operation}'s "
                f"{name} parameter, which objckpt's create-only commit needs (S3 conditional "
                "writes came with botocore releases of August 2024); upgrade botocore and "
                "aiobotocore (pip install -U 'objckpt[s3]')"
            )

    async def _exists(self, path: str) -> bool:
        # A bucket's existence: s3fs asks HeadBucket and GetBucketLocation first,
        # which cannot carry RequestPayer (their input has no such member) and which a
        # requester-pays bucket refuses; a one-key listing carries it: one request.
        bucket, key, _ = self.split_path(self._strip_protocol(path))
        if not self.requester_pays or key or not bucket:
            return bool(await super()._exists(path))
        try:
            await self._call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
        except FileNotFoundError:
            return False
        return True

    exists = sync_wrapper(_exists)

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

    async def _cat_file_into(self, path: str, start: int, end: int, sink: SpanSink) -> int:
        """Bytes ``[start, end)`` of ``path`` written into ``sink`` as they arrive:
        how many the answer had. One retried attempt per GET, its body included."""
        if end <= start:
            return 0
        bucket, key, version = self.split_path(path)
        direct = await self._direct_gets() if end - start >= DIRECT_FROM else None

        async def get_into(method: str, **kwargs: Any) -> dict[str, Any]:
            if direct is not None:  # received straight into the sink
                asked = self._get_s3_method_kwargs(direct.client.get_object, **kwargs)
                return {"ContentLength": await direct.get_into(asked, sink)}
            resp = await S3FileSystem._call_s3(self, method, **kwargs)
            body = resp["Body"]
            try:  # the answer as the request counter reads it
                return {"ContentLength": await _stream_into(body, sink)}
            finally:
                body.close()

        answer = await self._call_via(
            get_into,
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={start}-{end - 1}",
            **version_id_kw(version),
        )
        return int(answer["ContentLength"])

    async def _direct_gets(self) -> DirectGets | None:
        """The synchronous mirror of this filesystem's client that receives large
        ranges into their sinks (:mod:`objckpt.writers.s3_direct`), built on first
        use; None where it would not send what this client sends
        (:func:`~objckpt.writers.s3_direct.mirrorable`, said once in the log) or
        could not be built (logged: loads go on through aiohttp)."""
        if self._direct is not None or self._no_direct:
            return self._direct
        await self.set_session()
        if self._direct is not None or self._no_direct:  # built while this waited
            return self._direct
        why = mirrorable(self._s3, self.storage_options, bool(self.cache_regions))
        if why is not None:
            logger.info("S3 ranges are received through aiohttp (copied once): %s", why)
            self._no_direct = True
            return None
        endpoint = (self.client_kwargs or {}).get("endpoint_url") or self.endpoint_url
        try:
            self._direct = DirectGets.build(self._s3, endpoint, self.retry_policy.timeout)
        except Exception:
            logger.warning(
                "cannot receive S3 ranges into memory directly; loads go through aiohttp",
                exc_info=True,
            )
            self._no_direct = True
        return self._direct

    async def close_connections(self) -> None:
        """Close this filesystem's client and its connections now, on its loop (s3fs
        closes them only when the filesystem is garbage collected); a later request
        would open a new client."""
        direct, self._direct, self._no_direct = self._direct, None, False
        if direct is not None:
            direct.close()
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


async def _stream_into(body: Any, sink: SpanSink) -> int:
    """An answer's body written into ``sink`` as aiohttp receives it
    (:func:`~objckpt.writers.reads.receive_into`); another HTTP backend's body is
    read whole and copied in. A body cut short raises (aiohttp checks
    Content-Length), and the retry layer asks again."""
    raw = getattr(body, "raw_stream", None)
    if not isinstance(raw, aiohttp.ClientResponse):  # httpx: its .content raises unread
        return sink.fill(await body.read())
    return await receive_into(raw.content, sink, raw.content_length)
