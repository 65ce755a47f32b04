"""Reads have a deadline, and retries have one layer (#26 item 3).

Against a store that answers every GET with 503, a load makes ``attempts`` GETs of
the object, not ``attempts`` squared; a store that goes down for a while in the
middle of a save costs the save that while, not the save; a socket that accepts
and never answers fails ``objckpt info``, ``objckpt ls``, a load and a save within
their deadline, naming what was asked. Times are measured only where a bound on
time is the behaviour under test.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner, Result
from conftest import assert_state_equal, empty_like_state
from helpers import carried, load, save
from states import counting_state

import objckpt
from objckpt import RetryPolicy, UploadOptions
from objckpt.cli import main
from objckpt.cli.common import EXIT_ERROR
from objckpt.errors import RequestDeadlineError, SaveDeadlineError, StoreRefusedError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.relay import TcpRelay
from objckpt.testing.servers import s3_test_options

#: Quick retries, so a failing request is tried ``attempts`` times in well under a second.
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=30)
#: A deadline well below the per-attempt timeout, so only the deadline can end a request.
DEADLINE = 3.0
SILENT = RetryPolicy(
    attempts=3, base_delay=0.01, max_delay=0.05, timeout=60, request_deadline=DEADLINE
)


def _via(options: dict) -> StoreTarget:
    return StoreTarget(root="s3://objckpt-test/t", storage_options=options)


# -- one retry layer ------------------------------------------------------------------


@pytest.mark.parametrize("what", [MANIFEST_KEY, ".distcp"])
def test_every_get_answered_500_costs_attempts_gets_not_attempts_squared(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, what: str
) -> None:
    """The manifest (read whole) and a payload range (read in a batch) each get
    ``attempts`` GETs: the whole-read retry no longer wraps the request's own."""
    url = s3_bucket.url("ckpt")
    save(counting_state(), url, s3_bucket)
    via = _via(s3_proxy.storage_options())
    s3_proxy.add(Rule("GetObject", key_contains=what, action="status", status=500))
    with pytest.raises(BaseException) as info:
        load(empty_like_state(counting_state()), url, via, retry=FAST)
    assert url in str(carried(info.value))  # the load's error names the checkpoint
    gets = [s for s in s3_proxy.seen if s.operation == "GetObject" and what in s.path]
    assert len(gets) == FAST.attempts, [s.path for s in gets]


@pytest.mark.parametrize("what", [MANIFEST_KEY, ".distcp"])
def test_a_load_waits_out_slow_down_past_its_attempts(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, what: str
) -> None:
    """#46: a restore at scale meets the per-prefix limits a save does. GETs answered
    503 SlowDown (S3 asking for fewer requests, by name) three times as often as
    ``attempts`` allows are waited out, and the load succeeds (unfixed, it failed
    after ``attempts`` answers, a few seconds into a storm)."""
    url = s3_bucket.url("ckpt")
    state = counting_state()
    save(state, url, s3_bucket)
    refusals = 3 * FAST.attempts
    s3_proxy.add(Rule("GetObject", key_contains=what, status=503, times=refusals))
    got = empty_like_state(state)
    load(got, url, _via(s3_proxy.storage_options()), retry=FAST)
    assert_state_equal(got, state)
    assert s3_proxy.count("GetObject", faulted=True) == refusals


