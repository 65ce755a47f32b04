"""Real store servers for tests: moto's S3 server and gcp-storage-emulator.

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
    "GcsEmulator",
    "MotoServer",
    "free_port",
    "offline_env",
    "start_gcs_emulator",
    "start_moto_server",
]

logger = logging.getLogger(__name__)

#: Fake credentials the servers accept; real ones must never be needed by tests.
TEST_KEY = "objckpt-test-key"
TEST_SECRET = "objckpt-test-secret"


def s3_test_options(endpoint_url: str) -> dict[str, Any]:
    """s3fs options for an S3 endpoint that accepts the test credentials."""
    return {
        "endpoint_url": endpoint_url,
        "key": TEST_KEY,
        "secret": TEST_SECRET,
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


def _spawn(argv: list[str], url: str, probe: str, timeout: float) -> subprocess.Popen[bytes]:
    """Start ``python -m <argv>`` and wait until ``url + probe`` answers over HTTP."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **offline_env()},
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
    """

    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach this server with the test credentials."""
        return s3_test_options(self.endpoint_url)

    def reset(self) -> None:
        """Drop every bucket and object (moto's ``/moto-api/reset``)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def boto3_client(self) -> Any:
        """A boto3 S3 client for this server (for test setup and inspection)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=TEST_KEY,
            aws_secret_access_key=TEST_SECRET,
            region_name="us-east-1",
        )


def start_moto_server(
    host: str = "127.0.0.1", port: int | None = None, timeout: float = 60
) -> MotoServer:
    """Start ``moto.server`` in a subprocess and wait until it answers."""
    url = f"http://{host}:{port or free_port(host)}"
    port_s = url.rsplit(":", 1)[1]
    proc = _spawn(["moto.server", "-H", host, "-p", port_s], url, "/moto-api/", timeout)
    return MotoServer(endpoint_url=url, process=proc)


@dataclasses.dataclass
class GcsEmulator(_ServerProcess):
    """A gcp-storage-emulator process that enforces ``ifGenerationMatch=0``.

    The stock emulator ignores generation preconditions, which would make the
    create-only commit untestable; :mod:`objckpt.testing._gcs_emulator_main`
    runs it with that precondition enforced.
    """

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "objckpt-test"}

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint_url}/wipe", method="GET")
        with urllib.request.urlopen(req, timeout=10):
            pass

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
