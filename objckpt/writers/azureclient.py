"""The adlfs filesystem objckpt builds for ``az://``, ``abfs://`` and ``abfss://``.

**Retries and timeouts.** adlfs builds its ``BlobServiceClient`` with the Azure
SDK's defaults: azure-storage-blob's ``ExponentialRetry`` (up to 3 connection
retries, 3 read retries and 3 status retries, backing off 15, 18 and 24 s) and
its own 20 s connection and 60 s read timeouts. Against a stopped endpoint a save
then failed only after 80-87 s and ``CheckpointManager()`` took as long, whatever
:class:`~objckpt.RetryPolicy`, ``preflight_timeout`` or ``UploadOptions.deadline``
said. This subclass builds the service client itself (:meth:`do_connect`, the same
account, credential and endpoint as adlfs would) with two changes:

* azure-core's retry policy is replaced by :class:`ObjckptRetry`, a pipeline policy
  that sends each request under :func:`~objckpt.writers.retry.call_with_retries`:
  one retry layer, transient answers only (5xx, 429, 408, connection errors), capped
  backoff with jitter, ``give_up_after``, the save's deadline (or
  ``RetryPolicy.request_deadline``), request counting and the throttling back-off, as
  for S3 and GCS. It sits where the SDK's own retry policy sits, before signing, so
  each attempt is signed afresh.
* the transport's connection and read timeouts are ``RetryPolicy.timeout`` (a
  stalled attempt fails and is retried), unless ``storage_options`` give adlfs's
  ``connection_timeout`` / ``read_timeout``.

A user's own Azure retry settings win: any of azure-storage-blob's retry keywords
in ``storage_options`` (``retry_total``, ``retry_connect``, ``retry_read``,
``retry_status``, ``retry_to_secondary``, ``initial_backoff``, ``increment_base``,
``retry_jitter_range``) are passed to the client, which then retries with the
SDK's ``ExponentialRetry`` as told, and objckpt's policy is not installed (its
deadlines still bound what objckpt waits for, not each SDK request).

**Closing.** An owner of its clients (:class:`~objckpt.writers.clients.OwnedClients`,
an ``AsyncCheckpointer``) closes their connections and then ends the event loop
they ran on. adlfs closes its service client only from a ``weakref.finalize`` hook
registered with the filesystem, which runs at interpreter exit on the loop the
filesystem was built with; once that loop is closed, the hook fails ("Loop is not
running") and aiohttp reports the session it never closed.
:meth:`~RetryingAzureBlobFileSystem.close_connections` closes the service client
(and an async credential) on the loop while it runs, and retires adlfs's two hooks
for this filesystem, which have nothing left to do.

**Checksums in transit.** Every Put Block and Put Blob carries a checksum of its
body, which the service checks before it keeps anything
(:meth:`~RetryingAzureBlobFileSystem.transit_check`): Azure's CRC64
(``x-ms-content-crc64``, the CRC-64/NVME polynomial) where the body goes in one
request, computed by anycrc (a C library of the ``azure`` extra; about 0.2
CPU-s/GiB here, where Microsoft's own ``azure-storage-extensions``, which
azure-storage-blob's ``validate_content="crc64"`` needs, costs 1.0 and the
Content-MD5 of ``validate_content=True`` 1.8); otherwise (anycrc missing, or a
Put Blob the SDK cuts into blocks) a Content-MD5 per request. adlfs sends Put Blob
with neither, so a blob written in one request (a manifest, a small payload object)
was not checked on the way.

**Loads** write each downloaded chunk into the tensors' memory
(:meth:`~RetryingAzureBlobFileSystem._cat_file_into`: azure-storage-blob's
``readinto``), where adlfs's ``cat_file`` joins a range's chunks first.

``do_connect``, ``_USER_AGENT``, ``split_path``, ``_timeout_kwargs`` and the
attributes read in ``do_connect`` are adlfs's; ``tests/store/test_azure_bounds.py``
pins what this module relies on.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import os
import weakref
from typing import IO, Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

from adlfs import AzureBlobFileSystem
from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
from azure.core.pipeline.policies import AsyncHTTPPolicy
from fsspec.asyn import get_loop, sync, sync_wrapper

from objckpt.writers.checksum import BytesLike
from objckpt.writers.reads import SpanSink
from objckpt.writers.retry import RetryingFileSystem, RetryPolicy, call_with_retries
from objckpt.writers.throttle import Backoff, directory_of
from objckpt.writers.transient import is_transient

__all__ = ["AZURE_RETRY_OPTIONS", "ObjckptRetry", "RetryingAzureBlobFileSystem"]

#: azure-storage-blob's retry keywords: given in ``storage_options``, the SDK's own
#: retry policy is used with them instead of objckpt's (a user's choice wins).
AZURE_RETRY_OPTIONS = frozenset(
    {
        "retry_total",
        "retry_connect",
        "retry_read",
        "retry_status",
        "retry_to_secondary",
        "initial_backoff",
        "increment_base",
        "retry_jitter_range",
    }
)

# The per-request options azure-storage-blob's retry policy takes out of the
# request's context (set by the storage policies before it, or by callers); left
# there, the transport would pass them on to aiohttp, which refuses them.
_STORAGE_RETRY_CONTEXT = (
    "retry_total",
    "retry_connect",
    "retry_read",
    "retry_status",
    "retry_to_secondary",
    "location_mode",
    "hosts",
    "retry_hook",
)


def _without_query(url: str) -> str:
    """``url`` without its query (a SAS token is a secret) or credentials."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}" if parts.scheme else url.split("?")[0]


