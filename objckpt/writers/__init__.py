"""The store layer: how bytes get onto each store family, behind one protocol.

``base`` is the protocol (:class:`ObjectStore`); ``s3`` (its uploads in ``s3_upload``
and ``s3_body``), ``generic`` (GCS, memory, any fsspec store; GCS composite uploads
in ``gcs_compose``) and ``local`` implement it. Beside them live what every store
request needs: ``location`` (URL parsing and filesystem clients), ``retry`` and
``throttle`` (retry policy, AIMD concurrency), ``translate`` (backend errors to
objckpt's) and ``checksum`` (CRC32C). Nothing here knows about DCP or manifests.
"""

from __future__ import annotations

from fsspec import AbstractFileSystem

from objckpt.options import UploadOptions
from objckpt.writers.base import ObjectStore, ObjectUpload, OpenUpload
from objckpt.writers.generic import GcsStore, GenericStore, MemoryStore
from objckpt.writers.local import LocalStore
from objckpt.writers.location import Location
from objckpt.writers.s3 import S3Store

__all__ = ["ObjectStore", "ObjectUpload", "OpenUpload", "open_store"]

_FAMILIES: dict[str, type[ObjectStore]] = {
    "s3": S3Store,
    "s3a": S3Store,
    "gs": GcsStore,
    "gcs": GcsStore,
    "file": LocalStore,
    "local": LocalStore,
    "memory": MemoryStore,
}


def open_store(
    location: Location, options: UploadOptions | None = None, fs: AbstractFileSystem | None = None
) -> ObjectStore:
    """The store family for ``location``'s protocol (generic fsspec otherwise).

    Args:
        fs: An existing filesystem for the same protocol and options to reuse
            (its clients and connections); a fresh one is opened when None.
    """
    family = _FAMILIES.get(location.protocol, GenericStore)
    return family(location, options or UploadOptions(), fs)
