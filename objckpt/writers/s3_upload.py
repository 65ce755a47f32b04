"""S3 uploads of one object: a single PUT, or parallel multipart with abort on failure.

Requests go through s3fs's own client on s3fs's event loop (see
:class:`~objckpt.writers.s3.S3Store`), so many parts are in flight without a
thread per part.

Why not s3fs's ``open("wb")``: it uploads one part at a time and does not abort
the multipart upload when a part fails, leaving billed, invisible garbage. Here
parts are submitted as soon as they fill (bounded by ``max_parts_in_flight``), and any
failure aborts the upload before the error is raised.

A request whose answer was lost may still have been applied, and the retry layer
sends it again. Two multipart requests are not idempotent, and both are settled
here (:mod:`objckpt.writers.s3_settle`) rather than guessed:

* ``CompleteMultipartUpload``: the retry meets ``NoSuchUpload`` because the first
  try already made the object. The object is read back (HEAD): there with the
  upload's size and CRC32C (or the ETag its parts make) means done.
* ``CreateMultipartUpload``: the first try began an upload whose id never arrived.
  No request can make a Create idempotent (S3 takes no client token), so when a
  Create was retried after a failure that was not a throttle, one listing of the
  key's open uploads after the object is finished finds it and aborts it: one LIST
  per such object, none otherwise. The key carries the save's attempt id, so no
  other writer has an upload open there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

from objckpt.errors import UploadError
from objckpt.options import MAX_PARTS, S3_MAX_PUT
from objckpt.writers.accounting import RequestCounter, counting, current_counter
from objckpt.writers.base import PartedUpload, translated_future
from objckpt.writers.body import Part, StreamedBody
from objckpt.writers.checksum import BytesLike, crc32c_combine, format_crc, to_base64
from objckpt.writers.s3_settle import abort_orphans, landed, no_such_upload, refuses_parameters
from objckpt.writers.translate import describe, translate

if TYPE_CHECKING:
    from objckpt.writers.s3 import S3Store

__all__ = ["S3Upload"]

logger = logging.getLogger(__name__)


class S3Upload(PartedUpload):
    """One object: a single PUT when it fits in two parts (and in S3's 5 GiB limit of
    one PUT), else a multipart upload.

    Every request carries the CRC32C of its body (``x-amz-checksum-crc32c``), so S3
    verifies each part in transit; the object's CRC32C is combined from the parts'
    (no second pass), and botocore's own checksum and payload hash are turned off
    (:func:`objckpt.writers.retry.s3_options`): each byte is hashed once, not three times.

    A multipart upload asks for a full-object CRC32C (``ChecksumType=FULL_OBJECT``)
    and completes with the combined value, which S3 checks against the bytes and keeps:
    :meth:`~objckpt.writers.s3.S3Store.digest` then answers from a HEAD, so copies and
    backup polls need not read the object back. A store that refuses the parameters
    (or ignores them) gets today's per-part checksums; the store remembers it.
    """

    def __init__(self, store: S3Store, key: str, part_size: int) -> None:
        super().__init__(key, part_size)
        self._store = store
        self._bucket, self._obj = store.bucket_key(key)
        # The first full part waits here until a second one shows the object needs
        # multipart; objects up to two parts go up in a single request.
        self._held: Part | None = None
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._crc = 0  # of the parts sent so far, combined
        self._size = 0  # of the parts sent so far
        self._full_object = False  # the store keeps the object's CRC32C
        self._lost_create = False  # a Create may have begun an upload we never heard of
        self._done = False

    def _part_full(self, full: Part) -> None:
        if self._upload_id is None and self._held is None:
            self._held = full
            return
        if self._upload_id is None:
            assert self._held is not None
            self._start_multipart()
            held, self._held = self._held, None
            self._send(held)
        self._send(full)

    def _start_multipart(self) -> None:
        # Its own tally (still counted into the save's) says whether a try failed.
        tally = RequestCounter(parent=current_counter())
        try:
            with counting(tally):
                out = self._store.run_coro(self._create())
        except Exception as exc:
            self._lost_create = self._create_was_retried(tally)
            if self._lost_create:
                self._store.run_coro(self._abort_orphans())
            raise translate(
                exc, url=self._store.location.url_of(self.key), action="uploading"
            ) from exc
        self._upload_id = out["UploadId"]
        self._full_object = out.get("ChecksumType") == "FULL_OBJECT"
        self._lost_create = self._create_was_retried(tally)

    @staticmethod
    def _create_was_retried(tally: RequestCounter) -> bool:
        # A 503 SlowDown was refused unapplied; any other failed try may have begun
        # an upload (each retry follows one failed try).
        stats = tally.snapshot()
        return stats.retries > stats.throttled

    async def _create(self) -> dict[str, Any]:
        args = {"Bucket": self._bucket, "Key": self._obj, "ChecksumAlgorithm": "CRC32C"}
        if not self._store.full_object_crc32c:
            return dict(await self._store.call("create_multipart_upload", **args))
        try:
            out = await self._store.call(
                "create_multipart_upload", ChecksumType="FULL_OBJECT", **args
            )
        except Exception as exc:
            if not refuses_parameters(exc):
                raise
            self._store.no_full_object_crc32c(f"CreateMultipartUpload refused: {describe(exc)}")
            return dict(await self._store.call("create_multipart_upload", **args))
        if out.get("ChecksumType") != "FULL_OBJECT":
            self._store.no_full_object_crc32c("CreateMultipartUpload ignored ChecksumType")
        return dict(out)

    def _send(self, part: Part) -> None:
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise UploadError(
                f"{self._store.location.url_of(self.key)} needs more than {MAX_PARTS} parts; "
                f"raise UploadOptions.part_size"
            )
        self._crc = crc32c_combine(self._crc, part.crc, part.size)
        self._size += part.size
        self._store.acquire_slot()
        fut = self._store.submit_coro(self._upload_part(number, part.pieces, part.crc))
        fut.add_done_callback(self._store.release_slot)
        self._parts.append(fut)

    async def _upload_part(self, number: int, pieces: list[BytesLike], crc: int) -> dict[str, Any]:
        checksum = to_base64(crc)
        out = await self._store.call(
            "upload_part",
            Bucket=self._bucket,
            Key=self._obj,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=StreamedBody(pieces),
            ChecksumCRC32C=checksum,
        )
        return {"PartNumber": number, "ETag": out["ETag"], "ChecksumCRC32C": checksum}

    def close(self) -> concurrent.futures.Future[None]:
        url = self._store.location.url_of(self.key)
        if self._held is not None and self._held.size + self._part.size > S3_MAX_PUT:
            # Two parts past S3's single-PUT limit (parts above 2.5 GiB) go multipart.
            self._start_multipart()
            held, self._held = self._held, None
            self._send(held)
        if self._upload_id is None:
            last = self._take_part()
            body = last if self._held is None else self._held + last
            self._held = None
            crc = body.crc
            self.crc32c = format_crc(crc)
            self._store.acquire_slot()
            fut = self._store.submit_coro(
                self._store.call(
                    "put_object",
                    Bucket=self._bucket,
                    Key=self._obj,
                    Body=StreamedBody(body.pieces),
                    ChecksumCRC32C=to_base64(crc),
                )
            )
            fut.add_done_callback(self._store.release_slot)
            return translated_future(fut, url, "uploading")
        if self._part.size:
            self._send(self._take_part())
        self.crc32c = format_crc(self._crc)
        fut = self._store.submit_coro(self._complete())
        # Only now does the completion own the upload (it aborts it on failure): a
        # close that failed before here (the last part refused, no slot) leaves the
        # upload to abort(), which the caller calls.
        self._done = True
        return translated_future(fut, url, "uploading")

    async def _complete(self) -> None:
        whole = (
            {"ChecksumCRC32C": to_base64(self._crc), "ChecksumType": "FULL_OBJECT"}
            if self._full_object
            else {}
        )
        try:
            parts = await asyncio.gather(*(asyncio.wrap_future(p) for p in self._parts))
            try:
                await self._store.call(
                    "complete_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._obj,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": list(parts)},
                    **whole,
                )
            except Exception as exc:
                # A retry after a lost answer: the first try may have made the object.
                if not no_such_upload(exc) or not await landed(
                    self._store, self.key, self._size, self._crc, parts
                ):
                    raise
                logger.info(
                    "settled %s: its completion was answered NoSuchUpload, and the object "
                    "is there with the upload's %d bytes and checksum",
                    self._store.location.url_of(self.key),
                    self._size,
                )
        except BaseException:
            await self._abort_async()
            raise
        await self._abort_orphans()

    async def _abort_orphans(self) -> None:
        if self._lost_create:
            await abort_orphans(self._store, self.key, self._upload_id)

    async def _abort_async(self) -> None:
        # Let parts already sent settle first: S3 may keep a part that completes
        # after the abort, so an abort issued early can leave storage behind.
        await asyncio.gather(*(asyncio.wrap_future(p) for p in self._parts), return_exceptions=True)
        try:
            await self._store.call(
                "abort_multipart_upload",
                Bucket=self._bucket,
                Key=self._obj,
                UploadId=self._upload_id,
            )
            logger.info("aborted multipart upload of %s", self._store.location.url_of(self.key))
        except FileNotFoundError:
            # NoSuchUpload: ended already (aborted by gc or a lifecycle rule, or
            # completed), so no parts are left for `objckpt gc` to find.
            logger.info(
                "multipart upload of %s was already ended (NoSuchUpload); nothing to abort",
                self._store.location.url_of(self.key),
            )
        except Exception:
            logger.warning(
                "could not abort multipart upload of %s; `objckpt gc` will",
                self._store.location.url_of(self.key),
                exc_info=True,
            )
        await self._abort_orphans()

    def abort(self) -> None:
        self._take_part()
        self._held = None
        if self._upload_id is not None and not self._done:
            self._done = True
            self._store.run_coro(self._abort_async())