def _blob_name(url: str) -> str:
    """``container/blob`` a request is on (``container/prefix`` for a listing), for its
    back-off directory: the URL's path (an emulator's account segment included)."""
    parts = urlsplit(url)  # parsed already (the request's target): it cannot fail here
    name = unquote(parts.path).lstrip("/")
    prefix = parse_qs(parts.query).get("prefix")
    return f"{name}/{prefix[0]}" if prefix else name


def _endpoint_of(url: str) -> str | None:
    parts = urlsplit(url)
    if not parts.scheme or not parts.hostname:
        return None
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}"


class ObjckptRetry(AsyncHTTPPolicy):
    """azure-core pipeline policy in the retry policy's place: each request is sent
    under :func:`~objckpt.writers.retry.call_with_retries` (see the module docstring).

    An answer objckpt deems transient (:func:`~objckpt.writers.transient.is_transient`:
    5xx, 429, 408) is retried; when retrying ends, the error raised names what the
    store answered. Any other answer goes back to the SDK, which raises its own
    error for it (404, 409, 412, 403...).

    Args:
        policy: How requests are retried.
        backoff: The filesystem's throttling back-off (each attempt holds a slot of
            its blob's directory).
    """

    def __init__(self, policy: RetryPolicy, backoff: Backoff) -> None:
        super().__init__()
        self.policy = policy
        self.backoff = backoff

    async def send(self, request: Any) -> Any:
        options = request.context.options
        # The storage SDK reads the location mode back from the answer (as its
        # retry policy leaves it); objckpt's requests go to the primary.
        mode = options.get("location_mode") or "primary"
        for name in _STORAGE_RETRY_CONTEXT:
            options.pop(name, None)
        http = request.http_request
        body = http.body
        position: int | None = None
        if hasattr(body, "read") and hasattr(body, "seek"):
            try:
                position = body.tell()
            except Exception:  # an unseekable stream: sent once, as the SDK would
                position = None
        method = str(http.method)
        target = _without_query(str(http.url))
        attempts = 0

        async def once(_: str) -> Any:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and position is not None:
                body.seek(position)
            response = await self.next.send(request)
            answer = response.http_response
            error = HttpResponseError(response=answer)
            code = answer.headers.get("x-ms-error-code")
            if code:
                error.error_code = code  # type: ignore[attr-defined]  # as the SDK's own errors
            if is_transient(error):
                raise error
            answer.location_mode = mode
            return response

        return await call_with_retries(
            once,
            self.policy,
            self.backoff.slot(directory_of(_blob_name(str(http.url)))),
            lambda: f"Azure {method} of {target}",
            method,
            endpoint=lambda: _endpoint_of(target),
        )


#: Bytes of a body anycrc checksums per call (see ``transit_check``).
_CRC64_STEP = 1024 * 1024


