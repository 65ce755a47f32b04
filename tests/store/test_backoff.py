"""Throttling back-off per key directory (objckpt/writers/throttle.py, #46).

The rules on one event loop and a hand-stepped clock (tasks are stepped by yielding
to the loop, never by sleeping); the directory each store's requests are charged to,
read from the real clients' requests against moto, fake-gcs-server and Azurite; and
a store throttled in one directory through the fault proxy, which backs off there
and nowhere else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from objckpt import Location, UploadOptions
from objckpt.errors import SaveDeadlineError, StoreError
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store
from objckpt.writers.azureclient import _blob_name
from objckpt.writers.deadline import Deadline, bounded_by
from objckpt.writers.gcsclient import _object_name
from objckpt.writers.retry import RetryPolicy, call_with_retries
from objckpt.writers.throttle import Backoff, directory_of

FAST = RetryPolicy(attempts=8, base_delay=0.01, max_delay=0.05, timeout=10)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(test: Callable[[Backoff, Clock], Coroutine[Any, Any, None]], **kw: Any) -> None:
    clock = Clock()
    asyncio.run(test(Backoff(clock=clock, **kw), clock))


async def _steps() -> None:
    """Let every task that can run, run (grants are handed over one loop turn later)."""
    for _ in range(5):
        await asyncio.sleep(0)


def _refused(backoff: Backoff, prefix: str) -> None:
    """A request in ``prefix`` is answered SlowDown, and gives up its slot."""
    backoff.throttled(prefix)
    backoff.leave(prefix, False)


async def _now(entered: Awaitable[Any]) -> None:
    """A slot that must be free: fail at once if it is not (no test hangs)."""
    await asyncio.wait_for(entered, 5)


async def _fill(backoff: Backoff, prefix: str, n: int) -> None:
    for _ in range(n):
        await _now(backoff.enter(prefix))  # nothing limits yet: no wait


def test_a_throttled_directory_is_halved_and_the_others_go_on() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/run/step-1", 8)
        await _fill(backoff, "b/run/step-2", 8)
        _refused(backoff, "b/run/step-1")  # 8 were in flight there: at most 4
        assert backoff.stats().limited == (("b/run/step-1", 4.0),)
        waiter = asyncio.ensure_future(backoff.enter("b/run/step-1"))
        await _steps()
        assert not waiter.done()  # 7 in flight, limit 4
        await _now(backoff.enter("b/run/step-2"))  # not limited there
        for left in range(7, 4, -1):  # down to 4 in flight: still full
            backoff.leave("b/run/step-1", False)
            await _steps()
            assert not waiter.done(), left
        backoff.leave("b/run/step-1", False)  # 3 in flight: the waiter's turn
        await _steps()
        assert waiter.done()
        stats = backoff.stats()
        assert (stats.directory_cuts, stats.client_cuts, stats.client_limit) == (1, 0, None)

    _run(test)


def test_a_request_holds_its_slot_from_its_first_attempt_to_its_last() -> None:
    """A request refused once waits and is sent again without queueing anew (it was in
    flight all along), while a new request in its directory waits for the limit."""

    async def test(backoff: Backoff, clock: Clock) -> None:
        retried, go_on = asyncio.Event(), asyncio.Event()
        attempts = 0

        async def call(method: str) -> dict[str, Any]:
            nonlocal attempts
            attempts += 1
            if attempts == 1:
                raise OSError(errno.EBUSY, "SlowDown")  # s3fs's mapping of a 503
            retried.set()
            await go_on.wait()
            return {}

        await _fill(backoff, "b/d", 3)
        request = asyncio.ensure_future(
            call_with_retries(call, FAST, backoff.slot("b/d"), lambda: "PUT b/d/x", "put_object")
        )
        await _now(retried.wait())  # sent again with 4 in flight, over the new limit of 2
        assert backoff.stats().limited == (("b/d", 2.0),)
        newcomer = asyncio.ensure_future(backoff.enter("b/d"))
        await _steps()
        assert not newcomer.done()
        for _ in range(2):
            backoff.leave("b/d", False)
        go_on.set()
        await _now(request)  # it gives its slot back: 1 in flight, the newcomer's turn
        await _now(newcomer)
        assert attempts == 2

    _run(test)


def test_one_burst_of_refusals_halves_once_per_cooldown() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/d", 16)
        for _ in range(4):  # one burst: four 503s at one moment
            _refused(backoff, "b/d")
        assert backoff.stats().limited == (("b/d", 8.0),)
        clock.now += 0.5
        _refused(backoff, "b/d")
        assert backoff.stats().limited == (("b/d", 4.0),)
        assert backoff.stats().directory_cuts == 2 and backoff.stats().lowest == 4.0

    _run(test)


def test_successes_grow_a_limit_back_and_lift_it_where_it_was_cut() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/d", 8)
        _refused(backoff, "b/d")  # ceiling 8, limit 4
        for _ in range(4):
            backoff.leave("b/d", False)  # 3 in flight
        grown = []
        for _ in range(7):
            backoff.leave("b/d", True)
            await _now(backoff.enter("b/d"))  # below the limit again
            grown.append(dict(backoff.stats().limited).get("b/d"))
        assert grown[0] == pytest.approx(4.25)
        assert all(b is None or (a is not None and b > a) for a, b in itertools.pairwise(grown))
        for _ in range(40):
            backoff.leave("b/d", True)
            await _now(backoff.enter("b/d"))
        assert backoff.stats().limited == ()  # lifted at 8

    _run(test)


def test_a_limit_cut_deep_grows_fast_back_to_half_where_it_was_cut() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/d", 16)
        _refused(backoff, "b/d")  # 16 in flight: 8, and fast growth up to 8
        for _ in range(2):
            clock.now += 0.5
            _refused(backoff, "b/d")  # a storm: 4, then 2
        assert backoff.stats().limited == (("b/d", 2.0),)
        for _ in range(11):
            backoff.leave("b/d", False)  # 2 in flight
        limits = []
        for _ in range(7):
            backoff.leave("b/d", True)
            await _now(backoff.enter("b/d"))
            limits.append(dict(backoff.stats().limited)["b/d"])
        assert limits[:6] == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # one per success
        assert limits[6] == pytest.approx(8.125)  # then one per window

    _run(test)


def test_a_limit_not_cut_for_a_while_is_lifted() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/d", 4)
        _refused(backoff, "b/d")
        assert backoff.stats().limited == (("b/d", 2.0),)
        clock.now += 61.0  # forget_after: 60 s
        await _now(backoff.enter("b/d"))  # 4 in flight again, no limit
        assert backoff.stats().limited == ()

    _run(test)


def test_an_answer_that_is_not_retried_counts_as_served() -> None:
    """A 404 (a HEAD of an object not there) is the store serving the request: it
    grows a limit as a success does; a transient failure does not, nor a request that
    gave up on SlowDown (whose error is not transient either)."""

    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/d", 8)
        _refused(backoff, "b/d")  # 4, ceiling 8

        async def missing(method: str) -> None:
            raise FileNotFoundError("b/d/x")

        for _ in range(4):
            backoff.leave("b/d", False)  # 3 in flight
        with pytest.raises(FileNotFoundError):
            await call_with_retries(missing, FAST, backoff.slot("b/d"), lambda: "x", "head")
        assert backoff.stats().limited == (("b/d", 4.25),)

        async def reset(method: str) -> None:
            raise ConnectionResetError("reset")

        policy = RetryPolicy(attempts=1, base_delay=0.01, max_delay=0.01)
        with pytest.raises(StoreError):
            await call_with_retries(reset, policy, backoff.slot("b/d"), lambda: "x", "head")
        assert backoff.stats().limited == (("b/d", 4.25),)

        async def busy(method: str) -> None:
            raise OSError(errno.EBUSY, "SlowDown")

        clock.now += 1.0  # past the cooldown: the refusals below halve it once more
        with pytest.raises(StoreError):  # given up on SlowDown: not served, no growth
            await call_with_retries(busy, policy, backoff.slot("b/d"), lambda: "x", "head")
        assert backoff.stats().limited == (("b/d", 2.125),)

    _run(test)


def test_a_request_that_cannot_get_a_slot_in_time_fails_naming_its_directory() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/d", 2)
        _refused(backoff, "b/d")  # limit 1, 1 in flight: nothing leaves

        async def never(method: str) -> None:
            raise AssertionError("sent without a slot")

        waits = pytest.raises(SaveDeadlineError, match=r"waited for a slot in b/d")
        with waits, bounded_by(Deadline.start(2.0, "saving s3://b/d")):
            await call_with_retries(never, FAST, backoff.slot("b/d"), lambda: "PUT x", "put")
        spent_already = Deadline(time.monotonic() - 1.0, 5.0, "saving s3://b/d")
        with pytest.raises(SaveDeadlineError) as spent, bounded_by(spent_already):
            await call_with_retries(never, FAST, backoff.slot("b/d"), lambda: "PUT y", "put")
        assert "SlowDown" not in str(spent.value)  # nothing waited: not blamed on throttling
        assert backoff.stats().limited == (("b/d", 1.0),)

    _run(test)


def test_refusals_in_two_directories_halve_every_request() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        for prefix in ("b/spread-0/step-1", "b/spread-1/step-1", "b/spread-2/step-1"):
            await _fill(backoff, prefix, 4)
        _refused(backoff, "b/spread-0/step-1")
        assert backoff.stats().client_limit is None  # one directory: its own limit only
        clock.now += 0.2  # within the cooldown: the hot range spans both
        _refused(backoff, "b/spread-1/step-1")
        stats = backoff.stats()
        assert stats.client_cuts == 1 and stats.client_limit == 5.5  # 11 were in flight
        # A third directory, never refused, now waits for the client's limit.
        waiter = asyncio.ensure_future(backoff.enter("b/spread-2/step-1"))
        await _steps()
        assert not waiter.done()
        for _ in range(4):
            backoff.leave("b/spread-2/step-1", False)
            await _steps()
        assert not waiter.done()  # 6 in flight in all, fewer than 5 needed
        backoff.leave("b/spread-0/step-1", False)
        await _steps()
        assert not waiter.done()  # 5
        backoff.leave("b/spread-1/step-1", False)
        await _steps()
        assert waiter.done()  # 4: its turn

    _run(test)


def test_refusals_a_cooldown_apart_do_not_span_directories() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/x", 4)
        await _fill(backoff, "b/y", 4)
        _refused(backoff, "b/x")
        clock.now += 0.6
        _refused(backoff, "b/y")
        assert backoff.stats().client_cuts == 0

    _run(test)


def test_a_cancelled_waiter_holds_no_slot_and_keeps_no_one_waiting() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        await _fill(backoff, "b/d", 2)
        _refused(backoff, "b/d")  # limit 1, 1 in flight
        first = asyncio.ensure_future(backoff.enter("b/d"))
        second = asyncio.ensure_future(backoff.enter("b/d"))
        await _steps()
        first.cancel()  # cancelled while waiting (a request past its deadline)
        await _steps()
        backoff.leave("b/d", False)  # the slot goes to the second waiter
        await _steps()
        assert second.done() and not second.cancelled()
        # Granted, then cancelled before it ran: the slot comes back.
        third = asyncio.ensure_future(backoff.enter("b/d"))
        await _steps()
        backoff.leave("b/d", False)  # granted to the third...
        third.cancel()  # ...which is cancelled before it resumes
        await _steps()
        assert third.cancelled()
        await _now(backoff.enter("b/d"))  # its slot was given back

    _run(test)


def test_limits_of_idle_directories_are_kept_up_to_a_bound() -> None:
    async def test(backoff: Backoff, clock: Clock) -> None:
        for i in range(6):
            prefix = f"b/step-{i}"
            await _fill(backoff, prefix, 4)
            clock.now += 1.0
            _refused(backoff, prefix)
            for _ in range(3):
                backoff.leave(prefix, False)
        # Idle and limited: the oldest are forgotten past ``keep``.
        assert [name for name, _ in backoff.stats().limited] == [f"b/step-{i}" for i in (3, 4, 5)]

    _run(test, keep=3)


def test_the_directory_of_a_request() -> None:
    assert directory_of("bkt/run/step-5/__0_0.abc.distcp") == "bkt/run/step-5"
    assert directory_of("bkt/run/step-5/") == "bkt/run/step-5"  # a listing of the step
    assert directory_of("bkt/top.bin") == "bkt" and directory_of("bkt") == "bkt"
    # GCS: gcsfs's request shapes (path, query, a listing's prefix, a simple upload).
    base = "http://127.0.0.1:4443/storage/v1/"
    assert _object_name(base + "b/bkt/o/run%2Fstep-5%2Fx", {}) == "bkt/run/step-5/x"
    assert _object_name(base + "b/bkt/o/run%2Fx/compose", {}) == "bkt/run/x"
    assert _object_name(base + "b/bkt/o", {"prefix": "run/step-5/"}) == "bkt/run/step-5/"
    upload = "http://127.0.0.1:4443/upload/storage/v1/b/bkt/o"
    assert _object_name(upload + "?name=run%2Fy", {}) == "bkt/run/y"
    body = b'--==0==\nContent-Type: application/json\n\n{"name": "run/z"}\n--==0==\n\nDATA'
    assert _object_name(upload, {"data": body}) == "bkt/run/z"
    assert _object_name(base + "b/bkt", {}) == "bkt"
    # Azure: the URL's path (Azurite's account segment included), a listing's prefix.
    account = "http://127.0.0.1:10000/devstoreaccount1"
    assert _blob_name(f"{account}/c/run/step-5/x?comp=block&blockid=QQ") == (
        "devstoreaccount1/c/run/step-5/x"
    )
    assert _blob_name(f"{account}/c?restype=container&comp=list&prefix=run/") == (
        "devstoreaccount1/c/run/"
    )


@pytest.fixture(params=["s3", "rgw", "gcs", "azure"])
def target(request: pytest.FixtureRequest) -> StoreTarget:
    """A bucket on each kind of store, reached by the real client library."""
    name = {
        "s3": "s3_bucket",
        "rgw": "rgw_bucket",
        "gcs": "fake_gcs_bucket",
        "azure": "az_container",
    }
    return request.getfixturevalue(name[request.param])


def test_each_stores_requests_are_charged_to_their_objects_directory(
    target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory comes from the request each client really sends (an S3 key, a
    gcsfs path, query or upload body, an Azure URL): a write, a read and a listing of
    ``d/e/`` are all charged to ``<bucket>/<root>/d/e``."""
    store = open_store(Location.parse(target.url("bo"), target.storage_options), UploadOptions())
    try:
        backoff, entered = store.backoff, []
        assert backoff is not None
        try_enter = backoff.try_enter  # every request asks first

        def recorded(prefix: str) -> bool:
            entered.append(prefix)
            return try_enter(prefix)

        monkeypatch.setattr(backoff, "try_enter", recorded)
        store.put("d/e/f.bin", b"x" * 100)
        assert store.read("d/e/f.bin") == b"x" * 100
        assert list(store.listing("d/e/")) == ["f.bin"]
    finally:
        store.close()
    ours = [p for p in entered if "/bo/" in p + "/"]
    # The write, the read and the listing; a client may also ask about ``d/e``
    # itself (adlfs does, before listing it), a key in ``d``.
    assert sum(p.endswith("t/bo/d/e") for p in ours) >= 3, entered
    assert all(p.endswith(("t/bo/d/e", "t/bo/d")) for p in ours), entered


