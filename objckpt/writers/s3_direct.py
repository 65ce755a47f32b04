"""A load's large ranged GETs on S3, received straight into the reader's memory (#47).

Why: aiohttp, objckpt's S3 transport, hands a body over in chunks of at most
256 KiB, each a new ``bytes`` its parser copied out of the receive buffer; copying
each into place makes two copies of every byte and Python work per chunk. The
standard library's ``http.client`` receives into the buffer it is given
(``readinto``, a ``recv_into`` of the destination). ``bench_throughput.py``'s floor
rows measure both, with no objckpt code: 16 MiB ranged GETs and a CRC32C pass,
into memory that exists, cost 1.0 CPU-s/GiB through aiohttp and 0.6 through
``readinto`` on moto (docs/benchmarks.md).

So a ranged GET of at least :data:`DIRECT_FROM` bytes into a
:class:`~objckpt.writers.reads.SpanSink` is sent by a synchronous botocore client
that mirrors the filesystem's aiobotocore client (its endpoint, region, config,
TLS verification and credentials, the latter asked of the aiobotocore client on its
loop at every signing, so refreshed credentials stay shared), from a thread, and its
body is read with ``http.client``'s ``readinto`` into each buffer of the sink in turn.
The request stays one attempt of :func:`~objckpt.writers.retry.call_with_retries`
on the filesystem's loop, which awaits the thread: retries, deadlines, request
counting and throttling are the same as every other request's, and as many GETs run
at once as the client's ``max_pool_connections``. An attempt cut by its deadline
(or cancelled) never reads an answer that comes later, and one receiving its body
has its socket shut down and is waited for: once the attempt is over, its thread
writes nothing more into the sink.

Used only where the mirror is faithful (:func:`mirrorable`): s3fs's own client on
aiobotocore's aiohttp session, without per-region clients (``cache_regions``), a
``profile`` or ``session`` of the caller's, aiohttp connector arguments (a TLS
context, a resolver) or a proxy, and with credentials or unsigned. The internals
read here (``_request_signer``, ``_endpoint``, ``_ruleset_resolver``, urllib3's
``_raw_stream`` and ``_fp``) are pinned by ``tests/store/test_s3_direct.py``; where
one is missing a load goes on through aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
import threading
from collections.abc import Mapping
from typing import Any

from objckpt.errors import InternalError
from objckpt.writers.reads import SpanSink

__all__ = ["DIRECT_FROM", "DirectGets", "mirrorable"]

logger = logging.getLogger(__name__)

#: Ranges at least this long are received into the sink; shorter ones go through
#: aiohttp, where a thread per request would cost more than the copy it saves.
DIRECT_FROM = 1024 * 1024


#: aiohttp connector arguments that change nothing the store sees (how long idle
#: connections live, DNS caching); the others (``ssl_context``, ``resolver``,
#: ``socket_factory``) have no counterpart the mirror could be given.
_SAME_CONNECTIONS = frozenset(
    {"keepalive_timeout", "force_close", "enable_cleanup_closed", "use_dns_cache", "ttl_dns_cache"}
)


def mirrorable(aio: Any, storage_options: Mapping[str, Any], cache_regions: bool) -> str | None:
    """Why the synchronous mirror of ``aio`` (an s3fs filesystem's aiobotocore client,
    built from ``storage_options``) would not send what ``aio`` sends; None: it would."""
    http_session = getattr(getattr(aio, "_endpoint", None), "http_session", None)
    if type(http_session).__name__ != "AIOHTTPSession":
        return f"an HTTP session of type {type(http_session).__name__}"
    if cache_regions:
        return "cache_regions (a client per bucket region)"
    for name in ("profile", "session"):
        if storage_options.get(name) is not None:
            return f"storage option {name!r}"
    config = aio.meta.config
    for name in ("proxies", "proxies_config", "client_cert"):
        if getattr(config, name, None):
            return f"client config {name!r}"
    beyond = sorted(set(getattr(config, "connector_args", None) or ()) - _SAME_CONNECTIONS)
    if beyond:  # a TLS context, a resolver, a socket factory: aiohttp's alone
        return f"client config connector_args {beyond}"
    signer = getattr(aio, "_request_signer", None)
    if not hasattr(signer, "_credentials") or not hasattr(aio, "_ruleset_resolver"):
        return "an aiobotocore client without the attributes the mirror reads"
    if getattr(signer, "_credentials", None) is None and not _unsigned(aio):
        return "no credentials"
    return None


def _unsigned(aio: Any) -> bool:
    from botocore import UNSIGNED

    return getattr(aio._ruleset_resolver, "_requested_auth_scheme", None) is UNSIGNED


class _LoopCredentials:
    """botocore credentials whose every read asks the aiobotocore client's own
    credentials, on its loop: one source of truth, refreshed where it refreshes."""

    method = "objckpt-loop"

    def __init__(self, credentials: Any, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._credentials = credentials
        self._loop = loop
        self._timeout = timeout

    def get_frozen_credentials(self) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise InternalError("internal: a direct GET signed on its filesystem's loop")
        coro = self._credentials.get_frozen_credentials()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop closed: the filesystem is gone
            coro.close()
            raise
        return future.result(self._timeout)

    @property
    def access_key(self) -> str:
        return str(self.get_frozen_credentials().access_key)

    @property
    def secret_key(self) -> str:
        return str(self.get_frozen_credentials().secret_key)

    @property
    def token(self) -> str | None:
        token = self.get_frozen_credentials().token
        return None if token is None else str(token)

    def get_deferred_property(self, name: str) -> Any:
        """What botocore's endpoint rules ask of credentials (``account_id``)."""
        return lambda: getattr(self.get_frozen_credentials(), name, None)


