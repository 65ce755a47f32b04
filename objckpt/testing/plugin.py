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
    azurite: the session's :class:`~objckpt.testing.Azurite` (Azure Blob; skipped,
        saying why, where Node.js or Azurite is not installed).
    az_container: a fresh container on it (a new name per test, deleted after it),
        as a :class:`StoreTarget` with an ``az://`` root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from objckpt.testing.azurite import Azurite, AzuriteUnavailable, start_azurite
from objckpt.testing.proxy import FaultProxy
from objckpt.testing.rgw import RgwServer, missing_binaries, server_from_env, start_rgw
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


def _azurite_required() -> bool:
    """Whether a missing Azurite fails the run instead of skipping: in CI (``CI`` set)
    or where ``OBJCKPT_REQUIRE_AZURITE=1`` (the Makefile's test target)."""
    flags = (os.environ.get("CI", ""), os.environ.get("OBJCKPT_REQUIRE_AZURITE", ""))
    return any(f.strip().lower() not in ("", "0", "false", "no") for f in flags)


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    try:
        server = start_azurite()
    except AzuriteUnavailable as exc:
        if _azurite_required():
            pytest.fail(
                f"Azure Blob tests need Azurite: {exc} (required here: CI or "
                "OBJCKPT_REQUIRE_AZURITE is set)"
            )
        pytest.skip(f"Azure Blob tests need Azurite: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def az_container(azurite: Azurite) -> Iterator[StoreTarget]:
    name = azurite.create_container()  # Azurite has no reset: a container per test
    try:
        yield StoreTarget(
            root=f"az://{name}/t", storage_options=azurite.storage_options(), bucket=name
        )
    finally:
        azurite.delete_container(name)


def _rgw_required() -> bool:
    """Whether a missing RGW fails the run instead of skipping: in CI (``CI`` set, as
    CI services do) or where ``OBJCKPT_REQUIRE_RGW=1`` (the Makefile's test target)."""
    flags = (os.environ.get("CI", ""), os.environ.get("OBJCKPT_REQUIRE_RGW", ""))
    return any(f.strip().lower() not in ("", "0", "false", "no") for f in flags)


@pytest.fixture(scope="session")
def rgw_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RgwServer]:
    given = server_from_env()
    if given is not None:
        yield given  # someone else's server: nothing to start or stop
        return
    missing = missing_binaries()
    if missing:
        reason = (
            f"Ceph RGW is not installed (missing {', '.join(missing)}): run "
            "`python -m objckpt.testing.rgw install` as root, or set OBJCKPT_RGW_ENDPOINT"
        )
        if _rgw_required():
            pytest.fail(f"{reason} (required here: CI or OBJCKPT_REQUIRE_RGW is set)")
        pytest.skip(reason)
    directory = os.environ.get("OBJCKPT_RGW_DIR") or tmp_path_factory.mktemp("rgw")
    with _environment(AWS_EC2_METADATA_DISABLED="true"):
        server = start_rgw(directory)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def rgw_bucket(rgw_server: RgwServer) -> StoreTarget:
    # A bucket per test, left behind for inspection: the session's cluster goes with
    # its temporary directory.
    name = f"objckpt-test-{uuid.uuid4().hex[:12]}"
    rgw_server.create_bucket(name)
    return StoreTarget(
        root=f"s3://{name}/t", storage_options=rgw_server.storage_options(), bucket=name
    )
