"""S3 uploads of one object: a single PUT, or parallel multipart with abort on failure.

Requests go through s3fs's own client on s3fs's event loop (see
:class:`~objckpt.writers.s3.S3Store`), so many parts are in flight without a
thread per part.

Why not s3fs's ``open("wb")``: it uploads one part at a time and does not abort
the multipart upload when a part fails, leaving billed, invisible garbage. Here
parts are submitted as soon as they fill (bounded by ``max_in_flight``), and any
failure aborts the upload before the error is raised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

from objckpt.errors import UploadError
from objckpt.options import MAX_PARTS
from objckpt.writers.base import ObjectUpload, translated_future
from objckpt.writers.checksum import BytesLike, crc32c_combine, crc32c_of, format_crc, to_base64
from objckpt.writers.s3_body import Part, StreamedBody
from objckpt.writers.translate import translate

if TYPE_CHECKING:
    from objckpt.writers.s3 import S3Store

__all__ = ["S3Upload"]

logger = logging.getLogger(__name__)


class S3Upload(ObjectUpload):
    """One object: a single PUT when it fits in two parts, else a multipart upload.

    Every request carries the CRC32C of its body (``x-amz-checksum-crc32c``), so S3
    verifies each part in transit; the object's CRC32C is combined from the parts'
    (no second pass), and botocore's own checksum and payload hash are turned off
    (:func:`objckpt.writers.retry.s3_options`): each byte is hashed once, not three times.
    """

    tracks_crc32c = True

    def __init__(self, store: S3Store, key: str, part_size: int) -> None:
        super().__init__(key)
        self._store = store
        self._bucket, self._obj = store.bucket_key(key)
        self._part_size = part_size
        self._part = Part()
        # The first full part waits here until a second one shows the object needs
        # multipart; objects up to two parts go up in a single request.
        self._held: Part | None = None
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._crc = 0  # of the parts sent so far, combined
        self._done = False

    def write(self, data: BytesLike) -> int:
        """Copy ``data`` into part buffers, hashing each byte once: the CRC32C of a
        part (sent with it) and of ``data`` (returned) are built from the same pieces."""
        return self._add(data, copy=True)

    def write_kept(self, data: BytesLike) -> int:
        """As :meth:`write`, but parts refer to ``data`` where it lies (no copy)."""
        return self._add(data, copy=False)

    def _add(self, data: BytesLike, *, copy: bool) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        pos, total = 0, len(view)
        crc = 0
        while pos < total:
            take = min(total - pos, self._part_size - self._part.size)
            piece = view[pos : pos + take]
            piece_crc = crc32c_of(piece)
            self._part.add(piece, piece_crc, copy=copy)
            crc = crc32c_combine(crc, piece_crc, take) if pos else piece_crc
            pos += take
            if self._part.size == self._part_size:
                full, self._part = self._part, Part()
                self._part_full(full)
        return crc

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
        try:
            out = self._store.run_coro(
                self._store.call(
                    "create_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._obj,
                    ChecksumAlgorithm="CRC32C",
                )
            )
        except Exception as exc:
            raise translate(
                exc, url=self._store.location.url_of(self.key), action="uploading"
            ) from exc
        self._upload_id = out["UploadId"]

    def _send(self, part: Part) -> None:
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise UploadError(
                f"{self._store.location.url_of(self.key)} needs more than {MAX_PARTS} parts; "
                f"raise UploadOptions.part_size"
            )
        self._crc = crc32c_combine(self._crc, part.crc, part.size)
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
        self._done = True
        url = self._store.location.url_of(self.key)
        if self._upload_id is None:
            body = self._part if self._held is None else self._held + self._part
            self._held, self._part = None, Part()
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
            last, self._part = self._part, Part()
            self._send(last)
        self.crc32c = format_crc(self._crc)
        return translated_future(self._store.submit_coro(self._complete()), url, "uploading")

    async def _complete(self) -> None:
        try:
            parts = await asyncio.gather(*(asyncio.wrap_future(p) for p in self._parts))
            await self._store.call(
                "complete_multipart_upload",
                Bucket=self._bucket,
                Key=self._obj,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": list(parts)},
            )
        except BaseException:
            await self._abort_async()
            raise

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
        except Exception:
            logger.warning(
                "could not abort multipart upload of %s; `objckpt gc` will",
                self._store.location.url_of(self.key),
                exc_info=True,
            )

    def abort(self) -> None:
        self._part = Part()
        self._held = None
        if self._upload_id is not None and not self._done:
            self._done = True
            self._store.run_coro(self._abort_async())
