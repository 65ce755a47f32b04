"""The s3fs filesystem objckpt builds for ``s3://``: s3fs with objckpt's retries.

Why a subclass and not s3fs as is: s3fs retries each request itself (its class
attribute ``retries``, 5 tries) on top of botocore's retries, does not know a
save's deadline, and tells nobody about throttling. This subclass sets s3fs's loop
to one try and overrides ``_call_s3``, the one coroutine every s3fs request goes
through, to run it under :func:`~objckpt.writers.retry.call_with_retries`.
``_call_s3`` and ``retries`` are s3fs internals: ``tests/test_s3client.py`` pins
them for the s3fs range objckpt supports (``s3fs>=2024.6``), so a release that
changes them fails there, not in a user's save.
"""

from __future__ import annotations

from typing import Any

from s3fs import S3FileSystem

from objckpt.writers.retry import RetryingFileSystem

__all__ = ["RetryingS3FileSystem"]


class RetryingS3FileSystem(RetryingFileSystem, S3FileSystem):
    """``S3FileSystem`` whose requests follow a :class:`~objckpt.RetryPolicy` and the
    save's deadline (``retry_policy=`` besides s3fs's own options)."""

    retries = 1  # s3fs's own retry loop: one try; call_with_retries retries instead

    async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
        # Only the names, not ``kwargs``: tenacity's retry state forms reference cycles
        # that live until a garbage collection, and a closure over ``kwargs`` would keep
        # each request's Body (a 16 MiB part) alive with them (measured: ~10 parts per
        # upload worker after a save).
        bucket, key = kwargs.get("Bucket"), kwargs.get("Key")

        def what() -> str:
            target = f"s3://{bucket}/{key}" if key else f"s3://{bucket}" if bucket else "S3"
            return f"S3 {method} of {target}"

        return await self._retried(super()._call_s3, what, method, *akwarglist, **kwargs)
