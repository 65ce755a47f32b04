"""Retries for store requests: one policy value, one layer, where every request passes.

Why objckpt owns this instead of leaving it to the SDKs: s3fs retries each call
5 times and botocore retries again underneath, so a hard outage costs 25
attempts with two unrelated backoffs, and neither tells objckpt it is being
throttled nor knows a save's deadline. Here botocore is configured (through its
public ``Config``) for a single attempt with a per-request timeout, and
:class:`~objckpt.writers.s3client.RetryingS3FileSystem` (an s3fs subclass, so
uploads, reads, listings and deletes all pass it) runs each request through
:func:`call_with_retries`: capped exponential backoff with full jitter,
transient errors only (:mod:`objckpt.writers.transient`). GCS requests take the
same path (:class:`~objckpt.writers.gcsclient.RetryingGCSFileSystem` removes
gcsfs's own retry loop from the request coroutine).

One layer: a request is retried here and nowhere above it. A GET's retried unit
includes reading its body, so a response cut off after its 200 is retried like a
refused one, and whole-operation retries (:func:`retry_call`) run only for
fsspec stores that have no such layer. A failing object therefore costs
``attempts`` requests, not ``attempts`` squared.

Deadlines (:mod:`objckpt.writers.deadline`): inside a save with one, transient
failures are retried until it (a short outage costs its length, not the save);
anywhere else each request with its retries is bounded by
``RetryPolicy.request_deadline``. Each request holds a slot of the filesystem's
:class:`~objckpt.writers.throttle.Backoff` for its key's directory, from its first
attempt to its last, which is how
request concurrency backs off where the store answered "slow down"
(:mod:`objckpt.writers.throttle`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence, Sized
from typing import Any
from urllib.parse import urlsplit

import tenacity
from fsspec.asyn import _run_coros_in_chunks, sync_wrapper

from objckpt.errors import (
    ConfigurationError,
    StoreError,
    StoreRefusedError,
    StoreUnreachableError,
)
from objckpt.writers.accounting import current_counter
from objckpt.writers.deadline import Deadline, current_deadline
from objckpt.writers.reads import SpanSink
from objckpt.writers.throttle import Backoff, Slot, directory_of
from objckpt.writers.transient import (
    DAMAGED_TRIES,
    answer_of,
    asks_to_slow_down,
    is_damaged,
    is_throttle,
    is_transient,
)
from objckpt.writers.translate import describe

__all__ = [
    "RetryPolicy",
    "RetryingFileSystem",
    "call_with_retries",
    "is_throttle",
    "is_transient",
    "retry_call",
    "s3_options",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How store requests are retried.

    Attributes:
        attempts: Tries per request, the first included (1 = no retry).
        base_delay: First backoff in seconds; doubles per retry.
        max_delay: Cap on one backoff (seconds). Each wait is drawn uniformly
            from zero to the current cap ("full jitter"), so ranks that fail
            together do not retry together.
        timeout: Seconds one request may take to connect and to deliver each
            read; a stalled request fails and is retried.
        request_deadline: Seconds one request may take with all its retries where
            no save's deadline applies (reads, listings, HEADs, deletes, the CLI,
            saves with ``UploadOptions(deadline=None)``); None: no bound but
            ``attempts``. Each attempt is cut at what is left, whatever ``timeout``
            says, so a silent endpoint fails in this time with
            :class:`~objckpt.errors.RequestDeadlineError`. Under it, answers that
            ask for fewer requests by name (S3's ``SlowDown``, a 429) do not use
            up ``attempts``: a restore at scale meets the same per-prefix limits
            a save does, and is waited out until this bound (a bare 503 still
            counts). Inside a save with a deadline, that deadline bounds each
            request instead, and transient failures are retried until it
            (``attempts`` does not apply there).
        give_up_after: Seconds one request keeps being retried after its first
            failure; a failure that repeats for longer is taken as persistent and
            raised (:class:`~objckpt.errors.StoreRefusedError` naming what the
            store answered, how often and for how long, or
            :class:`~objckpt.errors.StoreUnreachableError` where it never answered),
            instead of waiting out the save's deadline. Throttling answers (503
            SlowDown, 429) do not count: a store asking for fewer requests is
            waited for (with concurrency backing off) until the save's deadline,
            since at 1,024 ranks a minute-long storm would otherwise fail some
            request almost surely. 60 s rides out a restart or a failover and
            lets a store that answers 500 on every try fail the save within
            about 90 s. The reference points: Google's Cloud Storage clients
            retry for 120 s in all, AWS's SDKs make 3 attempts. None: retry
            until the save's deadline.
    """

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0
    timeout: float = 60.0
    request_deadline: float | None = 300.0
    give_up_after: float | None = 60.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.attempts, bool)
            or not isinstance(self.attempts, int)
            or self.attempts < 1
        ):
            raise ConfigurationError(
                f"option attempts={self.attempts!r} is invalid: expected an int >= 1"
            )
        for name in ("base_delay", "max_delay", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(
                    f"option {name}={value!r} is invalid: expected seconds > 0"
                )
        for name in ("request_deadline", "give_up_after"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ConfigurationError(
                    f"option {name}={value!r} is invalid: "
                    "expected seconds > 0, or None for no bound"
                )
        if self.max_delay < self.base_delay:
            raise ConfigurationError(
                f"option max_delay={self.max_delay!r} is invalid: expected >= base_delay"
            )


#: botocore's addressing styles (``config_kwargs={"s3": {"addressing_style": ...}}``).
_ADDRESSING_STYLES = ("auto", "path", "virtual")


def _check_addressing(options: Mapping[str, Any], s3: Mapping[str, Any]) -> None:
    """Refuse an addressing style botocore would not use as asked: an unknown name,
    or ``virtual`` towards an IP address, where botocore sends path-style requests
    without a word (a bucket cannot be a subdomain of an address)."""
    style = s3.get("addressing_style")
    if style is None:
        return
    if style not in _ADDRESSING_STYLES:
        raise ConfigurationError(
            f"option config_kwargs['s3']['addressing_style']={style!r} is invalid: "
            f"expected one of {', '.join(_ADDRESSING_STYLES)}"
        )
    client = options.get("client_kwargs") or {}
    endpoint = options.get("endpoint_url") or (
        client.get("endpoint_url") if isinstance(client, Mapping) else None
    )
    if style != "virtual" or not isinstance(endpoint, str):
        return
    host = urlsplit(endpoint).hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return
    raise ConfigurationError(
        "option config_kwargs['s3']['addressing_style']='virtual' cannot be used with an "
        f"endpoint_url that is an IP address ({host}): botocore would send path-style "
        "requests instead; give the endpoint by a host name whose subdomains reach the "
        "store, or use 'path'"
    )


def s3_options(options: Mapping[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """s3fs options with the SDKs' own retries and checksums off and the request
    timeout set, unless the caller chose them.

    Raises:
        ConfigurationError: An addressing style botocore would not use as asked.
    """
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    # objckpt sends the CRC32C of every PUT and part itself (S3 checks it in
    # transit), so botocore's own CRC and payload SHA256 would hash each byte twice
    # more (measured: 0.9 and 1.3 CPU s/GiB). A request without objckpt's checksum
    # (a listing, a GET) carries no payload to hash.
    config.setdefault("request_checksum_calculation", "when_required")
    config.setdefault("response_checksum_validation", "when_required")
    s3 = dict(config.get("s3") or {})
    _check_addressing(options, s3)
    s3.setdefault("payload_signing_enabled", False)
    config["s3"] = s3
    config.setdefault("connect_timeout", policy.timeout)
    config.setdefault("read_timeout", policy.timeout)
    out["config_kwargs"] = config
    return out


def _backoff(policy: RetryPolicy, attempt: int) -> float:
    """The wait after the ``attempt``-th failure: full jitter under a cap doubling
    from ``base_delay`` up to ``max_delay``."""
    cap = min(policy.max_delay, policy.base_delay * 2.0 ** min(attempt - 1, 60))
    return random.uniform(0.0, cap)


async def call_with_retries(
    call: Callable[..., Awaitable[Any]],
    policy: RetryPolicy,
    slot: Slot | None,
    what: Callable[[], str],
    method: str,
    *args: Any,
    endpoint: Callable[[], str | None] = lambda: None,
    **kwargs: Any,
) -> Any:
    """Run one store request under ``policy`` and the deadline that bounds it.

    Within a save that has a deadline (:mod:`objckpt.writers.deadline`), transient
    failures are retried with capped backoff for as long as the next attempt can start
    before it (``attempts`` does not apply): an outage of a few seconds costs those
    seconds, not the save. Anywhere else (reads, listings, deletes, a save without a
    deadline) at most ``policy.attempts`` tries are made, all within
    ``policy.request_deadline``; answers asking for fewer requests by name (SlowDown,
    429) are not counted among them where that bound is set. Everywhere, a failure
    that keeps repeating for ``policy.give_up_after`` seconds is persistent: raised as
    :class:`~objckpt.errors.StoreRefusedError` (the store answered) or
    :class:`~objckpt.errors.StoreUnreachableError` (it did not), with the answer, the
    attempts and the time in the message, as are exhausted ``attempts``. Each attempt is
    cut at what is left of the deadline, whatever ``policy.timeout`` says; a request
    that runs out of time fails with :class:`~objckpt.errors.SaveDeadlineError` naming
    the save and the object, or :class:`~objckpt.errors.RequestDeadlineError` naming the
    object and the endpoint (``what()`` and ``endpoint()`` say which, for messages).
    The request holds ``slot`` (its directory in its filesystem's
    :class:`~objckpt.writers.throttle.Backoff`; None for none) from its first attempt
    to its last, waits between attempts included, as TCP counts a segment waiting to
    be sent again as in flight; it waits for the slot within the deadline, tells it of
    each throttling answer, and of how the request ended. Every outcome is counted
    (the current :class:`~objckpt.writers.accounting.RequestCounter`).
    """
    deadline = current_deadline()
    where = None if deadline is not None else endpoint()
    if slot is not None and not slot.try_enter():
        # Within a save, its deadline bounds the wait; elsewhere a request_deadline of
        # its own (the request's starts when it is sent).
        await _hold(slot, deadline or Deadline.for_request(policy.request_deadline, where), what)
    try:
        bound = deadline or Deadline.for_request(policy.request_deadline, where)
        out = await _with_retries(
            call, policy, deadline is not None, bound, slot, what, method, *args, **kwargs
        )
        if slot is not None:
            slot.served = True
        return out
    finally:
        if slot is not None:
            slot.leave()


async def _hold(slot: Slot, deadline: Deadline | None, what: Callable[[], str]) -> None:
    """Wait for ``slot`` within ``deadline`` (None: ``RetryPolicy(request_deadline=None)``,
    no bound): requests the client holds back after the store asked for fewer (in the
    slot's directory, or in all where refusals came from several) are in the way."""
    if deadline is None:
        await slot.enter()
        return
    left = deadline.remaining()
    if left <= 0:
        raise deadline.error(what())
    try:
        await asyncio.wait_for(slot.enter(), left)
    except asyncio.TimeoutError as exc:
        raise deadline.error(
            what(),
            0,
            f"not sent: it waited for a slot in {slot.prefix}, where the client holds "
            "requests back after the store asked for fewer",
            "SlowDown (to the requests it waited behind)",
        ) from exc


async def _with_retries(
    call: Callable[..., Awaitable[Any]],
    policy: RetryPolicy,
    until_deadline: bool,
    deadline: Deadline | None,
    slot: Slot | None,
    what: Callable[[], str],
    method: str,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """:func:`call_with_retries`' loop, within ``deadline`` (a save's, retried
    ``until_deadline``, or the request's own), holding ``slot``."""
    counter = current_counter()
    body = kwargs.get("Body")
    sent = len(body) if isinstance(body, (bytes, bytearray, memoryview, Sized)) else 0
    attempt = 0
    #: Attempts answered "slow down" by name, waited out under a bound (not counted).
    slowed = 0
    damaged = 0  # attempts refused for their body's checksum
    first_failure: float | None = None
    started = time.monotonic()
    last: BaseException | None = None
    while True:
        attempt += 1
        retry = attempt > 1
        left = None if deadline is None else deadline.remaining()
        if deadline is not None and left is not None and left <= 0:
            raise deadline.error(
                what(),
                attempt - 1,
                describe(last) if last is not None else "",
                answer_of(last) if last is not None else None,
            )
        try:
            attempted = call(method, *args, **kwargs)
            out = await (attempted if left is None else asyncio.wait_for(attempted, left))
        except Exception as exc:
            if (
                deadline is not None
                and isinstance(exc, asyncio.TimeoutError)
                and deadline.remaining() <= 0
            ):
                # Cut at the deadline, not the request's own timeout (which is retried).
                answered = answer_of(last) if last is not None else None
                raise deadline.error(what(), attempt, describe(exc), answered) from exc
            now = time.monotonic()
            throttled = is_throttle(exc)
            if not throttled and first_failure is None:
                # The window runs from the first failure that is not throttling: a
                # store asking for fewer requests is waited for until the deadline.
                first_failure = now
            last = exc
            if counter is not None:
                counter.record(method, sent=sent, retry=retry, throttled=throttled)
            if throttled and slot is not None:
                slot.throttled()
            if not is_transient(exc):
                if slot is not None:
                    slot.served = True  # the store's answer for good (404, 412...)
                raise
            if deadline is not None and asks_to_slow_down(exc):
                slowed += 1
            damaged += is_damaged(exc)
            if damaged >= DAMAGED_TRIES:
                raise StoreRefusedError(
                    f"{what()}: the store refused the body {damaged} times as not matching "
                    "the checksum sent with it: something on the way damages every "
                    "request, or the bytes changed between their checksum and their send "
                    "(a part is sent from the caller's memory, as S3's parts and Azure's "
                    "blocks are: memory written while the save read it?) "
                    f"(last answer: {describe(exc)})"
                ) from exc
            if not until_deadline and attempt - slowed >= policy.attempts:
                since = now - (first_failure if first_failure is not None else started)
                raise _given_up(what(), exc, attempt, since, "attempts") from exc
            wait = _backoff(policy, attempt)
            window = policy.give_up_after
            if (
                window is not None
                and first_failure is not None
                and now + wait - first_failure > window
            ):
                raise _given_up(what(), exc, attempt, now - first_failure, "give_up_after") from exc
            if deadline is not None and deadline.remaining() <= wait:
                # The next attempt could not start in time: fail now, naming why.
                raise deadline.error(what(), attempt, describe(exc), answer_of(exc)) from exc
            if until_deadline:
                until = ", until the save's deadline"
            elif deadline is not None and asks_to_slow_down(exc):
                until = ", asked to slow down: until RetryPolicy.request_deadline"
            else:
                until = f" of {policy.attempts + slowed}"
            _log_retry(what, exc, attempt, until)
            await asyncio.sleep(wait)
            continue
        if counter is not None:
            received = out.get("ContentLength", 0) if method == "get_object" else 0
            counter.record(
                method,
                sent=sent,
                received=received if isinstance(received, int) else 0,
                retry=retry,
                throttled=False,
            )
        return out


class RetryingFileSystem:
    """What objckpt's s3fs, gcsfs and adlfs subclasses share: a policy, a
    :class:`~objckpt.writers.throttle.Backoff`, and one request run under
    :func:`call_with_retries`. Mixed in before
    the fsspec class (``class RetryingS3FileSystem(RetryingFileSystem, S3FileSystem)``).

    Args:
        retry_policy: How requests are retried (objckpt's default if omitted).
        *args, **kwargs: The filesystem's own options (``storage_options``).
    """

    def __init__(self, *args: Any, retry_policy: RetryPolicy | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry_policy = retry_policy or RetryPolicy()
        # Shared by every store on this filesystem (a checkpointer shares one across
        # saves): what one save learns about throttling, the next one starts from.
        self.backoff = Backoff()

    async def _cat_file_into(self, path: str, start: int, end: int, sink: SpanSink) -> int:
        """Bytes ``[start, end)`` of ``path`` written into ``sink`` as they arrive (each
        family's own request): how many bytes the answer had."""
        raise NotImplementedError

    async def _cat_ranges_into(
        self,
        paths: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        sinks: Sequence[SpanSink],
    ) -> list[int | BaseException]:
        """:meth:`_cat_file_into` of each range, as many at once as fsspec's
        ``cat_ranges`` runs; a failed range's exception takes its place."""
        coros = [
            self._cat_file_into(p, s, e, k)
            for p, s, e, k in zip(paths, starts, ends, sinks, strict=True)
        ]
        this: Any = self  # the fsspec filesystem this is mixed into has the batch size
        return list(
            await _run_coros_in_chunks(
                coros, batch_size=this.batch_size, nofiles=True, return_exceptions=True
            )
        )

    #: A load's ranges into their sinks (``ObjectStore.read_ranges_into``).
    cat_ranges_into = sync_wrapper(_cat_ranges_into)

    async def _retried(
        self,
        call: Callable[..., Awaitable[Any]],
        what: Callable[[], str],
        name: str,
        method: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``call(method, *args, **kwargs)`` as one retried request on ``name``
        (``bucket/key``, or the bucket or prefix a listing covers), whose directory
        it holds a :attr:`backoff` slot of."""
        return await call_with_retries(
            call,
            self.retry_policy,
            self.backoff.slot(directory_of(name)),
            what,
            method,
            *args,
            endpoint=self.endpoint,
            **kwargs,
        )

    def endpoint(self) -> str | None:
        """The endpoint requests go to, for messages (no credentials, no query);
        None where unknown. Subclasses say where theirs is."""
        return None


def _given_up(what: str, exc: BaseException, attempts: int, seconds: float, why: str) -> StoreError:
    """The error for a request whose transient-looking failure persisted: what the
    store answered (or that it never did), how many attempts, for how long, and
    the :class:`RetryPolicy` field that ended it."""
    answered = answer_of(exc)
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    over = f"over {seconds:.1f} s (RetryPolicy.{why})"
    if answered is None:
        return StoreUnreachableError(
            f"{what}: no answer on each of {tries} {over}: {describe(exc)}"
        )
    return StoreRefusedError(
        f"{what}: the store answered {answered} on each of {tries} {over}; "
        f"retrying did not cure it (last: {describe(exc)})"
    )


def _log_retry(what: Callable[[], str], exc: BaseException, attempt: int, until: str) -> None:
    logger.info(
        "retrying %s after %s (attempt %d%s)", what(), type(exc).__name__, attempt + 1, until
    )


def retry_call(fn: Callable[[], Any], policy: RetryPolicy, what: str, fs: Any) -> Any:
    """Call ``fn`` (a whole operation on ``fs``, such as reading a batch of ranges)
    until it succeeds, raises a permanent error, or attempts run out.

    One retry layer per request: where ``fs`` retries each of its requests itself
    (objckpt's S3 and GCS filesystems, :class:`RetryingFileSystem`, whose retried
    request includes reading the answer's body) ``fn`` runs once, so a failing
    object costs ``policy.attempts`` requests, not that number squared. Other
    fsspec stores have no retry layer of their own; this is theirs (within
    ``policy.request_deadline`` where one is set, checked between attempts).
    """
    if isinstance(fs, RetryingFileSystem):
        return fn()
    stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(policy.attempts)
    if policy.request_deadline is not None:
        stop = stop | tenacity.stop_after_delay(policy.request_deadline)
    retrying = tenacity.Retrying(
        stop=stop,
        wait=tenacity.wait_random_exponential(multiplier=policy.base_delay, max=policy.max_delay),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=lambda s: logger.info(
            "retrying %s after %s (attempt %d of %d)",
            what,
            type(s.outcome.exception()).__name__ if s.outcome else "an error",
            s.attempt_number + 1,
            policy.attempts,
        ),
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            return fn()
    raise AssertionError("unreachable")  # pragma: no cover - reraise=True
