"""A TCP relay a test can switch off: the store's endpoint going down and coming back.

The fault proxy (:mod:`objckpt.testing.proxy`) breaks single requests; an outage is
different: every connection, open or new, fails for a while, whatever it carries.
Put a :class:`TcpRelay` in front of a server (or of a :class:`~objckpt.testing.FaultProxy`,
to both count and cut requests), call :meth:`TcpRelay.down` when the test has seen
what it waits for, :meth:`TcpRelay.wait_refused` for the failed attempts it wants,
then :meth:`TcpRelay.up`: the outage is timed by events, never by sleeps.

While down, open connections are cut and new ones are accepted and reset at once
(a TCP reset, as a restarting load balancer answers), so a client sees a
connection error on each attempt instead of a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import urllib.parse
from typing import Any

from objckpt.testing.servers import s3_test_options

__all__ = ["TcpRelay"]

logger = logging.getLogger(__name__)


def _cut(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset, waking any thread blocked reading it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class TcpRelay:
    """Relays loopback TCP connections to ``upstream`` until told to go down.

    Args:
        upstream: The server's URL (``http://127.0.0.1:PORT``).

    Attributes:
        refused: New connections refused while down (each is a failed attempt of
            some request; the connections cut by :meth:`down` are not counted).
    """

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        if not parts.hostname or not parts.port:
            raise ValueError(f"TcpRelay needs a host:port upstream, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.refused = 0
        self._up = True
        self._closed = False
        self._changed = threading.Condition()
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._thread = threading.Thread(target=self._accept, name="objckpt-tcp-relay", daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach the upstream through this relay."""
        return s3_test_options(self.endpoint_url)

    def down(self) -> None:
        """Cut every open connection and refuse new ones until :meth:`up`."""
        with self._changed:
            self._up = False
            cut, self._open = self._open, set()
        for sock in cut:
            _cut(sock)

    def up(self) -> None:
        """Relay connections again."""
        with self._changed:
            self._up = True

    def wait_refused(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` connections were refused while down; False if
        ``timeout`` seconds passed first (or the relay was closed)."""
        with self._changed:
            return (
                self._changed.wait_for(lambda: self.refused >= count or self._closed, timeout)
                and not self._closed
            )

    def close(self) -> None:
        with self._changed:
            self._closed = True
            cut, self._open = self._open, set()
            self._changed.notify_all()
        for sock in cut:
            _cut(sock)
        self._listener.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> TcpRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._refused(client):
                continue
            try:
                upstream = socket.create_connection(self.upstream, 30)
                upstream.settimeout(None)
            except OSError as exc:
                logger.warning("relay: upstream %s:%d failed: %s", *self.upstream, exc)
                _cut(client)
                continue
            with self._changed:
                relayed = self._up and not self._closed
                if relayed:
                    self._open.update((client, upstream))
            if not relayed:  # went down meanwhile
                _cut(upstream)
                self._refused(client)
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _refused(self, client: socket.socket) -> bool:
        """Refuse ``client`` (counted) if the relay is down."""
        with self._changed:
            if self._up and not self._closed:
                return False
            self.refused += 1
            self._changed.notify_all()
        _cut(client)
        return True

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with self._changed:
            mine = src in self._open
            self._open.discard(src)
            self._open.discard(dst)
        if mine:  # the other direction's end: close both (not reset: a normal close)
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
