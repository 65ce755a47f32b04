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

And it reads a ``multipart/related`` upload (gcsfs's one-request upload: the
object's JSON metadata, then its bytes) byte for byte, splitting it on the line
break the body itself uses before each boundary (gcsfs writes bare LFs). The stock
emulator hands the body to Python's ``email`` parser, which takes a trailing
carriage return of the content for part of a CRLF before the closing boundary and
drops it: one object in 256 of random bytes was stored a byte short (the
conformance suite's ``test_bytes_ending_in_a_line_break_round_trip``; it failed
``tests/store/test_gcs_composite.py`` now and then).

Usage: ``python -m objckpt.testing._gcs_emulator_main HOST PORT``
"""

from __future__ import annotations

import base64
import json
import logging
import re
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


_original_read_data = emulator._read_data
_BOUNDARY = re.compile(r';\s*boundary="?([^";\s]+)"?')


def _read_data_exactly(request_handler: Any, query: Any) -> Any:
    """The emulator's request body, with a ``multipart/related`` upload split on its
    boundary as bytes (see the module doc); anything else as the emulator reads it."""
    content_type = request_handler.headers.get("Content-Type") or ""
    found = _BOUNDARY.search(content_type)
    one_request = query.get("uploadType", [None])[0] == "multipart"
    if not (one_request and content_type.startswith("multipart/related") and found):
        return _original_read_data(request_handler, query)
    raw = emulator._decode_raw_data(emulator._read_raw_data(request_handler), request_handler)
    if not raw:
        return None
    delimiter = b"--" + found.group(1).encode()
    start = raw.find(delimiter)
    if start < 0:
        raise ValueError("a multipart upload without its boundary")
    rest = raw[start + len(delimiter) :]
    # The body's own line break (gcsfs writes bare LFs), which precedes each boundary.
    eol = b"\r\n" if rest.startswith(b"\r\n") else b"\n"
    parts = []
    for section in rest.split(eol + delimiter)[:2]:  # the metadata, then the content
        head, _, body = section.partition(eol + eol)
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (
                line.decode("latin-1").partition(":") for line in head.split(eol)[1:]
            )
        }
        if headers.get("content-transfer-encoding", "").lower() == "base64":
            body = base64.b64decode(body)
        parts.append((headers, body))
    if len(parts) != 2:
        raise ValueError(f"a multipart upload of {len(parts)} parts, not the metadata and content")
    (_, meta), (headers, content) = parts
    return {
        "meta": json.loads(meta),
        "content": content,
        "content-type": headers.get("content-type", "text/plain").split(";")[0].strip().lower(),
    }


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
    emulator._read_data = _read_data_exactly
    logging.basicConfig(level=logging.WARNING)
    emulator.create_server(host, port, in_memory=True).run()


if __name__ == "__main__":
    main()
