"""One client per process and store settings (:mod:`objckpt.writers.clients`).

A new botocore client costs its process the S3 model parsed again, a connection pool
and new connections; writers, readers and stores with the same settings now share
one. What must never happen: two settings sharing a client (another endpoint, other
credentials, another retry policy), a forked child using its parent's client, or one
save's requests counted in another's. Client creations are counted with a spy on
aiobotocore's ``AioSession._create_client`` that still builds the real client.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import uuid
from collections.abc import Iterator

import pytest
import torch
from aiobotocore.session import AioSession
from helpers import load, save

from objckpt import Location, RetryPolicy, UploadOptions
from objckpt.errors import AccessDeniedError, ConfigurationError
from objckpt.ops.maintain.verify import verify_checkpoint
from objckpt.testing import FaultProxy, MotoServer
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store
from objckpt.writers.clients import PROCESS_CLIENTS, ClientCache, OwnedClients, shared_filesystem

MiB = 1024 * 1024
READ_ONLY = ["s3:GetObject", "s3:ListBucket", "s3:HeadBucket"]


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """botocore clients built while the test runs, from an empty process cache."""
    PROCESS_CLIENTS.clear()
    made: list[int] = []
    real = AioSession._create_client

    def spy(self: AioSession, *args: object, **kwargs: object) -> object:
        made.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AioSession, "_create_client", spy)
    yield made
    PROCESS_CLIENTS.clear()


def _through(proxy: FaultProxy, s3_bucket: StoreTarget) -> StoreTarget:
    return StoreTarget(root=s3_bucket.root, storage_options=proxy.storage_options())


def test_writers_and_a_reader_with_the_same_settings_share_one_client(
    s3_bucket: StoreTarget, clients: list[int]
) -> None:
    state = {"w": torch.arange(64.0), "step": 3}
    first = save(state, s3_bucket.url("a"), s3_bucket)
    second = save(state, s3_bucket.url("b"), s3_bucket)
    got = {"w": torch.zeros(64), "step": 0}
    reader = load(got, s3_bucket.url("a"), s3_bucket)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    assert first.store._fs is second.store._fs is reader.store._fs
    assert len(clients) == 1  # before: one per writer and one per reader (3)


def test_another_endpoint_gets_its_own_client(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, clients: list[int]
) -> None:
    state = {"w": torch.arange(64.0)}
    save(state, s3_bucket.url("via-proxy"), _through(s3_proxy, s3_bucket))
    assert s3_proxy.count("PutObject") > 0
    s3_proxy.clear()
    save(state, s3_bucket.url("direct"), s3_bucket)
    assert s3_proxy.seen == []  # the direct save did not use the proxy's client
    assert len(clients) == 2


def test_other_credentials_get_their_own_client(
    moto_iam_server: MotoServer, clients: list[int]
) -> None:
    """A read-only user is refused between two admin preflights on the same endpoint:
    sharing the admin's client would let it through (or refuse the admin)."""
    bucket = f"clients-{uuid.uuid4().hex[:8]}"
    moto_iam_server.boto3_client().create_bucket(Bucket=bucket)
    admin = moto_iam_server.storage_options()
    reader = moto_iam_server.add_user(f"ro-{bucket}", READ_ONLY)
    url = f"s3://{bucket}/t/step"

    def preflight(options: dict[str, object]) -> None:
        open_store(Location.parse(url, options)).preflight(30)

    preflight(admin)
    with pytest.raises(AccessDeniedError, match=bucket):
        preflight(reader)
    preflight(admin)
    assert len(clients) == 2


def test_settings_that_differ_or_cannot_be_compared_never_share() -> None:
    cache = ClientCache()
    loc = Location.parse("memory://clients/a", {"x": 1})
    assert cache.filesystem(loc) is cache.filesystem(Location.parse("memory://clients/b", {"x": 1}))
    assert cache.built == 1
    others = [
        Location.parse("memory://clients/a", {"x": 2}),
        Location.parse("memory://clients/a", {"x": True}),  # == 1 in Python, not the same
        Location.parse("memory://clients/a", {"x": 1}, RetryPolicy(attempts=2)),
    ]
    fss = [cache.filesystem(o) for o in others]
    assert len({id(f) for f in [cache.filesystem(loc), *fss]}) == 4 and cache.built == 4
    unhashable = Location.parse("memory://clients/a", {"x": bytearray(b"1")})
    assert cache.filesystem(unhashable) is not cache.filesystem(unhashable)
    opted_out = Location.parse("memory://clients/a", {"skip_instance_cache": True})
    assert cache.filesystem(opted_out) is not cache.filesystem(opted_out)
    assert cache.built == 4


