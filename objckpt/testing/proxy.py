"""An HTTP proxy in front of an S3 server that records and breaks requests.

Put it between the code under test and a moto server (``storage_options()``
points at the proxy) to see which S3 operations the code issues, and to inject
the faults a real store produces on a bad day: a status (503 SlowDown, 500), a
reset connection, a stall, a truncated response. Each :class:`Rule` picks
requests by S3 operation, key substring, ordinal or probability.

The proxy understands path-style S3 requests (what botocore sends to an IP
endpoint) well enough to name their operation (:mod:`objckpt.testing.s3_operations`),
and Azurite's Azure Blob requests with ``operation_of=azure_operation``
(:mod:`objckpt.testing.azure_operations`); it forwards bytes unchanged, so
signatures stay valid. The rule and record values
live in :mod:`objckpt.testing.rules`; this module is the server that applies them.

Two ways in besides an endpoint URL: as a client's HTTP forward proxy
(:meth:`FaultProxy.forward_options`), it receives virtual-hosted requests for
``<bucket>.localhost``, a name no resolver here knows, and forwards them with their
``Host`` header to the server (``virtual_host="localhost"`` names their operations);
and over TLS (``tls=``), with a certificate from :mod:`objckpt.testing.tls`.

Example::

    with FaultProxy(moto.endpoint_url) as proxy:
        proxy.add(Rule("UploadPart", nth=3, action="status", status=503))
        run_the_save(storage_options=proxy.storage_options())
        assert proxy.count("UploadPart") >= 3
"""

from __future__ import annotations

import base64
import http.client
import http.server
import logging
import re
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import crc32c

from objckpt.testing.rules import Rule, RuleState, Seen
from objckpt.testing.s3_operations import s3_operation
from objckpt.testing.servers import s3_test_options
from objckpt.testing.throttle import PartitionModel
from objckpt.testing.tls import TestCertificate
from objckpt.writers.clients import PROCESS_CLIENTS

__all__ = ["FaultProxy", "Rule", "Seen", "s3_operation"]

logger = logging.getLogger(__name__)

_S3_ERRORS = {
    403: ("AccessDenied", "Access Denied"),
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}