def _crc64_model() -> Any:
    """anycrc's CRC-64/NVME, Azure's ``x-ms-content-crc64`` (None: anycrc is not
    installed)."""
    try:
        import anycrc
    except ImportError:
        return None
    return anycrc.Model("CRC64-NVME")


class RetryingAzureBlobFileSystem(RetryingFileSystem, AzureBlobFileSystem):
    """adlfs's ``AzureBlobFileSystem`` whose requests follow a
    :class:`~objckpt.RetryPolicy` and the save's deadline, and whose connections can
    be closed on its loop (``retry_policy=`` besides adlfs's own options)."""

    def __init__(self, *args: Any, retry_policy: RetryPolicy | None = None, **kwargs: Any) -> None:
        # do_connect runs inside adlfs's __init__: what it needs is set first, and
        # the SDK's retry keywords are taken out (adlfs would hand unknown options
        # to DefaultAzureCredential).
        self.retry_policy = retry_policy or RetryPolicy()
        self.backoff = Backoff()
        self._sdk_retry = {k: kwargs.pop(k) for k in list(kwargs) if k in AZURE_RETRY_OPTIONS}
        self._sdk_timeouts = {
            k: kwargs[k]
            for k in ("connection_timeout", "read_timeout")
            if kwargs.get(k) is not None
        }
        self._crc64 = _crc64_model()
        AzureBlobFileSystem.__init__(self, *args, **kwargs)

    def transit_check(self, *pieces: BytesLike, whole: bool = True) -> dict[str, Any]:
        """The azure-storage-blob keywords that send the checksum of a body (``pieces``
        back to back) with it, for the service to check before it keeps anything (see
        the module docstring): its CRC64 where the body goes in one request
        (``whole``: a Put Block, or a Put Blob the SDK does not cut into blocks) and
        anycrc is installed, else a Content-MD5 per request."""
        if whole and self._crc64 is not None:
            crc = 0  # the CRC of no bytes
            # A MiB at a time: anycrc holds the GIL while it runs (~0.2 ms a MiB
            # here), so other threads get it back in between. A block's runs on the
            # writing thread; a Put Blob's (at most two parts) on the event loop.
            for piece in pieces:
                view = memoryview(piece).cast("B")
                for at in range(0, len(view), _CRC64_STEP):
                    crc = self._crc64.calc(view[at : at + _CRC64_STEP], crc)
            return {"transactional_content_crc64": crc.to_bytes(8, "little")}
        return {"validate_content": True}

    async def _pipe_file(self, path: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        """adlfs's Put Blob (``pipe_file``, ``mode="create"`` or not), with the body's
        checksum (adlfs sends none). A body over the SDK's ``max_single_put_size`` goes
        up as blocks, each with its MD5: a CRC64 of the whole would fit none of them."""
        if not {"validate_content", "transactional_content_crc64"} & kwargs.keys():
            config = getattr(self.service_client, "_config", None)
            whole = len(value) <= getattr(config, "max_single_put_size", 0)
            kwargs.update(self.transit_check(value, whole=whole))
        return await super()._pipe_file(path, value, *args, **kwargs)

    # adlfs binds its sync pipe_file to its own _pipe_file: the commit's create and
    # ObjectStore.put call this one, so they send the checksum too.
    pipe_file = sync_wrapper(_pipe_file)

    def client_options(self) -> dict[str, Any]:
        """The keywords objckpt adds to the ``BlobServiceClient`` (see the module
        docstring): its retry policy (or the user's SDK retry settings) and the
        transport's timeouts."""
        timeout = self.retry_policy.timeout
        out: dict[str, Any] = {"connection_timeout": timeout, "read_timeout": timeout}
        out.update(self._sdk_timeouts)
        if self._sdk_retry:
            out.update(self._sdk_retry)
        else:
            out["retry_policy"] = ObjckptRetry(self.retry_policy, self.backoff)
        return out

    def do_connect(self) -> None:
        """adlfs's ``do_connect`` (connection string first, then an account with a
        credential or key, a SAS token, or anonymous), with :meth:`client_options`."""
        from adlfs.spec import _USER_AGENT
        from azure.storage.blob.aio import BlobServiceClient

        extra = self.client_options()
        try:
            if self.connection_string is not None:
                self.service_client = BlobServiceClient.from_connection_string(
                    conn_str=self.connection_string, user_agent=_USER_AGENT, **extra
                )
            elif self.account_name is not None:
                if hasattr(self, "account_host"):
                    self.account_url = f"https://{self.account_host}"
                else:
                    self.account_url = f"https://{self.account_name}.blob.core.windows.net"
                credential = next(
                    (c for c in (self.credential, self.account_key) if c is not None), None
                )
                if credential is not None:
                    self.service_client = BlobServiceClient(
                        account_url=self.account_url,
                        credential=credential,
                        _location_mode=self.location_mode,
                        user_agent=_USER_AGENT,
                        **extra,
                    )
                elif self.sas_token is not None:
                    this: Any = self  # adlfs leaves sas_token's type to inference
                    if not this.sas_token.startswith("?"):
                        this.sas_token = f"?{this.sas_token}"
                    self.service_client = BlobServiceClient(
                        account_url=self.account_url + this.sas_token,
                        _location_mode=self.location_mode,
                        user_agent=_USER_AGENT,
                        **extra,
                    )
                else:  # anonymous: a public container
                    self.service_client = BlobServiceClient(
                        account_url=self.account_url, user_agent=_USER_AGENT, **extra
                    )
            else:
                raise ValueError(
                    "Must provide either a connection_string or account_name with credentials!!"
                )
        except RuntimeError:
            asyncio.set_event_loop(get_loop())
            self.do_connect()
        except Exception as e:
            # adlfs's wording; location.py turns it into a ConfigurationError. The
            # message names the exception only: no connection string in it.
            raise ValueError(f"unable to connect to account: {type(e).__name__}") from e

    async def close_connections(self) -> None:
        """Close the service client and credential now (see the module docstring);
        the filesystem cannot send requests afterwards."""
        await self.service_client.close()
        credential = getattr(self, "credential", None)
        close = getattr(credential, "close", None)
        if close is not None:
            closed = close()
            if inspect.isawaitable(closed):
                await closed
        # adlfs's exit hooks are ``weakref.finalize(self, sync, loop, close_*, self)``;
        # the registry is the only way to find them (finalize has no lookup by object).
        for hook in list(getattr(weakref.finalize, "_registry", {})):
            held = hook.peek()
            if held is not None and held[0] is self and held[1] is sync:
                hook.detach()

    async def _cat_file_into(self, path: str, start: int, end: int, sink: SpanSink) -> int:
        """Bytes ``[start, end)`` of the blob at ``path`` written into ``sink`` chunk by
        chunk as azure-storage-blob downloads them (its ``readinto``, to a
        :class:`~objckpt.writers.reads.SinkFile`), where adlfs's ``cat_file`` joins
        the chunks into one answer, which was then copied in; how many bytes the
        answer had. One chunk at a time, as adlfs's ``cat_ranges`` asks: the ranges
        of a batch already run concurrently. The SDK retries a chunk whose body was
        cut short itself; each request is sent under :class:`ObjckptRetry`."""
        if end <= start:
            return 0
        container, blob, version_id = self.split_path(self._strip_protocol(path))
        async with self.service_client.get_blob_client(container=container, blob=blob) as client:
            try:
                download = await client.download_blob(
                    offset=start,
                    length=end - start,
                    version_id=version_id,
                    max_concurrency=1,
                    **self._timeout_kwargs,
                )
            except ResourceNotFoundError as exc:  # as adlfs's cat_file says it
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from exc
            into = sink.file()
            try:
                await download.readinto(cast(IO[bytes], into))
            finally:
                into.close()  # a chunk still downloading writes nothing more
            return into.received

    def endpoint(self) -> str | None:
        """The blob endpoint requests go to (scheme, host and port)."""
        client = getattr(self, "service_client", None)
        url = getattr(client, "url", None)
        return _endpoint_of(url) if isinstance(url, str) else None


#: The name this class had before it took objckpt's retries (kept for imports).
ClosableAzureBlobFileSystem = RetryingAzureBlobFileSystem
