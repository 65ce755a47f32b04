"""Settling multipart requests whose answer was lost: read back, never guess.

Why a module of its own: :class:`~objckpt.writers.s3_upload.S3Upload` sends, and
this module answers the questions a lost answer leaves. The retry layer
(:mod:`objckpt.writers.retry`) resends a request after a connection reset or a
timeout, and by then the store may have applied the first try:

* a retried ``CompleteMultipartUpload`` meets ``NoSuchUpload`` (the upload became
  the object); :func:`landed` reads the object back to tell that from an upload
  that is really gone;
* a retried ``CreateMultipartUpload`` began a second upload; :func:`abort_orphans`
  aborts the one whose id never arrived.

Also here: which refusals mean "this store does not take these parameters"
(:func:`refuses_parameters`), for the full-object CRC32C fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from objckpt.writers.checksum import to_base64
from objckpt.writers.translate import causes, service_error

if TYPE_CHECKING:
    from objckpt.writers.s3 import S3Store

__all__ = ["abort_orphans", "landed", "multipart_etag", "no_such_upload", "refuses_parameters"]

logger = logging.getLogger(__name__)

#: Answers of a store that does not implement a request's parameters.
_REFUSALS = frozenset({"InvalidArgument", "InvalidRequest", "NotImplemented"})


def _answer(exc: BaseException) -> tuple[str | None, int | None]:
    for seen in causes(exc):
        code, status = service_error(seen)
        if code is not None or status is not None:
            return code, status
    return None, None


def no_such_upload(exc: BaseException) -> bool:
    """Whether the store answered ``NoSuchUpload`` (completed, aborted or unknown)."""
    return _answer(exc)[0] == "NoSuchUpload"


def refuses_parameters(exc: BaseException) -> bool:
    """Whether the store refused a request as malformed or unimplemented (400, 501):
    what an S3-compatible store answers to parameters it does not know. A refusal
    for another reason recurs on the request without them and is raised then."""
    code, status = _answer(exc)
    return code in _REFUSALS or status in (400, 501)


def multipart_etag(parts: Iterable[Mapping[str, Any]]) -> str | None:
    """The ETag S3 gives the object completed from ``parts`` (the MD5 of their MD5s,
    then ``-<count>``); None when a part's ETag is no MD5 (SSE-KMS, SSE-C)."""
    digests = []
    for part in parts:
        tag = str(part.get("ETag", "")).strip('"')
        try:
            raw = bytes.fromhex(tag)
        except ValueError:
            return None
        if len(raw) != 16:
            return None
        digests.append(raw)
    if not digests:
        return None
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


async def landed(
    store: S3Store, key: str, size: int, crc: int, parts: Iterable[Mapping[str, Any]]
) -> bool:
    """Whether the object ``key`` is the one an upload completes: ``size`` bytes,
    and the upload's full-object CRC32C where the store keeps one, else the ETag its
    ``parts`` make. One HEAD.

    Raises:
        Exception: The HEAD failed other than with "not found".
    """
    bucket, obj = store.bucket_key(key)
    try:
        head = await store.call("head_object", Bucket=bucket, Key=obj, ChecksumMode="ENABLED")
    except FileNotFoundError:
        return False
    if int(head.get("ContentLength", -1)) != size:
        return False
    if head.get("ChecksumType") == "FULL_OBJECT" and head.get("ChecksumCRC32C"):
        return bool(head["ChecksumCRC32C"] == to_base64(crc))
    expected = multipart_etag(parts)
    return expected is not None and str(head.get("ETag", "")).strip('"') == expected


async def abort_orphans(store: S3Store, key: str, ours: str | None) -> None:
    """Abort the open uploads of ``key`` other than ``ours``: begun by a Create whose
    answer was lost (None: every one). One listing; best effort (``objckpt gc``
    aborts what is left), so a failure is logged, never raised."""
    bucket, obj = store.bucket_key(key)
    url = store.location.url_of(key)
    try:
        page = await store.call("list_multipart_uploads", Bucket=bucket, Prefix=obj)
        for upload in page.get("Uploads", []):
            if upload.get("Key") != obj or upload.get("UploadId") == ours:
                continue
            with contextlib.suppress(FileNotFoundError):  # gone already
                await store.call(
                    "abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload["UploadId"]
                )
            logger.info(
                "aborted upload %s of %s: begun by a CreateMultipartUpload whose answer was lost",
                upload["UploadId"],
                url,
            )
    except Exception:
        logger.warning(
            "could not abort the uploads of %s begun by a retried CreateMultipartUpload; "
            "`objckpt gc` will",
            url,
            exc_info=True,
        )
