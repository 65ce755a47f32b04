"""A load's large ranges on S3, received straight into the reader's memory (#47).

Through the fault proxy in front of moto: a large range goes the direct way
(:mod:`objckpt.writers.s3_direct`, ``http.client``'s ``readinto``), and faults on it
are what they are on every other request (a body cut short retried by the one retry
layer, ``attempts`` GETs then a failure naming the object; a 500 retried; the
request's own parameters, ``RequestPayer`` here, sent as s3fs would). The
conformance suite (``test_large_ranges_land_in_their_sinks``) checks the bytes on
moto and Ceph RGW, whose signature check proves the mirror's credentials.

Units, with a stand-in client whose answers the test releases by event: an attempt
that ended (its deadline, a cancellation) never writes into the sink, whether it
ended before the answer came or while the body was arriving; credentials are asked
of the aiobotocore client at every signing. Offline: the mirror addresses buckets as
the aiobotocore client does where no endpoint was given (AWS), and is not used where
it would not send what that client sends.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import ssl
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import assert_state_equal, empty_like_state
from helpers import carried, load, save

from objckpt import RetryPolicy
from objckpt.errors import InternalError, RequestDeadlineError
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import s3client
from objckpt.writers.reads import SpanSink
from objckpt.writers.s3_direct import DIRECT_FROM, DirectGets, _LoopCredentials

#: Quick retries: a failing request is tried ``attempts`` times in well under a second.
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=30)


def _state() -> dict[str, torch.Tensor]:
    """A tensor whose range is received directly (2 MiB), and a small one."""
    return {
        "big": torch.arange(2 * DIRECT_FROM // 4, dtype=torch.float32),
        "small": torch.arange(10.0),
    }


@pytest.fixture
def direct_gets(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The GETs received directly, and that each read its body with ``http.client``."""
    seen: list[str] = []
    real_get, real_readinto = DirectGets._get_into, http.client.HTTPResponse.readinto

    def get_into(self: DirectGets, kwargs: dict[str, Any], *args: Any) -> int:
        seen.append(str(kwargs.get("Key")))
        return real_get(self, kwargs, *args)

    def readinto(self: http.client.HTTPResponse, b: Any) -> int:
        if threading.current_thread().name == "objckpt-get":
            seen.append("readinto")
        return real_readinto(self, b)

    monkeypatch.setattr(DirectGets, "_get_into", get_into)
    monkeypatch.setattr(http.client.HTTPResponse, "readinto", readinto)
    return seen


def _saved(s3_bucket: StoreTarget) -> str:
    url = s3_bucket.url("ckpt")
    save(_state(), url, s3_bucket)
    return url


def _via(proxy: FaultProxy) -> StoreTarget:
    return StoreTarget(root="s3://objckpt-test/t", storage_options=proxy.storage_options())


#: A body cut short: closed with a reset, or cleanly (``http.client`` reads a clean
#: close before Content-Length as an end, not an error: objckpt must not).
CUTS = pytest.mark.parametrize("cut", ["truncate", "cut"], ids=["reset", "clean-close"])


