"""pytest fixtures for checkpoint tests against real store servers.

One server process per test session, reset before each test that asks for a
bucket, so tests are isolated without paying a process start each time.

Fixtures:
    moto_server: the session's :class:`~objckpt.testing.MotoServer`.
    s3_bucket: a fresh, empty bucket on it, as a :class:`StoreTarget`.
    moto_iam_server: a second moto server that enforces signatures and IAM
        policies (``start_moto_server(iam=True)``); make restricted users with
        :meth:`~objckpt.testing.MotoServer.add_user`. Started only when asked for.
    gcs_emulator: the session's :class:`~objckpt.testing.GcsEmulator`.
    gcs_bucket: a fresh, empty bucket on it, as a :class:`StoreTarget`.
    fake_gcs_server: the session's :class:`~objckpt.testing.FakeGcsServer` (a
        second, independent GCS implementation that enforces preconditions itself).
    fake_gcs_bucket: a fresh bucket on it (a new name per test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from objckpt.testing.proxy import FaultProxy
from objckpt.testing.servers import (
    FakeGcsServer,
    GcsEmulator,
    MotoServer,
    start_fake_gcs_server,
    start_gcs_emulator,
    start_moto_server,
)

__all__ = ["StoreTarget"]

BUCKET = "objckpt-test"


@dataclasses.dataclass(frozen=True)
class StoreTarget:
    """A bucket ready for a test: where to write, and how to reach it.

    Attributes:
        root: URL of an empty prefix in the bucket (``s3://objckpt-test/t``).
        storage_options: fsspec options that reach the server.
        bucket: The bucket name.
    """

    root: str
    storage_options: dict[str, Any]
    bucket: str = BUCKET

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for a fixture's lifetime only (unless already set),
    so a project that merely installs objckpt keeps its environment as it was."""
    added = [k for k in values if k not in os.environ]
    for k in added:
        os.environ[k] = values[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    # No EC2 metadata probe while objckpt's S3 fixtures are in use.
    with _environment(AWS_EC2_METADATA_DISABLED="true"):
        server = start_moto_server()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def moto_iam_server() -> Iterator[MotoServer]:
    with _environment(AWS_EC2_METADATA_DISABLED="true"):
        server = start_moto_server(iam=True)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> StoreTarget:
    moto_server.reset()
    moto_server.boto3_client().create_bucket(Bucket=BUCKET)
    return StoreTarget(root=f"s3://{BUCKET}/t", storage_options=moto_server.storage_options())


@pytest.fixture
def s3_proxy(moto_server: MotoServer, s3_bucket: StoreTarget) -> Iterator[FaultProxy]:
    """A recording, fault-injecting :class:`~objckpt.testing.FaultProxy` in front of
    the moto server (reach ``s3_bucket`` through it with ``s3_proxy.storage_options()``)."""
    with FaultProxy(moto_server.endpoint_url, seed=7) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    # gcsfs reads this when it is first imported: a suite that imports gcsfs before
    # this fixture runs should set it itself (objckpt's own tests/conftest.py does).
    with _environment(GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"):
        server = start_gcs_emulator()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator: GcsEmulator) -> StoreTarget:
    gcs_emulator.reset()
    gcs_emulator.create_bucket(BUCKET)
    return StoreTarget(root=f"gs://{BUCKET}/t", storage_options=gcs_emulator.storage_options())


@pytest.fixture(scope="session")
def fake_gcs_server() -> Iterator[FakeGcsServer]:
    with _environment(GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"):
        server = start_fake_gcs_server()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def fake_gcs_bucket(fake_gcs_server: FakeGcsServer) -> StoreTarget:
    name = f"objckpt-test-{uuid.uuid4().hex[:12]}"  # no wipe endpoint: a bucket per test
    fake_gcs_server.create_bucket(name)
    return StoreTarget(
        root=f"gs://{name}/t", storage_options=fake_gcs_server.storage_options(), bucket=name
    )
