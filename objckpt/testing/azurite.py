"""Azurite, Microsoft's Azure Storage emulator, on loopback: the Azure Blob test server.

Why Azurite: it is Azure's own emulator (Node.js, from npm), implementing the Blob
REST API that adlfs and azure-storage-blob speak: conditional Put Blob
(``If-None-Match: *`` answered 409 ``BlobAlreadyExists``), staged blocks and block
lists, ranged GETs answered 416 past an object's end, SharedKey signatures. objckpt's
Azure store family runs its conformance suite and end-to-end saves against it.

What runs: ``azurite-blob`` (the blob service only) on a free loopback port,
in-memory (``--inMemoryPersistence``; a restart loses everything), with
``--skipApiVersionCheck`` (azure-storage-blob sends API versions newer than the
emulator knows, which it refuses otherwise) and ``--disableTelemetry``. It speaks
plain HTTP with the development account, whose name and key are public and
well known (``devstoreaccount1``); nothing here reaches Azure.

Where the server comes from (first found): the ``OBJCKPT_AZURITE`` environment
variable (the path of an ``azurite-blob`` executable), ``azurite-blob`` on
``PATH``, or npm's install under the running Python environment
(``npm install --prefix <venv>/azurite azurite``, what ``make azurite`` does).
Node.js must be on ``PATH``. When either is missing, :func:`start_azurite` raises
:class:`AzuriteUnavailable` saying what to install, and the fixtures skip with
that reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from typing import Any

from objckpt.testing.servers import _ServerProcess, _wait_http, free_port

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "AZURITE_VERSION",
    "Azurite",
    "AzuriteUnavailable",
    "azurite_binary",
    "start_azurite",
]

logger = logging.getLogger(__name__)

#: The Azurite release objckpt's suite runs (``make azurite`` installs it).
AZURITE_VERSION = "3.37.0"
#: The development storage account every Azurite accepts (public, documented by
#: Microsoft: "Use the Azurite emulator for local Azure Storage development").
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


class AzuriteUnavailable(RuntimeError):
    """Azurite or Node.js is not installed here; the message says what to install."""


def azurite_binary() -> str | None:
    """The ``azurite-blob`` executable to run, or None (see the module docstring)."""
    given = os.environ.get("OBJCKPT_AZURITE")
    if given:
        return given if os.access(given, os.X_OK) else None
    found = shutil.which("azurite-blob")
    if found:
        return found
    local = os.path.join(sys.prefix, "azurite", "node_modules", ".bin", "azurite-blob")
    return local if os.access(local, os.X_OK) else None


@dataclasses.dataclass
class Azurite(_ServerProcess):
    """An ``azurite-blob`` process (in-memory) and how to reach it.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>`` (the account is the path's first
            segment: ``<endpoint_url>/devstoreaccount1``).
        process: The server's process (kill it to simulate an outage).
        workspace: The directory it runs in (removed by :meth:`stop`).
    """

    workspace: str = ""

    def connection_string(self, endpoint_url: str | None = None) -> str:
        """The development account's connection string, for this server or another
        address in front of it (a :class:`~objckpt.testing.FaultProxy`)."""
        endpoint = (endpoint_url or self.endpoint_url).rstrip("/")
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
        )

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """adlfs options that reach this server (or ``endpoint_url`` in front of it)."""
        return {"connection_string": self.connection_string(endpoint_url)}

    def blob_service_client(self) -> Any:
        """A synchronous azure-storage-blob ``BlobServiceClient`` (test setup, inspection)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def create_container(self, name: str | None = None) -> str:
        """Create a container (a new name by default) and return its name."""
        name = name or f"objckpt-{uuid.uuid4().hex[:16]}"
        with self.blob_service_client() as client:
            client.create_container(name)
        return name

    def delete_container(self, name: str) -> None:
        """Delete a container and everything in it (absent is fine)."""
        from azure.core.exceptions import ResourceNotFoundError

        with self.blob_service_client() as client, contextlib.suppress(ResourceNotFoundError):
            client.delete_container(name)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.workspace, ignore_errors=True)


def start_azurite(host: str = "127.0.0.1", port: int | None = None, timeout: float = 60) -> Azurite:
    """Start ``azurite-blob`` in-memory on a free loopback port and wait until it answers.

    Raises:
        AzuriteUnavailable: Node.js or Azurite is not installed (the message says how
            to install them).
        RuntimeError, TimeoutError: It exited or did not answer in ``timeout`` seconds.
    """
    binary = azurite_binary()
    if binary is None:
        raise AzuriteUnavailable(
            f"Azurite is not installed: `make azurite`, or `npm install --prefix "
            f"{os.path.join(sys.prefix, 'azurite')} azurite@{AZURITE_VERSION}`, or set "
            "OBJCKPT_AZURITE to an azurite-blob executable"
        )
    if shutil.which("node") is None:
        raise AzuriteUnavailable(f"Node.js (`node`) is not on PATH; {binary} needs it")
    url = f"http://{host}:{port or free_port(host)}"
    workspace = tempfile.mkdtemp(prefix="objckpt-azurite-")
    argv = [binary, "--blobHost", host, "--blobPort", url.rsplit(":", 1)[1]]
    # In memory, so no --location (Azurite refuses both); it runs in ``workspace``.
    argv += ["--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=workspace,
        start_new_session=True,
    )
    try:
        # Any HTTP answer will do: an unsigned listing is refused with 403.
        _wait_http(f"{url}/{AZURITE_ACCOUNT}?comp=list", proc, timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        shutil.rmtree(workspace, ignore_errors=True)
        raise
    logger.info("azurite-blob listening at %s (pid %d)", url, proc.pid)
    return Azurite(endpoint_url=url, process=proc, workspace=workspace)
