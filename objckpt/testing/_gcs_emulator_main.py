"""Run gcp-storage-emulator with ``ifGenerationMatch=0`` enforced.

The stock emulator ignores generation preconditions, so a create-only upload
silently overwrites. This entry point wraps the emulator's object-insert handler:
a request carrying ``ifGenerationMatch=0`` for an object that exists is answered
``412 Precondition Failed``, as the real service does, and the check and the
write happen under one lock so two racing creators cannot both succeed.

It also knows one read-only principal, which the stock emulator (no auth at all)
cannot express: requests bearing the token :data:`READ_ONLY_TOKEN` may read, but
every write is answered ``403``, and ``testIamPermissions`` grants them only the
read permissions, as GCS does for a ``roles/storage.objectViewer`` holder. Requests
bearing :data:`INVALID_TOKEN` are all answered ``401 Invalid Credentials``, as GCS
answers an expired or revoked token.

Usage: ``python -m objckpt.testing._gcs_emulator_main HOST PORT``
"""

from __future__ import annotations

import logging
import sys
import threading
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import buckets, objects

from objckpt.testing.servers import GCS_INVALID_TOKEN as INVALID_TOKEN
from objckpt.testing.servers import GCS_READ_ONLY_TOKEN as READ_ONLY_TOKEN

_READ_PERMISSIONS = frozenset(
    {"storage.buckets.get", "storage.objects.get", "storage.objects.list"}
)
_READS = frozenset({"GET", "HEAD"})

_lock = threading.Lock()
_original_insert = objects.insert


def _object_name(request: Any) -> str | None:
    if "name" in request.query:
        return str(request.query["name"][0])
    data = request.data
    if isinstance(data, dict):
        meta = data.get("meta") if "meta" in data else data
        if isinstance(meta, dict) and meta.get("name"):
            return str(meta["name"])
    return None


def _insert_with_preconditions(
    request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any
) -> Any:
    if request.query.get("ifGenerationMatch", [None])[0] != "0":
        return _original_insert(request, response, storage, *args, **kwargs)
    name = _object_name(request)
    with _lock:
        try:
            storage.get_file_obj(request.params["bucket_name"], name)
            exists = True
        except NotFound:
            exists = False
        if exists:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "conditionNotMet", "errors": []}})
            return None
        return _original_insert(request, response, storage, *args, **kwargs)


def _is_read_only(request: Any) -> bool:
    return bool(request.get_header("Authorization", "") == f"Bearer {READ_ONLY_TOKEN}")


def _test_permissions(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
    if request.params.get("bucket_name") not in storage.buckets:
        response.status = HTTPStatus.NOT_FOUND
        return None
    asked = request.query.get("permissions") or []
    held = [p for p in asked if p in _READ_PERMISSIONS] if _is_read_only(request) else asked
    response.json({"kind": "storage#testIamPermissionsResponse", "permissions": held})
    return None


def _writes_refused_for_read_only(handler: Any) -> Any:
    def guarded(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_read_only(request):
            response.status = HTTPStatus.FORBIDDEN
            response.json(
                {
                    "error": {
                        "code": 403,
                        "message": f"{READ_ONLY_TOKEN} does not have storage.objects.create "
                        "access (read-only principal)",
                        "errors": [],
                    }
                }
            )
            return None
        return handler(request, response, storage, *args, **kwargs)

    return guarded


def _refused_for_invalid_token(handler: Any) -> Any:
    def guarded(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if request.get_header("Authorization", "") == f"Bearer {INVALID_TOKEN}":
            response.status = HTTPStatus.UNAUTHORIZED
            response.json({"error": {"code": 401, "message": "Invalid Credentials", "errors": []}})
            return None
        return handler(request, response, storage, *args, **kwargs)

    return guarded


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    for _, handlers in emulator.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is _original_insert:
                handler = _insert_with_preconditions
            elif handler is buckets.test_iam_permissions:
                handler = _test_permissions
            if method not in _READS:
                handler = _writes_refused_for_read_only(handler)
            handlers[method] = _refused_for_invalid_token(handler)
    # the router's fallback path for uploads looks the insert handler up here
    objects.insert = _refused_for_invalid_token(
        _writes_refused_for_read_only(_insert_with_preconditions)
    )
    logging.basicConfig(level=logging.WARNING)
    emulator.create_server(host, port, in_memory=True).run()


if __name__ == "__main__":
    main()