def test_store_environment_that_differs_gets_its_own_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDKs read ``AWS_*`` (and the like) when a client is built: another value
    there is another client; a variable no store reads changes nothing."""
    cache = ClientCache()
    loc = Location.parse("memory://clients/env", {"x": 1})
    monkeypatch.delenv("AWS_OBJCKPT_TEST_MARKER", raising=False)
    first = cache.filesystem(loc)
    monkeypatch.setenv("OBJCKPT_TEST_UNRELATED", "1")
    assert cache.filesystem(loc) is first and cache.built == 1
    monkeypatch.setenv("AWS_OBJCKPT_TEST_MARKER", "a")
    second = cache.filesystem(loc)
    assert second is not first and cache.built == 2
    monkeypatch.setenv("AWS_OBJCKPT_TEST_MARKER", "b")
    third = cache.filesystem(loc)
    assert third is not first and third is not second and cache.built == 3
    monkeypatch.setenv("AWS_OBJCKPT_TEST_MARKER", "a")
    assert cache.filesystem(loc) is second and cache.built == 3


def test_the_cache_keeps_only_the_newest_settings() -> None:
    cache = ClientCache(limit=2)
    a, b, c = (Location.parse("memory://clients/k", {"n": n}) for n in range(3))
    fs_a = cache.filesystem(a)
    cache.filesystem(b)
    assert cache.filesystem(a) is fs_a  # used again: b is now the oldest
    cache.filesystem(c)
    assert len(cache) == 2 and cache.filesystem(a) is fs_a and cache.built == 3
    assert "ClientCache(2 of 2 kept" in repr(cache)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_builds_its_own_client(s3_bucket: StoreTarget) -> None:
    """The parent's client is bound to an event loop thread the child does not have."""
    loc = Location.parse(s3_bucket.root, s3_bucket.storage_options)
    parent = shared_filesystem(loc)
    parent.ls(s3_bucket.bucket)  # the client exists and holds a connection
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into pytest
        code = 1
        try:
            fs = shared_filesystem(loc)
            if fs is parent:
                os.write(writable, b"shared the parent's client")
            else:
                fs.ls(s3_bucket.bucket)
                os.write(writable, b"own")
            code = 0
        except BaseException as exc:
            os.write(writable, repr(exc).encode()[:400])
        finally:
            os._exit(code)
    os.close(writable)
    try:
        ready, _, _ = select.select([readable], [], [], 120)
        answer = os.read(readable, 1000).decode() if ready else "no answer within 120 s"
    finally:
        os.close(readable)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert answer == "own"
    assert shared_filesystem(loc) is parent  # the parent's is untouched


def test_saves_on_one_client_count_their_own_requests(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, clients: list[int]
) -> None:
    """Two saves at once through one shared client: each manifest's request counts are
    its own save's, as the proxy saw them under its URL."""
    target = _through(s3_proxy, s3_bucket)
    parts = UploadOptions(part_size=5 * MiB, object_size=16 * MiB)
    states = {
        "one": {"big": torch.ones(4 * MiB), "small": torch.ones(7)},
        "two": {"big": torch.ones(4 * MiB), "a": torch.ones(3), "b": torch.ones(5)},
    }
    writers = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            writers[name] = save(states[name], target.url(name), target, upload=parts)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(writers) == 2
    assert writers["one"].store._fs is writers["two"].store._fs and len(clients) == 1
    for name, writer in writers.items():
        stats = writer.last_manifest.requests if writer.last_manifest else None
        assert stats is not None
        mine = f"/{s3_bucket.bucket}/t/{name}/"
        parts_seen = [p for p in s3_proxy.paths("UploadPart") if p.startswith(mine)]
        puts_seen = [p for p in s3_proxy.paths("PutObject") if p.startswith(mine)]
        assert stats.requests["UploadPart"] == len(parts_seen) > 0
        # The manifest's own PUT, and .metadata's, come after its counts were written.
        assert stats.requests.get("PUT", 0) + 2 == len(puts_seen)


def test_a_shared_client_reads_what_is_stored_now_not_what_it_listed(
    s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """A client lists a root (as retention and gc do), then an object there is stored
    again with another ETag (here: the same bytes as a one-part multipart upload). A
    later read through the same shared client must not ask for the listed ETag."""
    root = Location.parse(s3_bucket.url("run"), s3_bucket.storage_options)
    step = root.child("step-1")
    save({"w": torch.arange(32.0)}, step.url, s3_bucket)
    assert [o.key for o in open_store(root).inventory()]  # listed, by this client
    client = moto_server.boto3_client()
    key = f"{step.path.split('/', 1)[1]}/.metadata"
    body = client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read()
    upload = client.create_multipart_upload(Bucket=s3_bucket.bucket, Key=key)["UploadId"]
    part = client.upload_part(
        Bucket=s3_bucket.bucket, Key=key, UploadId=upload, PartNumber=1, Body=body
    )
    client.complete_multipart_upload(
        Bucket=s3_bucket.bucket,
        Key=key,
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )
    report = verify_checkpoint(step)
    assert report.ok, [(f.key, f.problem) for f in report.failures]


def test_owned_clients_run_on_their_own_loop_and_close_with_it(s3_bucket: StoreTarget) -> None:
    """An owner's clients send from its loop, not fsspec's process-wide one; close()
    ends that loop's thread and closes the loop, and a closed owner builds no more."""
    owned = OwnedClients("t-owned")
    loc = Location.parse(s3_bucket.url("owned"), s3_bucket.storage_options)
    fs = owned.filesystem(loc)
    fs.pipe_file(loc.key_path("x"), b"payload")
    assert fs.cat_file(loc.key_path("x")) == b"payload"
    assert fs.loop is not shared_filesystem(loc).loop
    assert [t.name for t in threading.enumerate()].count("t-owned-io") == 1
    owned.close()
    assert fs.loop.is_closed()
    assert "t-owned-io" not in [t.name for t in threading.enumerate()]
    with pytest.raises(ConfigurationError, match="closed"):
        owned.filesystem(loc)
