"""Run gcp-storage-emulator with ``ifGenerationMatch=0`` enforced.

The stock emulator ignores generation preconditions, so a create-only upload
silently overwrites. This entry point wraps the emulator's object-insert handler:
a request carrying ``ifGenerationMatch=0`` for an object that exists is answered
``412 Precondition Failed``, as the real service does, and the check and the
write happen under one lock so two racing creators cannot both succeed.

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
from gcp_storage_emulator.handlers import objects

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


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    for _, handlers in emulator.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is _original_insert:
                handlers[method] = _insert_with_preconditions
    objects.insert = _insert_with_preconditions  # the router's fallback path looks it up here
    logging.basicConfig(level=logging.WARNING)
    emulator.create_server(host, port, in_memory=True).run()


if __name__ == "__main__":
    main()