def test_a_load_answered_slow_down_forever_fails_at_its_request_deadline(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """Waiting out SlowDown is bounded by ``request_deadline``: past it the load fails
    with :class:`StoreRefusedError` naming the object, what the store answered and
    the option."""
    url = s3_bucket.url("ckpt")
    save(counting_state(), url, s3_bucket)
    s3_proxy.add(Rule("GetObject", key_contains=MANIFEST_KEY, status=503))
    # Long enough that the first answer comes inside it on a loaded machine.
    policy = dataclasses.replace(SILENT, request_deadline=10.0)
    via = _via(s3_proxy.storage_options())
    with pytest.raises(BaseException) as info:
        load(empty_like_state(counting_state()), url, via, retry=policy)
    err = carried(info.value)
    assert isinstance(err, StoreRefusedError), repr(err)
    for named in (MANIFEST_KEY, "HTTP 503 SlowDown", "RetryPolicy.request_deadline"):
        assert named in str(err), str(err)
    assert s3_proxy.count("GetObject", faulted=True) > policy.attempts


def test_a_body_cut_off_every_time_is_retried_attempts_times(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """A 200 whose body is cut short is retried by the request layer (the one layer
    left): ``attempts`` GETs, then the load fails naming the object."""
    url = s3_bucket.url("ckpt")
    save(counting_state(), url, s3_bucket)
    s3_proxy.add(Rule("GetObject", key_contains=".distcp", action="truncate"))
    with pytest.raises(BaseException) as info:
        load(empty_like_state(counting_state()), url, _via(s3_proxy.storage_options()), retry=FAST)
    assert ".distcp" in str(carried(info.value))
    assert s3_proxy.count("GetObject", faulted=True) == FAST.attempts


# -- an outage in the middle of a save ------------------------------------------------

#: Two tries per request: an outage longer than that must not fail a save with a deadline.
BRIEF = RetryPolicy(attempts=2, base_delay=0.05, max_delay=0.2, timeout=30)
#: Refused connections to wait for while down: more than every try ``BRIEF`` allows
#: (aiohttp may resend a reset request once itself, so each try can cost two).
REFUSALS = 3 * BRIEF.attempts


@pytest.fixture
def relay(s3_proxy: FaultProxy) -> Iterator[TcpRelay]:
    """client -> relay (the outage) -> fault proxy (holds the first payload PUT) -> moto."""
    with TcpRelay(s3_proxy.endpoint_url) as r:
        yield r


def _outage(relay: TcpRelay, proxy: FaultProxy, finished: threading.Event) -> threading.Thread:
    """Once the save's first payload PUT is held at the proxy, take the endpoint down
    (cutting that request), wait until ``REFUSALS`` attempts were refused, bring it
    back up. Every step waits for an event, none for a time."""
    proxy.add(Rule("PutObject", key_contains=".distcp", nth=1, action="hold", stall=120))

    def run() -> None:
        try:
            proxy.wait_for("PutObject", faulted=True, timeout=120)
        except TimeoutError:
            return
        relay.down()
        proxy.release()  # the held request goes on to moto; its answer is lost
        while not finished.is_set() and not relay.wait_refused(REFUSALS, timeout=1.0):
            pass
        relay.up()

    thread = threading.Thread(target=run, name="outage", daemon=True)
    thread.start()
    return thread


def _commits_through_the_outage(
    relay: TcpRelay, s3_proxy: FaultProxy, s3_bucket: StoreTarget, run_save: Callable[[], None]
) -> None:
    finished = threading.Event()
    thread = _outage(relay, s3_proxy, finished)
    try:
        run_save()
    finally:
        finished.set()
        relay.up()
        thread.join(timeout=30)
    assert relay.refused >= REFUSALS  # the endpoint was down mid-save, beyond BRIEF's tries
    got = empty_like_state(counting_state())
    load(got, s3_bucket.url("ckpt"), s3_bucket)
    assert_state_equal(got, counting_state())


def test_a_sync_save_commits_through_an_outage(
    relay: TcpRelay, s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    via = _via(relay.storage_options())

    def run() -> None:
        save(
            counting_state(),
            s3_bucket.url("ckpt"),
            via,
            retry=BRIEF,
            upload=UploadOptions(deadline=120),
        )

    _commits_through_the_outage(relay, s3_proxy, s3_bucket, run)


def test_an_async_save_commits_through_an_outage(
    relay: TcpRelay, s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    def run() -> None:
        with objckpt.AsyncCheckpointer(
            storage_options=relay.storage_options(),
            retry=BRIEF,
            upload=UploadOptions(max_parts_in_flight=4, deadline=120),
        ) as ckpt:
            ckpt.save(counting_state(), s3_bucket.url("ckpt"), no_dist=True).result(timeout=300)

    _commits_through_the_outage(relay, s3_proxy, s3_bucket, run)


# -- a socket that accepts and never answers ------------------------------------------


def _within_the_deadline(started: float) -> None:
    # The behaviour under test is a bound on time: the deadline plus 10%, plus 10 s
    # for client construction and DCP planning on a loaded machine. Still far below
    # the 60 s attempt timeout, so only the deadline can have ended the request.
    assert time.monotonic() - started <= DEADLINE * 1.1 + 10.0


def _cli(endpoint: str, *args: str) -> Result:
    opts = [
        x
        for k, v in s3_test_options(endpoint).items()
        for x in ("--storage-option", f"{k}={json.dumps(v)}")
    ]
    return CliRunner().invoke(
        main, [*args, "--deadline", str(DEADLINE), *opts], catch_exceptions=False
    )


@pytest.mark.parametrize("command", ["info", "ls"])
def test_the_cli_fails_within_its_deadline_naming_the_endpoint(
    black_hole: str, command: str
) -> None:
    target = (
        "s3://objckpt-test/run/step-0000000001" if command == "info" else "s3://objckpt-test/run"
    )
    started = time.monotonic()
    out = _cli(black_hole, command, target)
    _within_the_deadline(started)
    assert out.exit_code == EXIT_ERROR, out.output
    assert black_hole in out.stderr and "s3://objckpt-test" in out.stderr, out.stderr
    assert "request_deadline" in out.stderr and "Traceback" not in out.output


def test_a_load_fails_within_its_deadline_naming_the_endpoint(black_hole: str) -> None:
    started = time.monotonic()
    with pytest.raises(BaseException) as info:
        load(
            empty_like_state(counting_state()),
            "s3://objckpt-test/run/step-1",
            _via(s3_test_options(black_hole)),
            retry=SILENT,
        )
    _within_the_deadline(started)
    err = carried(info.value)
    assert isinstance(err, RequestDeadlineError), repr(err)
    assert black_hole in str(err) and "s3://objckpt-test/run/step-1" in str(err)


def test_a_save_fails_within_its_deadline_naming_the_rank(black_hole: str) -> None:
    started = time.monotonic()
    with pytest.raises(BaseException) as info:
        save(
            counting_state(),
            "s3://objckpt-test/run/step-1",
            _via(s3_test_options(black_hole)),
            retry=SILENT,
            upload=UploadOptions(deadline=DEADLINE),
        )
    _within_the_deadline(started)
    err = carried(info.value)
    assert isinstance(err, SaveDeadlineError), repr(err)
    assert "rank 0" in str(err) and "s3://objckpt-test" in str(err)
