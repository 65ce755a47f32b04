"""Which Azure Blob REST operation a path-style HTTP request is (Azurite's URLs).

:class:`~objckpt.testing.FaultProxy` in front of Azurite
(``FaultProxy(url, operation_of=azure_operation)``) names requests with this, so that
rules and counts speak Azure's operations (``PutBlob``, ``PutBlock``,
``PutBlockList``...) instead of S3's. Azurite and any IP endpoint put the account in
the path (``/devstoreaccount1/container/blob``); the operation follows from the
method, the ``comp`` and ``restype`` query parameters and a copy source header.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

__all__ = ["azure_operation"]

_BLOB_COMP = {
    ("PUT", "block"): "PutBlock",
    ("PUT", "blocklist"): "PutBlockList",
    ("PUT", "metadata"): "SetBlobMetadata",
    ("PUT", "properties"): "SetBlobProperties",
    ("PUT", "lease"): "LeaseBlob",
    ("PUT", "snapshot"): "SnapshotBlob",
    ("PUT", "tags"): "SetBlobTags",
    ("GET", "blocklist"): "GetBlockList",
    ("GET", "metadata"): "GetBlobMetadata",
    ("GET", "tags"): "GetBlobTags",
}
_BLOB_PLAIN = {
    "PUT": "PutBlob",
    "GET": "GetBlob",
    "HEAD": "GetBlobProperties",
    "DELETE": "DeleteBlob",
}
_CONTAINER = {
    ("PUT", None): "CreateContainer",
    ("DELETE", None): "DeleteContainer",
    ("GET", "list"): "ListBlobs",
    ("GET", None): "GetContainerProperties",
    ("HEAD", None): "GetContainerProperties",
}


def _first(query: Mapping[str, Any], name: str) -> str | None:
    value = query.get(name)
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return str(value) if value is not None else None


def azure_operation(
    method: str, path: str, query: Mapping[str, Any], headers: Mapping[str, str]
) -> str:
    """The Azure Blob operation of a path-style request (``PutBlob``, ``GetBlob``...)."""
    parts = urllib.parse.unquote(path).lstrip("/").split("/", 2)
    comp = _first(query, "comp")
    if len(parts) < 2 or not parts[1]:
        return "ListContainers" if comp == "list" else f"Account{method.title()}"
    if len(parts) == 2 or not parts[2]:
        return _CONTAINER.get((method, comp), f"Container{method.title()}")
    if comp is not None:
        return _BLOB_COMP.get((method, comp), f"Blob{method.title()}:{comp}")
    if method == "PUT" and any(k.lower() == "x-ms-copy-source" for k in headers):
        return "CopyBlob"
    return _BLOB_PLAIN.get(method, f"Blob{method.title()}")
