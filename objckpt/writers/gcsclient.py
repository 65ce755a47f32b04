"""The gcsfs filesystem objckpt builds for ``gs://``: gcsfs with objckpt's retries.

Why: gcsfs retries every request itself (``retry_request``, 6 tries with its own
backoff, a 401 included), knows no save deadline and counts nothing, so GCS saves
had neither :class:`~objckpt.RetryPolicy` nor ``UploadOptions.deadline`` nor request
accounting. This subclass replaces gcsfs's ``_request`` (the coroutine every gcsfs
request goes through) by the same function without gcsfs's retry decorator
(``__wrapped__``), run under :func:`~objckpt.writers.retry.call_with_retries`: one
retry loop, transient errors only (5xx, 429, connection errors; a 401 or 403 fails at
once), bounded by the save's deadline. ``_request`` and its ``__wrapped__`` are gcsfs
internals, pinned by ``tests/store/test_gcsclient.py`` for the supported range.
"""

from __future__ import annotations

from typing import Any

from gcsfs import GCSFileSystem

from objckpt.writers.retry import RetryingFileSystem

__all__ = ["RetryingGCSFileSystem"]

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

        return await self._retried(once, what, method, path, *args, **kwargs)

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
