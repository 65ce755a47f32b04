"""S3: the store family behind :class:`S3Store`, with an ``If-None-Match: *`` commit.

Requests go through s3fs's own client (built from the caller's
``storage_options``) on s3fs's event loop, so many requests are in flight without a
thread each, and endpoint/credential handling stays s3fs's. This module holds what
is asked of the store as a whole (preflight, create-only commit, server-side copy,
digests, finding and aborting open uploads); one object's upload, single PUT or
multipart, is :mod:`objckpt.writers.s3_upload`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from objckpt.errors import BucketNotFoundError
from objckpt.options import S3_MAX_PUT
from objckpt.writers.base import (
    PREFLIGHT_GRACE,
    PROBE_KEY,
    ObjectStore,
    ObjectUpload,
    OpenUpload,
)
from objckpt.writers.checksum import crc32c_of, crc_from_base64, to_base64
from objckpt.writers.s3_upload import S3Upload
from objckpt.writers.translate import precondition_failed, translate

__all__ = ["S3Store"]

logger = logging.getLogger(__name__)

#: Attribute of an s3fs filesystem marking that its endpoint refused full-object
#: CRC32C multipart uploads. On the filesystem, not the store: a training process and
#: each upload worker keep one filesystem for all their saves (a store per save), so
#: the endpoint is asked, and the fallback logged, once per process.
_NO_FULL_OBJECT_CRC32C = "_objckpt_no_full_object_crc32c"


class S3Store(ObjectStore):
    """Writes objects to S3 (or any S3-compatible endpoint) through s3fs."""

    atomic_create = True  # If-None-Match: * on PutObject
    keeps_crc32c = True  # x-amz-checksum-crc32c, where the endpoint keeps it
    verifies_writes = True  # ChecksumCRC32C on every PutObject (create, put)
    lists_open_uploads = True  # ListMultipartUploads

    @property
    def full_object_crc32c(self) -> bool:
        """Whether multipart uploads ask the store to keep a full-object CRC32C
        (``ChecksumType=FULL_OBJECT``), which :meth:`digest` then reports without
        reading the object: true until the endpoint refuses one."""
        return _NO_FULL_OBJECT_CRC32C not in vars(self._fs)

    def no_full_object_crc32c(self, why: str) -> None:
        """Remember that the endpoint refuses full-object CRC32C uploads (logged once).

        Uploads go on as before (a CRC32C per part; the manifest keeps the object's),
        but such objects are read back wherever they are checked (backups, copies).
        """
        first = object()
        if vars(self._fs).setdefault(_NO_FULL_OBJECT_CRC32C, first) is first:
            logger.warning(
                "%s does not keep full-object CRC32C checksums of multipart uploads (%s); "
                "uploading without, so copies and backups of large objects are checked by "
                "reading them back",
                self.location.url,
                why,
            )

    def bucket_key(self, key: str) -> tuple[str, str]:
        """The bucket and the object key S3 requests name for ``key``."""
        bucket, _, prefix = self.path(key).partition("/")
        return bucket, prefix

    async def call(self, method: str, **kwargs: Any) -> Any:
        return await self._fs._call_s3(method, **kwargs)

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
        bucket, prefix = self.bucket_key("")
        probe = self.bucket_key(PROBE_KEY)[1]
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
            with self.preflight_bound(timeout):
                self.run_coro(check(), timeout=timeout + PREFLIGHT_GRACE)
        except Exception as exc:
            raise translate(exc, url=url, action=doing[0]) from exc

    def begin(self, key: str, size_hint: int) -> ObjectUpload:
        return S3Upload(self, key, self.options.part_size_for(size_hint))

    def create(self, key: str, data: bytes | bytearray, *, overwrite: bool = False) -> None:
        bucket, obj = self.bucket_key(key)
        extra = {} if overwrite else {"IfNoneMatch": "*"}
        extra["ChecksumCRC32C"] = to_base64(crc32c_of(data))
        try:
            self.run_coro(self.call("put_object", Bucket=bucket, Key=obj, Body=data, **extra))
        except FileExistsError:
            raise
        except Exception as exc:
            if not overwrite and precondition_failed(exc):  # a 412 that names no condition
                raise FileExistsError(self.location.url_of(key)) from exc
            raise translate(exc, url=self.location.url_of(key), action="committing") from exc
        finally:
            self._fs.invalidate_cache(self.path(key))

    def put(self, key: str, data: bytes | bytearray) -> None:
        self.create(key, data, overwrite=True)

    server_side_copy = True

    def _copy_inside(self, src: ObjectStore, key: str, size: int) -> None:
        """CopyObject, or UploadPartCopy in parallel ranges above two parts (CopyObject
        stops at 5 GiB). The copy asks S3 for a full-object CRC32C, computed by S3
        from the bytes at rest, which :meth:`digest` then reports."""
        s_bucket, _, s_key = src.path(key).partition("/")
        bucket, obj = self.bucket_key(key)
        source = {"Bucket": s_bucket, "Key": s_key}
        part = self.options.part_size_for(size)
        if size <= min(2 * part, S3_MAX_PUT):
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
        slots = asyncio.Semaphore(self.options.max_parts_in_flight)

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
        bucket, obj = self.bucket_key(key)
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
        bucket, prefix = self.bucket_key("")
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
        bucket, key = self.bucket_key(upload.key)
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
