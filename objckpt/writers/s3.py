"""S3: parallel multipart uploads and an ``If-None-Match: *`` commit.

Requests go through s3fs's own client (built from the caller's
``storage_options``) on s3fs's event loop, so many parts are in flight without a
thread per part, and endpoint/credential handling stays s3fs's.

Why not s3fs's ``open("wb")``: it uploads one part at a time and does not abort
the multipart upload when a part fails, leaving billed, invisible garbage. Here
parts are submitted as soon as they fill (bounded by ``max_in_flight``), and any
failure aborts the upload before the error is raised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from objckpt.errors import BucketNotFoundError, UploadError
from objckpt.options import MAX_PARTS
from objckpt.writers.base import PROBE_KEY, ObjectStore, ObjectUpload, OpenUpload, translated_future
from objckpt.writers.checksum import (
    COMBINE_ABOVE,
    BytesLike,
    crc32c_combine,
    crc32c_of,
    crc_from_base64,
    format_crc,
    to_base64,
)
from objckpt.writers.translate import translate

__all__ = ["S3Store", "StreamedBody"]

logger = logging.getLogger(__name__)


class S3Store(ObjectStore):
    """Writes objects to S3 (or any S3-compatible endpoint) through s3fs."""

    def _bucket_key(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = self.path(key).partition("/")
        return bucket, prefix

    async def call(self, method: str, **kwargs: Any) -> Any:
        return await self.fs._call_s3(method, **kwargs)

    def preflight(self, timeout: float) -> None:
        """Prove, in bounded time and before anything is staged, that a save can succeed.

        Three requests: a one-key listing under the checkpoint prefix (bucket exists,
        credentials valid, ``s3:ListBucket``; unlike HeadBucket's bare 403 it carries
        an error code that says *which* credential problem it is), then an empty
        multipart upload begun and aborted at :data:`PROBE_KEY` (``s3:PutObject``,
        ``s3:AbortMultipartUpload`` and, for SSE-KMS buckets, the KMS key). A
        read-only role therefore fails here, not after the state dict was copied;
        the aborted upload leaves no object and no bill.
        """
        bucket, prefix = self._bucket_key("")
        probe = self._bucket_key(PROBE_KEY)[1]
        url = self.location.url
        doing = ["listing"]

        async def check() -> None:
            try:
                await self.call("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
            except FileNotFoundError as exc:
                raise BucketNotFoundError(f"bucket {bucket!r} of {url} does not exist") from exc
            doing[0] = "probing write access (s3:PutObject) to"
            out = await self.call("create_multipart_upload", Bucket=bucket, Key=probe)
            doing[0] = "probing abort access (s3:AbortMultipartUpload) to"
            with contextlib.suppress(FileNotFoundError):  # already gone: nothing left either way
                await self.call(
                    "abort_multipart_upload", Bucket=bucket, Key=probe, UploadId=out["UploadId"]
                )

        try:
            self.run_coro(check(), timeout=timeout)
        except Exception as exc:
            raise translate(exc, url=url, action=doing[0]) from exc

    def begin(self, key: str, size_hint: int) -> ObjectUpload:
        return S3Upload(self, key, self.options.part_size_for(size_hint))

    def create(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        bucket, obj = self._bucket_key(key)
        extra = {} if overwrite else {"IfNoneMatch": "*"}
        extra["ChecksumCRC32C"] = to_base64(crc32c_of(data))
        try:
            self.run_coro(self.call("put_object", Bucket=bucket, Key=obj, Body=data, **extra))
        except FileExistsError:
            raise
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="committing") from exc
        finally:
            self.fs.invalidate_cache(self.path(key))

    def put(self, key: str, data: bytes) -> None:
        self.create(key, data, overwrite=True)

    server_side_copy = True

    def _copy_inside(self, src: ObjectStore, key: str, size: int) -> None:
        """CopyObject, or UploadPartCopy in parallel ranges above two parts (CopyObject
        stops at 5 GiB). The copy asks S3 for a full-object CRC32C, computed by S3
        from the bytes at rest, which :meth:`digest` then reports."""
        s_bucket, _, s_key = src.path(key).partition("/")
        bucket, obj = self._bucket_key(key)
        source = {"Bucket": s_bucket, "Key": s_key}
        part = self.options.part_size_for(size)
        if size <= 2 * part:
            self.run_coro(
                self.call(
                    "copy_object",
                    Bucket=bucket,
                    Key=obj,
                    CopySource=source,
                    ChecksumAlgorithm="CRC32C",
                )
            )
        else:
            self.run_coro(self._copy_parts(bucket, obj, source, size, part))

    async def _copy_parts(
        self, bucket: str, obj: str, source: dict[str, str], size: int, part: int
    ) -> None:
        out = await self.call(
            "create_multipart_upload",
            Bucket=bucket,
            Key=obj,
            ChecksumAlgorithm="CRC32C",
            ChecksumType="FULL_OBJECT",
        )
        upload_id = out["UploadId"]
        slots = asyncio.Semaphore(self.options.max_in_flight)

        async def one(number: int, start: int) -> dict[str, Any]:
            end = min(start + part, size) - 1
            async with slots:
                res = await self.call(
                    "upload_part_copy",
                    Bucket=bucket,
                    Key=obj,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceRange=f"bytes={start}-{end}",
                )
            return {"PartNumber": number, "ETag": res["CopyPartResult"]["ETag"]}

        try:
            parts = await asyncio.gather(
                *(one(i + 1, start) for i, start in enumerate(range(0, size, part)))
            )
            await self.call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=obj,
                UploadId=upload_id,
                MultipartUpload={"Parts": list(parts)},
            )
        except BaseException:
            try:
                await self.call(
                    "abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload_id
                )
            except Exception:
                logger.warning("could not abort the copy of %s; `objckpt gc` will", obj)
            raise

    def digest(self, key: str) -> tuple[int, str | None]:
        bucket, obj = self._bucket_key(key)
        try:
            head = self.run_coro(
                self.call("head_object", Bucket=bucket, Key=obj, ChecksumMode="ENABLED")
            )
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(key), action="checking") from exc
        crc = head.get("ChecksumCRC32C")
        # A composite (per-part) checksum is not comparable with the manifest's. S3
        # says which kind it keeps; a store that does not say (moto) is trusted only
        # for single-request objects (a multipart ETag ends in "-<parts>").
        kind = head.get("ChecksumType")
        if kind is None:
            kind = "COMPOSITE" if "-" in str(head.get("ETag", "")) else "FULL_OBJECT"
        if not crc or kind != "FULL_OBJECT" or "-" in crc:
            return int(head["ContentLength"]), None
        return int(head["ContentLength"]), crc_from_base64(crc)

    def open_uploads(self) -> list[OpenUpload]:
        bucket, prefix = self._bucket_key("")
        out: list[OpenUpload] = []
        markers: dict[str, str] = {}
        while True:
            try:
                page = self.run_coro(
                    self.call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
                )
            except Exception as exc:
                raise translate(
                    exc, url=self.location.url, action="listing multipart uploads"
                ) from exc
            for u in page.get("Uploads", []):
                times = [u["Initiated"].timestamp()] if u.get("Initiated") else []
                times += self._part_times(bucket, u["Key"], u["UploadId"])
                out.append(
                    OpenUpload(
                        key=u["Key"][len(prefix) :],
                        upload_id=u["UploadId"],
                        last_activity=max(times) if times else None,
                    )
                )
            if not page.get("IsTruncated"):
                return out
            markers = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }

    def _part_times(self, bucket: str, key: str, upload_id: str) -> list[float]:
        """Upload times of an open upload's parts: a live upload keeps getting parts,
        and some S3-compatible servers report a fixed ``Initiated`` (moto does)."""
        try:
            page = self.run_coro(
                self.call("list_parts", Bucket=bucket, Key=key, UploadId=upload_id)
            )
        except FileNotFoundError:
            return []  # finished or aborted since the listing
        except Exception as exc:
            raise translate(exc, url=self.location.url, action="listing upload parts") from exc
        return [
            p["LastModified"].timestamp() for p in page.get("Parts", []) if p.get("LastModified")
        ]

    def abort_upload(self, upload: OpenUpload) -> None:
        bucket, key = self._bucket_key(upload.key)
        try:
            self.run_coro(
                self.call(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id
                )
            )
        except FileNotFoundError:
            pass  # already completed or aborted
        except Exception as exc:
            raise translate(exc, url=self.location.url_of(upload.key), action="aborting") from exc


class StreamedBody:
    """A request body aiohttp sends in slices: a part's bytes, never copied whole.

    Given a ``bytearray``, aiohttp slices it to the Content-Length (a copy of the
    whole part) and hands it to the event loop's transport, which on Python 3.11 copies
    whatever the socket does not take at once into a per-connection buffer that keeps
    its size: two copies of each part, and up to a part of memory per pooled connection
    for the life of the process. As an async iterable of ``chunk``-byte views, the body
    is written a slice at a time with a drain between slices, so the copies are gone and
    each connection buffers at most one slice. botocore sees a sized, seekable stream
    (``read``/``seek``/``tell``), which it may rewind before a retry; each send streams
    the whole body from the start.

    ``data`` is one buffer or a sequence of them (a part gathered from several
    places: a frame's head, a staged tensor's bytes, its tail), sent in order.
    """

    def __init__(self, data: BytesLike | list[BytesLike], chunk: int = 1024 * 1024) -> None:
        pieces = data if isinstance(data, list) else [data]
        self._views = [memoryview(p).cast("B") for p in pieces]
        self._views = [v for v in self._views if v.nbytes]
        self._size = sum(v.nbytes for v in self._views)
        self._chunk = chunk
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._pos + size, self._size)
        out = bytearray()
        start = 0
        for view in self._views:
            stop = start + view.nbytes
            if stop > self._pos and start < end:
                out += view[max(self._pos - start, 0) : min(end, stop) - start]
            start = stop
        self._pos += len(out)
        return bytes(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = max(0, min(base + offset, self._size))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return self._slices()

    async def _slices(self) -> AsyncIterator[memoryview]:
        step = self._chunk
        for view in self._views:
            for start in range(0, view.nbytes, step):
                yield view[start : start + step]


class _Part:
    """The bytes of one part as they arrive: copies of what :meth:`S3Upload.write`
    got (consecutive small writes share one buffer) and, without a copy, what
    :meth:`S3Upload.write_kept` got. Tracks its size and CRC32C."""

    def __init__(self) -> None:
        self.pieces: list[BytesLike] = []
        self.size = 0
        self.crc = 0
        self._open: bytearray | None = None  # the copy buffer later copies extend

    def add(self, piece: memoryview, crc: int, *, copy: bool) -> None:
        """Append ``piece``, whose CRC32C is ``crc``."""
        if piece.nbytes < COMBINE_ABOVE:  # rehashing is cheaper than combining
            self.crc = crc32c_of(piece, self.crc)
        else:
            self.crc = crc32c_combine(self.crc, crc, piece.nbytes)
        if not copy:
            self.pieces.append(piece)
            self._open = None
        elif self._open is not None:
            self._open += piece
        else:
            self._open = bytearray(piece)
            self.pieces.append(self._open)
        self.size += piece.nbytes

    def __add__(self, other: _Part) -> _Part:
        joined = _Part()
        joined.pieces = self.pieces + other.pieces
        joined.size = self.size + other.size
        joined.crc = crc32c_combine(self.crc, other.crc, other.size)
        return joined


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
        self._bucket, self._obj = store._bucket_key(key)
        self._part_size = part_size
        self._part = _Part()
        # The first full part waits here until a second one shows the object needs
        # multipart; objects up to two parts go up in a single request.
        self._held: _Part | None = None
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
                full, self._part = self._part, _Part()
                self._part_full(full)
        return crc

    def _part_full(self, full: _Part) -> None:
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

    def _send(self, part: _Part) -> None:
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
            self._held, self._part = None, _Part()
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
            last, self._part = self._part, _Part()
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
        self._part = _Part()
        self._held = None
        if self._upload_id is not None and not self._done:
            self._done = True
            self._store.run_coro(self._abort_async())
