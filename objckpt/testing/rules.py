"""The values of a fault proxy: which requests to break, and what each request met.

A :class:`Rule` is what a test writes (operation, key, ordinal, probability, what
to do); :class:`RuleState` is the proxy's count of how often a rule matched and
fired, so ``nth``, ``times`` and ``probability`` hold across requests; a
:class:`Seen` is the proxy's record of one request, for the test to assert on.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

__all__ = ["ACTIONS", "Rule", "RuleState", "Seen"]

ACTIONS = (
    "status",
    "reset",
    "stall",
    "hold",
    "truncate",
    "cut",
    "reorder",
    "session",
    "corrupt",
)


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
            (hold it until :meth:`~objckpt.testing.FaultProxy.release` or ``stall`` seconds, then
            forward it: a stall the test ends when it has seen what it wanted), ``truncate``
            (forward, then send half the response body and reset the connection), ``cut``
            (the same, closed cleanly: a FIN where ``truncate`` sends a RST, which
            ``http.client`` reads as an end, not an error), ``reorder`` (forward,
            then answer a listing with its entries in reverse order, as S3 Express One
            Zone directory buckets list keys in no particular order), ``session``
            (answer a ``CreateSession`` with made-up session credentials, as S3 Express
            One Zone does, for a server that has no such operation: moto), ``corrupt``
            (forward the request with one byte of its body changed, its headers as
            sent: a body damaged on the way, which a store that checks the
            checksum the client sent refuses).
        nth: Break only the nth matching request (1-based).
        probability: Break each matching request with this probability.
        times: Break at most this many requests (None: no limit).
        status: The HTTP status for ``action="status"``.
        stall: Seconds for ``action="stall"``.
        before_upstream: Break before the upstream sees the request. False: forward
            it first (it is applied), then ``status``/``reset`` lose the answer and
            ``stall``/``hold`` delay it (a request that lands while its caller
            gives up on it).
        code: For ``action="status"``: the S3 error code in the body (None:
            ``SlowDown`` for 503, ``InternalError`` otherwise); e.g. ``NoSuchUpload``
            with 404, as S3 answers a retried ``CompleteMultipartUpload`` whose first
            try completed the upload.
        unless_header: Match only requests that lack this header (name, value; the
            name compared case-insensitively): ``("x-amz-request-payer", "requester")``
            with ``status=403, code="AccessDenied"`` is a requester-pays bucket.
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
    code: str | None = None
    unless_header: tuple[str, str] | None = None

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
    #: The request's own headers, names lowercased: S3's ``x-amz-*`` (checksums,
    #: payload hash), Azure's ``x-ms-*`` (``x-ms-content-crc64``), and ``Content-MD5``.
    amz: tuple[tuple[str, str], ...] = ()
    #: Whether the payload matches its ``x-amz-checksum-crc32c`` header (None: no header).
    crc32c_ok: bool | None = None
    #: The request's ``Host`` header (``bucket.localhost:port`` when virtual-hosted).
    host: str = ""


class RuleState:
    """One rule's matching state inside a proxy: matches and fires counted, its own RNG.

    Args:
        rule: The rule.
        seed: Seed of the rule's random source (for ``probability``).
    """

    def __init__(self, rule: Rule, seed: int) -> None:
        self.rule = rule
        self.matched = 0
        self.fired = 0
        self.rng = random.Random(seed)

    def fires(self, operation: str, path: str, headers: Mapping[str, str] | None = None) -> bool:
        """Whether the rule breaks this request (counting it when it matches).

        Args:
            operation: The request's S3 operation.
            path: The request target, path and query.
            headers: The request's headers.
        """
        r = self.rule
        if r.operation is not None and r.operation != operation:
            return False
        if r.key_contains is not None and r.key_contains not in path:
            return False
        if r.unless_header is not None:
            name, value = r.unless_header
            sent = {k.lower(): v for k, v in (headers or {}).items()}
            if sent.get(name.lower()) == value:
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
