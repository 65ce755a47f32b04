"""objckpt's gcsfs subclass: the gcsfs internal it relies on, one retry loop, fast failures."""

from __future__ import annotations

import inspect
import os
import time

import gcsfs
import pytest
from gcsfs import GCSFileSystem
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from objckpt import Location, RetryPolicy
from objckpt.testing import FaultProxy, GcsEmulator, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.servers import FakeGcsServer
from objckpt.writers import open_store
from objckpt.writers.accounting import RequestCounter, counting
from objckpt.writers.gcsclient import RetryingGCSFileSystem
from objckpt.writers.reads import SpanSink

MiB = 1024 * 1024


def _supported(package: str, extra: str) -> SpecifierSet:
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    spec = next(d for d in extras[extra] if d.startswith(package))
    return SpecifierSet(spec.removeprefix(package))


def test_the_gcsfs_internal_the_subclass_replaces_is_there() -> None:
    """``_request`` (every gcsfs request) wrapped by gcsfs's retry decorator, whose
    undecorated function objckpt calls instead."""
    assert Version(gcsfs.__version__) in _supported("gcsfs", "gcs"), gcsfs.__version__
    single = GCSFileSystem._request.__wrapped__
    assert inspect.iscoroutinefunction(single)
    names = list(inspect.signature(single).parameters)
    assert names[:3] == ["self", "method", "path"], names


def test_the_gcsfs_internals_a_ranged_read_into_memory_uses_are_there() -> None:
    """What ``_cat_file_into`` sends its GET with, as gcsfs's ``_request`` does (the
    session, the headers with the credentials, the parameters, the timeout, the media
    URL), and gcsfs's reading of an error answer."""
    from gcsfs.retry import validate_response

    for name in ("_set_session", "_get_headers", "_get_params", "url", "split_path"):
        assert callable(getattr(GCSFileSystem, name)), name
    assert isinstance(GCSFileSystem.session, property)
    headers = list(inspect.signature(GCSFileSystem._get_headers).parameters)
    assert headers[:2] == ["self", "headers"], headers
    fs = GCSFileSystem(token="anon", endpoint_url="http://127.0.0.1:9")
    assert hasattr(fs, "requests_timeout")
    assert "/download/storage/v1/b/b/o/k%2Fx?alt=media" in fs.url("b/k/x")
    with pytest.raises(FileNotFoundError):
        validate_response(404, b"", "b/k")


def test_the_gcsfs_internals_a_streamed_upload_uses_are_there() -> None:
    """What ``_put_streamed`` sends its media upload with: ``_call`` (which hands its
    keywords to ``_request`` and parses the answer with ``json_out``) and the
    endpoint's ``_location``."""
    names = list(inspect.signature(GCSFileSystem._call).parameters)
    assert names[:3] == ["self", "method", "path"] and "json_out" in names, names
    fs = GCSFileSystem(token="anon", endpoint_url="http://127.0.0.1:9")
    assert fs._location == "http://127.0.0.1:9"


@pytest.fixture(params=["gcp-storage-emulator", "fake-gcs-server"])
def any_gcs(request: pytest.FixtureRequest) -> StoreTarget:
    """A bucket on each GCS test server."""
    fixture = "gcs_bucket" if request.param == "gcp-storage-emulator" else "fake_gcs_bucket"
    return request.getfixturevalue(fixture)


