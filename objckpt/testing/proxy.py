"""An HTTP proxy in front of an S3 server that records and breaks requests.

Put it between the code under test and a moto server (``storage_options()``
points at the proxy) to see which S3 operations the code issues, and to inject
the faults a real store produces on a bad day: a status (503 SlowDown, 500), a
reset connection, a stall, a truncated response. Each :class:`Rule` picks
requests by S3 operation, key substring, ordinal or probability.

The proxy understands path-style S3 requests (what botocore sends to an IP
endpoint) well enough to name their operation; it forwards bytes unchanged,
so signatures stay valid.

Example::

    with FaultProxy(moto.endpoint_url) as proxy:
        proxy.add(Rule("UploadPart", nth=3, action="status", status=503))
        run_the_save(storage_options=proxy.storage_options())
        assert proxy.count("UploadPart") >= 3
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import http.server
import logging
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

import crc32c

from objckpt.testing.servers import s3_test_options

__all__ = ["FaultProxy", "Rule", "Seen", "s3_operation"]

logger = logging.getLogger(__name__)

ACTIONS = ("status", "reset", "stall", "hold", "truncate")
_S3_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}


def s3_operation(
    method: str, path: str, query: Mapping[str, Any], headers: Mapping[str, str]
) -> str:
    """The S3 API operation of a path-style request (``UploadPart``, ``HeadBucket``...)."""
    parts = urllib.parse.unquote(path).lstrip("/").split("/", 1)
    copy = any(k.lower() == "x-amz-copy-source" for k in headers)
    if not parts[0]:
        return "ListBuckets"
    if len(parts) == 1 or not parts[1]:
        bucket_ops = {
            ("HEAD", None): "HeadBucket",
            ("GET", "uploads"): "ListMultipartUploads",
            ("GET", "list-type"): "ListObjectsV2",
            ("GET", "location"): "GetBucketLocation",
            ("GET", "versioning"): "GetBucketVersioning",
            ("POST", "delete"): "DeleteObjects",
            ("PUT", None): "CreateBucket",
            ("DELETE", None): "DeleteBucket",
        }
        for (m, q), name in bucket_ops.items():
            if m == method and (q is None or q in query):
                return name
        return "ListObjects" if method == "GET" else f"Bucket{method.title()}"
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        return "CopyObject" if copy else "PutObject"
    if method == "POST":
        return "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "GET":
        return "ListParts" if "uploadId" in query else "GetObject"
    if method == "HEAD":
        return "HeadObject"
    return f"Object{method.title()}"


@dataclasses.dataclass(frozen=True)
class Rule:
    """Which requests to break and how.

    Attributes:
        operation: S3 operation name to match (None: any).
        key_contains: Substring of the request target, path and query, to match
            (``"manifest.json"``, ``"partNumber=3&"``; None: any).
        action: ``status`` (answer ``status`` with an S3 error body), ``reset``
            (close the connection with a TCP reset, nothing answered), ``stall``
            (hold the request ``stall`` seconds, then forward it), ``hold``
            (hold it until :meth:`FaultProxy.release` or ``stall`` seconds, then
            forward it: a stall the test ends when it has seen what it wanted), ``truncate``
            (forward, then send half the response body and close).
        nth: Break only the nth matching request (1-based).
        probability: Break each matching request with this probability.
        times: Break at most this many requests (None: no limit).
        status: The HTTP status for ``action="status"``.
        stall: Seconds for ``action="stall"``.
        before_upstream: For ``status``/``reset``: break before the upstream
            sees the request (False: after it was applied, the answer lost).
    """

    operation: str | None = None
    key_contains: str | None = None
    action: str = "status"
    nth: int | None = None
    probability: float | None = None
    times: int | None = None
    status: int = 503
    stall: float = 5.0
    before_upstream: bool = True

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Rule action={self.action!r}: expected one of {ACTIONS}")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"Rule probability={self.probability!r}: expected 0..1")


@dataclasses.dataclass(frozen=True)
class Seen:
    """One request that reached the proxy, and what the proxy did with it."""

    operation: str
    method: str
    path: str
    fault: str | None
    #: Bytes of the request's payload (decoded from aws-chunked framing).
    sent: int = 0
    #: The request's ``x-amz-*`` headers (checksums, payload hash), names lowercased.
    amz: tuple[tuple[str, str], ...] = ()
    #: Whether the payload matches its ``x-amz-checksum-crc32c`` header (None: no header).
    crc32c_ok: bool | None = None


class _RuleState:
    def __init__(self, rule: Rule, seed: int) -> None:
        self.rule = rule
        self.matched = 0
        self.fired = 0
        self.rng = random.Random(seed)

    def fires(self, operation: str, path: str) -> bool:
        r = self.rule
        if r.operation is not None and r.operation != operation:
            return False
        if r.key_contains is not None and r.key_contains not in path:
            return False
        self.matched += 1
        if r.times is not None and self.fired >= r.times:
            return False
        if r.nth is not None and self.matched != r.nth:
            return False
        if r.probability is not None and self.rng.random() >= r.probability:
            return False
        self.fired += 1
        return True


class FaultProxy:
    """A threaded HTTP proxy on a loopback port in front of ``upstream`` (a URL).

    Args:
        upstream: The S3 server's endpoint URL (``http://127.0.0.1:PORT``).
        seed: Seed for probabilistic rules (runs are reproducible).
    """

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy needs an http:// upstream, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self._seed = seed
        self._lock = threading.Lock()
        self._rules: list[_RuleState] = []
        self._changed = threading.Condition(self._lock)  # a request seen or finished
        self._released = threading.Event()
        self._forwarding = 0
        self._open: dict[str, int] = {}
        self._peak_open: dict[str, int] = {}
        self.seen: list[Seen] = []
        self._received: dict[str, int] = {}
        handler = type("_Handler", (_Handler,), {"proxy": self})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="objckpt-fault-proxy", daemon=True
        )
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach the upstream through this proxy."""
        return s3_test_options(self.endpoint_url)

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(_RuleState(rule, self._seed + len(self._rules)))
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

    def _decide(self, operation: str, path: str) -> Rule | None:
        with self._lock:
            for state in self._rules:
                if state.fires(operation, path):
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

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

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
        operation = s3_operation(self.command, split.path, query, headers)
        self.proxy._open_change(operation, +1)
        try:
            self._serve(split, headers, operation)
        finally:
            self.proxy._open_change(operation, -1)

    def _serve(
        self, split: urllib.parse.SplitResult, headers: dict[str, str], operation: str
    ) -> None:
        body = self._body()
        rule = self.proxy._decide(operation, self.path)  # path and query
        fault = None if rule is None else rule.action
        decoded = self.headers.get("x-amz-decoded-content-length")
        sent = int(decoded) if decoded else len(body)
        amz = tuple(
            sorted((k.lower(), v) for k, v in headers.items() if k.lower().startswith("x-amz-"))
        )
        claimed = dict(amz).get("x-amz-checksum-crc32c")
        crc_ok = None
        if claimed is not None and not decoded:  # plain bodies only (not aws-chunked)
            crc_ok = base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode() == claimed
        self.proxy._record(Seen(operation, self.command, split.path, fault, sent, amz, crc_ok))
        if rule is not None and rule.action == "stall":
            time.sleep(rule.stall)
            rule = None
        if rule is not None and rule.action == "hold":
            self.proxy._released.wait(rule.stall)
            rule = None
        if rule is not None and rule.before_upstream and rule.action in ("status", "reset"):
            self._fault(rule)
            return
        self.proxy._forwarding_change(+1)
        try:
            status, reason, out_headers, payload = self._forward(split, headers, body)
        except OSError as exc:
            self.send_error(502, f"upstream failed: {exc}")
            return
        finally:
            self.proxy._forwarding_change(-1)
        if rule is not None and rule.action in ("status", "reset"):
            self._fault(rule)  # applied upstream; the answer is lost
            return
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
        if rule is not None:  # truncate: promise all of it, send half, hang up
            self.end_headers()
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            self._reset()
            return
        self.end_headers()
        if not head:
            self.wfile.write(payload)

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

    def _fault(self, rule: Rule) -> None:
        if rule.action == "reset":
            self._reset()
            return
        code, message = _S3_ERRORS.get(rule.status, ("InternalError", "injected"))
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