class _Attempt:
    """One GET's thread and the attempt that awaits it: whether the attempt ended,
    and the connection to shut down when it does. The lock orders the two: a
    connection is shut down only while the thread still holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ended = False
        self._raw: Any = None

    def attach(self, raw: Any) -> bool:
        """Whether the answer may be read (its attempt still waits for it)."""
        with self._lock:
            if self.ended:
                return False
            self._raw = raw
            return True

    def detach(self) -> bool:
        """The thread is done with its connection: whether it may go back to the
        pool (False: the attempt ended, and the connection is shut down)."""
        with self._lock:
            self._raw = None
            return not self.ended

    def end(self) -> bool:
        """The attempt is over: the thread must not read on, nor write. Whether the
        thread was receiving (its socket is shut down, so it stops); one still
        waiting for the answer never reads it (:meth:`attach`)."""
        with self._lock:
            self.ended = True
            raw, self._raw = self._raw, None
            if raw is None:
                return False
            sock = getattr(getattr(raw, "connection", None), "sock", None)
            # urllib3 wraps TLS inside a TLS proxy tunnel; the socket is beneath.
            shutdown = getattr(sock, "shutdown", None) or getattr(
                getattr(sock, "socket", None), "shutdown", None
            )
            if shutdown is not None:
                with contextlib.suppress(OSError):  # already closed: nothing to stop
                    shutdown(socket.SHUT_RDWR)
            return True


class DirectGets:
    """The synchronous mirror of an aiobotocore S3 client: ``client``, and how many
    GETs it runs at once (its pool's size).

    Built on the filesystem's loop (:meth:`build`); :meth:`get_into` is awaited there.
    """

    def __init__(self, client: Any, at_once: int) -> None:
        self.client = client
        self._slots = asyncio.Semaphore(at_once)

    @classmethod
    def build(cls, aio: Any, endpoint_url: str | None, timeout: float) -> DirectGets:
        """The mirror of ``aio`` (an aiobotocore S3 client that :func:`mirrorable`
        passed), on its running loop. ``endpoint_url``: the one the caller gave
        (None: botocore resolves it, as it did for ``aio``; the resolved one, given
        back, would be taken as custom and change how buckets are addressed)."""
        import botocore.credentials
        import botocore.session
        from botocore.config import Config

        meta = aio.meta
        session = botocore.session.Session()
        credentials = aio._request_signer._credentials
        if credentials is not None:
            loop_credentials = _LoopCredentials(credentials, asyncio.get_running_loop(), timeout)

            class Provider(botocore.credentials.CredentialProvider):
                METHOD = _LoopCredentials.method

                def load(self) -> Any:
                    return loop_credentials

            resolver = session.get_component("credential_provider")
            resolver.providers.insert(0, Provider())
        verify = getattr(aio._endpoint.http_session, "_verify", None)
        # The client's config holds the signature version its endpoint resolved to
        # ("s3v4"); asked for by name, it would keep S3 Express directory buckets from
        # their session auth. Ask for what the aiobotocore client was asked for.
        asked = getattr(aio._ruleset_resolver, "_requested_auth_scheme", None)
        client = session.create_client(
            "s3",
            region_name=meta.region_name,
            endpoint_url=endpoint_url,
            verify=verify,
            config=meta.config.merge(Config(signature_version=asked)),
        )
        return cls(client, max(1, int(meta.config.max_pool_connections or 1)))

    async def get_into(self, kwargs: dict[str, Any], sink: SpanSink) -> int:
        """One GET (``get_object`` with ``kwargs``) whose body lands in ``sink``: how
        many bytes the answer had (those past the sink's end counted, not written)."""
        async with self._slots:
            attempt = _Attempt()
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[int] = loop.create_future()
            # A daemon thread per GET (not an executor's, which the interpreter joins at
            # exit): one waiting on a store that never answers must not hold up exit.
            threading.Thread(
                target=self._run,
                args=(loop, fut, kwargs, sink, attempt),
                name="objckpt-get",
                daemon=True,
            ).start()
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                # Cut by the deadline or cancelled: the thread stops before the next
                # attempt (or the caller) may use the sink. Its outcome is nobody's.
                fut.add_done_callback(_forget)
                if attempt.end():
                    # Its socket is shut down: its receive returns now. Waited for
                    # whole (a second cancellation included): a bound here could let
                    # a late write land under the next attempt's bytes.
                    while not fut.done():
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.wait({fut})
                raise

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future[int],
        kwargs: dict[str, Any],
        sink: SpanSink,
        attempt: _Attempt,
    ) -> None:
        """The thread: the GET, its outcome handed to ``fut`` on ``loop``."""
        try:
            got: int | BaseException = self._get_into(kwargs, sink, attempt)
        except BaseException as exc:
            got = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for it
            loop.call_soon_threadsafe(_settle, fut, got)

    def _get_into(self, kwargs: dict[str, Any], sink: SpanSink, attempt: _Attempt) -> int:
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error

        try:
            resp = self.client.get_object(**kwargs)
        except ClientError as exc:  # as s3fs says what the store answered
            translated = translate_boto_error(exc)
            if translated is exc:
                raise
            raise translated from exc
        body = resp["Body"]
        raw = getattr(body, "_raw_stream", None)  # urllib3's response
        if raw is None:  # a botocore that hides it: read whole, copied in
            return sink.fill(body.read())
        if not attempt.attach(raw):
            raw.close()
            raise asyncio.CancelledError
        try:
            got, whole = _receive(raw, sink, attempt)
        except BaseException:
            attempt.detach()
            raw.close()  # a connection with a body half read is never reused
            raise
        if attempt.detach() and whole:
            raw.release_conn()
        else:
            raw.close()
        return got

    def close(self) -> None:
        """Close the mirror's kept connections (a GET still running closes its own)."""
        self.client.close()


def _forget(fut: asyncio.Future[int]) -> None:
    """Mark an ended attempt's outcome as read (asyncio logs one never read)."""
    if not fut.cancelled():
        fut.exception()


def _settle(fut: asyncio.Future[int], got: int | BaseException) -> None:
    if fut.done():  # its attempt ended without it
        return
    if isinstance(got, BaseException):
        fut.set_exception(got)
    else:
        fut.set_result(got)


def _receive(raw: Any, sink: SpanSink, attempt: _Attempt) -> tuple[int, bool]:
    """The body of ``raw`` received into ``sink``'s buffers in turn: how many bytes
    it had, and whether it was read to its end (its connection reusable).

    A body cut short raises ``http.client.IncompleteRead`` (the retry layer asks
    again), closed with a reset or cleanly: ``http.client`` answers a clean close
    before Content-Length with an empty read, not an error. One shorter than the
    sink (the object ends inside the range) is what it is; one longer (a store that
    ignored the Range) is not read on: counted where its length is known, else as
    one byte more."""
    fp = getattr(raw, "_fp", None)
    readinto = fp.readinto if isinstance(fp, http.client.HTTPResponse) else raw.readinto

    def left() -> int | None:
        length = getattr(fp, "length", None)
        return (
            length if isinstance(fp, http.client.HTTPResponse) and isinstance(length, int) else None
        )

    got = 0
    for view in sink.views():
        at = 0
        while at < len(view):
            n = readinto(view[at:])
            if attempt.ended:
                raise asyncio.CancelledError
            if not n:
                missing = left()
                if missing:  # closed before its Content-Length
                    raise http.client.IncompleteRead(b"", missing)
                return got + at, True
            at += n
        got += at
    missing = left()
    more = missing if missing is not None else readinto(memoryview(bytearray(1)))
    return got + more, not more