class FaultProxy:
    """A threaded HTTP proxy on a loopback port in front of ``upstream`` (a URL).

    Args:
        upstream: The server's endpoint URL (``http://127.0.0.1:PORT``).
        seed: Seed for probabilistic rules (runs are reproducible).
        operation_of: Names a request's operation from its method, path, query and
            headers: :func:`s3_operation` (the default), or
            :func:`~objckpt.testing.azure_operations.azure_operation` in front of
            Azurite.
        tls: Serve https with this certificate (None: plain http).
        virtual_host: The domain of virtual-hosted requests (``localhost``: a
            request for ``b.localhost`` is bucket ``b``'s), so their operations are
            named as path-style ones are; the request goes upstream unchanged.
        throttle: S3's request-rate partitions, modelled
            (:class:`~objckpt.testing.throttle.PartitionModel`): an object request
            its partition refuses is answered 503 SlowDown (``Seen.fault`` is
            ``"throttle"``) before rules apply (None: no limit).
    """

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        operation_of: Callable[
            [str, str, Mapping[str, Any], Mapping[str, str]], str
        ] = s3_operation,
        tls: TestCertificate | None = None,
        virtual_host: str | None = None,
        throttle: PartitionModel | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy needs an http:// upstream, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.operation_of = operation_of
        self.virtual_host = virtual_host
        self.throttle = throttle
        self._tls = tls
        self._seed = seed
        self._lock = threading.Lock()
        self._rules: list[RuleState] = []
        self._changed = threading.Condition(self._lock)  # a request seen or finished
        self._released = threading.Event()
        self._forwarding = 0
        self._failed_handshakes = 0
        self._open: dict[str, int] = {}
        self._peak_open: dict[str, int] = {}
        self.seen: list[Seen] = []
        self._received: dict[str, int] = {}
        handler = type("_Handler", (_Handler,), {"proxy": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.cert_file)
            # The handshake runs in the request's thread (_Handler.setup), so a client
            # that refuses the certificate never holds up the accepting thread.
            self._server.socket = context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="objckpt-fault-proxy", daemon=True
        )
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        port = self._server.server_address[1]
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{port}"

    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach the upstream through this proxy (over https
        without a CA bundle: add ``client_kwargs["verify"]`` to trust it)."""
        return s3_test_options(self.endpoint_url)

    def forward_options(self, endpoint_url: str) -> dict[str, Any]:
        """s3fs options for ``endpoint_url`` (any host name, e.g.
        ``http://localhost:1``) with this proxy as botocore's HTTP proxy: no name is
        resolved on the client, and every request reaches the upstream."""
        options = s3_test_options(endpoint_url)
        options["config_kwargs"] = {"proxies": {"http": self.endpoint_url}}
        return options

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(RuleState(rule, self._seed + len(self._rules)))
        return rule

    def clear(self) -> None:
        """Drop every rule and the request log."""
        with self._lock:
            self._rules = []
            self.seen = []
            self._received = {}
            self._peak_open = dict(self._open)

    def operations(self) -> set[str]:
        with self._lock:
            return {s.operation for s in self.seen}

    def count(self, operation: str, *, faulted: bool | None = None) -> int:
        with self._lock:
            return sum(
                1
                for s in self.seen
                if s.operation == operation
                and (faulted is None or (s.fault is not None) == faulted)
            )

    def sent_bytes(self, *operations: str) -> int:
        """Payload bytes the client sent in requests of these operations."""
        with self._lock:
            return sum(s.sent for s in self.seen if s.operation in operations)

    def received_bytes(self, *operations: str) -> int:
        """Response bytes the client received for these operations (answered by upstream)."""
        with self._lock:
            return sum(self._received.get(op, 0) for op in operations)

    def paths(self, operation: str) -> list[str]:
        """Request paths (``/bucket/key``) of every request of ``operation``, in order."""
        with self._lock:
            return [s.path for s in self.seen if s.operation == operation]

    def _add_received(self, operation: str, n: int) -> None:
        with self._lock:
            self._received[operation] = self._received.get(operation, 0) + n

    def _decide(self, operation: str, path: str, headers: Mapping[str, str]) -> Rule | None:
        with self._lock:
            for state in self._rules:
                if state.fires(operation, path, headers):
                    return state.rule
        return None

    def _record(self, seen: Seen) -> None:
        with self._changed:
            self.seen.append(seen)
            self._changed.notify_all()

    def wait_for(
        self,
        operation: str | None,
        *,
        count: int = 1,
        faulted: bool | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Block until ``count`` requests of ``operation`` (None: any; faulted or
        not, as :meth:`count`) have arrived; the way a test synchronises on what the code
        under test has done, instead of sleeping.

        Raises:
            TimeoutError: Not seen within ``timeout`` seconds (says how many were).
        """

        def enough() -> bool:
            return (
                sum(
                    1
                    for s in self.seen
                    if operation in (None, s.operation)
                    and (faulted is None or (s.fault is not None) == faulted)
                )
                >= count
            )

        with self._changed:
            if not self._changed.wait_for(enough, timeout):
                raise TimeoutError(
                    f"FaultProxy saw fewer than {count} {operation or 'S3'} requests in {timeout} s"
                )

    def release(self) -> None:
        """Let every request a ``hold`` rule holds (and any it meets later) go on."""
        self._released.set()

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until no request is being forwarded upstream (held ones aside):
        after the client was killed, the requests it had sent have landed.

        Raises:
            TimeoutError: Still forwarding after ``timeout`` seconds.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._forwarding == 0, timeout):
                raise TimeoutError(f"FaultProxy still forwarding after {timeout} s")

    def peak_open(self, operation: str) -> int:
        """The most requests of ``operation`` the proxy had open at once (received,
        not yet answered): how many a client had in flight, held ones included."""
        with self._lock:
            return self._peak_open.get(operation, 0)

    @property
    def failed_handshakes(self) -> int:
        """TLS handshakes that failed (a client that refused the certificate)."""
        with self._lock:
            return self._failed_handshakes

    def wait_failed_handshakes(self, count: int = 1, timeout: float = 60.0) -> None:
        """Block until ``count`` TLS handshakes have failed here: the client sees its
        failure before this proxy's thread does.

        Raises:
            TimeoutError: Fewer within ``timeout`` seconds.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._failed_handshakes >= count, timeout):
                raise TimeoutError(
                    f"FaultProxy saw {self._failed_handshakes} failed handshakes, not {count}"
                )

    def _handshake_failed(self) -> None:
        with self._changed:
            self._failed_handshakes += 1
            self._changed.notify_all()

    def _open_change(self, operation: str, delta: int) -> None:
        with self._lock:
            now = self._open.get(operation, 0) + delta
            self._open[operation] = now
            self._peak_open[operation] = max(self._peak_open.get(operation, 0), now)

    def _forwarding_change(self, delta: int) -> None:
        with self._changed:
            self._forwarding += delta
            self._changed.notify_all()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        # A later proxy may be given this port: clients kept for it must not send
        # requests down connections this one's handler threads still hold.
        PROCESS_CLIENTS.clear()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that refused the certificate, or hung up: logged, not printed.
        logger.debug("proxy: request from %s failed", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            try:
                self.request.do_handshake()
            except (ssl.SSLError, OSError):
                self.proxy._handshake_failed()
                raise
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("proxy: " + format, *args)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        headers = {k: v for k, v in self.headers.items()}
        operation = self.proxy.operation_of(
            self.command, self._path_style(split.path), query, headers
        )
        self.proxy._open_change(operation, +1)
        self._unanswered: str | None = operation
        try:
            self._serve(split, headers, operation)
        finally:
            self._answered()

    def _path_style(self, path: str) -> str:
        """``path`` as a path-style request names it (``/bucket/key``)."""
        domain = self.proxy.virtual_host
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
        if domain and host.endswith("." + domain):
            return "/" + host[: -len(domain) - 1] + path
        return path

    def _answered(self) -> None:
        """The request is answered (or given up): no longer open. Counted before the
        answer goes out, as the client may send its next request once it reads it."""
        operation, self._unanswered = getattr(self, "_unanswered", None), None
        if operation is not None:
            self.proxy._open_change(operation, -1)

    def send_response(self, code: int, message: str | None = None) -> None:
        self._answered()
        super().send_response(code, message)

    def _serve(
        self, split: urllib.parse.SplitResult, headers: dict[str, str], operation: str
    ) -> None:
        body = self._body()
        throttled = self._throttled(split.path)
        rule = None if throttled else self.proxy._decide(operation, self.path, headers)
        fault = "throttle" if throttled else None if rule is None else rule.action
        decoded = self.headers.get("x-amz-decoded-content-length")
        sent = int(decoded) if decoded else len(body)
        amz = tuple(
            sorted(
                (k.lower(), v)
                for k, v in headers.items()
                if k.lower().startswith(("x-amz-", "x-ms-")) or k.lower() == "content-md5"
            )
        )
        claimed = dict(amz).get("x-amz-checksum-crc32c")
        crc_ok = None
        if claimed is not None and not decoded:  # plain bodies only (not aws-chunked)
            crc_ok = base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode() == claimed
        host = self.headers.get("Host") or ""
        self.proxy._record(
            Seen(operation, self.command, split.path, fault, sent, amz, crc_ok, host)
        )
        if throttled:
            self._fault(Rule(status=503))
            return
        if rule is not None and rule.before_upstream and rule.action in ("stall", "hold"):
            self._wait(rule)
            rule = None
        if rule is not None and rule.before_upstream and rule.action in ("status", "reset"):
            self._fault(rule)
            return
        if rule is not None and rule.action == "session":
            self._session()
            return
        if rule is not None and rule.action == "corrupt":
            body = _damaged(body)
            rule = None
        self.proxy._forwarding_change(+1)
        try:
            status, reason, out_headers, payload = self._forward(split, headers, body)
        except OSError as exc:
            self.send_error(502, f"upstream failed: {exc}")
            return
        finally:
            self.proxy._forwarding_change(-1)
        if rule is not None and rule.action in ("stall", "hold"):
            self._wait(rule)  # applied upstream; the answer comes late
            rule = None
        if rule is not None and rule.action in ("status", "reset"):
            self._fault(rule)  # applied upstream; the answer is lost
            return
        if rule is not None and rule.action == "reorder":
            payload = _reversed_entries(payload)
            rule = None
        if self.command != "HEAD":
            self.proxy._add_received(operation, len(payload))
        self.send_response(status, reason)
        head = self.command == "HEAD"  # keeps the upstream's Content-Length: the object's size
        for name, value in out_headers:
            if name.lower() in ("transfer-encoding", "connection"):
                continue
            if name.lower() == "content-length" and not head:
                continue
            self.send_header(name, value)
        if not head:
            self.send_header("Content-Length", str(len(payload)))
        if rule is not None:  # truncate or cut: promise all of it, send half, hang up
            self.end_headers()
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            if rule.action == "truncate":
                self._reset()
            return
        self.end_headers()
        if not head:
            self.wfile.write(payload)

    def _throttled(self, path: str) -> bool:
        """Whether the partition model refuses this object request (its key's
        partition is over its rate)."""
        model = self.proxy.throttle
        key = self._path_style(path).lstrip("/").partition("/")[2]
        if model is None or not key:
            return False
        return not model.admit(urllib.parse.unquote(key), self.command in ("PUT", "POST", "DELETE"))

    def _forward(
        self, split: urllib.parse.SplitResult, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=120)
        try:
            target = split.path + (f"?{split.query}" if split.query else "")
            send = {k: v for k, v in headers.items() if k.lower() != "transfer-encoding"}
            if body or self.command in ("PUT", "POST"):
                send["Content-Length"] = str(len(body))
            conn.request(self.command, target, body=body or None, headers=send)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()

    def _wait(self, rule: Rule) -> None:
        """A ``stall`` sleeps its seconds; a ``hold`` waits for a release (at most as long)."""
        if rule.action == "stall":
            time.sleep(rule.stall)
        else:
            self.proxy._released.wait(rule.stall)

    def _fault(self, rule: Rule) -> None:
        if rule.action == "reset":
            self._reset()
            return
        code, message = _S3_ERRORS.get(rule.status, ("InternalError", "injected"))
        code = rule.code or code
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>"
        ).encode()
        self.send_response(rule.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _session(self) -> None:
        """A CreateSession answer: session credentials valid for five minutes."""
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 300))
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><CreateSessionResult '
            'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Credentials>'
            "<SessionToken>objckpt-test-session-token</SessionToken>"
            "<SecretAccessKey>objckpt-test-session-secret</SecretAccessKey>"
            "<AccessKeyId>objckpt-test-session-key</AccessKeyId>"
            f"<Expiration>{expires}</Expiration></Credentials></CreateSessionResult>"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _reset(self) -> None:
        """Close with RST (SO_LINGER 0): the client sees 'connection reset by peer'."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


_ENTRY = re.compile(rb"<(Contents|CommonPrefixes|Upload)>.*?</\1>", re.DOTALL)


def _damaged(body: bytes) -> bytes:
    """``body`` with its middle byte inverted (an empty body stays empty: nothing to
    damage)."""
    if not body:
        return body
    at = len(body) // 2
    return body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]


def _reversed_entries(payload: bytes) -> bytes:
    """A listing's XML with its entries (objects, prefixes, uploads) in reverse order."""
    entries = [m.group(0) for m in _ENTRY.finditer(payload)]
    if len(entries) < 2:
        return payload
    swapped = iter(reversed(entries))
    return _ENTRY.sub(lambda _: next(swapped), payload)
