"""The store layer: how bytes get onto and off each store family, behind one protocol.

``base`` is the protocol (:class:`ObjectStore`: writes, the commit, reads, ranged
reads, listings, HEADs, deletes, and capability flags); ``s3`` (its uploads in
``s3_upload``), ``azure`` (Azure Blob through adlfs), ``generic`` (GCS, memory, any
fsspec store; GCS's uploads in ``gcs_compose``) and ``local`` implement it.
``body`` holds a part's bytes as written and sends them without copying them whole
(S3, Azure and GCS), and ``reads`` is how every family's bytes are read back.
Beside them live what every store request needs: ``location`` (URL parsing and
filesystem clients), ``clients`` (one client per process and store settings),
``retry`` and ``throttle`` (retry policy, back-off per key directory), ``translate``
(backend errors to objckpt's) and ``checksum`` (CRC32C). Nothing here knows about DCP or manifests.

A family's module is imported when a location of its protocol is first opened: a
process that saves to S3 never imports the GCS or local families, and s3fs itself is
imported only when an ``s3://`` client is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable

from objckpt.options import UploadOptions
from objckpt.writers.base import ObjectHead, ObjectStore, ObjectUpload, OpenUpload
from objckpt.writers.clients import PROCESS_CLIENTS, ClientCache, OwnedClients
from objckpt.writers.location import Location

__all__ = ["ObjectHead", "ObjectStore", "ObjectUpload", "OpenUpload", "open_store"]

#: Store family by protocol: (module, class); any other protocol is generic fsspec.
_FAMILIES: dict[str, tuple[str, str]] = {
    "s3": ("objckpt.writers.s3", "S3Store"),
    "s3a": ("objckpt.writers.s3", "S3Store"),
    "gs": ("objckpt.writers.generic", "GcsStore"),
    "gcs": ("objckpt.writers.generic", "GcsStore"),
    "az": ("objckpt.writers.azure", "AzureStore"),
    "abfs": ("objckpt.writers.azure", "AzureStore"),
    "abfss": ("objckpt.writers.azure", "AzureStore"),
    "file": ("objckpt.writers.local", "LocalStore"),
    "local": ("objckpt.writers.local", "LocalStore"),
    "memory": ("objckpt.writers.generic", "MemoryStore"),
}
_GENERIC = ("objckpt.writers.generic", "GenericStore")


def store_family(protocol: str) -> type[ObjectStore]:
    """The :class:`ObjectStore` class for ``protocol`` (generic fsspec otherwise)."""
    module, name = _FAMILIES.get(protocol, _GENERIC)
    family: type[ObjectStore] = getattr(importlib.import_module(module), name)
    return family


def open_store(
    location: Location,
    options: UploadOptions | None = None,
    *,
    clients: ClientCache | OwnedClients | None = None,
    scope: Hashable = None,
) -> ObjectStore:
    """The store family for ``location``'s protocol (generic fsspec otherwise).

    Args:
        clients: Whose client for the location's settings to use (its connections);
            by default this process's shared one (:mod:`objckpt.writers.clients`).
        scope: What else that client is kept apart by (see
            :meth:`~objckpt.writers.clients.ClientCache.filesystem`).
    """
    family = store_family(location.protocol)
    fs = (clients if clients is not None else PROCESS_CLIENTS).filesystem(location, scope)
    return family(location, options or UploadOptions(), fs)
