"""What a save or a load cost in store requests: counts by kind, bytes, retries, 503s.

At 1,024 ranks a checkpoint's bill and its throttling risk are set by request
counts, which no timing shows. Every S3 request passes the retry layer
(:mod:`objckpt.writers.retry`), which records each attempt into the
:class:`RequestCounter` of the operation in progress. The operation names its
counter with :func:`counting`, a context variable rather than a global: it follows
the request into fsspec's event-loop thread (``run_coroutine_threadsafe`` copies
the caller's context) and into nothing else, so two saves running at once in one
process each count their own requests.

GCS and Azure requests pass the same layer but are named by their HTTP method, so
they are counted as ``OTHER``; stores with no retry layer of their own are not
counted yet.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["RequestCounter", "RequestStats", "counting", "current_counter", "kind_of"]

#: S3 API methods (botocore's snake_case names) by the kind they are counted as.
_KINDS = {
    "put_object": "PUT",
    "upload_part": "UploadPart",
    "get_object": "GET",
    "list_objects_v2": "LIST",
    "list_objects": "LIST",
    "list_multipart_uploads": "LIST",
    "list_parts": "LIST",
    "head_object": "HEAD",
    "head_bucket": "HEAD",
    "delete_object": "DELETE",
    "delete_objects": "DELETE",
    "copy_object": "COPY",
    "upload_part_copy": "COPY",
    "create_multipart_upload": "MULTIPART",
    "complete_multipart_upload": "MULTIPART",
    "abort_multipart_upload": "MULTIPART",
}


def kind_of(method: str) -> str:
    """The kind an S3 method is counted as (``OTHER`` for the rest)."""
    return _KINDS.get(method, "OTHER")


@dataclasses.dataclass(frozen=True)
class RequestStats:
    """Requests of one operation (or a sum of several).

    Attributes:
        requests: Attempts by kind (``PUT``, ``UploadPart``, ``GET``, ``LIST``,
            ``HEAD``, ``DELETE``, ``COPY``, ``MULTIPART``, ``OTHER``); a retried
            request counts once per attempt.
        bytes_sent: Request payload bytes (PUT and UploadPart bodies).
        bytes_received: Response payload bytes (GET bodies, as announced).
        retries: Attempts that were retries of a failed one.
        throttled: Attempts answered 503 SlowDown.
    """

    requests: Mapping[str, int] = dataclasses.field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    retries: int = 0
    throttled: int = 0

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    def __add__(self, other: RequestStats) -> RequestStats:
        kinds = dict(self.requests)
        for k, n in other.requests.items():
            kinds[k] = kinds.get(k, 0) + n
        return RequestStats(
            requests=dict(sorted(kinds.items())),
            bytes_sent=self.bytes_sent + other.bytes_sent,
            bytes_received=self.bytes_received + other.bytes_received,
            retries=self.retries + other.retries,
            throttled=self.throttled + other.throttled,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "retries": self.retries,
            "throttled": self.throttled,
        }

    @classmethod
    def from_json(cls, doc: Any) -> RequestStats | None:
        """Parse what ``to_json`` wrote; None for anything else (it is informational)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("requests"), dict):
            return None
        ints = ("bytes_sent", "bytes_received", "retries", "throttled")
        if not all(type(doc.get(k, 0)) is int for k in ints):
            return None
        kinds = {str(k): v for k, v in doc["requests"].items() if type(v) is int}
        return cls(kinds, *(doc.get(k, 0) for k in ints))

    def summary(self) -> str:
        """One line for logs: ``12 requests (PUT 4, UploadPart 8), 96.0 MiB up, ...``."""
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.requests.items()))
        return (
            f"{self.total} requests ({kinds or 'none'}), "
            f"{self.bytes_sent / 2**20:.1f} MiB sent, {self.bytes_received / 2**20:.1f} MiB "
            f"received, {self.retries} retries, {self.throttled} throttled"
        )


class RequestCounter:
    """A thread-safe running tally (see the module docstring for how it is fed).

    Args:
        parent: Also told of every request (a commit counted on its own and
            within the save it belongs to).
    """

    def __init__(self, parent: RequestCounter | None = None) -> None:
        self._parent = parent
        self._lock = threading.Lock()
        self._kinds: dict[str, int] = {}
        self._sent = self._received = self._retries = self._throttled = 0

    def record(
        self, method: str, *, sent: int = 0, received: int = 0, retry: bool, throttled: bool
    ) -> None:
        kind = kind_of(method)
        with self._lock:
            self._kinds[kind] = self._kinds.get(kind, 0) + 1
            self._sent += sent
            self._received += received
            self._retries += int(retry)
            self._throttled += int(throttled)
        if self._parent is not None:
            self._parent.record(
                method, sent=sent, received=received, retry=retry, throttled=throttled
            )

    def add(self, stats: RequestStats) -> None:
        """Fold in stats counted elsewhere (an upload worker's, another rank's)."""
        with self._lock:
            for k, n in stats.requests.items():
                self._kinds[k] = self._kinds.get(k, 0) + n
            self._sent += stats.bytes_sent
            self._received += stats.bytes_received
            self._retries += stats.retries
            self._throttled += stats.throttled

    def snapshot(self) -> RequestStats:
        with self._lock:
            return RequestStats(
                dict(sorted(self._kinds.items())),
                self._sent,
                self._received,
                self._retries,
                self._throttled,
            )


_CURRENT: contextvars.ContextVar[RequestCounter | None] = contextvars.ContextVar(
    "objckpt_request_counter", default=None
)


def current_counter() -> RequestCounter | None:
    """The counter of the operation this code runs for, if one is counting."""
    return _CURRENT.get()


@contextlib.contextmanager
def counting(counter: RequestCounter) -> Iterator[RequestCounter]:
    """Count the store requests made in this block (and in what it schedules on the
    filesystem's event loop) into ``counter``."""
    token = _CURRENT.set(counter)
    try:
        yield counter
    finally:
        _CURRENT.reset(token)