@CUTS
@pytest.mark.parametrize("received", ["directly", "through-aiohttp"])
def test_a_body_cut_short_once_is_asked_again_and_received_whole(
    s3_bucket: StoreTarget,
    s3_proxy: FaultProxy,
    direct_gets: list[str],
    cut: str,
    received: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Either way a large range is received (aiohttp's where the mirror is not used)."""
    if received == "through-aiohttp":
        monkeypatch.setattr(s3client, "DIRECT_FROM", 1 << 62)
    url = _saved(s3_bucket)
    s3_proxy.add(Rule("GetObject", key_contains=".distcp", nth=1, action=cut))
    got = empty_like_state(_state())
    load(got, url, _via(s3_proxy), retry=FAST)
    assert_state_equal(got, _state())
    assert s3_proxy.count("GetObject", faulted=True) == 1
    payload_gets = [k for k in direct_gets if k.endswith(".distcp")]
    if received == "through-aiohttp":
        assert not payload_gets, direct_gets
        return
    assert len(payload_gets) == 2, direct_gets  # the cut attempt, then the whole one
    assert "readinto" in direct_gets  # received by http.client, not copied by urllib3


@CUTS
def test_a_body_cut_short_every_time_costs_attempts_gets_then_fails_naming_the_object(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, direct_gets: list[str], cut: str
) -> None:
    url = _saved(s3_bucket)
    s3_proxy.add(Rule("GetObject", key_contains=".distcp", action=cut))
    with pytest.raises(BaseException) as info:
        load(empty_like_state(_state()), url, _via(s3_proxy), retry=FAST)
    assert ".distcp" in str(carried(info.value)), str(carried(info.value))
    assert s3_proxy.count("GetObject", faulted=True) == FAST.attempts
    assert len([k for k in direct_gets if k.endswith(".distcp")]) == FAST.attempts


@pytest.mark.parametrize(("status", "code"), [(500, None), (503, "SlowDown")])
def test_an_error_answer_is_retried_as_on_every_request(
    s3_bucket: StoreTarget,
    s3_proxy: FaultProxy,
    direct_gets: list[str],
    status: int,
    code: str | None,
) -> None:
    url = _saved(s3_bucket)
    s3_proxy.add(Rule("GetObject", key_contains=".distcp", times=2, status=status, code=code))
    got = empty_like_state(_state())
    load(got, url, _via(s3_proxy), retry=FAST)
    assert_state_equal(got, _state())
    assert s3_proxy.count("GetObject", faulted=True) == 2
    assert len([k for k in direct_gets if k.endswith(".distcp")]) == 3


def test_a_requester_pays_bucket_gets_its_header_on_direct_gets(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, direct_gets: list[str]
) -> None:
    """s3fs's request-wide parameters reach the mirror's requests: a GET without
    ``x-amz-request-payer`` is refused as a requester-pays bucket refuses it."""
    url = _saved(s3_bucket)
    s3_proxy.add(
        Rule(
            "GetObject",
            status=403,
            code="AccessDenied",
            unless_header=("x-amz-request-payer", "requester"),
        )
    )
    options = {**s3_proxy.storage_options(), "requester_pays": True}
    got = empty_like_state(_state())
    load(got, url, StoreTarget(root=s3_bucket.root, storage_options=options), retry=FAST)
    assert_state_equal(got, _state())
    assert s3_proxy.count("GetObject", faulted=True) == 0
    assert any(k.endswith(".distcp") for k in direct_gets), direct_gets


# -- units: an ended attempt, credentials, a fork --------------------------------------


class _Raw:
    """A stand-in for urllib3's response: its body handed out by ``readinto``, and
    a socket whose shutdown the test sees."""

    def __init__(self, body: bytes, hold_after: int | None = None) -> None:
        self._body, self._at = body, 0
        self._hold_after = hold_after
        self.reading = threading.Event()
        self.shut = threading.Event()
        self.after_shutdown: threading.Event | None = None
        self.closed = threading.Event()
        self.connection = SimpleNamespace(
            sock=SimpleNamespace(shutdown=lambda how: self.shut.set())
        )

    def readinto(self, view: memoryview) -> int:
        if self._hold_after is not None and self._at >= self._hold_after:
            self.reading.set()
            self.shut.wait(30)  # a blocked receive, ended by the shutdown
            if self.after_shutdown is not None:
                self.after_shutdown.wait(30)
            return 0
        n = min(len(view), len(self._body) - self._at, self._hold_after or len(self._body))
        view[:n] = self._body[self._at : self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self.closed.set()

    def release_conn(self) -> None:
        pass


class _Client:
    """A stand-in botocore client: ``get_object`` waits for ``answer`` and returns ``raw``."""

    def __init__(self, raw: _Raw) -> None:
        self.raw = raw
        self.asked = threading.Event()
        self.answer = threading.Event()

    def get_object(self, **kwargs: Any) -> dict[str, Any]:
        self.asked.set()
        self.answer.wait(30)
        return {"Body": SimpleNamespace(_raw_stream=self.raw), "ContentLength": 8}


def _cut(client: _Client, sink: SpanSink, when: Callable[[], threading.Event]) -> None:
    """Start a direct GET into ``sink`` and cancel it once ``when()`` is set."""

    async def run() -> None:
        task = asyncio.ensure_future(DirectGets(client, 4).get_into({}, sink))
        await asyncio.get_running_loop().run_in_executor(None, when().wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_an_attempt_ended_before_its_answer_never_reads_it() -> None:
    raw = _Raw(b"01234567")
    client = _Client(raw)
    buf = bytearray(8)
    _cut(client, SpanSink([memoryview(buf)]), lambda: client.asked)
    client.answer.set()  # the answer comes after its attempt ended
    assert raw.closed.wait(30)  # closed, not read
    assert buf == bytearray(8)


def test_an_attempt_ended_mid_body_stops_its_thread_before_it_returns() -> None:
    """The cancellation of a GET receiving its body shuts the socket down and returns
    only once the thread has given the sink up (checked while the thread, having
    seen the shutdown, waits for the test: the attempt must still be waiting)."""
    raw = _Raw(b"01234567", hold_after=4)
    client = _Client(raw)
    client.answer.set()
    buf = bytearray(8)
    checked = threading.Event()
    raw.after_shutdown = checked  # the thread waits for the test's look at the task

    async def run() -> bool:
        task = asyncio.ensure_future(
            DirectGets(client, 4).get_into({}, SpanSink([memoryview(buf)]))
        )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, raw.reading.wait, 30)
        task.cancel()
        await loop.run_in_executor(None, raw.shut.wait, 30)
        waiting = not task.done()
        checked.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return waiting

    assert asyncio.run(run()), "the cancelled GET returned while its thread still ran"
    assert raw.closed.is_set()  # the half-read connection is not reused
    assert bytes(buf) == b"0123" + bytes(4)


def test_credentials_are_asked_of_the_aiobotocore_client_at_every_signing() -> None:
    answers = iter(["first", "refreshed"])

    class Credentials:
        async def get_frozen_credentials(self) -> Any:
            return SimpleNamespace(access_key=next(answers), secret_key="s", token=None)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        bridge = _LoopCredentials(Credentials(), loop, timeout=30)
        assert bridge.get_frozen_credentials().access_key == "first"
        assert bridge.access_key == "refreshed"

        async def on_the_loop() -> None:
            bridge.get_frozen_credentials()

        with pytest.raises(InternalError):
            asyncio.run_coroutine_threadsafe(on_the_loop(), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_a_direct_get_held_past_the_request_deadline_fails_naming_the_object(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, direct_gets: list[str]
) -> None:
    """A payload GET whose answer never comes in time: the load fails at its request
    deadline, naming the object, its thread left behind never to read the answer
    (the stand-in tests above show that it does not)."""
    url = _saved(s3_bucket)
    s3_proxy.add(Rule("GetObject", key_contains=".distcp", action="hold", stall=120))
    policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, request_deadline=2.0)
    try:
        with pytest.raises(BaseException) as info:
            load(empty_like_state(_state()), url, _via(s3_proxy), retry=policy)
    finally:
        s3_proxy.release()
    err = carried(info.value)
    assert isinstance(err, RequestDeadlineError), repr(err)
    assert ".distcp" in str(err), str(err)
    assert any(k.endswith(".distcp") for k in direct_gets), direct_gets


def _resolved_urls(client: Any, bucket: str, call: Callable[..., Any]) -> str:
    """The URL ``client`` would send a GetObject of ``bucket`` to (nothing is sent)."""

    class Sent(Exception):
        pass

    seen: list[str] = []

    def stop(request: Any, **kwargs: Any) -> None:
        seen.append(request.url)
        raise Sent

    client.meta.events.register("before-send.s3.GetObject", stop)
    try:
        with pytest.raises(Sent):
            call(Bucket=bucket, Key="k")
    finally:
        client.meta.events.unregister("before-send.s3.GetObject", stop)
    return seen[0]


@pytest.mark.parametrize(
    "bucket",
    ["plain-bucket", "arn:aws:s3:us-west-2:123456789012:accesspoint/objckpt"],
    ids=["bucket", "access-point"],
)
def test_the_mirror_addresses_buckets_as_the_client_does_where_no_endpoint_was_given(
    bucket: str,
) -> None:
    """On AWS (no endpoint_url) the mirror must resolve endpoints as the aiobotocore
    client does: the resolved URL given back as a custom endpoint would address
    buckets path-style and send access points to the bucket host."""
    from fsspec.asyn import sync

    from objckpt.writers.s3client import RetryingS3FileSystem

    fs = RetryingS3FileSystem(
        key="AKIAOBJCKPTTEST",
        secret="offline",
        client_kwargs={"region_name": "us-west-2"},
        skip_instance_cache=True,
    )
    direct = sync(fs.loop, fs._direct_gets)
    assert isinstance(direct, DirectGets)

    def aio_get(**kwargs: Any) -> Any:
        return sync(fs.loop, fs._s3.get_object, **kwargs)

    expected = _resolved_urls(fs._s3, bucket, aio_get)
    assert _resolved_urls(direct.client, bucket, direct.client.get_object) == expected
    sync(fs.loop, fs.close_connections)


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"cache_regions": True}, "cache_regions"),
        ({"profile": "other"}, "'profile'"),
        ({"config_kwargs": {"proxies": {"https": "http://127.0.0.1:9"}}}, "'proxies'"),
        (
            {"config_kwargs": {"connector_args": {"ssl_context": ssl.create_default_context()}}},
            "ssl_context",
        ),
    ],
    ids=["cache-regions", "profile", "proxies", "connector-args"],
)
def test_no_mirror_where_it_would_not_send_what_the_client_sends(
    options: dict[str, Any],
    why: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Offline (no request is sent): per-region clients, a profile, a proxy or aiohttp
    connector arguments leave large ranges to aiohttp, saying why in the log."""
    from fsspec.asyn import sync

    from objckpt.writers.s3client import RetryingS3FileSystem

    (tmp_path / "config").write_text("[profile other]\nregion = us-west-2\n")
    (tmp_path / "credentials").write_text(
        "[other]\naws_access_key_id = AKIAOBJCKPTTEST\naws_secret_access_key = offline\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    keys = {} if "profile" in options else {"key": "AKIAOBJCKPTTEST", "secret": "offline"}
    fs = RetryingS3FileSystem(**keys, **options, skip_instance_cache=True)
    try:
        with caplog.at_level("INFO", logger="objckpt.writers.s3client"):
            assert sync(fs.loop, fs._direct_gets) is None
    finally:
        sync(fs.loop, fs.close_connections)
    assert why in caplog.text, caplog.text


#: Run in a fresh process (no other test's connections come and go): a large range
#: received directly, then the filesystem's connections closed; prints the TCP
#: connections to the store's port open after the read and after the close.
_CLOSE_SCRIPT = """
import json, os, sys
from fsspec.asyn import sync
from objckpt import Location
from objckpt.writers import open_store
from objckpt.writers.reads import SpanSink

def connected(port):
    inodes = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{name}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if int(cols[2].rsplit(":", 1)[1], 16) == port and cols[3] == "01":
                    inodes.add(cols[9])
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            ours.add(fd)
    return len(ours)

options, url, port = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = open_store(Location.parse(url, options))
store.put("big.bin", os.urandom(4 << 20))
fs = store._fs
sync(fs.loop, fs.close_connections)  # the PUT's connections: not what is counted
sink = SpanSink([memoryview(bytearray(3 << 20))])
out = store.read_ranges_into(["big.bin"], [0], [3 << 20], [sink])
assert out == [3 << 20], out
mirror = fs._direct  # held here: closed by close_connections, not by collection
assert mirror is not None
read = connected(port)
sync(fs.loop, fs.close_connections)
print(json.dumps({"after_read": read, "after_close": connected(port)}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="needs /proc")
def test_closing_the_filesystem_closes_the_mirrors_connections(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, tmp_path: Path
) -> None:
    """The proxy keeps connections alive as a real store does (moto closes each one
    itself): after a direct GET the mirror holds one, and ``close_connections``
    (which a checkpointer's close and the process's client cache call) closes it."""
    script = tmp_path / "close.py"
    script.write_text(_CLOSE_SCRIPT)
    port = urllib.parse.urlsplit(s3_proxy.endpoint_url).port
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            json.dumps(s3_proxy.storage_options()),
            s3_bucket.url("closed"),
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after_read"] >= 1, seen  # kept alive: the count can see it
    assert seen["after_close"] == 0, seen
