"""The gcsfs filesystem objckpt builds for ``gs://``: gcsfs with objckpt's retries.

Why: gcsfs retries every request itself (``retry_request``, 6 tries with its own
backoff, a 401 included), knows no save deadline and counts nothing, so GCS saves
had neither :class:`~objckpt.RetryPolicy` nor ``UploadOptions.deadline`` nor request
accounting. This subclass replaces gcsfs's ``_request`` (the coroutine every gcsfs
request goes through) by the same function without gcsfs's retry decorator
(``__wrapped__``), run under :func:`~objckpt.writers.retry.call_with_retries`: one
retry loop, transient errors only (5xx, 429, connection errors; a 401 or 403 fails at
once), bounded by the save's deadline. A load's ranges are GETs of their own
(:meth:`RetryingGCSFileSystem._cat_file_into`), sent as ``_request`` sends them, whose
bodies are written into the tensors as they arrive instead of read whole.
Uploads objckpt makes itself go up streamed (:meth:`RetryingGCSFileSystem._put_streamed`).
``_request`` and its ``__wrapped__``, what ``_cat_file_into`` sends with
(``_set_session``, ``session``, ``_get_headers``, ``_get_params``,
``requests_timeout``, ``url``, ``gcsfs.retry.validate_response``) and what
``_put_streamed`` sends with (``_call`` and its ``json_out``, ``_location``) are gcsfs
internals, pinned by ``tests/store/test_gcsclient.py`` for the supported range.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from gcsfs import GCSFileSystem
from gcsfs.retry import validate_response

from objckpt.writers.body import StreamedBody
from objckpt.writers.checksum import BytesLike
from objckpt.writers.reads import SpanSink, receive_into
from objckpt.writers.retry import RetryingFileSystem

__all__ = ["RetryingGCSFileSystem"]

#: gcsfs's simple upload: a multipart body whose first part is the object's JSON.
_SIMPLE_UPLOAD = b"--==0=="


def _object_name(url: str, kwargs: dict[str, Any]) -> str:
    """``bucket/object`` a gcsfs request is on (``bucket/prefix`` for a listing, the
    bucket where neither shows), for its :class:`~objckpt.writers.throttle.Backoff`
    directory. gcsfs puts the object in the path (``b/B/o/NAME``, quoted), in the
    query (a resumable upload's ``name``), in a listing's ``prefix``, or in the JSON
    head of a simple upload's body."""
    parts = urlsplit(url)
    segments = parts.path.split("/")
    if "b" not in segments:
        return ""
    at = segments.index("b")
    bucket = unquote(segments[at + 1]) if at + 1 < len(segments) else ""
    if at + 3 < len(segments) and segments[at + 2] == "o":
        return f"{bucket}/{unquote(segments[at + 3])}"
    named = kwargs.get("name") or parse_qs(parts.query).get("name")
    name = named[0] if isinstance(named, list) else named
    if name is None and isinstance(kwargs.get("prefix"), str):
        name = kwargs["prefix"]
    data = kwargs.get("data")
    if name is None and isinstance(data, bytes) and data.startswith(_SIMPLE_UPLOAD):
        end = data.find(b"\n" + _SIMPLE_UPLOAD, 1, 65536)
        if end > 0:
            name = json.loads(data[:end].split(b"\n\n", 1)[-1]).get("name")
    return f"{bucket}/{name}" if isinstance(name, str) else bucket


#: gcsfs's request coroutine without its own retry loop.
_SINGLE_REQUEST = GCSFileSystem._request.__wrapped__


class RetryingGCSFileSystem(RetryingFileSystem, GCSFileSystem):
    """``GCSFileSystem`` whose requests follow a :class:`~objckpt.RetryPolicy` and the
    save's deadline (``retry_policy=`` besides gcsfs's own options)."""

    async def _request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        def what() -> str:
            try:
                target = self._format_path(path, args)
            except Exception:  # a message must not fail the request
                target = path
            return f"GCS {method} of {target}"

        async def once(m: str, p: str, *a: Any, **kw: Any) -> Any:
            return await _SINGLE_REQUEST(self, m, p, *a, **kw)

        try:
            name = _object_name(self._format_path(path, args), kwargs)
        except Exception:  # a slot's directory must not fail the request
            name = ""
        return await self._retried(once, what, name, method, path, *args, **kwargs)

    async def _put_streamed(self, path: str, pieces: list[BytesLike], size: int) -> dict[str, Any]:
        """One object of ``size`` bytes, ``pieces`` back to back, sent where they lie
        (a payload object, or a composite upload's piece): a media upload, whose body
        is the bytes alone, streamed (:class:`~objckpt.writers.body.StreamedBody`;
        each retry sends it from its start); the object's resource as GCS answers it
        (its ``size`` and ``crc32c``). gcsfs's ``pipe_file`` sends a multipart body
        it builds by concatenation, a copy of every byte, which the event loop's
        transport then copies again where the socket does not take it at once; an
        object objckpt writes needs none of what the multipart form adds (its own
        metadata)."""
        if not size:  # gcp-storage-emulator drops an empty media upload's connection
            await self._pipe_file(path, b"")
            return {}
        bucket, name, _ = self.split_path(path)
        answer = await self._call(
            "POST",
            f"{self._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
            f"?uploadType=media&name={quote(name, safe='')}",
            data=StreamedBody(pieces),
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            json_out=True,
        )
        return answer if isinstance(answer, dict) else {}

    async def _cat_file_into(self, path: str, start: int, end: int, sink: SpanSink) -> int:
        """Bytes ``[start, end)`` of the object at ``path`` written into ``sink`` as
        they arrive (:func:`~objckpt.writers.reads.receive_into`, where gcsfs's
        ``cat_file`` reads an answer whole, which was then copied in); how many bytes
        the answer had. One ranged GET sent as gcsfs's ``_request`` sends it (its
        session, headers with the credentials, parameters such as ``userProject``,
        and timeout), run whole under the retry loop: a body cut short is one failed
        attempt, and the next writes the sink again from its start."""
        if end <= start:
            return 0
        url = self.url(path)
        name = "/".join(self.split_path(path)[:2])

        async def once(method: str, target: str) -> int:
            await self._set_session()
            async with self.session.request(
                method=method,
                url=target,
                params=self._get_params({}),
                headers=self._get_headers({"Range": f"bytes={start}-{end - 1}"}),
                timeout=self.requests_timeout,
            ) as answer:
                if answer.status >= 300:
                    validate_response(answer.status, await answer.read(), target)  # raises
                    raise OSError(f"GCS answered {answer.status} to a ranged GET of {target}")
                return await receive_into(answer.content, sink, answer.content_length)

        return int(await self._retried(once, lambda: f"GCS GET of {url}", name, "GET", url))

    async def close_connections(self) -> None:
        """Close this filesystem's HTTP session now, on its loop (gcsfs closes it only
        when the filesystem is garbage collected); a later request opens a new one."""
        this: Any = self  # gcsfs leaves ``_session``'s type to inference mypy cannot do
        session, this._session = this._session, None
        if session is not None and not session.closed:
            await session.close()

    def endpoint(self) -> str | None:
        """The GCS endpoint requests go to (an emulator's, or Google's)."""
        try:
            url = self._location
        except Exception:  # a message must not fail the request
            return None
        return url.split("?")[0] if isinstance(url, str) and url else None