def test_a_loads_range_is_written_into_its_sink_as_it_arrives(
    any_gcs: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's range is written into the reader's memory chunk by chunk as the answer
    arrives, across the sink's buffers, never first read whole by gcsfs's
    ``cat_file`` and copied in after (#47); a range the object ends inside counts
    what it had, one past the end none, a missing object is its error, and an answer
    longer than its sink is counted, not written past it."""
    store = open_store(Location.parse(any_gcs.url("into"), any_gcs.storage_options))
    data = os.urandom(3 * MiB + 3)
    try:
        store.put("r.bin", data)

        def whole(*args: object, **kwargs: object) -> bytes:
            raise AssertionError("a range was read whole through gcsfs's cat_file")

        monkeypatch.setattr(GCSFileSystem, "_cat_file", whole)
        first, second = bytearray(MiB + 1), bytearray(2 * MiB)
        past, gone = bytearray(8), bytearray(8)
        short, guard = bytearray(MiB), bytearray(8)
        got = store.read_ranges_into(
            ["r.bin", "r.bin", "missing.bin", "r.bin"],
            [2, len(data), 0, 2 * MiB],
            [len(data), len(data) + 8, 8, 4 * MiB],
            [
                SpanSink([memoryview(first), memoryview(second)]),
                SpanSink([memoryview(past)]),
                SpanSink([memoryview(gone)]),
                SpanSink([memoryview(short), memoryview(guard)]).window(0, MiB),
            ],
        )
    finally:
        store.close()
    assert got[:2] == [len(data) - 2, 0] and got[3] == MiB + 3, got
    assert isinstance(got[2], FileNotFoundError), got[2]
    assert bytes(first + second)[: len(data) - 2] == data[2:]
    assert not any(past) and not any(gone) and not any(guard)
    assert bytes(short) == data[2 * MiB : 3 * MiB]


@pytest.mark.parametrize("cut", ["truncate", "cut"], ids=["reset", "clean-close"])
def test_a_range_cut_short_is_asked_again_and_written_whole(
    fake_gcs_server: FakeGcsServer, fake_gcs_bucket: StoreTarget, cut: str
) -> None:
    """A body cut mid-range (a reset, or a clean close before its length) is one failed
    attempt of the request: it is sent again, and the sink written again from its
    start."""
    data = os.urandom(2 * MiB + 5)
    with FaultProxy(fake_gcs_server.endpoint_url) as proxy:
        options = {**fake_gcs_bucket.storage_options, "endpoint_url": proxy.endpoint_url}
        policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=10)
        store = open_store(Location.parse(fake_gcs_bucket.url("cut"), options, policy))
        try:
            store.put("c.bin", data)
            proxy.add(Rule("GetObject", key_contains="c.bin", nth=1, action=cut))
            into = bytearray(len(data) - 1)
            got = store.read_ranges_into(
                ["c.bin"], [1], [len(data)], [SpanSink([memoryview(into)])]
            )
        finally:
            store.close()
        assert proxy.count("GetObject", faulted=True) == 1
    assert got == [len(data) - 1] and bytes(into) == data[1:]


def test_open_fs_builds_the_subclass(gcs_bucket: StoreTarget) -> None:
    policy = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, timeout=5)
    fs = Location.parse(gcs_bucket.root, gcs_bucket.storage_options, policy).open_fs(fresh=True)
    assert isinstance(fs, RetryingGCSFileSystem) and fs.retry_policy == policy


@pytest.mark.parametrize("which", ["invalid", "read_only"])
def test_wrong_credentials_fail_at_the_first_answer(
    gcs_emulator: GcsEmulator, gcs_bucket: StoreTarget, which: str
) -> None:
    """A 401 (invalid token) or 403 (read-only principal) is not retried: one request,
    and the error well before gcsfs's own loop would have given up (6 tries, ~31 s
    of backoff for a 401 "Invalid Credentials")."""
    opts = (
        gcs_emulator.invalid_credentials_options()
        if which == "invalid"
        else gcs_emulator.read_only_options()
    )
    policy = RetryPolicy(attempts=6, base_delay=1.0, max_delay=10.0, timeout=30)
    fs = Location.parse(gcs_bucket.root, opts, policy).open_fs(fresh=True)
    path = gcs_bucket.root.removeprefix("gs://") + "/obj"
    started = time.monotonic()
    refused = "Invalid Credentials" if which == "invalid" else "read-only principal"
    with counting(RequestCounter()) as counter, pytest.raises(Exception, match=refused):
        fs.pipe_file(path, b"payload")
    stats = counter.snapshot()
    assert stats.retries == 0 and sum(stats.requests.values()) == 1, stats
    assert time.monotonic() - started < 5