def _put_all(store: Any, keys: list[str]) -> None:
    def put(key: str) -> None:
        with bounded_by(Deadline.start(120, "saving")):  # as a save: 503s waited out
            store.put(key, b"y" * 64)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(put, keys))


def test_a_store_throttled_in_one_directory_backs_off_there_only(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = s3_proxy.storage_options()
    loc = Location.parse(s3_bucket.url("throttled"), options, FAST)
    store = open_store(loc, UploadOptions())
    try:
        backoff = Backoff(cooldown=60.0)  # every refusal within one cooldown
        monkeypatch.setattr(store._fs, "backoff", backoff)
        refused: list[str] = []
        throttled = backoff.throttled

        def recorded(prefix: str) -> None:
            refused.append(prefix)
            throttled(prefix)

        monkeypatch.setattr(backoff, "throttled", recorded)
        s3_proxy.add(Rule("PutObject", key_contains="/hot/", action="status", status=503, times=6))
        keys = [f"{d}/{i}.bin" for i in range(24) for d in ("hot", "cold")]
        _put_all(store, keys)
        stats = backoff.stats()
        # One halving, of the hot directory's limit (the cold one was never limited,
        # nor was the client); successes may have lifted it since.
        assert set(refused) == {f"{s3_bucket.bucket}/t/throttled/hot"}, refused
        assert stats.directory_cuts == 1 and stats.client_cuts == 0, stats
        # Refusals in a second directory within the cooldown: every request backs off.
        s3_proxy.add(Rule("PutObject", key_contains="/warm/", action="status", status=503, times=2))
        _put_all(store, [f"warm/{i}.bin" for i in range(8)])
        assert backoff.stats().client_cuts == 1
    finally:
        store.close()
    assert s3_proxy.count("PutObject", faulted=True) == 8  # every refusal was ridden out
    assert s3_proxy.count("PutObject", faulted=False) == 56  # then each was written once
